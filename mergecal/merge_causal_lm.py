"""Merging Hugging Face causal-LM checkpoint directories key by key (``merge_causal_lms``), beside ``merge``'s
``merge_checkpoints`` for safetensors files: the directories are read and written by
``mergecal.backbones.hf_causal_lm``, which itself imports no merge method, so that what loads and trains a model
(the LLM stages) does not depend on the merges and calibrations (each DVC stage depends on the modules it imports:
``scripts/stage_deps.py``)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch

from .backbones.hf_causal_lm import check_same_family, save_causal_lm_weights, weight_format
from .checkpoint import SafetensorsSource
from .errors import CheckpointError, ParameterError
from .merge import _iter_merged_model, _iter_model, iter_weight_space, require_data_free
from .methods import get_merge_method
from .outputs import remove_stale
from .recipe import Recipe
from .task_vectors import TaskVectorSet


def merge_causal_lms(pretrained_dir: str | os.PathLike, expert_dirs: Sequence[str | os.PathLike], method,
                     out_dir: str | os.PathLike, *, out_dtype: torch.dtype | None = None,
                     max_shard_bytes: int = 2 * 1024**3, progress: bool = False, overwrite: bool = False,
                     device: str | None = None, diagnostics: dict | None = None, align_vocabulary: bool = False,
                     **params) -> Path:
    """Merge local model directories key by key (never more than one key of each model in memory) into a
    loadable model directory with the pretrained model's config and tokenizer. ``method`` is a merge method or
    a data-free ``Recipe`` (a merge then ``svc`` / ``wsc`` steps, which stream too); the method ID (and the
    recipe ID) is recorded in the safetensors metadata; ``diagnostics`` (a dict) receives the calibrations'
    (SVC's spectra, WSC's coefficients). The experts must share the base's config and tokenizer
    (``check_same_family``), or with ``align_vocabulary`` may add tokens after the base's vocabulary, as DARE's code
    aligns them (``mergecal.backbones.vocabulary``: mean rows for a model's missing tokens; the output takes the
    config and tokenizer of the model holding every added token). ``out_dir`` may not hold an input; see
    ``save_causal_lm_weights``."""
    remove_stale(out_dir)  # what a killed merge left beside out_dir, even if this one fails on its inputs
    if isinstance(expert_dirs, (str, os.PathLike)):
        raise ParameterError(f"expert_dirs: expected a list of model directories, got a single path "
                             f"{str(expert_dirs)!r}")
    for path in [pretrained_dir, *expert_dirs]:
        if weight_format(path) != "safetensors":
            # the stream reads safetensors only; the opt-in of load_causal_lm does not apply here
            raise CheckpointError(
                f"{path}: pickled weights (pytorch_model*.bin); merge_causal_lms reads safetensors only. Convert the "
                "directory first: save_causal_lm(*load_causal_lm(path, allow_unsafe_pickle=True), new_dir) for a "
                "directory you trust")
    like = pretrained_dir
    if align_vocabulary:
        from .backbones.vocabulary import PaddedVocabularySource, aligned_vocabulary, check_aligned_family

        check_aligned_family(pretrained_dir, expert_dirs)
        size, like, own = aligned_vocabulary(pretrained_dir, expert_dirs)
        pretrained, *experts = [PaddedVocabularySource(SafetensorsSource(p), own[Path(p)], size)
                                for p in [pretrained_dir, *expert_dirs]]
        tvs = TaskVectorSet.from_models(pretrained, experts, device=device)
    else:
        check_same_family(pretrained_dir, expert_dirs)
        tvs = TaskVectorSet.from_models(str(pretrained_dir), [str(p) for p in expert_dirs], device=device)
    if isinstance(method, Recipe):
        if params:
            raise ParameterError(f"recipe {method.label!r}: give parameters inside the recipe, not as keywords "
                                 f"({sorted(params)[0]!r})")
        require_data_free(method)
        model = _iter_model(tvs, iter_weight_space(method, tvs, progress=progress, diagnostics=diagnostics),
                            out_dtype)
        metadata = {"mergecal_method": method.merge.id, "mergecal_recipe": method.id}
    else:
        merge_method = get_merge_method(method, **params)
        model = _iter_merged_model(tvs, merge_method, out_dtype, progress)
        metadata = {"mergecal_method": merge_method.id}
    return save_causal_lm_weights(model, out_dir, like=like,
                                  max_shard_bytes=max_shard_bytes, inputs=expert_dirs, overwrite=overwrite,
                                  metadata={**metadata, "mergecal_num_models": str(tvs.K)})
