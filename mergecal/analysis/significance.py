"""MAGIC's significance test of a calibration, as pure statistics: every subset of the K experts merged with and
without the calibration, one paired value per subset (its average accuracy over its own tasks), then a paired
t-test over the subsets and the share of subsets the calibration improves.

MAGIC (arXiv:2512.19320) runs it over the 2^8 - 1 = 255 subsets of its eight models (Task Arithmetic against Task
Arithmetic calibrated: t = 31.4, p = 1.5e-89). The subsets here are those of at least ``min_size`` experts (a merge
of one expert is that expert's own task vector: 247 subsets of at least two for K = 8). The data are computed
elsewhere (``mergecal.pipeline.paper_significance``); nothing here reads a model.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import combinations
from typing import Any

from ..errors import ParameterError


def subsets(names: Sequence[str], min_size: int = 2) -> list[tuple[str, ...]]:
    """Every subset of ``names`` with at least ``min_size`` of them, smallest first, each in the order of
    ``names`` (``itertools.combinations``: the same list on every run)."""
    names = list(names)
    if not isinstance(min_size, int) or isinstance(min_size, bool) or min_size < 1:
        raise ParameterError(f"subsets: min_size {min_size!r}: expected an integer >= 1")
    if len(set(names)) != len(names):
        raise ParameterError(f"subsets: the names repeat one ({', '.join(names)}); expected distinct experts")
    if len(names) < min_size:
        raise ParameterError(f"subsets: {len(names)} expert(s), fewer than min_size {min_size}: no subset to test")
    return [subset for size in range(min_size, len(names) + 1) for subset in combinations(names, size)]


def subset_count(k: int, min_size: int = 2) -> int:
    """How many subsets of K experts hold at least ``min_size``: 2^K minus the smaller ones."""
    if k < min_size or min_size < 1:
        raise ParameterError(f"subset_count: K = {k} and min_size {min_size}: expected K >= min_size >= 1")
    return 2 ** k - sum(math.comb(k, size) for size in range(min_size))


def _values(values: Sequence[float], name: str) -> list[float]:
    out = []
    for value in values:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ParameterError(f"paired test: {name} holds {value!r}; expected finite numbers")
        out.append(float(value))
    return out


def paired_t_test(calibrated: Sequence[float], base: Sequence[float]) -> dict[str, Any]:
    """The two-sided paired t-test of ``calibrated`` against ``base`` (one pair per subset): ``t`` (the mean
    difference over its standard error, n - 1 degrees of freedom) and ``p`` (``scipy.stats.ttest_rel``'s).
    Differences without spread have no t: ``t`` and ``p`` are None then."""
    mine, theirs = _values(calibrated, "calibrated"), _values(base, "base")
    if len(mine) != len(theirs):
        raise ParameterError(f"paired test: {len(mine)} calibrated values against {len(theirs)} base values; "
                             "expected one pair per subset")
    if len(mine) < 2:
        raise ParameterError(f"paired test: {len(mine)} pair(s); expected at least 2")
    differences = [a - b for a, b in zip(mine, theirs)]
    n = len(differences)
    mean = sum(differences) / n
    sd = math.sqrt(sum((d - mean) ** 2 for d in differences) / (n - 1))
    out: dict[str, Any] = {"n": n, "df": n - 1, "mean_difference": mean, "sd_difference": sd, "t": None, "p": None}
    if sd > 0:
        from scipy.stats import ttest_rel

        found = ttest_rel(mine, theirs)
        out.update(t=float(found.statistic), p=float(found.pvalue))
    return out


def summary(calibrated: Sequence[float], base: Sequence[float]) -> dict[str, Any]:
    """Over the subsets: each side's mean, the paired t-test (``paired_t_test``), and how many subsets the
    calibration improves (calibrated above base), worsens (below) or leaves equal, with their shares."""
    test = paired_t_test(calibrated, base)
    differences = [a - b for a, b in zip(calibrated, base)]
    n = test["n"]
    counts = {"improved": sum(d > 0 for d in differences), "worse": sum(d < 0 for d in differences),
              "equal": sum(d == 0 for d in differences)}
    return {**test, "mean_base": sum(base) / n, "mean_calibrated": sum(calibrated) / n, **counts,
            **{f"{name}_share": count / n for name, count in counts.items()}}
