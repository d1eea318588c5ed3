"""Recipes: a merge method with its calibrations, as one small config object with a stable string form.

A recipe is a chain of steps in four phases, in this order:

    pre-merge (distac)*  ->  merge method (exactly one)  ->  weight space (svc | wsc)*  ->  feature space (fsc)?

Each calibration's phase comes from the registry (``mergecal.calibrations.registry``). ``dsc`` is MAGIC's
dual-space calibration, a composite that expands to ``wsc -> fsc``; ``dsc_a`` to ``wsc -> fsc`` on task-agnostic
data (``mergecal.calibrations.dsc``). The written form, e.g. ``distac→tsv_m→svc→dsc``, is kept as ``label``;
``id`` is the canonical form with every hyperparameter filled in, e.g.
``distac(...)→tsv_m(float64=False,...)→svc(alpha=1.0,...)→wsc(...)→fsc(...)``. ``Recipe.parse(recipe.id)``
gives the same recipe back, and equal computations have equal ids (used as cache keys and run names).
Steps accept ``→``, ``->`` or ``>`` as separators; parameters are YAML values: ``svc(alpha=1.0)``.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import yaml

from .calibrations.registry import calibration_names, get_calibration
from .errors import ParameterError, UnknownNameError
from .methods import MERGE_METHODS
from .methods.base import build_params, format_params

ARROW = "→"
PHASES = ("pre", "merge", "weight", "feature")


def step_phase(name: str) -> str:
    """The phase of a recipe step: a merge method, or a calibration's registered phase."""
    if name in MERGE_METHODS:
        return "merge"
    spec = get_calibration(name)
    if spec is None:
        allowed = sorted([*MERGE_METHODS, *calibration_names()])
        raise UnknownNameError(f"unknown recipe step {name!r}; choose one of: {', '.join(allowed)}")
    return spec.phase


class Step:
    """One validated step: a name and its full, typed parameters."""

    def __init__(self, name: str, values: Mapping[str, Any] | None = None):
        self.name = name
        self.phase = step_phase(name)
        if self.phase == "composite":  # composites are expanded by Recipe; a Step is one computation
            raise ParameterError(f"recipe: {name!r} stands for several steps; build it with Recipe")
        params_cls = MERGE_METHODS[name].Params if self.phase == "merge" else get_calibration(name).Params
        self.params = build_params(params_cls, name, dict(values or {}))

    @property
    def id(self) -> str:
        return f"{self.name}({format_params(self.params)})"

    @property
    def at_unit_scaling(self) -> bool:
        """Whether the step calibrates the merge at scaling 1, before the merge method's scaling is applied (a
        weight-space step whose parameters say ``calibrate_at: unit_scaling``, SVC's default)."""
        return self.phase == "weight" and getattr(self.params, "calibrate_at", None) == "unit_scaling"

    @property
    def needs_data(self) -> bool:
        """Whether the step needs models and data beyond the checkpoints (the registry's word; a merge never does)."""
        return self.phase != "merge" and get_calibration(self.name).needs_data

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Step) and self.id == other.id

    def __repr__(self) -> str:
        return self.id


def _split_top_level(text: str, separators: Sequence[str]) -> list[str]:
    """Split on any separator outside brackets, parentheses and quotes."""
    parts, depth, quote, current, i = [], 0, None, "", 0
    while i < len(text):
        ch = text[i]
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif depth == 0:
            sep = next((s for s in separators if text.startswith(s, i)), None)
            if sep:
                parts.append(current)
                current, i = "", i + len(sep)
                continue
        current += ch
        i += 1
    parts.append(current)
    return [p.strip() for p in parts]


def _parse_value(text: str) -> Any:
    if text == "None":
        return None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        raise ParameterError(f"recipe: cannot read value {text!r}: {err}") from None


def _parse_step(text: str) -> tuple[str, dict[str, Any]]:
    if "(" not in text:
        return text, {}
    if not text.endswith(")"):
        raise ParameterError(f"recipe: step {text!r} should look like name(param=value,...)")
    name, args = text[: text.index("(")].strip(), text[text.index("(") + 1:-1]
    values = {}
    for arg in _split_top_level(args, [","]):
        if not arg:
            continue
        key, sep, value = arg.partition("=")
        if not sep:
            raise ParameterError(f"recipe: in step {name!r}, {arg!r} should be param=value")
        if key.strip() in values:
            raise ParameterError(f"recipe: in step {name!r}, parameter {key.strip()!r} is given twice")
        values[key.strip()] = _parse_value(value.strip())
    return name, values


class Recipe:
    """A validated chain of steps (see the module docstring)."""

    def __init__(self, steps: Sequence[tuple[str, Mapping[str, Any]]], label: str | None = None):
        expanded: list[Step] = []
        for name, values in steps:
            if step_phase(name) == "composite":  # dsc, dsc_a: their parts, each with its parameter group
                expanded.extend(Step(part, part_values) for part, part_values in get_calibration(name).expand(values))
            else:
                expanded.append(Step(name, values))
        self.steps = expanded
        self._validate()
        self._fill_merge_dependent_defaults()
        self.label = label or ARROW.join(name for name, _ in steps)

    def _fill_merge_dependent_defaults(self) -> None:
        """SVC without an explicit alpha takes the authors' value for the merge it follows (1 after TSV-M;
        1/K, kept as None, after the others), written into the step so the id shows the value used."""
        from .calibrations.svc import AUTHORS_ALPHA

        alpha = AUTHORS_ALPHA.get(self.merge.name)
        if alpha is None:
            return
        self.steps = [Step("svc", {**step.params.model_dump(), "alpha": alpha})
                      if step.name == "svc" and step.params.alpha is None else step for step in self.steps]

    def _validate(self) -> None:
        merges = [s for s in self.steps if s.phase == "merge"]
        if len(merges) != 1:
            raise ParameterError(f"recipe: exactly one merge method is required, found {len(merges)}"
                                 + (f" ({', '.join(s.name for s in merges)})" if merges else ""))
        order = [PHASES.index(s.phase) for s in self.steps]
        for previous, step, rank in zip(self.steps, self.steps[1:], order[1:]):
            if rank < PHASES.index(previous.phase):
                raise ParameterError(f"recipe: step {step.name!r} ({step.phase}) cannot follow {previous.name!r} "
                                     f"({previous.phase}); order: pre-merge, merge, weight space, feature space")
        weight = [s for s in self.steps if s.phase == "weight"]
        at_unit = [s.at_unit_scaling for s in weight]
        if any(later and not earlier for earlier, later in zip(at_unit, at_unit[1:])):
            first = next(s for s, unit in zip(weight, at_unit) if not unit)
            raise ParameterError(f"recipe: a step with calibrate_at=unit_scaling reads the merge before its scaling, "
                                 f"so it cannot follow {first.name!r}, which calibrates the scaled merge")
        if sum(s.phase == "feature" for s in self.steps) > 1:
            raise ParameterError("recipe: at most one feature-space step (fsc / dsc) is allowed")

    @classmethod
    def parse(cls, text: str) -> "Recipe":
        normalised = text.replace("->", ARROW).replace(">", ARROW)
        parts = _split_top_level(normalised, [ARROW])
        if any(not p for p in parts):
            raise ParameterError(f"recipe: empty step in {text!r}")
        return cls([_parse_step(p) for p in parts], label=ARROW.join(_parse_step(p)[0] for p in parts))

    @classmethod
    def from_config(cls, config: str | Sequence[str | Mapping[str, Any]]) -> "Recipe":
        """From params.yaml: a string, or a list of step names / ``{name: ..., <params>}`` mappings."""
        if isinstance(config, str):
            return cls.parse(config)
        steps = []
        for item in config:
            if isinstance(item, str):
                steps.append(_parse_step(item))
            elif isinstance(item, Mapping) and "name" in item:
                steps.append((item["name"], {k: v for k, v in item.items() if k != "name"}))
            else:
                raise ParameterError(f"recipe: each step must be a name or a mapping with 'name', got {item!r}")
        return cls(steps)

    @property
    def id(self) -> str:
        return ARROW.join(step.id for step in self.steps)

    @property
    def digest(self) -> str:
        """A short hash of ``id``, for file names."""
        return hashlib.sha256(self.id.encode()).hexdigest()[:16]

    def phase(self, name: str) -> list[Step]:
        return [s for s in self.steps if s.phase == name]

    @property
    def merge(self) -> Step:
        return self.phase("merge")[0]

    def with_scaling(self, scaling: float) -> "Recipe":
        """The same recipe with its merge at ``scaling``: how a cell's searched or given scaling enters a recipe
        (``mergecal.merge`` applies it)."""
        return Recipe([(s.name, {**s.params.model_dump(), "scaling": scaling} if s.phase == "merge"
                        else s.params.model_dump()) for s in self.steps], label=self.label)

    def without_pre_merge(self) -> "Recipe":
        """The recipe from its merge on: what runs after the pre-merge steps (DisTaC) conditioned the models."""
        return Recipe([(s.name, s.params.model_dump()) for s in self.steps if s.phase != "pre"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Recipe) and self.id == other.id

    def __repr__(self) -> str:
        return f"Recipe({self.label!r})"

