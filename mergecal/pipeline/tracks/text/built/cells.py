"""The text track: the packaged MiniLM encoder, a head per task; merged encoders scored with each task's own head.
Weight-space chains only: a chain with a step that needs models and data (DisTaC, FSC) has no text adapter yet.
What its DVC stages build: ``.stages``."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

from .....recipe import Recipe
from .....run_recipe import RecipeInputs, recipe_trials
from ....cells import (COMMON_REFERENCES, Cell, CellResult, base_params, finetuned_reference, jsonable_diagnostics,
                       matrix_chains, per_example_results, per_seed, per_seed_skipped, recipe_cell, recipe_params,
                       summaries, validation_averages)
from ....chains import DATA_MERGE_SKIP, merge_needs_data
from ....config import Params
from ...protocol import Session
from .stages import TextModels, data_root, finetuned_path, references_path

NAME = "text"
SKIP_REASON = ("needs models and data: DisTaC and MAGIC's feature-space steps (FSC, DSC) have no text-encoder "
               "adapter yet; the text track runs weight-space chains (merge, svc, wsc)")


def enabled(params: Params) -> bool:
    return params.text.enabled


def cells(params: Params) -> list[Cell]:
    track = params.text
    out = [Cell(NAME, track.backbone, track.task_set, tuple(track.tasks), "standard", ref, "")
           for ref in COMMON_REFERENCES]
    for merge, chain, values, grid, recipe in matrix_chains(params):
        if any(s.needs_data for s in recipe.steps) or merge_needs_data(recipe):
            continue
        steps = [(s.name, values if s.phase == "merge" else s.params.model_dump()) for s in recipe.steps]
        out.append(recipe_cell(params, NAME, track.backbone, track.task_set, track.tasks, "standard", merge, chain,
                               steps, grid))
    return per_seed(out, params.seeds)


def skipped(params: Params) -> list[tuple[Cell, str]]:
    """The chains this track cannot run, as cells with the reason (the leaderboard lists them)."""
    track, out = params.text, []
    for merge, chain, _, _, recipe in matrix_chains(params):
        if any(s.needs_data for s in recipe.steps) or merge_needs_data(recipe):
            out.append((Cell(NAME, track.backbone, track.task_set, tuple(track.tasks), "standard", merge, chain,
                             recipe.label), DATA_MERGE_SKIP if merge_needs_data(recipe) else SKIP_REASON))
    return per_seed_skipped(out, params.seeds)


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    files = {"data_manifest": data_root(root) / "manifest.json",
             "reference": references_path(params, root, cell.seed)}
    for task in cell.tasks:
        files[f"finetuned.{task}"] = finetuned_path(params, root, task, cell.seed)
    return files


def fingerprint(params: Params):
    return params.text.finetune


def cell_fingerprint(cell: Cell, params: Params):
    return fingerprint(params)


def reference(cell: Cell, params: Params, root: str | Path, *, device: str = "cpu") -> CellResult:
    """The ``zeroshot`` row (the pretrained encoder with each task's head: no zero-shot head exists) or the
    ``finetuned`` row (the references)."""
    models, tasks = TextModels(params, root, cell.seed), list(cell.tasks)
    reference = json.loads(references_path(params, root, cell.seed).read_text())
    logged = base_params(cell)
    if cell.merge == "zeroshot":
        test = models.evaluate(models.pretrained, tasks, "test", device=device, per_example=True)
        return CellResult(summaries(tasks, test, reference), logged, examples=per_example_results(tasks, test))
    return finetuned_reference(tasks, reference, logged)


def session(cell: Cell, recipe: Recipe, grid: tuple[float, ...], params: Params, root: str | Path, *,
            device: str = "cpu") -> nullcontext[Session]:
    """A recipe cell: the task encoders merged (weight-space chain), every task scored with its own head."""
    models, tasks = TextModels(params, root, cell.seed), list(cell.tasks)
    evaluation = params.benchmark.evaluation
    reference = json.loads(references_path(params, root, cell.seed).read_text())
    states = [models.finetuned(t)[0] for t in tasks]
    merged = recipe_trials(recipe, models.pretrained, states, RecipeInputs(progress=False, device=device), grid)

    def validate(trial) -> tuple[float, float]:
        val = models.evaluate(trial.state_dict, tasks, "validation", max_items=evaluation.max_validation,
                              device=device)
        return validation_averages(val, reference, tasks)

    def result(chosen, scaling: float, curve: list) -> CellResult:
        test = models.evaluate(chosen.state_dict, tasks, "test", device=device, per_example=True)
        metrics = {**summaries(tasks, test, reference), "selected_scaling": float(scaling)}
        logged = recipe_params(cell, recipe, scaling, base_params(cell))
        artifacts = jsonable_diagnostics(chosen.diagnostics, None)
        if curve:
            artifacts["scaling_curve"] = curve
        artifacts["task_vectors"] = {t: {"norm": reference[t]["norm"], "entropy": reference[t]["entropy"]}
                                     for t in tasks}
        return CellResult(metrics, logged, artifacts, per_example_results(tasks, test))

    return nullcontext(Session(merged, validate, result))
