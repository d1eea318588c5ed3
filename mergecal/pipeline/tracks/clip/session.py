"""What every source of the CLIP family shares in its cells: a track's cells (``recipe_cells``) and a recipe
cell's session over what the source loaded (``CellModels`` -> ``session``: the scaling grid merged into one CLIP,
FSC hooked on a copy, every task scored with its frozen zero-shot head, the result logged; a merge that learns on
data, AdaMerging, learned first on the source's unlabelled images). A source never imports another; this module
imports none."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .... import cost
from ....backbones.clip_checkpoints import load_visual
from ....calibrations.registry import get_calibration, step_params
from ....errors import MergecalError
from ....merge import weight_space_trials
from ....methods import MERGE_METHODS
from ....recipe import Recipe
from ....task_vectors import TaskVectorSet
from ...cells import (COMMON_REFERENCES, Cell, CellResult, jsonable_diagnostics, matrix_chains, per_example_results,
                      recipe_cell, recipe_params, summaries, validation_averages)
from ...config import Params
from ..protocol import Session


def recipe_cells(params: Params, name: str, backbone: str, task_set: str, tasks: Sequence[str], regime: str,
                 distac_step: dict, protocols=(), references: Sequence[str] = COMMON_REFERENCES) -> list[Cell]:
    """One regime's cells of a CLIP track: its ``references``, then every merge in every chain of the matrix and of
    the track's own fixed-scaling ``protocols`` (a DisTaC step takes the source's ``distac_step``: its parameters,
    as a dict)."""
    out = [Cell(name, backbone, task_set, tuple(tasks), regime, ref, "") for ref in references]
    for merge, chain, values, grid, recipe in matrix_chains(params, protocols):
        steps = [(s.name, values if s.phase == "merge" else distac_step if s.name == "distac" else
                  s.params.model_dump()) for s in recipe.steps]
        out.append(recipe_cell(params, name, backbone, task_set, tasks, regime, merge, chain, steps, grid))
    return out


@dataclass
class CellModels:
    """What a CLIP source loads for a recipe cell (its ``session``); ``session`` below runs the rest."""

    tasks: list[str]
    reference: Mapping[str, dict]  # per task: the fine-tuned model's figures (val_accuracy, entropy, ...)
    logged: dict[str, str]  # the MLflow params every cell of the source logs
    pretrained: Any  # the pretrained image encoder: a state dict or a TensorSource of its ``visual.*`` keys
    finetuned: list  # the K image encoders merged, DisTaC-conditioned where the chain starts with DisTaC
    norms: dict[str, float]  # each merged task vector's norm (after DisTaC where conditioned)
    model: torch.nn.Module  # the CLIP the merges are loaded into (holding the pretrained weights)
    new_model: Callable[[], torch.nn.Module]  # another such CLIP (FSC's pretrained and fine-tuned models)
    score: Callable[..., dict]  # (model, task, split, per_example) -> the task's scores
    fsc_data: Callable[[Any], list]  # FSC's samples for its step's parameters
    sensitive: list[str] | None = None  # the probed magnitude-sensitive keys (WSC, FSC)
    sensitivity_file: Path | None = None
    distac: dict | None = None  # the DisTaC stage's {"kappas", "conditioned"}, when the chain starts with it
    rescale: dict | None = None  # the rescaling's {"kappas", "rescaled"}, when the chain starts with it
    # a merge that learns on data (AdaMerging): each task's zero-shot head, and (task, split) -> its uint8 images
    # [N, H, W, 3] (labels never read); None where the source gives none (its cells are skipped)
    heads: Mapping[str, torch.Tensor] | None = None
    unlabelled: Callable[[str, str], torch.Tensor] | None = None


class _ReloadedModels:
    """FSC's fine-tuned models as a lazy sequence: one CLIP, its image encoder reloaded for task t when FSC
    reads item t (``measure_fsc`` reads each once, in order), so one fine-tuned model is held at a time."""

    def __init__(self, model, encoders):
        self.model, self.encoders = model, encoders

    def __len__(self) -> int:
        return len(self.encoders)

    def __getitem__(self, t: int):
        encoder = self.encoders[t]  # a state dict or a TensorSource: both ``get`` a key
        load_visual(self.model, ((k, encoder.get(k)) for k in encoder.keys()))
        return self.model


class _ImageEncoder(torch.nn.Module):
    """CLIP's image tower on uint8 images [N, H, W, 3], each batch preprocessed as the evaluation does: the
    inputs stay uint8 until drawn (a task's test split in float32 at 224 px would be GBs). Its parameters are named
    as the CLIP's (``visual.*``)."""

    def __init__(self, visual: torch.nn.Module, size: int):
        super().__init__()
        self.visual, self.size = visual, size

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        from ....backbones.open_clip_vit import preprocess

        return self.visual(preprocess(images.cpu(), self.size).to(images.device))


def learned_merge(models: CellModels, cell: Cell, recipe: Recipe, tvs: TaskVectorSet,
                  device: str) -> tuple[TaskVectorSet, dict]:
    """A merge that ``needs_data`` (AdaMerging): its coefficients learned on the CLIP's image encoder, task k's
    logits its frozen zero-shot head's (logit_scale * normalize(embedding) @ head), on task k's unlabelled images
    of the method's ``inputs`` split. Returns the task vectors carrying them (what the merge's ``fit`` reads) and
    the run's record (coefficients, loss)."""
    from ....backbones.open_clip_vit import image_size

    if models.heads is None or models.unlabelled is None:
        raise MergecalError(f"{cell.label}: {recipe.merge.name} learns on each task's zero-shot head and unlabelled "
                            "images, which this source does not give")
    method = MERGE_METHODS[recipe.merge.name](recipe.merge.params)
    clip = models.model.to(device)
    heads = [models.heads[t].to(device) for t in models.tasks]
    scale = clip.logit_scale.exp().detach()
    batches = [models.unlabelled(t, method.params.inputs) for t in models.tasks]

    def logits(embedding: torch.Tensor, k: int) -> torch.Tensor:
        return scale * F.normalize(embedding, dim=-1) @ heads[k]

    with cost.step("merge", call=False):  # the learning is the merge's own cost (its stream adds the pass)
        learned, result = method.learn(_ImageEncoder(clip.visual, image_size(clip)), tvs, batches, logits=logits)
    c = result.coefficients
    record = {"coefficients": {t: c[k].tolist() for k, t in enumerate(models.tasks)},
              "loss": {"first": result.history[0]["loss"], "last": result.history[-1]["loss"]},
              "steps": len(result.history)}
    if c.dim() == 2:  # layer-wise: each coefficient's key
        record["keys"] = result.keys
    return learned, record


def session(models: CellModels, cell: Cell, recipe: Recipe, grid: tuple[float, ...], *,
            device: str = "cpu") -> nullcontext[Session]:
    """A recipe cell's session (``Track.session``): one CLIP whose image encoder is overwritten with each merge
    of the grid (``weight_space_trials``: merged once and rescaled where the recipe allows, else streamed key by
    key); an FSC step is measured on it and applied to a copy, its pretrained and fine-tuned models two more
    CLIPs (the fine-tuned one reloaded per task); the chosen merge is loaded again before the test split when
    the grid's last is not it. DisTaC ran in its source's stage: ``models.finetuned`` holds its encoders. A merge
    that learns on data (AdaMerging) learns once, first (``learned_merge``); its grid is its scaling, 1."""
    tasks, reference = models.tasks, models.reference
    tvs = TaskVectorSet.from_models(models.pretrained, models.finetuned, names=tasks, device=device)
    learned = None
    if MERGE_METHODS[recipe.merge.name].needs_data:
        tvs, learned = learned_merge(models, cell, recipe, tvs, device)
    trials = weight_space_trials(recipe, tvs, grid, sensitive=models.sensitive)
    model = models.model

    feature = recipe.phase("feature")
    if feature:  # FSC's pretrained and (reloaded) fine-tuned models, and its samples
        fsc_params = step_params(feature[0], models.sensitive)
        model = model.to(device)
        pre_model = models.new_model().to(device)
        task_models = _ReloadedModels(models.new_model().to(device), models.finetuned)
        fsc_data = models.fsc_data(fsc_params)

    loaded: list = [None, model]  # the scaling whose merge the model holds, and the model scored

    def merged(value: float):
        updates, diagnostics = trials(value)
        load_visual(model, ((k, tvs.load_pretrained(k) + u) for k, u in updates))
        loaded[:] = [value, model]
        if feature:  # MAGIC: FSC measured on the weight-space result, applied to a copy (the model is reloaded)
            calibrated, measured = get_calibration(feature[0].name).run(fsc_params, model, pre_model, task_models,
                                                                        fsc_data, progress=False)
            diagnostics = {**diagnostics, feature[0].name: measured}
            loaded[1] = calibrated
        return value, diagnostics

    def validate(outcome) -> tuple[float, float]:
        val = {t: models.score(loaded[1], t, "validation", False) for t in tasks}
        return validation_averages(val, reference, tasks)

    def result(outcome, scaling: float, curve: list) -> CellResult:
        _, diagnostics = outcome
        if loaded[0] != scaling:  # the model holds the grid's last merge: load the chosen one again
            _, diagnostics = merged(scaling)
        test = {t: models.score(loaded[1], t, "test", True) for t in tasks}
        metrics = {**summaries(tasks, test, reference), "selected_scaling": float(scaling)}
        logged = recipe_params(cell, recipe, scaling, models.logged)
        artifacts = jsonable_diagnostics(diagnostics, models.sensitivity_file)
        if curve:
            artifacts["scaling_curve"] = curve
        if models.distac is not None:
            artifacts["distac"] = models.distac
        if models.rescale is not None:
            artifacts["rescale"] = models.rescale
        if learned is not None:
            artifacts["adamerging"] = learned
        artifacts["task_vectors"] = {t: {"norm": models.norms[t], "entropy": reference[t]["entropy"]} for t in tasks}
        return CellResult(metrics, logged, artifacts, per_example_results(tasks, test))

    return nullcontext(Session(merged, validate, result))
