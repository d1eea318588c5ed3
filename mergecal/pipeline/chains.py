"""Chains of the benchmark matrix (recipe templates with ``{merge}``): their calibration name and, under
``calibrated_scaling: selected``, which chain's cell chooses the scaling they calibrate. A module of its own so
that the params schema (config.py) and the cells (cells.py) both use it without importing each other."""

from __future__ import annotations

import ast

from ..methods import MERGE_METHODS
from ..recipe import Recipe

MERGE = "{merge}"
# why a track other than the vision track lists a chain around such a merge as skipped
DATA_MERGE_SKIP = ("its merge learns its coefficients on a model and unlabelled inputs of each task (AdaMerging); "
                   "the vision track runs it")


def merge_needs_data(recipe: Recipe) -> bool:
    """Whether the recipe's merge learns on a model and data (``MergeMethod.needs_data``: AdaMerging), which only
    the vision track's session gives it."""
    return MERGE_METHODS[recipe.merge.name].needs_data


def fixed_chain(chain: str, scaling: float, settings: dict | None = None) -> str:
    """A chain of a fixed-scaling protocol: its merge at ``scaling``, no search (``{merge}(scaling=0.3)>dsc``), with
    the protocol's own merge ``settings`` where it has any (``{merge}(scaling=0.3,disjoint='sum')``)."""
    named = "".join(f",{k}={v!r}" for k, v in sorted((settings or {}).items()))
    return chain.replace(MERGE, f"{MERGE}(scaling={float(scaling)!r}{named})")


def _parts(chain: str) -> list[str]:
    return [p.strip() for p in chain.replace("->", ">").replace("→", ">").split(">")]


def chain_settings(chain: str) -> dict:
    """The merge's settings a chain from ``fixed_chain`` fixes, its scaling included ({}: the merge's grid)."""
    merge = next(p for p in _parts(chain) if p.startswith(MERGE))
    if merge == MERGE:
        return {}
    call = ast.parse(f"f{merge[len(MERGE):]}", mode="eval").body
    return {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}


def chain_scaling(chain: str) -> float | None:
    """The fixed scaling of a chain from ``fixed_chain`` (None: the merge's grid)."""
    scaling = chain_settings(chain).get("scaling")
    return None if scaling is None else float(scaling)


def calibration_name(chain: str) -> str:
    """The chain without its merge: ``distac>{merge}>svc`` -> ``distac>svc``; ``none`` for the merge alone. A
    fixed-scaling chain says its protocol after ``@``: ``{merge}(scaling=0.3)>dsc`` -> ``dsc@λ=0.3`` (its base
    row is ``none@λ=0.3``, the merge at that scaling), and the protocol's own settings after it
    (``none@λ=0.3,disjoint=sum``: another base than the matrix's own merge at 0.3)."""
    name = ">".join(p for p in _parts(chain) if not p.startswith(MERGE)) or "none"
    settings = chain_settings(chain)
    if not settings:
        return name
    others = "".join(f",{k}={v}" for k, v in sorted(settings.items()) if k != "scaling")
    return f"{name}@λ={float(settings['scaling']):g}{others}"


def _chain_steps(chain: str) -> list:
    return Recipe.parse(chain.replace(MERGE, "task_arithmetic")).steps


def scaling_source(chain: str, chains: list[str]) -> str | None:
    """Under ``calibrated_scaling: selected``, the chain whose cell chooses the scaling that ``chain`` calibrates:
    the same chain without its weight/feature-space steps when the matrix has it (``distac>{merge}`` for
    ``distac>{merge}>svc``), else the plain ``{merge}``. "" for a chain without calibration steps, or whose
    calibrations all read the merge at scaling 1 (SVC's protocol: the scaling is chosen on validation with the
    calibration in place), which searches its own grid; None when neither source is in ``chains``."""
    steps = _chain_steps(chain)
    uncalibrated = [s for s in steps if s.phase in ("pre", "merge")]
    if all(s.phase in ("pre", "merge") or s.at_unit_scaling for s in steps):
        return ""
    candidates = {other: _chain_steps(other) for other in chains}
    for wanted in (uncalibrated, [s for s in steps if s.phase == "merge"]):
        for other, other_steps in candidates.items():
            if other_steps == wanted:
                return other
    return None
