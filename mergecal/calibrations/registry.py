"""The calibration registry: what a recipe step named like a calibration is, like ``MERGE_METHODS`` for merges.

Each calibration registers itself in its own module with ``@register_calibration(name, phase=..., needs_data=...)``
on its class (or, for DisTaC, its step parameters): a new calibration is one file in this package. The registry
reads which module registers which name from the package's sources (``mergecal.plugins``) and imports that module
on first use: FSC and DisTaC pull in model-level code (families, outputs, tqdm, training
helpers) that ``import mergecal`` should not pay for, so nothing here imports a calibration module eagerly.

Phases, in recipe order: ``pre`` (before the merge: conditions the fine-tuned models), ``weight`` (data-free,
per key, after the merge), ``feature`` (measured on the merged model). A ``composite`` (DSC, DSC-A) is not a
step itself: a recipe expands it into its parts (``expand``).
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .. import cost
from ..plugins import registering_modules

CALIBRATION_PHASES = ("pre", "weight", "feature", "composite")

#: name -> module of mergecal.calibrations that registers it, read from the sources (so lookups can import lazily)
MODULES = {name: module for module, names in registering_modules(Path(__file__).parent, "register_calibration").items()
           for name in names}


@dataclass(frozen=True)
class CalibrationSpec:
    name: str
    phase: str
    needs_data: bool  # needs models and data (DisTaC, FSC, DSC): cannot run on checkpoints alone
    Params: type | None  # the step's typed hyperparameters (None for a composite)
    #: weight phase: ``build(params, sensitive)`` -> the ``WeightCalibration``; ``sensitive`` is the probed ranking
    build: Callable[..., Any] | None = None
    #: composite: ``expand(values)`` -> [(part name, part values), ...]
    expand: Callable[[Mapping[str, Any]], Iterable[tuple[str, dict[str, Any]]]] | None = None
    #: feature phase: ``run(params, merged, pretrained, finetuned, data, **options)`` -> (model, diagnostics); pre
    #: phase: ``run(params, pretrained, finetuned, build_task_model, data, previous=..., **options)`` -> (models,
    #: report), ``previous`` the report of an earlier step of the same name in the recipe
    run: Callable[..., Any] | None = None

    @property
    def uses_sensitivity(self) -> bool:
        """Whether the step takes the probed magnitude-sensitive keys when its own ``sensitive`` is unset."""
        return self.Params is not None and "sensitive" in self.Params.model_fields


#: filled as the modules are imported: look names up with ``get_calibration`` (or ``all_calibrations``)
CALIBRATIONS: dict[str, CalibrationSpec] = {}


def register_calibration(name: str, *, phase: str, needs_data: bool):
    """Class decorator registering calibration ``name``. The decorated object is a calibration class with a
    ``Params`` attribute (a weight-phase one also ``from_step``), a parameters class itself, or for a composite
    a class with ``expand``."""
    if phase not in CALIBRATION_PHASES:
        raise ValueError(f"calibration {name!r}: phase {phase!r} is not one of {CALIBRATION_PHASES}")

    def decorate(obj):
        if name in CALIBRATIONS:
            raise ValueError(f"calibration {name!r} registered twice")
        if phase == "composite":
            spec = CalibrationSpec(name, phase, needs_data, None, expand=obj.expand)
        else:
            params = obj if not hasattr(obj, "Params") else obj.Params
            spec = CalibrationSpec(name, phase, needs_data, params, build=obj.from_step if phase == "weight" else None,
                                   run=_costed(name, obj.run_step) if phase in ("pre", "feature") else None)
        CALIBRATIONS[name] = spec
        return obj

    return decorate


def _costed(name: str, run: Callable[..., Any]) -> Callable[..., Any]:
    """``run`` with its time and peak memory recorded as step ``name``'s (``mergecal.cost``)."""

    @functools.wraps(run)
    def costed(*args, **kwargs):
        with cost.step(name):
            return run(*args, **kwargs)

    return costed


def calibration_names() -> list[str]:
    """Every calibration and composite a recipe accepts, without importing their modules."""
    return sorted({*MODULES, *CALIBRATIONS})


def get_calibration(name: str) -> CalibrationSpec | None:
    """The spec registered as ``name`` (importing its module on first use), or None if there is none."""
    if name not in CALIBRATIONS and name in MODULES:
        importlib.import_module(f"{__package__}.{MODULES[name]}")
    return CALIBRATIONS.get(name)


def step_params(step, sensitive: Iterable[str] | None):
    """A recipe step's parameters, with the probed magnitude-sensitive keys ``sensitive`` where the step uses a
    ranking (``uses_sensitivity``) and lists none of its own."""
    spec = get_calibration(step.name)
    if spec is None or not spec.uses_sensitivity or step.params.sensitive is not None or sensitive is None:
        return step.params
    return step.params.model_copy(update={"sensitive": list(sensitive)})


def all_calibrations() -> dict[str, CalibrationSpec]:
    """Every spec, importing every calibration module (for listings and messages, not for hot paths)."""
    return {name: get_calibration(name) for name in calibration_names()}
