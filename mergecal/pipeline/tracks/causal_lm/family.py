"""What every source of the causal-LM family shares: its cells (references, then every weight-space chain; the
chains that need data listed as skipped), and a cell's computation over the ``Models`` a source gives (the base
and experts' directories, the lm-eval scorer, the references): the ``zeroshot``/``finetuned`` rows and a recipe
cell's session, merged checkpoint to checkpoint by the streaming path (``merge_causal_lms``: key by key, sharded
safetensors out, so the same cell code runs a 7B family) and scored with lm-eval. Weight-space chains only:
DisTaC and MAGIC's feature-space steps (FSC, so DSC) have no causal-LM adapter. A source module (``built``: the
pipeline's own tiny Llama; ``files``: a lab's directories) never imports another."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ....adapters import merge_experts
from ....merge_causal_lm import merge_causal_lms
from ....recipe import Recipe
from ...cells import (COMMON_REFERENCES, Cell, CellResult, base_params, jsonable_diagnostics, matrix_chains,
                      per_example_results, recipe_cell, recipe_params)
from ...chains import DATA_MERGE_SKIP, merge_needs_data
from ...config import Params
from ..protocol import Session
from .scoring import LmEval


@dataclass(frozen=True)
class Models:
    """What a source gives a cell: the references its stage wrote (base and experts' scores, norms, task
    configurations), the base's directory, the experts' (task order of the cell), the lm-eval scorer, and the
    folder under which the cell writes its scratch merges."""

    reference: dict
    base: Path
    experts: list[Path]
    scorer: LmEval
    scratch: Path
    align_vocabulary: bool = False  # experts may add tokens (merge_causal_lms's option)
    adapters: bool = False  # the experts are peft adapters of the base, merged by ``mergecal.adapters``


#: what a source's module gives the flow to import before its cells fan out into threads (``flow.preload``): lm-eval's
#: Hugging Face model, and with it transformers, imported once in one thread
PRELOAD = ("lm_eval.models.huggingface",)

SKIP_REASON = ("needs models and data: DisTaC and MAGIC's feature-space steps (FSC, DSC) have no causal-LM "
               "adapter yet; the LLM track runs weight-space chains (merge, svc, wsc)")


def cells(params: Params, track: str, backbone: str, task_set: str, tasks, protocols=(),
          regime: str = "standard") -> list[Cell]:
    """The cells of an LLM family (a base and one expert per task): references, then every weight-space
    chain of the matrix (and of the track's own fixed-scaling ``protocols``)."""
    out = [Cell(track, backbone, task_set, tuple(tasks), regime, ref, "") for ref in COMMON_REFERENCES]
    for merge, chain, values, grid, recipe in matrix_chains(params, protocols):
        if any(s.needs_data for s in recipe.steps) or merge_needs_data(recipe):
            continue
        steps = [(s.name, values if s.phase == "merge" else s.params.model_dump()) for s in recipe.steps]
        out.append(recipe_cell(params, track, backbone, task_set, tasks, regime, merge, chain, steps, grid))
    return out


def skipped(params: Params, track: str, backbone: str, task_set: str, tasks,
            reason: str = SKIP_REASON, regime: str = "standard") -> list[tuple[Cell, str]]:
    """The chains an LLM family cannot run, as cells with the reason (the leaderboard lists them)."""
    return [(Cell(track, backbone, task_set, tuple(tasks), regime, merge, chain, recipe.label),
             DATA_MERGE_SKIP if merge_needs_data(recipe) else reason)
            for merge, chain, _, _, recipe in matrix_chains(params)
            if any(s.needs_data for s in recipe.steps) or merge_needs_data(recipe)]


def lm_eval_version() -> str:
    from importlib.metadata import version

    return version("lm_eval")


def summaries(tasks, test: dict[str, float], reference: dict, metrics_of: dict[str, str]) -> dict[str, float]:
    """``acc.<task>`` is the task's lm-eval metric (exact_match or acc: the leaderboard's column), also logged
    under its own name (a filter's comma as a colon, which MLflow's names allow: ``exact_match:flexible-extract``);
    normalized by the expert's own test score."""
    metrics: dict[str, float] = {}
    for task in tasks:
        metrics[f"acc.{task}"] = metrics[f"{metrics_of[task].replace(',', ':')}.{task}"] = test[task]
        metrics[f"norm_acc.{task}"] = test[task] / max(reference["tasks"][task]["test_accuracy"], 1e-12)
    metrics["avg_acc"] = sum(metrics[f"acc.{t}"] for t in tasks) / len(tasks)
    metrics["avg_norm_acc"] = sum(metrics[f"norm_acc.{t}"] for t in tasks) / len(tasks)
    return metrics


def logged_params(cell: Cell, reference: dict) -> dict[str, str]:
    logged = {**base_params(cell), "lm_eval_version": lm_eval_version()}
    for name, digest in reference["task_configs"].items():
        logged[f"lm_eval_task.{name}"] = digest[:16]
    return logged


def reference(cell: Cell, models: Models, *, device: str = "cpu") -> CellResult:
    """The ``zeroshot`` row (the base scored on test with lm-eval) or the ``finetuned`` row (each expert's own
    score, from the source's references)."""
    reference, base, scorer = models.reference, models.base, models.scorer
    tasks = list(cell.tasks)
    logged = logged_params(cell, reference)
    if cell.merge == "zeroshot":
        examples: dict[str, list[float]] = {}  # per-document test scores, for the leaderboard's intervals
        return CellResult(summaries(tasks, scorer.score(base, tasks, "test", device=device, examples=examples),
                                    reference, scorer.metrics), logged, examples=examples)
    test = {t: reference["tasks"][t]["test_accuracy"] for t in tasks}
    norms = {t: {"norm": reference["tasks"][t]["norm"]} for t in tasks}
    return CellResult(summaries(tasks, test, reference, scorer.metrics), logged, {"task_vectors": norms},
                      examples=per_example_results(tasks, reference["tasks"], "test_correct"))


@contextmanager
def session(cell: Cell, recipe: Recipe, models: Models, *, device: str = "cpu") -> Iterator[Session]:
    """A recipe cell: the experts merged checkpoint to checkpoint (weight-space chain; adapters: each one's delta
    on the base, ``mergecal.adapters.merge_experts``) into a scratch directory for each scaling, scored on
    validation with lm-eval; only the best merge so far stays on disk, and the scratch directory goes when the cell
    ends."""
    reference, base, experts, scorer, scratch_root = (models.reference, models.base, models.experts, models.scorer,
                                                      models.scratch)
    tasks = list(cell.tasks)
    scratch_root.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="cell-", dir=scratch_root))

    def merged(value: float):
        diagnostics: dict = {}
        if models.adapters:  # the calibrations' diagnostics are merge_causal_lms's only
            return merge_experts(base, experts, recipe.with_scaling(value), scratch / f"scaling-{value:g}",
                                 device=device).path, diagnostics
        out = merge_causal_lms(base, experts, recipe.with_scaling(value), scratch / f"scaling-{value:g}",
                               device=device, diagnostics=diagnostics, align_vocabulary=models.align_vocabulary)
        return out, diagnostics

    best: list = []  # [avg normalized score, directory] of the best merge so far: the only one kept on disk

    def validate(outcome) -> tuple[float, float]:
        val = scorer.score(outcome[0], tasks, "validation", device=device, cache=False)  # scored once
        avg = sum(val.values()) / len(tasks)
        norm = sum(val[t] / max(reference["tasks"][t]["val_accuracy"], 1e-12) for t in tasks) / len(tasks)
        if not best or norm > best[0]:  # select_scaling's rule: the first of equal scores wins
            if best:
                shutil.rmtree(best[1])
            best[:] = [norm, outcome[0]]
        else:
            shutil.rmtree(outcome[0])
        return avg, norm

    def result(outcome, scaling: float, curve: list) -> CellResult:
        directory, diagnostics = outcome
        examples: dict[str, list[float]] = {}  # per-document test scores, for the leaderboard's intervals
        test = scorer.score(directory, tasks, "test", device=device, cache=False, examples=examples)
        metrics = {**summaries(tasks, test, reference, scorer.metrics), "selected_scaling": float(scaling)}
        logged = recipe_params(cell, recipe, scaling, logged_params(cell, reference))
        artifacts = jsonable_diagnostics(diagnostics, None)
        if curve:
            artifacts["scaling_curve"] = curve
        artifacts["task_vectors"] = {t: {"norm": reference["tasks"][t]["norm"]} for t in tasks}
        return CellResult(metrics, logged, artifacts, examples=examples)

    try:
        yield Session(merged, validate, result)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)

