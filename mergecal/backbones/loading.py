"""Loading model weights from local files, safely.

* ``.safetensors`` files, directories and sharded ``*.index.json``: read with safetensors (no code runs).
* ``.pt`` / ``.pth`` / ``.bin`` / ``.ckpt``: ``torch.load(weights_only=True)``, which accepts tensors and plain
  containers only. Some published checkpoints are whole pickled modules (the task_vectors repository saves
  its fine-tuned ``ImageEncoder`` objects with ``torch.save(model)``); unpickling those runs arbitrary code,
  so it needs ``allow_unsafe_pickle=True`` and the error says why.
Nothing is ever fetched from a hub: a missing path is an error naming it.
"""

from __future__ import annotations

import os
import pickle
import re
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import nn

from ..checkpoint import INDEX_SUFFIX, PICKLE_SUFFIXES, load_state_dict, readable_file
from ..errors import CheckpointError


def _as_state_dict(obj: object, path: Path) -> dict[str, torch.Tensor]:
    if isinstance(obj, nn.Module):
        return {k: v.detach() for k, v in obj.state_dict().items()}
    if isinstance(obj, Mapping):
        for wrapper in ("state_dict", "model_state_dict"):  # common training-checkpoint wrappers
            if wrapper in obj and isinstance(obj[wrapper], Mapping):
                obj = obj[wrapper]
                break
        tensors = {k: v for k, v in obj.items() if isinstance(v, torch.Tensor)}
        if tensors and len(tensors) == len(obj):
            return dict(tensors)
    raise CheckpointError(f"{path}: expected a state dict (name -> tensor) or an nn.Module, got {type(obj).__name__}")


def _unreadable(path: Path, err: Exception) -> CheckpointError:
    text = str(err).strip()
    if "WeightsUnpickler" in text:  # weights_only's own parser met bytes that are no pickle opcode stream
        reason = "not a pickle"
    else:
        reason = text.splitlines()[0].split(". ")[0] if text else type(err).__name__
    return CheckpointError(f"{path}: not a readable PyTorch checkpoint (corrupt, truncated or another format: "
                           f"{reason[:120]})")


def _torch_load(path: Path, weights_only: bool) -> object:
    """``torch.load`` with a file that is no checkpoint at all (random bytes, truncated) reported as such."""
    try:
        return torch.load(path, map_location="cpu", weights_only=weights_only)
    except pickle.UnpicklingError as err:
        # weights_only refuses a well-formed pickle of objects with "Unsupported global"; anything else
        # means the bytes are not a pickled checkpoint, and the unsafe opt-in would not help
        if weights_only and "Unsupported global" in str(err):
            raise
        raise _unreadable(path, err) from None
    except (RuntimeError, EOFError, ValueError, OSError) as err:
        raise _unreadable(path, err) from None


def load_weights_file(path: str | os.PathLike, *, allow_unsafe_pickle: bool = False) -> dict[str, torch.Tensor]:
    """The ``{name: tensor}`` stored in a local weights file (see the module docstring)."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: weights file not found (nothing is downloaded; give a local file)")
    if path.is_dir() or path.suffix == ".safetensors" or path.name.endswith(INDEX_SUFFIX):
        return load_state_dict(path)
    if path.suffix not in PICKLE_SUFFIXES:
        raise CheckpointError(f"{path}: unknown weights format (expected .safetensors, a directory, "
                              f"*{INDEX_SUFFIX} or one of {', '.join(PICKLE_SUFFIXES)})")
    readable_file(path)  # a FIFO, device or socket is refused before torch.load opens it (and blocks)
    try:
        return _as_state_dict(_torch_load(path, weights_only=True), path)
    except pickle.UnpicklingError as err:
        if not allow_unsafe_pickle:
            found = re.search(r"GLOBAL (\S+)", str(err))
            holds = f" (it holds {found.group(1)})" if found else ""
            raise CheckpointError(
                f"{path}: a pickled Python object, not plain tensors{holds}; unpickling runs arbitrary code, "
                "so pass allow_unsafe_pickle=True only for a file you trust") from None
    return _as_state_dict(_torch_load(path, weights_only=False), path)
