"""Writing a merge: a PEFT adapter directory, or a model source key by key as a full model."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import ShardedCheckpointWriter, TensorSource, save_state_dict
from ..errors import CheckpointError, ParameterError
from ..outputs import OutputDir, remove_stale
from .read import ADAPTER_CONFIG, ADAPTER_WEIGHTS


def _located(path: str | os.PathLike) -> Path:
    """An output path as ``OutputDir`` checks it (absolute, its parent's symlinks resolved)."""
    path = Path(os.path.abspath(path))
    return Path(os.path.realpath(path.parent)) / path.name


def _inputs(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike]) -> list[str | os.PathLike]:
    """The paths a merge reads, which its output may not be or hold."""
    return [p for p in (pretrained, *finetuned) if isinstance(p, (str, os.PathLike))]

def write_adapter(out_dir: str | os.PathLike, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *,
                  metadata: Mapping[str, str] | None = None, files: Mapping[str, str] | None = None,
                  inputs: Iterable[str | os.PathLike] = (), overwrite: bool = False) -> Path:
    """Write a PEFT adapter directory atomically (a staging directory renamed into place, ``mergecal.outputs``):
    ``adapter_config.json``, ``adapter_model.safetensors`` and any other small text ``files``."""
    remove_stale(out_dir)
    with OutputDir(out_dir, inputs=inputs, overwrite=overwrite) as staging:
        save_state_dict(tensors, staging / ADAPTER_WEIGHTS, metadata={"format": "pt", **(metadata or {})})
        (staging / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        for name, text in (files or {}).items():
            (staging / name).write_text(text)
    return Path(out_dir)

def write_full_model(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike], model: TensorSource,
                     out_dir, *, metadata: Mapping[str, str], label: str, out_dtype: torch.dtype | None = None,
                     max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False, hf_directory: bool | None = None,
                     tokenizer_from: str | os.PathLike | None = None) -> Path:
    """Write a model source key by key as ``merge_checkpoints`` writes a merge: float keys in ``out_dtype`` (else
    their own), sharded, atomically, and as a Hugging Face model directory when the base is one."""
    from .. import __version__
    from ..backbones.hf_directory import (SAFETENSORS_METADATA, check_hf_sources, is_hf_model_dir, model_card,
                                         write_hf_files)
    from ..task_vectors import check_finite

    remove_stale(out_dir)
    hf = is_hf_model_dir(pretrained) if hf_directory is None else hf_directory
    if hf and not is_hf_model_dir(pretrained):
        raise CheckpointError(f"{pretrained}: not a Hugging Face model directory (no config.json); a Hugging Face "
                              "output needs one as the pretrained model")
    if tokenizer_from is not None and not hf:
        raise ParameterError(f"tokenizer_from {tokenizer_from}: tokenizer files go with a Hugging Face output")
    if hf:
        check_hf_sources(pretrained, tokenizer_from)
    metadata = {**metadata, **(SAFETENSORS_METADATA if hf else {})}
    inputs = [*_inputs(pretrained, finetuned), *([tokenizer_from] if tokenizer_from is not None else [])]
    with ShardedCheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes, metadata=metadata, inputs=inputs,
                                 overwrite=overwrite) as writer:
        for key in model.keys():
            tensor = model.get(key)
            if tensor.is_floating_point():
                tensor = tensor.to(out_dtype or tensor.dtype)
                check_finite(tensor, key, f"the merged model ({tensor.dtype})")
            writer.add(key, tensor)
        writer.finish()
        if hf:
            card = model_card(pretrained, finetuned, label, __version__, out_dtype, tokenizer_from)
            write_hf_files(writer.staging, pretrained, tokenizer_from=tokenizer_from, dtype=out_dtype, card=card)
    return Path(out_dir)

