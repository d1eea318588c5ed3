"""Run a merge method over K task vectors, key by key.

    merged_tau[key] = method.params.scaling * method.combine(key, taus[key])      # (*)

(*) is the one place where lambda / alpha is applied: in ``iter_merge``, or, for a recipe whose first weight-space
calibrations read the merge at scaling 1 (SVC, ``calibrate_at: unit_scaling``), in ``iter_scaled`` after them
(``iter_weight_space``, below), or, for a scaling grid searched over one such merge, in ``rescaled_model``. A
recipe carries its scaling (``Recipe.with_scaling``); the benchmark's search is ``mergecal.pipeline.cells``'.
``iter_merge`` streams ``(key, merged_tau)`` pairs and holds only one
key's K slices at a time (plus whatever ``fit`` keeps: a few numbers for
TIES), so ``merge_checkpoints`` can merge sharded checkpoints larger than memory.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from . import cost
from .calibrations.base import iter_calibrated
from .calibrations.registry import all_calibrations, get_calibration
from .checkpoint import ShardedCheckpointWriter, save_checkpoint
from .errors import CheckpointError, ParameterError
from .methods import MERGE_METHODS, get_merge_method
from .methods.base import MergeMethod
from .outputs import remove_stale
from .recipe import Recipe
from .task_vectors import COMPUTE_DTYPE, SourceLike, TaskVectorSet, check_finite

ROW_BLOCK = 1 << 22  # elements of a key read and merged at a time by ``iter_model_in_blocks`` (16 MB in float32)


def iter_merge(task_vectors: TaskVectorSet, method: MergeMethod, keys: Sequence[str] | None = None,
               progress: bool = False, skip_zero_keys: bool = True,
               scaled: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(key, merged task vector)`` in float32 for every float key (or the given ``keys``). A key whose
    task vectors are all exactly zero merges to zero without calling the method (``skip_zero_keys``); the
    method's ``fit`` still sees every key, so global statistics (TIES's top-k threshold) are unchanged.
    A zero-size key (shape 0 x 6, say) merges to an empty tensor for every method, which neither ``fit`` nor
    ``combine`` sees: it has no element to count, no row to trim and no singular value. ``scaled=False``: the
    merge at scaling 1, for calibrations that read it before ``iter_scaled`` applies the method's scaling."""
    keys = list(task_vectors.keys if keys is None else keys)
    unknown = [k for k in keys if k not in set(task_vectors.keys)]
    if unknown:
        raise CheckpointError(f"key {unknown[0]!r} is not a floating-point key of the models being merged")
    empty = {k for k in keys if math.prod(task_vectors.shape(k)) == 0}
    method.fit(task_vectors, [k for k in keys if k not in empty])
    for key in tqdm(keys, desc=f"merge {method.name}", unit="key", disable=not progress, leave=False):
        taus = task_vectors.load(key)
        if key in empty or (skip_zero_keys and not any(bool(tau.any()) for tau in taus)):
            # no task moved this key (a frozen embedding, say): every method's combine gives exactly zero
            # here (tests/test_methods.py), so skip its work (SVDs of a 30522 x 384 matrix for MiniLM's)
            merged = torch.zeros_like(taus[0], dtype=COMPUTE_DTYPE)
        else:
            merged = method.combine(key, taus)
            if any(merged.data_ptr() == tau.data_ptr() for tau in taus):  # never scale an input in place
                merged = merged.clone()
            if scaled:
                merged.mul_(method.params.scaling)  # (*)
        del taus  # not held while the consumer works on this key (K key-sized buffers)
        yield key, merged


def iter_scaled(merged: Iterator[tuple[str, torch.Tensor]], method: MergeMethod) -> Iterator[tuple[str, torch.Tensor]]:
    """``method``'s scaling applied to a stream of updates merged at scaling 1 (``iter_merge(scaled=False)``)
    and calibrated there: every update comes from the stream, never an input, so it is scaled in place (*)."""
    for key, update in merged:
        yield key, update.mul_(method.params.scaling)


def weight_calibrations(recipe: Recipe, sensitive: Sequence[str] | None = None) -> list:
    """The recipe's weight-space calibrations, in order. A step that uses a sensitivity ranking (WSC) and has
    no ``sensitive`` list of its own takes the probed magnitude-sensitive keys given here (None: no rule)."""
    return [get_calibration(step.name).build(step.params, sensitive) for step in recipe.phase("weight")]


def iter_weight_space(recipe: Recipe, task_vectors, *, sensitive: Sequence[str] | None = None,
                      diagnostics: dict | None = None, progress: bool = False):
    """Stream ``(key, update)``: the recipe's merge method followed by its weight-space calibrations.

    Pre-merge (DisTaC) and feature-space (FSC) steps need models and data; they are run by the caller
    around this (``task_vectors`` should already hold the conditioned task vectors). The leading calibrations
    that read the merge at scaling 1 (SVC's paper protocol, ``calibrate_at: unit_scaling``) run on the unscaled
    merge and the merge method's scaling follows them; the others calibrate the scaled merge.
    """
    method = MERGE_METHODS[recipe.merge.name](recipe.merge.params)
    calibrations = weight_calibrations(recipe, sensitive)
    n_unit = sum(step.at_unit_scaling for step in recipe.phase("weight"))  # the leading ones: Recipe checks
    merged = cost.timed("merge", iter_merge(task_vectors, method, progress=progress, scaled=not n_unit))
    if n_unit:
        merged = iter_scaled(iter_calibrated(merged, task_vectors, calibrations[:n_unit], diagnostics), method)
    return cost.peak_of(cost.WEIGHT_SPACE, iter_calibrated(merged, task_vectors, calibrations[n_unit:], diagnostics))


def weight_space_trials(recipe: Recipe, task_vectors: TaskVectorSet, grid: Sequence[float], *,
                        sensitive: Sequence[str] | None = None):
    """``value -> (updates, diagnostics)``: the recipe's merge and weight-space steps (``iter_weight_space``) at
    each scaling of ``grid``, ``updates`` a stream of ``(key, update)``. When the grid has several values and every
    weight-space step reads the merge at scaling 1 (none, or SVC's protocol), they run once, at scaling 1, held in
    memory (one update per key), and each value rescales them, equal bit for bit (``rescaled_model``); otherwise
    each value streams the recipe again, one key at a time. Pre-merge and feature-space steps are the caller's."""
    unit_recipe = recipe.with_scaling(1.0)
    if len(grid) > 1 and all(s.at_unit_scaling for s in unit_recipe.phase("weight")):
        diagnostics: dict[str, Any] = {}
        unit = dict(iter_weight_space(unit_recipe, task_vectors, sensitive=sensitive, diagnostics=diagnostics))
        return lambda value: (((k, u * value) for k, u in unit.items()), diagnostics)

    def streamed(value: float):
        diagnostics: dict[str, Any] = {}
        return iter_weight_space(recipe.with_scaling(value), task_vectors, sensitive=sensitive,
                                 diagnostics=diagnostics), diagnostics

    return streamed


def rescaled_model(pretrained: dict[str, torch.Tensor], unit_update: dict[str, torch.Tensor], scaling: float,
                   device: str | None = None) -> dict[str, torch.Tensor]:
    """theta_0 + ``scaling`` x an update merged (and calibrated) at scaling 1 (``iter_weight_space`` of the recipe at
    scaling 1), key by key as ``run_recipe`` adds a merge: equal, bit for bit, to the recipe run at ``scaling`` when
    every step after the merge reads it at scaling 1 (*). Keys without an update are the pretrained ones."""
    state = {}
    for key, tensor in pretrained.items():
        if key in unit_update:
            merged = tensor.to(device=device, dtype=COMPUTE_DTYPE) + unit_update[key] * scaling
            state[key] = merged.to(tensor.dtype).cpu()
        else:
            state[key] = tensor.clone()
    return state


def merge_task_vectors(task_vectors: Sequence[SourceLike] | TaskVectorSet, method: str | MergeMethod,
                       *, device: str | None = None, progress: bool = False, **params: Any) -> dict[str, torch.Tensor]:
    """The merged task vector ``{key: tensor}`` (float32) of K task vectors."""
    method = get_merge_method(method, **params)
    tvs = (task_vectors if isinstance(task_vectors, TaskVectorSet)
           else TaskVectorSet.from_task_vectors(task_vectors, device=device))
    return dict(iter_merge(tvs, method, progress=progress))


def _iter_merged_model(tvs: TaskVectorSet, method: MergeMethod, out_dtype: torch.dtype | None,
                       progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """The merged model key by key: a ``blockwise`` method with a pretrained model merges each key in row blocks
    (``iter_model_in_blocks``), any other through ``iter_merge``. A negative scaling goes through ``iter_merge``:
    there a key no task moved is theta_0 + (+0.0), in blocks theta_0 + (-0.0), which turns a -0.0 of theta_0's
    into +0.0 in one and not the other."""
    if method.blockwise and tvs.pretrained is not None and method.params.scaling >= 0:
        return iter_model_in_blocks(tvs, method, out_dtype, progress=progress)
    return _iter_model(tvs, iter_merge(tvs, method, progress=progress), out_dtype)


def row_blocks(shape: tuple[int, ...], block: int = ROW_BLOCK) -> list[tuple[int, int]]:
    """``(start, stop)`` ranges of a key's first dimension, each about ``block`` elements (at least one row)."""
    rows = shape[0]
    per_row = max(1, math.prod(shape[1:]))
    step = max(1, block // per_row)
    return [(start, min(start + step, rows)) for start in range(0, rows, step)]


def iter_model_in_blocks(tvs: TaskVectorSet, method: MergeMethod, out_dtype: torch.dtype | None = None, *,
                         block: int = ROW_BLOCK, progress: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """theta_0 + scaling * merge, key by key, for a ``blockwise`` method: each key is read, merged, offset and
    converted in row blocks of about ``block`` elements into the output tensor, so what a key holds beside its
    output is K + 2 blocks (not K whole float32 task vectors). Bit for bit ``_iter_model(tvs, iter_merge(...))``
    (tests/test_row_blocks.py) for a scaling >= 0: every step is elementwise, in the same order, and a key no task
    moved comes out as theta_0 + 0 either way (``_iter_merged_model`` says why not for a negative one)."""
    if not method.blockwise:
        raise ParameterError(f"{method.name}: merges a key from statistics of the whole key, not in row blocks")
    float_keys = set(tvs.keys)  # no ``fit``: a blockwise method reads no statistic of a key or of the model
    for key in tqdm(tvs.all_keys, desc=f"merge {method.name}", unit="key", disable=not progress, leave=False):
        if key not in float_keys:  # integer buffers come from the pretrained model
            yield key, tvs.pretrained.get(key).clone()
        else:
            yield key, _merged_key_in_blocks(tvs, method, key, out_dtype or tvs.dtype(key), block)


def _merged_key_in_blocks(tvs: TaskVectorSet, method: MergeMethod, key: str, dtype: torch.dtype,
                          block: int) -> torch.Tensor:
    shape = tvs.shape(key)
    out = torch.empty(shape, dtype=dtype, device=tvs.device)
    if out.numel() == 0:
        return out
    if not shape:  # a 0-d key: one block of one element, read whole
        ranges = [(0, 1)]

        def blocks():
            yield [tau.reshape(1) for tau in tvs.load(key)]

        def offset(start, stop, merged):
            return tvs.add_pretrained(key, merged.reshape(())).reshape(1)
    else:
        ranges = row_blocks(shape, block)

        def blocks():
            for start, stop in ranges:
                yield tvs.load_rows(key, start, stop)

        def offset(start, stop, merged):
            return tvs.add_pretrained_rows(key, start, stop, merged)
    rows = out.view(1) if not shape else out
    for (start, stop), merged in zip(ranges, method.combine_blocks(key, blocks), strict=True):
        merged.mul_(method.params.scaling)  # (*); combine_blocks yields buffers of its own
        theta = offset(start, stop, merged).to(dtype)
        check_finite(theta, key, f"the merged model ({theta.dtype})")
        rows[start:stop] = theta
    return out


def _iter_model(tvs: TaskVectorSet, merged: Iterator[tuple[str, torch.Tensor]],
                out_dtype: torch.dtype | None) -> Iterator[tuple[str, torch.Tensor]]:
    """theta_0 + merged tau, key by key, from a stream of ``(key, merged tau)`` over ``tvs.keys``."""
    float_keys = set(tvs.keys)
    for key in tvs.all_keys:
        if key not in float_keys:  # integer buffers come from the pretrained model
            yield key, tvs.pretrained.get(key).clone()
            continue
        merged_key, tau = next(merged)
        assert merged_key == key
        theta = tvs.add_pretrained(key, tau).to(out_dtype or tvs.dtype(key))
        # a scaling too large for the output dtype (1e6 in float16, say) must not be written as a model of Infs
        check_finite(theta, key, f"the merged model ({theta.dtype})")
        yield key, theta
    next(merged, None)  # the stream ends here, not when collected (mergecal.cost records its memory at its end)


def merge_models(pretrained: SourceLike, finetuned: Sequence[SourceLike], method: str | MergeMethod, *,
                 out_dtype: torch.dtype | None = None, device: str | None = None, progress: bool = False,
                 **params: Any) -> dict[str, torch.Tensor]:
    """The merged model theta_0 + merged_tau as a state dict (each key in its input dtype unless
    ``out_dtype`` is given; tensors on CPU)."""
    method = get_merge_method(method, **params)
    tvs = TaskVectorSet.from_models(pretrained, finetuned, device=device)
    return {key: value.cpu() for key, value in _iter_merged_model(tvs, method, out_dtype, progress)}


def require_data_free(recipe: Recipe) -> None:
    """Reject recipe steps that need models and data (DisTaC, FSC and so DSC) and pre-merge steps (rescale, which
    conditions whole models): only the merge and weight space stream."""
    for step in recipe.steps:
        if step.needs_data or step.phase == "pre":
            data_free = " and/or ".join(sorted(n for n, spec in all_calibrations().items()
                                               if not spec.needs_data and spec.phase == "weight"))
            if not step.needs_data:
                raise ParameterError(f"recipe {recipe.label!r}: step {step.name!r} conditions the fine-tuned models "
                                     "before the merge, so it runs through the pipeline or mergecal.run_recipe; "
                                     f"checkpoints on disk take a merge method followed by {data_free}")
            raise ParameterError(
                f"recipe {recipe.label!r}: step {step.name!r} needs models and data, so it runs through the pipeline "
                f"or mergecal.run_recipe; checkpoints on disk take a merge method followed by {data_free}")


def merge_checkpoints(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike],
                      method: str | MergeMethod | Recipe, out_dir: str | os.PathLike, *,
                      out_dtype: torch.dtype | None = None, device: str | None = None,
                      max_shard_bytes: int = 2 * 1024**3, progress: bool = False, overwrite: bool = False,
                      hf_directory: bool | None = None, tokenizer_from: str | os.PathLike | None = None,
                      **params: Any) -> Path:
    """Merge safetensors checkpoints (single or sharded) into ``out_dir``, streaming key by key.

    ``method`` is a merge method, or a data-free ``Recipe`` (a merge followed by ``svc`` / ``wsc`` steps, which
    also stream key by key). The output directory appears only when complete (see ``ShardedCheckpointWriter``);
    its metadata records the method ID (and the recipe ID). ``out_dir`` may not be or hold an input, and an
    existing directory that mergecal did not write is replaced only with ``overwrite=True``. What a killed
    merge left beside ``out_dir`` (hidden staging directories, the lock file) is removed first (``remove_stale``).
    ``hf_directory`` (None: when ``pretrained`` is a Hugging Face model directory): write the output as one, the
    base's configs, the tokenizer files of ``tokenizer_from`` (None: the base's) and a model card beside the
    weights (``backbones.hf_directory``), so that ``from_pretrained(out_dir)`` loads it.
    """
    from . import __version__
    from .backbones.hf_directory import (SAFETENSORS_METADATA, check_hf_sources, is_hf_model_dir, model_card,
                                         write_hf_files)

    remove_stale(out_dir)
    hf = is_hf_model_dir(pretrained) if hf_directory is None else hf_directory
    if hf and not is_hf_model_dir(pretrained):
        raise CheckpointError(f"{pretrained}: not a Hugging Face model directory (no config.json); a Hugging Face "
                              "output needs one as the pretrained model")
    if tokenizer_from is not None and not hf:
        why = ("a weights-only output has none" if hf_directory is False else
               f"{pretrained} is not a Hugging Face model directory (no config.json)")
        raise ParameterError(f"tokenizer_from {tokenizer_from}: tokenizer files go with a Hugging Face output; {why}")
    if hf:
        check_hf_sources(pretrained, tokenizer_from)
    if isinstance(method, Recipe):
        if params:
            raise ParameterError(f"recipe {method.label!r}: give parameters inside the recipe, e.g. svc(alpha=1.0), "
                                 f"not as keywords ({sorted(params)[0]!r})")
        require_data_free(method)
        recipe, method_id = method, method.merge.id
    else:
        recipe, method = None, get_merge_method(method, **params)
        method_id = method.id
    tvs = TaskVectorSet.from_models(pretrained, finetuned, device=device)
    metadata = {"mergecal_method": method_id, "mergecal_num_models": str(tvs.K), **(SAFETENSORS_METADATA if hf else {})}
    if recipe is None:
        model = _iter_merged_model(tvs, method, out_dtype, progress)
    else:
        model = _iter_model(tvs, iter_weight_space(recipe, tvs, progress=progress), out_dtype)
        metadata["mergecal_recipe"] = recipe.id
    paths = [p for p in [pretrained, *finetuned] if isinstance(p, (str, os.PathLike))]
    if not hf:
        return save_checkpoint(model, out_dir, max_shard_bytes=max_shard_bytes,
                               metadata=metadata, inputs=paths, overwrite=overwrite)
    with ShardedCheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes, metadata=metadata,
                                 inputs=[*paths, *([tokenizer_from] if tokenizer_from is not None else [])],
                                 overwrite=overwrite) as writer:
        for key, tensor in model:
            writer.add(key, tensor)
        writer.finish()
        card = model_card(pretrained, finetuned, recipe.id if recipe is not None else method_id, __version__,
                          out_dtype, tokenizer_from)
        write_hf_files(writer.staging, pretrained, tokenizer_from=tokenizer_from, dtype=out_dtype, card=card)
    return Path(out_dir)


def parse_dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    table = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}
    if name not in table:
        raise ParameterError(f"dtype {name!r}: expected one of {', '.join(table)}")
    return table[name]


__all__ = ["iter_merge", "iter_scaled", "iter_weight_space", "merge_task_vectors", "merge_models", "merge_checkpoints",
           "parse_dtype", "rescaled_model", "weight_space_trials", "COMPUTE_DTYPE"]

