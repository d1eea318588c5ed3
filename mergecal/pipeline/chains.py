"""Chains of the benchmark matrix (recipe templates with ``{merge}``): their calibration name and, under
``calibrated_scaling: selected``, which chain's cell chooses the scaling they calibrate. A module of its own so
that the params schema (config.py) and the cells (cells.py) both use it without importing each other."""

from __future__ import annotations

from ..recipe import Recipe

MERGE = "{merge}"


def fixed_chain(chain: str, scaling: float) -> str:
    """A chain of a fixed-scaling protocol: its merge at ``scaling``, no search (``{merge}(scaling=0.3)>dsc``)."""
    return chain.replace(MERGE, f"{MERGE}(scaling={float(scaling)!r})")


def _parts(chain: str) -> list[str]:
    return [p.strip() for p in chain.replace("->", ">").replace("→", ">").split(">")]


def chain_scaling(chain: str) -> float | None:
    """The fixed scaling of a chain from ``fixed_chain`` (None: the merge's grid)."""
    merge = next(p for p in _parts(chain) if p.startswith(MERGE))
    return float(merge[len(MERGE) + len("(scaling="):-1]) if merge != MERGE else None


def calibration_name(chain: str) -> str:
    """The chain without its merge: ``distac>{merge}>svc`` -> ``distac>svc``; ``none`` for the merge alone. A
    fixed-scaling chain says its protocol after ``@``: ``{merge}(scaling=0.3)>dsc`` -> ``dsc@λ=0.3`` (its base
    row is ``none@λ=0.3``, the merge at that scaling)."""
    name = ">".join(p for p in _parts(chain) if not p.startswith(MERGE)) or "none"
    scaling = chain_scaling(chain)
    return name if scaling is None else f"{name}@λ={scaling:g}"


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
