"""Hugging Face causal LMs (Llama family and the like) from local directories, and merged models written back.

Loading never touches a hub (``local_files_only=True``; a missing directory is an error naming it). Weights are
read from ``*.safetensors`` (single or sharded with ``model.safetensors.index.json``). A directory with only
pickled ``pytorch_model*.bin`` files is refused unless ``allow_unsafe_pickle=True``; even then each file goes
through ``torch.load(weights_only=True)`` first (tensors and plain containers only) and full unpickling happens
only where that refuses a file (see ``mergecal.backbones.loading``).

A merged state dict is saved as a loadable model directory: the base model's config, generation config and
tokenizer files copied, weights as (sharded) safetensors, all staged beside the target and renamed into place.
Tied input/output embeddings are stored once (as ``save_pretrained`` does), so merging sees them once.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import torch

from ..checkpoint import (INDEX_SUFFIX, ShardedCheckpointWriter, load_state_dict, read_index,
                          safetensors_files, shard_file)
from ..device import resolve_device
from ..errors import CheckpointError
from .construction import MODEL_CONSTRUCTION
from .loading import load_weights_file
from .. import offline
from .hf_directory import SAFETENSORS_METADATA

offline.apply(offline.HUB_OFFLINE)  # before transformers is imported


PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json")
# Files that describe a model directory besides its weights (copied into a merged model's directory).
AUX_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
             "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
             "chat_template.jinja", "chat_template.json")


def weight_format(model_dir: str | os.PathLike) -> str:
    """``"safetensors"`` or ``"pickle"`` for a local model directory; a one-line CheckpointError otherwise."""
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"{path}: model directory not found (nothing is downloaded from a hub; "
                              "give a local directory with config.json and *.safetensors)")
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: not a Hugging Face model directory (no config.json)")
    found = stored_format(path)
    if found is not None:
        return found
    raise CheckpointError(f"{path}: no weights found (expected model.safetensors, model.safetensors.index.json "
                          "or, with allow_unsafe_pickle=True, pytorch_model.bin)")


def stored_format(path: Path) -> str | None:
    """``"safetensors"``, ``"pickle"`` or None: how a directory stores its weights, from file names alone."""
    if any(path.glob("*.safetensors")) or any(path.glob(f"*.safetensors{INDEX_SUFFIX}")):
        return "safetensors"
    if any((path / name).exists() for name in PICKLE_WEIGHTS) or any(path.glob("pytorch_model-*.bin")):
        return "pickle"
    return None


def model_dir_files(model_dir: str | os.PathLike) -> list[Path]:
    """The files a model directory is loaded from (``load_causal_lm``, ``load_tokenizer``, the streaming merge):
    the ``AUX_FILES`` it holds and its weights, the safetensors ``SafetensorsSource`` reads or else the pickled
    files ``_pickle_state_dict`` reads (with their index). Empty when it holds none of them (nothing else of the
    directory is ever listed); a CheckpointError when its weights cannot be resolved (a shard missing, ...)."""
    path = Path(model_dir)
    if not path.is_dir():
        return []
    files = [path / name for name in AUX_FILES if (path / name).is_file()]
    found = stored_format(path)
    if found == "safetensors":
        files += safetensors_files(path)
    elif found == "pickle":
        index = path / "pytorch_model.bin.index.json"
        files += ([index] if index.exists() else []) + pickle_weight_files(path)
    return files


def _refuse_pickle(path: Path) -> CheckpointError:
    return CheckpointError(
        f"{path}: only pickled weights (pytorch_model*.bin), no *.safetensors; unpickling a file can run arbitrary "
        "code, so pass allow_unsafe_pickle=True for a directory you trust (each file is then read with "
        "torch.load(weights_only=True), which accepts tensors only) or convert it to safetensors")


def pickle_weight_files(path: Path) -> list[Path]:
    """The pickled weight files of a directory: those its ``pytorch_model.bin.index.json`` lists, else
    ``pytorch_model.bin``, else every ``pytorch_model-*.bin``."""
    index = path / "pytorch_model.bin.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index}: not a weights index (expected a JSON object with 'weight_map'): "
                                  f"{err}") from None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(f"{index}: 'weight_map' must map tensor names to shard files")
        files = sorted({shard_file(index, key, shard) for key, shard in weight_map.items()})
    elif (path / "pytorch_model.bin").exists():
        files = [path / "pytorch_model.bin"]
    else:
        files = sorted(path.glob("pytorch_model-*.bin"))
    return files


def _pickle_state_dict(path: Path, allow_unsafe_pickle: bool) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for file in pickle_weight_files(path):
        state.update(load_weights_file(file, allow_unsafe_pickle=allow_unsafe_pickle))
    return state


def causal_lm_state_dict(model_dir: str | os.PathLike, *, allow_unsafe_pickle: bool = False
                         ) -> dict[str, torch.Tensor]:
    """The weights of a local model directory as stored (tied embeddings once), without building the model."""
    path = Path(model_dir)
    if weight_format(path) == "pickle":
        if not allow_unsafe_pickle:
            raise _refuse_pickle(path)
        return _pickle_state_dict(path, allow_unsafe_pickle)
    return load_state_dict(path)


def load_tokenizer(model_dir: str | os.PathLike):
    from transformers import AutoTokenizer

    weight_format(model_dir)
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def load_causal_lm(model_dir: str | os.PathLike, *, dtype: torch.dtype = torch.float32, device: str = "cpu",
                   allow_unsafe_pickle: bool = False):
    """``(model, tokenizer)`` from a local directory, in eval mode on ``device`` (``"auto"``: CUDA if present)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    path = Path(model_dir)
    hf_logging.disable_progress_bar()
    if weight_format(path) == "safetensors":
        if (path / f"model.safetensors{INDEX_SUFFIX}").exists():  # transformers follows it: shards beside it only
            read_index(path / f"model.safetensors{INDEX_SUFFIX}")
        with MODEL_CONSTRUCTION:  # from_pretrained patches process-wide functions (backbones.construction)
            model = AutoModelForCausalLM.from_pretrained(str(path), local_files_only=True, use_safetensors=True,
                                                         dtype=dtype)
    else:
        if not allow_unsafe_pickle:
            raise _refuse_pickle(path)
        config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        with MODEL_CONSTRUCTION:  # its dtype is set as torch's process-wide default while it builds
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        load_into(model, _pickle_state_dict(path, allow_unsafe_pickle), name=str(path))
    return model.to(resolve_device(device)).eval(), load_tokenizer(path)


def _tied_aliases(model) -> set[str]:
    """Keys of ``model.state_dict()`` that share storage with an earlier key (tied embeddings)."""
    seen, aliases = {}, set()
    for key, tensor in model.state_dict().items():
        ptr = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if ptr in seen:
            aliases.add(key)
        else:
            seen[ptr] = key
    return aliases


def stored_state_dict(model) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` detached, with tied aliases removed: the tensors a checkpoint stores."""
    aliases = _tied_aliases(model)
    return {k: v.detach() for k, v in model.state_dict().items() if k not in aliases}


def load_into(model, state: Mapping[str, torch.Tensor], *, name: str = "state dict") -> None:
    """Load a stored state dict (tied aliases may be absent) into ``model``; any other mismatch is an error."""
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in missing if k not in _tied_aliases(model)]
    if missing or unexpected:
        raise CheckpointError(f"{name}: does not fit {type(model).__name__}: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()


def save_causal_lm_weights(tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
                           out_dir: str | os.PathLike, *, like: str | os.PathLike | None = None,
                           model=None, tokenizer=None, max_shard_bytes: int = 2 * 1024**3,
                           metadata: Mapping[str, str] | None = None, inputs: Sequence[str | os.PathLike] = (),
                           overwrite: bool = False) -> Path:
    """Write ``tensors`` (a state dict or streamed ``(key, tensor)`` pairs, e.g. a merge) as a loadable model
    directory. The config and tokenizer come from the model directory ``like`` (files copied) or from
    ``model``/``tokenizer`` objects (``save_pretrained``). For a tied model a given ``lm_head.weight`` is dropped.
    Everything is written to a staging directory that replaces ``out_dir`` only when complete; ``out_dir`` may
    not hold ``like`` or ``inputs`` (the models streamed), and a directory mergecal did not write is replaced
    only with ``overwrite=True`` (``mergecal.outputs``)."""
    out_dir = Path(out_dir)
    if like is not None:
        from transformers import AutoConfig

        weight_format(like)
        tied = bool(getattr(AutoConfig.from_pretrained(str(like), local_files_only=True), "tie_word_embeddings", False))
    elif model is not None:
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
    else:
        raise CheckpointError(f"{out_dir}: give the base model directory (like=...) or a model to take the config from")
    pairs = tensors.items() if isinstance(tensors, Mapping) else tensors
    with ShardedCheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes,
                                 metadata={**(metadata or {}), **SAFETENSORS_METADATA},
                                 inputs=[*inputs, *([like] if like is not None else [])],
                                 overwrite=overwrite) as writer:
        for key, tensor in pairs:
            if not (tied and key == "lm_head.weight"):
                writer.add(key, tensor)
        writer.finish()
        stage = writer.staging
        if like is not None:
            for name in AUX_FILES:
                if (Path(like) / name).exists():
                    shutil.copy2(Path(like) / name, stage / name)
        else:
            model.config.save_pretrained(str(stage))
            if getattr(model, "generation_config", None) is not None:
                model.generation_config.save_pretrained(str(stage))
            if tokenizer is not None:
                tokenizer.save_pretrained(str(stage))
    return out_dir


def save_causal_lm(model, tokenizer, out_dir: str | os.PathLike, *, max_shard_bytes: int = 2 * 1024**3,
                   overwrite: bool = False) -> Path:
    """Save a model object and its tokenizer as a model directory (atomically, sharded safetensors)."""
    return save_causal_lm_weights(stored_state_dict(model), out_dir, model=model, tokenizer=tokenizer,
                                  max_shard_bytes=max_shard_bytes, overwrite=overwrite)


# config.json keys that do not change what a model computes (written by whichever library saved it)
CONFIG_BOOKKEEPING = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures")


def check_same_config(base: Path, expert: Path, ignore: Sequence[str] = ()) -> None:
    """The expert's config.json equals the base's but for bookkeeping keys and ``ignore``: one CheckpointError
    naming the expert's file and the first differing key otherwise."""
    base_config, config = _config(base), _config(expert)
    for key in sorted(set(base_config) | set(config)):
        if key in CONFIG_BOOKKEEPING or key in ignore or base_config.get(key) == config.get(key):
            continue
        raise CheckpointError(f"{expert / 'config.json'}: {key} is {config.get(key)!r}, the base model "
                              f"{base} has {base_config.get(key)!r} (an expert must be a fine-tune of the base)")


def check_same_family(pretrained_dir: str | os.PathLike, expert_dirs: Sequence[str | os.PathLike]) -> None:
    """Experts must be fine-tunes of the base: the same model config (bookkeeping keys aside) and the same
    tokenizer files, byte for byte. A mismatch is one CheckpointError naming the expert's file and key."""
    base = Path(pretrained_dir)
    for expert in map(Path, expert_dirs):
        check_same_config(base, expert)
        for name in ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt"):
            mine, theirs = expert / name, base / name
            if mine.exists() != theirs.exists() or (mine.exists() and mine.read_bytes() != theirs.read_bytes()):
                raise CheckpointError(f"{mine}: the tokenizer differs from the base model's ({theirs}); merged "
                                      "weights would index another vocabulary")


def _config(model_dir: Path) -> dict:
    weight_format(model_dir)
    try:
        return json.loads((model_dir / "config.json").read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{model_dir / 'config.json'}: not valid JSON ({err})") from None


def weights_digest(model_dir: str | os.PathLike) -> str:
    """sha256 over config.json and every weight file's bytes: a merged model's identity (e.g. a cache key)."""
    import hashlib

    path = Path(model_dir)
    weight_format(path)
    h = hashlib.sha256()
    files = [path / "config.json"] + sorted(p for p in path.iterdir() if p.suffix == ".safetensors"
                                            or p.name.endswith(".bin") or p.name.endswith(INDEX_SUFFIX))
    for file in files:
        h.update(file.name.encode())
        with open(file, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 24), b""):
                h.update(chunk)
    return h.hexdigest()

