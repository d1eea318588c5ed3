"""Run a merge method over K task vectors, key by key.

    merged_tau[key] = method.params.scaling * method.combine(key, taus[key])      # (*)

(*) is the one place where lambda / alpha is applied. ``iter_merge`` streams ``(key, merged_tau)``
pairs and holds only one key's K slices at a time (plus whatever ``fit`` keeps: a few numbers for
TIES), so ``merge_checkpoints`` can merge sharded checkpoints larger than memory.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from .checkpoint import save_checkpoint
from .errors import CheckpointError, ParameterError
from .methods import get_merge_method
from .methods.base import MergeMethod
from .task_vectors import COMPUTE_DTYPE, SourceLike, TaskVectorSet


def iter_merge(task_vectors: TaskVectorSet, method: MergeMethod, keys: Sequence[str] | None = None,
               progress: bool = False, skip_zero_keys: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, merged task vector)`` in float32 for every float key (or the given ``keys``). A key whose
    task vectors are all exactly zero merges to zero without calling the method (``skip_zero_keys``); the
    method's ``fit`` still sees every key, so global statistics (TIES's top-k threshold) are unchanged."""
    keys = list(task_vectors.keys if keys is None else keys)
    unknown = [k for k in keys if k not in set(task_vectors.keys)]
    if unknown:
        raise CheckpointError(f"key {unknown[0]!r} is not a floating-point key of the models being merged")
    method.fit(task_vectors, keys)
    for key in tqdm(keys, desc=f"merge {method.name}", unit="key", disable=not progress, leave=False):
        taus = task_vectors.load(key)
        if skip_zero_keys and not any(bool(tau.any()) for tau in taus):
            # no task moved this key (a frozen embedding, say): every method's combine gives exactly zero
            # here (tests/test_methods.py), so skip its work (SVDs of a 30522 x 384 matrix for MiniLM's)
            yield key, torch.zeros_like(taus[0], dtype=COMPUTE_DTYPE)
            continue
        merged = method.combine(key, taus)
        if any(merged.data_ptr() == tau.data_ptr() for tau in taus):  # never scale an input in place
            merged = merged.clone()
        yield key, merged.mul_(method.params.scaling)  # (*)


def merge_task_vectors(task_vectors: Sequence[SourceLike] | TaskVectorSet, method: str | MergeMethod,
                       *, device: str | None = None, progress: bool = False, **params: Any) -> dict[str, torch.Tensor]:
    """The merged task vector ``{key: tensor}`` (float32) of K task vectors."""
    method = get_merge_method(method, **params)
    tvs = task_vectors if isinstance(task_vectors, TaskVectorSet) else TaskVectorSet.from_task_vectors(task_vectors, device=device)
    return dict(iter_merge(tvs, method, progress=progress))


def _iter_merged_model(tvs: TaskVectorSet, method: MergeMethod, out_dtype: torch.dtype | None,
                       progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    merged = iter_merge(tvs, method, progress=progress)
    float_keys = set(tvs.keys)
    for key in tvs.all_keys:
        if key not in float_keys:  # integer buffers come from the pretrained model
            yield key, tvs.pretrained.get(key).clone()
            continue
        merged_key, tau = next(merged)
        assert merged_key == key
        theta = tvs.load_pretrained(key) + tau
        yield key, theta.to(out_dtype or tvs.dtype(key))


def merge_models(pretrained: SourceLike, finetuned: Sequence[SourceLike], method: str | MergeMethod, *,
                 out_dtype: torch.dtype | None = None, device: str | None = None, progress: bool = False,
                 **params: Any) -> dict[str, torch.Tensor]:
    """The merged model theta_0 + merged_tau as a state dict (each key in its input dtype unless
    ``out_dtype`` is given; tensors on CPU)."""
    method = get_merge_method(method, **params)
    tvs = TaskVectorSet.from_models(pretrained, finetuned, device=device)
    return {key: value.cpu() for key, value in _iter_merged_model(tvs, method, out_dtype, progress)}


def merge_checkpoints(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike],
                      method: str | MergeMethod, out_dir: str | os.PathLike, *, out_dtype: torch.dtype | None = None,
                      device: str | None = None, max_shard_bytes: int = 2 * 1024**3, progress: bool = False,
                      **params: Any) -> Path:
    """Merge safetensors checkpoints (single or sharded) into ``out_dir``, streaming key by key.

    The output directory appears only when complete (see ``ShardedCheckpointWriter``); its metadata
    records the method ID.
    """
    method = get_merge_method(method, **params)
    if Path(out_dir).resolve() in {Path(p).resolve() for p in [pretrained, *finetuned]}:
        raise ParameterError(f"out_dir={out_dir}: must not be one of the input checkpoints")
    tvs = TaskVectorSet.from_models(pretrained, finetuned, device=device)
    metadata = {"mergecal_method": method.id, "mergecal_num_models": str(tvs.K)}
    return save_checkpoint(_iter_merged_model(tvs, method, out_dtype, progress), out_dir,
                           max_shard_bytes=max_shard_bytes, metadata=metadata)


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
    if name not in table:
        raise ParameterError(f"dtype {name!r}: expected one of {', '.join(table)}")
    return table[name]


__all__ = ["iter_merge", "merge_task_vectors", "merge_models", "merge_checkpoints", "parse_dtype", "COMPUTE_DTYPE"]

