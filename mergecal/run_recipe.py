"""Run a recipe end to end: DisTaC pre-conditioning -> merge -> weight-space calibrations -> FSC.

The data-free middle streams key by key (``mergecal.merge.iter_weight_space``). DisTaC and FSC need
models and data, which the caller supplies in ``RecipeInputs`` (the backbone adapters provide them).
Following MAGIC, FSC is measured on the model that the weight-space steps produced (so ``dsc`` = WSC,
then FSC measured on the WSC-calibrated model), and each task's fine-tuned model in FSC is the one that
went into the merge (DisTaC-conditioned when the recipe conditions it).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .calibrations.registry import get_calibration, step_params
from .errors import ParameterError
from .merge import iter_weight_space, rescaled_model
from .recipe import Recipe
from .task_vectors import COMPUTE_DTYPE, TaskVectorSet

StateDict = Mapping[str, torch.Tensor]


@dataclass
class RecipeInputs:
    """Models and data a recipe needs beyond the checkpoints.

    ``build_model(state_dict)``: the backbone as an ``nn.Module`` (FSC). ``build_task_model(t, state_dict)``:
    the model with task t's frozen head, returning logits (DisTaC). ``distac_data[t]``: unlabeled inputs of
    task t. ``fsc_data[t]``: task t's samples for FSC; for ``data='task_agnostic'`` (DSC-A) give
    ``fsc_agnostic_data`` (one shared batch). ``sensitive``: the probed magnitude-sensitive keys, used by
    WSC and FSC steps that do not list their own. ``architecture``: the FSC architecture (None: detect).
    ``trainable``: DisTaC's parameter filter (None: every float parameter).
    """

    build_model: Callable[[StateDict], nn.Module] | None = None
    build_task_model: Callable[[int, StateDict], nn.Module] | None = None
    distac_data: Sequence[Any] | None = None
    fsc_data: Sequence[Any] | None = None
    fsc_agnostic_data: Any | None = None
    sensitive: Sequence[str] | None = None
    architecture: Any = None
    trainable: Callable[[str], bool] | None = None
    device: str = "cpu"
    progress: bool = True


@dataclass
class RecipeResult:
    recipe: Recipe
    state_dict: dict[str, torch.Tensor]  # theta_0 + the calibrated merged task vector (weight space)
    model: nn.Module | None = None  # the FSC-calibrated model, when the recipe ends in feature space
    diagnostics: dict[str, Any] = field(default_factory=dict)


def _require(value: Any, what: str, step: str) -> Any:
    if value is None:
        raise ParameterError(f"recipe step {step!r} needs RecipeInputs.{what}")
    return value


def run_pre_steps(recipe: Recipe, pretrained: StateDict, finetuned: Sequence[StateDict], inputs: RecipeInputs,
                  diagnostics: dict) -> list[StateDict]:
    """The recipe's pre-merge steps (DisTaC), each through the registry's ``run``; returns the (partly) conditioned
    fine-tuned models."""
    models = list(finetuned)
    for step in recipe.phase("pre"):
        spec = get_calibration(step.name)
        if not spec.needs_data:  # rescale: the models alone
            models, diagnostics[step.name] = spec.run(step.params, pretrained, models)
            continue
        build = _require(inputs.build_task_model, "build_task_model", step.name)
        data = _require(inputs.distac_data, "distac_data", step.name)
        if len(data) != len(models):
            raise ParameterError(f"recipe step {step.name!r}: distac_data has {len(data)} entries for {len(models)} "
                                 "tasks")
        models, diagnostics[step.name] = spec.run(
            step.params, pretrained, models, build, data, previous=diagnostics.get(step.name),
            trainable=inputs.trainable, progress=inputs.progress, device=inputs.device)
    return models


def run_recipe(recipe: Recipe | str, pretrained: StateDict, finetuned: Sequence[StateDict],
               inputs: RecipeInputs | None = None) -> RecipeResult:
    """Apply ``recipe`` to a pretrained model and its K fine-tuned models (state dicts)."""
    recipe = Recipe.parse(recipe) if isinstance(recipe, str) else recipe
    inputs = inputs or RecipeInputs()
    diagnostics: dict[str, Any] = {}

    models = run_pre_steps(recipe, pretrained, finetuned, inputs, diagnostics)

    tvs = TaskVectorSet.from_models(pretrained, models, device=inputs.device)
    updates = dict(iter_weight_space(recipe, tvs, sensitive=inputs.sensitive, diagnostics=diagnostics,
                                     progress=inputs.progress))
    state = {}
    for key, value in pretrained.items():
        if key in updates:
            merged = value.to(device=inputs.device, dtype=COMPUTE_DTYPE) + updates[key]
            state[key] = merged.to(value.dtype).cpu()
        else:
            state[key] = value.clone()

    model = None
    for step in recipe.phase("feature"):
        build = _require(inputs.build_model, "build_model", step.name)
        params = step_params(step, inputs.sensitive)
        if getattr(params, "data", None) == "task_agnostic":
            data = [_require(inputs.fsc_agnostic_data, "fsc_agnostic_data", f"{step.name} (task-agnostic data)")]
        else:
            data = _require(inputs.fsc_data, "fsc_data", step.name)
        device = torch.device(inputs.device)
        model, diagnostics[step.name] = get_calibration(step.name).run(
            params, build(state).to(device), build(pretrained).to(device), [build(m).to(device) for m in models],
            data, architecture=inputs.architecture, progress=inputs.progress, copy_model=False)
    return RecipeResult(recipe=recipe, state_dict=state, model=model, diagnostics=diagnostics)


def recipe_trials(recipe: Recipe, pretrained: StateDict, finetuned: Sequence[StateDict], inputs: RecipeInputs,
                  grid: Sequence[float]) -> Callable[[float], RecipeResult]:
    """``value -> RecipeResult`` of ``recipe`` with its merge at that scaling (``Recipe.with_scaling``), for each value
    of ``grid``. A recipe whose every step after the merge reads it at scaling 1 (none, or SVC's protocol) and is
    tried at several values is merged and calibrated once, at scaling 1, then rescaled
    (``mergecal.merge.rescaled_model``), so every state equals the recipe at that value bit for bit."""
    unit_recipe = recipe.with_scaling(1.0)
    rescalable = all(s.phase == "merge" or s.at_unit_scaling for s in unit_recipe.steps)
    if not rescalable or len(grid) == 1:
        return lambda value: run_recipe(recipe.with_scaling(value), pretrained, finetuned, inputs)
    tvs = TaskVectorSet.from_models(pretrained, finetuned, device=inputs.device)
    diagnostics: dict[str, Any] = {}
    unit = dict(iter_weight_space(unit_recipe, tvs, sensitive=inputs.sensitive, diagnostics=diagnostics))
    return lambda value: RecipeResult(recipe=recipe.with_scaling(value), diagnostics=diagnostics,
                                      state_dict=rescaled_model(pretrained, unit, value, inputs.device))
