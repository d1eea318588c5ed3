"""A row's label with every hyperparameter that differs from its method's default, so that two recipes are never
shown (or compared) under one name: ``ties>svc`` with ``top_k: 0.3`` reads ``ties(top_k=0.3)>svc``.

A cell's label (``Cell.label``) names its chain only (``ties>svc``): within one params.yaml that is unambiguous, so a
single checkout's leaderboard keeps it. Across invocations and checkouts (the history, a lab's board) it is not;
the run's canonical recipe id (the ``recipe_id`` tag, every parameter of every step) tells the variants apart. The
merge's scaling stays out: the label already names its protocol (a searched grid, or ``(scaling=0.3)``).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from ..recipe import Recipe, Step, step_phase


def _value(value: Any) -> str:
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(repr(v) for v in value) + "]"
    return repr(value)


def _default_steps(name: str, merge: str) -> list[Step]:
    """The steps a label token stands for, each with its defaults (a composite's parts as it expands them; SVC's
    alpha as the recipe fills it in after ``merge``)."""
    if step_phase(name) == "composite":
        from ..calibrations.registry import get_calibration

        return [Step(part, values) for part, values in get_calibration(name).expand({})]
    if name == "svc":
        return Recipe([(merge, {}), ("svc", {})]).steps[1:]
    return [Step(name)]


def _differences(step: Step, default: Step) -> dict[str, Any]:
    mine, theirs = step.params.model_dump(), default.params.model_dump()
    drop = {"scaling"} if step.phase == "merge" else set()
    return {k: v for k, v in sorted(mine.items()) if k not in drop and theirs.get(k) != v}


@lru_cache(maxsize=4096)
def qualified_tokens(label: str, recipe_id: str) -> tuple[str, ...]:
    """Each step of ``label`` (split at ``>``) with its non-default hyperparameters; the label's own tokens where
    the recipe id is empty (references) or does not match the label step for step."""
    tokens = label.split(">")
    if not recipe_id:
        return tuple(tokens)
    try:
        steps = Recipe.parse(recipe_id).steps
    except Exception:  # a recipe id this version cannot read (a newer method): the label as logged
        return tuple(tokens)
    merge = next(s.name for s in steps if s.phase == "merge")
    out, position = [], 0
    for token in tokens:
        name, paren, inner = token.partition("(")
        defaults = _default_steps(name, merge)
        mine = steps[position:position + len(defaults)]
        if len(mine) != len(defaults) or any(s.name != d.name for s, d in zip(mine, defaults)):
            return tuple(tokens)
        position += len(defaults)
        prefix = len(defaults) > 1  # a composite: name each part's parameter
        shown = {item.partition("=")[0].strip() for item in inner.rstrip(")").split(",")} if paren else set()
        extra = [f"{s.name + '.' if prefix else ''}{k}={_value(v)}"
                 for s, d in zip(mine, defaults) for k, v in _differences(s, d).items() if k not in shown]
        if not extra:
            out.append(token)
        elif paren:  # "task_arithmetic(scaling=0.3)": the others beside the protocol's scaling
            out.append(f"{name}({inner.rstrip(')')},{','.join(extra)})")
        else:
            out.append(f"{name}({','.join(extra)})")
    return tuple(out) if position == len(steps) else tuple(tokens)


def qualified_label(label: str, recipe_id: str) -> str:
    """``label`` with every non-default hyperparameter of its steps (see the module docstring)."""
    return ">".join(qualified_tokens(label, recipe_id))


def qualified_merge(merge: str, label: str, recipe_id: str) -> str:
    """The merge of a row with its non-default hyperparameters (``ties(top_k=0.3)``), so that a calibrated row is
    compared with the base merge of the same variant; ``merge`` itself when it has none."""
    for token in qualified_tokens(label, recipe_id):
        if token.partition("(")[0] == merge:
            return merge if "(" not in token or token.startswith(f"{merge}(scaling=") and "," not in token else token
    return merge


__all__ = ["qualified_label", "qualified_merge", "qualified_tokens"]
