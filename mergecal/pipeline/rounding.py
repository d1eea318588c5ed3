"""The papers' computed documents rounded to a few significant digits, so that the same inputs give the same bytes
on another machine's arithmetic (``paper_analysis``, ``paper_significance``)."""

from __future__ import annotations

from typing import Any

DIGITS = 6


def rounded(value: Any, digits: int = DIGITS) -> Any:
    """``value`` with every float rounded to ``digits`` significant digits (None, ints and strings unchanged)."""
    if isinstance(value, float):
        return float(f"{value:.{digits}g}")
    if isinstance(value, dict):
        return {k: rounded(v, digits) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [rounded(v, digits) for v in value]
    return value
