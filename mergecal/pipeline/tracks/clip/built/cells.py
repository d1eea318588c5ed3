"""The vision track: the project's small open_clip ViT, fine-tuned per task (image encoder only), in three regimes;
every task scored with its frozen zero-shot head. What its DVC stages build: ``.stages``."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

import torch

from .....calibrations.probing import SensitivityRanking
from .....calibrations.registry import get_calibration
from .....checkpoint import load_state_dict
from .....data.vision import load_split
from .....errors import MergecalError
from .....recipe import Recipe
from .....task_vectors import task_vector
from ....cells import (COMMON_REFERENCES, Cell, CellResult, base_params, finetuned_reference, per_example_results,
                       per_seed, summaries, uses_sensitivity)
from ....config import Params
from ...protocol import Session
from ..family import check_distac_file
from ..session import CellModels, recipe_cells
from ..session import session as family_session
from .stages import VisionModels, distac_params, evaluate_tasks, paths_for, preprocessed, regime_files, task_split

NAME = "vision"
MULTITASK_REGIME = "standard"  # the regime whose recipe the multi-task reference is trained with (``stages.multitask``)


def enabled(params: Params) -> bool:
    return params.vision.enabled


def cells(params: Params) -> list[Cell]:
    """Per fine-tuning seed and regime: the references (the ``standard`` regime's with the ``multitask`` row), then
    every merge in every chain (a DisTaC step takes the regime's preset)."""
    track = params.vision
    out = [cell for regime in track.regimes
           for cell in recipe_cells(params, NAME, track.backbone, track.task_set, track.tasks, regime,
                                    distac_params(params, regime).model_dump(), references=references(regime))]
    return per_seed(out, params.seeds)


def references(regime: str) -> tuple[str, ...]:
    """The reference rows of a regime: every track's, and the multi-task model in the regime it was trained in."""
    return (*COMMON_REFERENCES, "multitask") if regime == MULTITASK_REGIME else COMMON_REFERENCES


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    paths = paths_for(params, root, cell.seed)
    files = {"pretrained": paths.pretrained, "heads": paths.heads, "data_manifest": paths.data / "manifest.json",
             "reference": paths.task_vectors(cell.regime) / "diagnostics.json"}
    if cell.merge == "zeroshot":
        return files
    if cell.merge == "multitask":
        return {**files, "multitask": paths.multitask}
    for task, path in regime_files(paths, params.vision, cell.regime).items():
        files[f"finetuned.{task}"] = path
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
    """The ``zeroshot`` row (the pretrained encoder scored on test), the ``multitask`` row (the encoder fine-tuned on
    every task jointly, ``stages.multitask``, scored on test with each task's head) or the ``finetuned`` row (the
    references). Normalized accuracy divides by the ``finetuned`` row's, as every row's."""
    models = VisionModels(params, Path(root), cell.seed)
    paths, tasks = models.paths, list(cell.tasks)
    reference = json.loads((paths.task_vectors(cell.regime) / "diagnostics.json").read_text())
    logged = base_params(cell)
    if cell.merge in ("zeroshot", "multitask"):
        state = load_state_dict(paths.multitask) if cell.merge == "multitask" else {}
        test = evaluate_tasks(models.model(state), models.heads, paths.data, tasks, "test",
                              batch_size=params.benchmark.evaluation.batch_size, device=device, per_example=True)
        return CellResult(summaries(tasks, test, reference), logged, examples=per_example_results(tasks, test))
    return finetuned_reference(tasks, reference, logged)


def session(cell: Cell, recipe: Recipe, grid: tuple[float, ...], params: Params, root: str | Path, *,
            device: str = "cpu") -> nullcontext[Session]:
    """A recipe cell (the family's ``session.session``) over the regime's models: a DisTaC step's, those its stage
    conditioned (checked against the cell's step); FSC's samples, train images of each task (task-agnostic: of the
    suite's ``mixed`` split)."""
    models = VisionModels(params, Path(root), cell.seed)
    paths, tasks = models.paths, list(cell.tasks)
    evaluation = params.benchmark.evaluation
    reference = json.loads((paths.task_vectors(cell.regime) / "diagnostics.json").read_text())

    pre_steps = recipe.phase("pre")
    distac = rescale = None
    if pre_steps and pre_steps[0].name == "distac":  # it ran once in its DVC stage with these parameters (checked)
        states = []
        for task in tasks:
            path = paths.distac(cell.regime) / f"{task}.safetensors"
            check_distac_file(path, pre_steps[0].params.model_dump(mode="json"), "the cell's recipe")
            states.append(load_state_dict(path))
        info = json.loads((paths.distac(cell.regime) / "distac.json").read_text())
        distac = {"kappas": info["kappas"], "conditioned": info["conditioned"]}
    else:
        states = models.finetuned(cell.regime)
    pre_visual = models.visual_pretrained()
    for step in pre_steps[1 if distac else 0:]:  # a data-free step (rescale) runs here, on what came before it
        spec = get_calibration(step.name)
        if spec.needs_data:
            raise MergecalError(f"{cell.label}: {step.name!r} after another pre-merge step: only a chain's first "
                                "step reads DisTaC's stage")
        states, report = spec.run(step.params, pre_visual, states)
        rescale = {"kappas": report["kappas"], "rescaled": [tasks[t] for t in report["rescaled"]]}
    sensitivity_path = paths.sensitivity(cell.regime) if uses_sensitivity(cell.recipe) else None
    sensitive = SensitivityRanking.load(sensitivity_path).sensitive if sensitivity_path else None
    norms = {t: float(sum(v.double().pow(2).sum() for v in task_vector(s, pre_visual).values()) ** 0.5)
             for t, s in zip(tasks, states)}

    def score(model, task: str, split: str, per_example: bool) -> dict:
        limit = evaluation.max_validation if split == "validation" else None
        return evaluate_tasks(model, models.heads, paths.data, [task], split, max_items=limit,
                              batch_size=evaluation.batch_size, device=device, per_example=per_example)[task]

    def fsc_data(fsc_params) -> list:
        n = fsc_params.n_samples_per_task
        if fsc_params.data == "task_agnostic":
            return [preprocessed(load_split(paths.data, "mixed", "train")["images"][: n * len(tasks)],
                                 params.vision.arch)]
        return [preprocessed(task_split(paths.data, t, "train", max_items=n)[0], params.vision.arch) for t in tasks]

    def unlabelled(task: str, split: str) -> torch.Tensor:  # AdaMerging's inputs: the images, never the labels
        return torch.as_tensor(task_split(paths.data, task, split)[0])

    return family_session(CellModels(tasks, reference, base_params(cell), pre_visual, states, norms,
                                     models.model({}), lambda: models.model({}), score, fsc_data=fsc_data,
                                     sensitive=sensitive, sensitivity_file=sensitivity_path, distac=distac,
                                     rescale=rescale, heads=models.heads, unlabelled=unlabelled),
                          cell, recipe, grid, device=device)
