"""The seq2seq family's ``built`` source, the seq2seq track (``seq2seq`` in params.yaml): a tiny T5 pretrained by
the papers' profile and its experts per regime (``standard``: full fine-tunes, the SVC paper's T5 rows; ``ia3``: IA³
adapters merged in vector form, the SVC and MAGIC papers' T0 rows), merged with the library (``merge_experts``) and
scored T0-style, by rank classification, on the suite's tasks. What its stages build: ``.stages``.

In the ``ia3`` regime the merges and calibrations defined on matrices (TSV-M, Iso-C, Iso-CTS; SVC's matrix rule,
WSC's ``wsc_weights``) do not apply (the papers print "—"): they are listed as skipped with the reason;
``svc(calibrate_vectors=true)`` and ``wsc(key_rule=vectors)`` calibrate the vectors."""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from .....adapters import merge_experts
from .....merge import weight_calibrations
from .....methods import MERGE_METHODS
from .....methods.base import MatrixMergeMethod
from .....recipe import Recipe
from ....cells import (COMMON_REFERENCES, Cell, CellResult, base_params, matrix_chains, per_example_results,
                       per_seed, per_seed_skipped, recipe_cell, recipe_params)
from ....chains import DATA_MERGE_SKIP, merge_needs_data
from ....config import Params
from ...protocol import Session
from .stages import (base_dir, expert_dir, load_model, manifest_path, references_path, score, split_path,
                     validation_limit, work_dir)

NAME = "seq2seq"
#: imported by the flow before the cells fan out (``flow.preload``): transformers, whose first import replaces its
#: module in ``sys.modules``, once in one thread
PRELOAD = ("transformers",)
DATA_SKIP = ("needs models and data: DisTaC's steps and MAGIC's feature-space steps (FSC, DSC) have no seq2seq "
             "adapter; the seq2seq track runs weight-space chains (merge, svc, wsc)")
VECTOR_SKIP = ("IA³ experts are vectors: {what} is defined on matrices and does not apply (the papers print '—'); "
               "svc(calibrate_vectors=true) and wsc(key_rule=vectors) calibrate vectors")
#: an IA³ key as the merge reads it (``mergecal.adapters.IA3Vectors``): what a calibration must cover to apply
_IA3_KEY, _IA3_SHAPE = "base_model.model.encoder.block.0.layer.0.SelfAttention.k.ia3_l", (64,)


def enabled(params: Params) -> bool:
    return params.seq2seq.enabled


def why_not(recipe: Recipe, regime: str) -> str | None:
    """Why the seq2seq track cannot run ``recipe`` in ``regime`` (None: it can)."""
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


def _chains(params: Params):
    track = params.seq2seq
    for regime in track.regimes:
        yield regime, None, None, None, None, None
        for merge, chain, values, grid, recipe in matrix_chains(params):
            yield regime, merge, chain, values, grid, recipe


def cells(params: Params) -> list[Cell]:
    """Per regime: the references, then every chain of the matrix the regime can run."""
    track, out = params.seq2seq, []
    for regime, merge, chain, values, grid, recipe in _chains(params):
        if merge is None:
            out += [Cell(NAME, track.backbone, track.task_set, tuple(track.tasks), regime, ref, "")
                    for ref in COMMON_REFERENCES]
        elif why_not(recipe, regime) is None:
            steps = [(s.name, values if s.phase == "merge" else s.params.model_dump()) for s in recipe.steps]
            out.append(recipe_cell(params, NAME, track.backbone, track.task_set, track.tasks, regime, merge, chain,
                                   steps, grid))
    return per_seed(out, params.seeds)


def skipped(params: Params) -> list[tuple[Cell, str]]:
    track, out = params.seq2seq, []
    for regime, merge, chain, _, _, recipe in _chains(params):
        if merge is not None and (reason := why_not(recipe, regime)) is not None:
            out.append((Cell(NAME, track.backbone, track.task_set, tuple(track.tasks), regime, merge, chain,
                             recipe.label), reason))
    return per_seed_skipped(out, params.seeds)


def model_files(models: dict[str, Path]) -> dict[str, Path]:
    """{role/file name: path} of every file of each model directory (a directory not built yet: itself, which the
    cell's id then reports missing, naming it)."""
    return {f"{role}/{p.name}": p for role, d in models.items()
            for p in (sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else [d])}


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    files = {"data_manifest": manifest_path(root),
             "reference": references_path(params, root, cell.regime, cell.seed)}
    files.update({f"data.{t}.{s}": split_path(root, t, s) for t in cell.tasks for s in ("validation", "test")})
    models = {"base": base_dir(params, root)}
    if cell.merge != "zeroshot":
        models.update({f"expert.{t}": expert_dir(params, root, cell.regime, t, cell.seed) for t in cell.tasks})
    return {**files, **model_files(models)}


def cell_fingerprint(cell: Cell, params: Params):
    return {"evaluation": params.seq2seq.evaluation.model_dump()}


def summaries(tasks, test: dict[str, float], reference: dict) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for task in tasks:
        metrics[f"acc.{task}"] = test[task]
        metrics[f"norm_acc.{task}"] = test[task] / max(reference["tasks"][task]["test_accuracy"], 1e-12)
    metrics["avg_acc"] = sum(metrics[f"acc.{t}"] for t in tasks) / len(tasks)
    metrics["avg_norm_acc"] = sum(metrics[f"norm_acc.{t}"] for t in tasks) / len(tasks)
    return metrics


def _reference_file(cell: Cell, params: Params, root: Path) -> dict:
    return json.loads(references_path(params, root, cell.regime, cell.seed).read_text())


def reference(cell: Cell, params: Params, root: str | Path, *, device: str = "cpu") -> CellResult:
    """The ``zeroshot`` row (the base scored on test) or the ``finetuned`` row (each expert on its own task, from
    the regime's references)."""
    root, tasks = Path(root), list(cell.tasks)
    found = _reference_file(cell, params, root)
    logged = base_params(cell)
    if cell.merge == "zeroshot":
        model, tokenizer = load_model(params, root, cell.regime, base_dir(params, root), device=device)
        test = score(params, root, model, tokenizer, tasks, "test", device=device)
        return CellResult(summaries(tasks, {t: s["accuracy"] for t, s in test.items()}, found), logged,
                          examples={t: s["correct"] for t, s in test.items()})
    test = {t: found["tasks"][t]["test_accuracy"] for t in tasks}
    norms = {t: {"norm": found["tasks"][t]["norm"]} for t in tasks}
    return CellResult(summaries(tasks, test, found), logged, {"task_vectors": norms},
                      examples=per_example_results(tasks, found["tasks"], "test_correct"))


@contextmanager
def session(cell: Cell, recipe: Recipe, grid: tuple[float, ...], params: Params, root: str | Path, *,
            device: str = "cpu") -> Iterator[Session]:
    """A recipe cell: the experts merged by the library (full checkpoints, or IA³ adapters in vector form written
    as the base scaled by the merged vectors) into a scratch directory for each scaling, loaded, the directory
    deleted; scored on validation, the chosen one on test."""
    root, tasks = Path(root), list(cell.tasks)
    found = _reference_file(cell, params, root)
    base = base_dir(params, root)
    experts = [expert_dir(params, root, cell.regime, t, cell.seed) for t in tasks]
    work_dir(root).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cell-", dir=work_dir(root)))

    def merged(value: float):
        out = merge_experts(base, experts, recipe.with_scaling(value), scratch / "merged",
                            full_model=cell.regime == "ia3", overwrite=True).path
        model = load_model(params, root, "standard", out, device=device)
        shutil.rmtree(out)
        return model

    def validate(model) -> tuple[float, float]:
        val = score(params, root, *model, tasks, "validation", device=device, limit=validation_limit(params))
        avg = sum(v["accuracy"] for v in val.values()) / len(tasks)
        norm = sum(val[t]["accuracy"] / max(found["tasks"][t]["val_accuracy"], 1e-12) for t in tasks) / len(tasks)
        return avg, norm

    def result(model, scaling: float, curve: list) -> CellResult:
        test = score(params, root, *model, tasks, "test", device=device)
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
