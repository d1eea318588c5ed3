"""The vision track: the project's small open_clip ViT, fine-tuned per task (image encoder only), in three regimes;
every task scored with its frozen zero-shot head. What its DVC stages build: ``.stages``."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

from .....calibrations.probing import SensitivityRanking
from .....checkpoint import load_state_dict
from .....data.vision import load_split
from .....recipe import Recipe
from .....run_recipe import RecipeInputs, recipe_trials
from .....task_vectors import task_vector
from ....cells import (REFERENCES, Cell, CellResult, base_params, finetuned_reference, flat_params,
                     jsonable_diagnostics, matrix_chains, per_example_results, per_seed, recipe_cell, summaries,
                     uses_sensitivity, validation_averages)
from ....config import Params
from ...protocol import Session
from ..family import check_distac_file
from .stages import (VisionModels, distac_params, evaluate_tasks, paths_for, preprocessed,
                      regime_variants, task_split)

NAME = "vision"


def enabled(params: Params) -> bool:
    return params.vision.enabled


def cells(params: Params) -> list[Cell]:
    """Per fine-tuning seed and regime: the references, then every merge in every chain (a DisTaC step takes the
    regime's preset)."""
    track, out = params.vision, []
    for regime in track.regimes:
        out += [Cell(NAME, track.backbone, track.task_set, tuple(track.tasks), regime, ref, "") for ref in REFERENCES]
        for merge, chain, values, grid, recipe in matrix_chains(params):
            steps = []
            for step in recipe.steps:
                if step.phase == "merge":
                    steps.append((step.name, values))
                elif step.name == "distac":
                    steps.append(("distac", distac_params(params, regime).model_dump()))
                else:
                    steps.append((step.name, step.params.model_dump()))
            out.append(recipe_cell(params, NAME, track.backbone, track.task_set, track.tasks, regime, merge, chain,
                                   steps, grid))
    return per_seed(out, params.seeds)


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    paths = paths_for(params, root, cell.seed)
    files = {"pretrained": paths.pretrained, "heads": paths.heads, "data_manifest": paths.data / "manifest.json",
             "reference": paths.task_vectors(cell.regime) / "diagnostics.json"}
    if cell.merge == "zeroshot":
        return files
    for task, variant in regime_variants(params.vision, cell.regime).items():
        files[f"finetuned.{task}"] = paths.finetuned(variant, task)
    if cell.recipe.startswith("distac"):
        for task in cell.tasks:
            files[f"distac.{task}"] = paths.distac(cell.regime) / f"{task}.safetensors"
    if cell.recipe and uses_sensitivity(cell.recipe):
        files["sensitivity"] = paths.sensitivity(cell.regime)
    return files


def skipped(params: Params) -> list[tuple[Cell, str]]:
    return []  # every chain runs


def fingerprint(params: Params):
    return params.vision.arch


def cell_fingerprint(cell: Cell, params: Params):
    return fingerprint(params)


def reference(cell: Cell, params: Params, root: str | Path, *, device: str = "cpu") -> CellResult:
    """The ``zeroshot`` row (the pretrained encoder scored on test) or the ``finetuned`` row (the references)."""
    models = VisionModels(params, Path(root), cell.seed)
    paths, tasks = models.paths, list(cell.tasks)
    reference = json.loads((paths.task_vectors(cell.regime) / "diagnostics.json").read_text())
    logged = base_params(cell)
    if cell.merge == "zeroshot":
        test = evaluate_tasks(models.model({}), models.heads, paths.data, tasks, "test",
                              batch_size=params.benchmark.evaluation.batch_size, device=device, per_example=True)
        return CellResult(summaries(tasks, test, reference), logged, examples=per_example_results(tasks, test))
    return finetuned_reference(tasks, reference, logged)


def session(cell: Cell, recipe: Recipe, grid: tuple[float, ...], params: Params, root: str | Path, *,
            device: str = "cpu") -> nullcontext[Session]:
    """A recipe cell: a DisTaC step reads the models its stage conditioned, the merge and weight-space steps
    stream, FSC hooks the merged model; every task scored with its frozen zero-shot head."""
    root = Path(root)
    models = VisionModels(params, root, cell.seed)
    paths, tasks = models.paths, list(cell.tasks)
    evaluation = params.benchmark.evaluation
    reference = json.loads((paths.task_vectors(cell.regime) / "diagnostics.json").read_text())

    pre_steps = recipe.phase("pre")
    if pre_steps:  # DisTaC ran once in its DVC stage with exactly these parameters (checked here)
        states = []
        for task in tasks:
            path = paths.distac(cell.regime) / f"{task}.safetensors"
            check_distac_file(path, pre_steps[0].params.model_dump(mode="json"), "the cell's recipe")
            states.append(load_state_dict(path))
    else:
        states = models.finetuned(cell.regime)
    needs_sensitive = uses_sensitivity(cell.recipe)
    sensitivity_path = paths.sensitivity(cell.regime) if needs_sensitive else None
    sensitive = SensitivityRanking.load(sensitivity_path).sensitive if sensitivity_path else None

    pre_visual = models.visual_pretrained()
    fsc_data, agnostic = None, None
    if recipe.phase("feature"):
        n = recipe.phase("feature")[0].params.n_samples_per_task  # the FSC step's own count (its recipe id's)
        fsc_data = [preprocessed(task_split(paths.data, t, "train", max_items=n)[0], params.vision.arch) for t in tasks]
        mixed = load_split(paths.data, "mixed", "train")["images"][: n * len(tasks)]
        agnostic = preprocessed(mixed, params.vision.arch)
    inputs = RecipeInputs(build_model=models.model, fsc_data=fsc_data, fsc_agnostic_data=agnostic, sensitive=sensitive,
                          progress=False, device=device)
    run_trial = recipe_trials(recipe.without_pre_merge(), pre_visual, states, inputs, grid)

    def merged(value: float):
        result = run_trial(value)
        return (result.model if result.model is not None else models.model(result.state_dict)), result.diagnostics

    def validate(outcome) -> tuple[float, float]:
        val = evaluate_tasks(outcome[0], models.heads, paths.data, tasks, "validation",
                             max_items=evaluation.max_validation, batch_size=evaluation.batch_size, device=device)
        return validation_averages(val, reference, tasks)

    def result(outcome, scaling: float, curve: list) -> CellResult:
        model, diagnostics = outcome
        test = evaluate_tasks(model, models.heads, paths.data, tasks, "test", batch_size=evaluation.batch_size,
                              device=device, per_example=True)
        metrics = summaries(tasks, test, reference)
        metrics["selected_scaling"] = float(scaling)
        logged = {**base_params(cell), "grid": json.dumps(list(cell.grid)),
                  "scaling_from": cell.scaling_from or "own grid"}
        for step in recipe.steps:
            logged.update(flat_params(step.name, step.params.model_dump(mode="json")))
        logged[f"{recipe.merge.name}.scaling"] = json.dumps(scaling)
        artifacts = jsonable_diagnostics(diagnostics, sensitivity_path)
        if curve:
            artifacts["scaling_curve"] = curve
        if pre_steps:
            info = json.loads((paths.distac(cell.regime) / "distac.json").read_text())
            artifacts["distac"] = {"kappas": info["kappas"], "conditioned": info["conditioned"]}
        norms = {t: float(sum(v.double().pow(2).sum() for v in task_vector(s, pre_visual).values()) ** 0.5)
                 for t, s in zip(tasks, states)}
        artifacts["task_vectors"] = {t: {"norm": norms[t], "entropy": reference[t]["entropy"]} for t in tasks}
        return CellResult(metrics, logged, artifacts, per_example_results(tasks, test))

    return nullcontext(Session(merged, validate, result))
