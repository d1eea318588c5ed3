"""Chains of the benchmark matrix (recipe templates with ``{merge}``): their calibration name and, under
``calibrated_scaling: selected``, which chain's cell chooses the scaling they calibrate. A module of its own so
that the params schema (config.py) and the cells (cells.py) both use it without importing each other."""

from __future__ import annotations


def calibration_name(chain: str) -> str:
    """The chain without its merge: ``distac>{merge}>svc`` -> ``distac>svc``; ``none`` for the merge alone."""
    parts = [p for p in chain.replace("->", ">").replace("→", ">").split(">") if p.strip() != "{merge}"]
    return ">".join(p.strip() for p in parts) or "none"


def _chain_steps(chain: str) -> list:
    from ..recipe import Recipe

    return Recipe.parse(chain.replace("{merge}", "task_arithmetic")).steps


def scaling_source(chain: str, chains: list[str]) -> str | None:
    """Under ``calibrated_scaling: selected``, the chain whose cell chooses the scaling that ``chain`` calibrates:
    the same chain without its weight/feature-space steps when the matrix has it (``distac>{merge}`` for
    ``distac>{merge}>svc``), else the plain ``{merge}``. "" for a chain without calibration steps (it searches
    its own grid); None when neither source is in ``chains``."""
    steps = _chain_steps(chain)
    uncalibrated = [s for s in steps if s.phase in ("pre", "merge")]
    if len(uncalibrated) == len(steps):
        return ""
    candidates = {other: _chain_steps(other) for other in chains}
    for wanted in (uncalibrated, [s for s in steps if s.phase == "merge"]):
        for other, other_steps in candidates.items():
            if other_steps == wanted:
                return other
    return None
