"""What every source of the seq2seq family shares (``built``: the papers' profile's tiny T5; ``files``: a lab's own
T5 / T0 directories): its cells per regime (``standard``: full fine-tunes; ``ia3``: IA³ adapters merged in vector
form; ``lora``: LoRA adapters, a delta per target matrix), what a regime cannot run (``why_not``), and a cell's
computation over the ``Models`` a source gives: the experts merged by the library (``merge_experts``) into a
scratch directory per scaling, loaded, the directory deleted; scored by rank classification (``.scoring``) on
validation, the chosen one on test. A source module never imports another.

In the ``ia3`` regime the merges and calibrations defined on matrices (TSV-M, Iso-C, Iso-CTS; SVC's matrix rule,
WSC's ``wsc_weights``) do not apply (the papers print "—"): they are listed as skipped with the reason;
``svc(calibrate_vectors=true)`` and ``wsc(key_rule=vectors)`` calibrate the vectors."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from ....adapters import merge_experts
from ....merge import weight_calibrations
from ....methods import MERGE_METHODS
from ....methods.base import MatrixMergeMethod
from ....recipe import Recipe
from ...cells import (COMMON_REFERENCES, Cell, CellResult, base_params, matrix_chains, per_example_results,
                      recipe_cell, recipe_params)
from ...chains import DATA_MERGE_SKIP, merge_needs_data
from ...config import Params
from ..protocol import Session
from .scoring import Scorer, load_model

#: imported by the flow before the cells fan out (``flow.preload``): transformers, whose first import replaces its
#: module in ``sys.modules``, once in one thread
PRELOAD = ("transformers",)
DATA_SKIP = ("needs models and data: DisTaC's steps and MAGIC's feature-space steps (FSC, DSC) have no seq2seq "
             "adapter; the seq2seq track runs weight-space chains (merge, svc, wsc)")
VECTOR_SKIP = ("IA³ experts are vectors: {what} is defined on matrices and does not apply (the papers print '—'); "
               "svc(calibrate_vectors=true) and wsc(key_rule=vectors) calibrate vectors")
#: an IA³ key as the merge reads it (``mergecal.adapters.IA3Vectors``): what a calibration must cover to apply
_IA3_KEY, _IA3_SHAPE = "base_model.model.encoder.block.0.layer.0.SelfAttention.k.ia3_l", (64,)


def why_not(recipe: Recipe, regime: str) -> str | None:
    """Why the family cannot run ``recipe`` in ``regime`` (None: it can)."""
    if any(s.needs_data or s.phase == "pre" for s in recipe.steps):  # DisTaC's rescale conditions whole models
        return DATA_SKIP
    if merge_needs_data(recipe):
        return DATA_MERGE_SKIP
    if regime != "ia3":
        return None
    if issubclass(MERGE_METHODS[recipe.merge.name], MatrixMergeMethod):
        return VECTOR_SKIP.format(what=recipe.merge.name)
    for step, calibration in zip(recipe.phase("weight"), weight_calibrations(recipe)):
        if not calibration.covers(_IA3_KEY, _IA3_SHAPE, torch.float32):
            return VECTOR_SKIP.format(what=f"{step.name} (key rule {step.params.key_rule})")
    return None


def _chains(params: Params, regimes, protocols=()):
    for regime in regimes:
        yield regime, None, None, None, None, None
        for merge, chain, values, grid, recipe in matrix_chains(params, protocols):
            yield regime, merge, chain, values, grid, recipe


def cells(params: Params, track: str, backbone: str, task_set: str, tasks, regimes, protocols=()) -> list[Cell]:
    """Per regime: the references, then every chain of the matrix (and of the track's own fixed-scaling
    ``protocols``) the regime can run."""
    out = []
    for regime, merge, chain, values, grid, recipe in _chains(params, regimes, protocols):
        if merge is None:
            out += [Cell(track, backbone, task_set, tuple(tasks), regime, ref, "") for ref in COMMON_REFERENCES]
        elif why_not(recipe, regime) is None:
            steps = [(s.name, values if s.phase == "merge" else s.params.model_dump()) for s in recipe.steps]
            out.append(recipe_cell(params, track, backbone, task_set, tasks, regime, merge, chain, steps, grid))
    return out


def skipped(params: Params, track: str, backbone: str, task_set: str, tasks, regimes) -> list[tuple[Cell, str]]:
    return [(Cell(track, backbone, task_set, tuple(tasks), regime, merge, chain, recipe.label), reason)
            for regime, merge, chain, _, _, recipe in _chains(params, regimes)
            if merge is not None and (reason := why_not(recipe, regime)) is not None]


# -------------------------------------------------------------------------------------------------- cells

@dataclass(frozen=True)
class Models:
    """What a source gives a cell: the references its stage wrote, the base's directory, the experts' (task order
    of the cell), the scorer, and the folder under which the cell writes its scratch merges."""

    reference: dict
    base: Path
    experts: list[Path]
    scorer: Scorer
    scratch: Path


def summaries(tasks, test: dict[str, float], reference: dict) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for task in tasks:
        metrics[f"acc.{task}"] = test[task]
        metrics[f"norm_acc.{task}"] = test[task] / max(reference["tasks"][task]["test_accuracy"], 1e-12)
    metrics["avg_acc"] = sum(metrics[f"acc.{t}"] for t in tasks) / len(tasks)
    metrics["avg_norm_acc"] = sum(metrics[f"norm_acc.{t}"] for t in tasks) / len(tasks)
    return metrics


def reference(cell: Cell, models: Models, *, device: str = "cpu") -> CellResult:
    """The ``zeroshot`` row (the base scored on test) or the ``finetuned`` row (each expert on its own task, from
    the references)."""
    tasks, found = list(cell.tasks), models.reference
    logged = base_params(cell)
    if cell.merge == "zeroshot":
        model, tokenizer = load_model(models.base, models.base, device=device)
        test = models.scorer.score(model, tokenizer, tasks, "test", device=device)
        return CellResult(summaries(tasks, {t: s["accuracy"] for t, s in test.items()}, found), logged,
                          examples={t: s["correct"] for t, s in test.items()})
    test = {t: found["tasks"][t]["test_accuracy"] for t in tasks}
    norms = {t: {"norm": found["tasks"][t]["norm"]} for t in tasks}
    return CellResult(summaries(tasks, test, found), logged, {"task_vectors": norms},
                      examples=per_example_results(tasks, found["tasks"], "test_correct"))


@contextmanager
def session(cell: Cell, recipe: Recipe, models: Models, *, device: str = "cpu") -> Iterator[Session]:
    """A recipe cell: the experts merged by the library (full checkpoints or LoRA adapters into a full model; IA³
    adapters in vector form, written as the base scaled by the merged vectors) into a scratch directory for each
    scaling, loaded, the directory deleted; scored on validation, the chosen one on test."""
    tasks, found = list(cell.tasks), models.reference
    models.scratch.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cell-", dir=models.scratch))

    def merged(value: float):
        out = merge_experts(models.base, models.experts, recipe.with_scaling(value), scratch / "merged",
                            full_model=cell.regime == "ia3", overwrite=True).path
        model = load_model(models.base, out, device=device)
        shutil.rmtree(out)
        return model

    def validate(model) -> tuple[float, float]:
        val = models.scorer.score(*model, tasks, "validation", device=device)
        avg = sum(v["accuracy"] for v in val.values()) / len(tasks)
        norm = sum(val[t]["accuracy"] / max(found["tasks"][t]["val_accuracy"], 1e-12) for t in tasks) / len(tasks)
        return avg, norm

    def result(model, scaling: float, curve: list) -> CellResult:
        test = models.scorer.score(*model, tasks, "test", device=device)
        metrics = {**summaries(tasks, {t: s["accuracy"] for t, s in test.items()}, found),
                   "selected_scaling": float(scaling)}
        artifacts: dict = {"task_vectors": {t: {"norm": found["tasks"][t]["norm"]} for t in tasks}}
        if curve:
            artifacts["scaling_curve"] = curve
        return CellResult(metrics, recipe_params(cell, recipe, scaling, base_params(cell)), artifacts,
                          examples={t: s["correct"] for t, s in test.items()})

    try:
        yield Session(merged, validate, result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
