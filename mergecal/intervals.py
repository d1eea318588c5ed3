"""95 % bootstrap confidence intervals of the leaderboard's accuracies and of a calibration's change.

A row's value is a weighted sum of per-task means of per-example scores (one task: its accuracy; the average
accuracy: weights 1/T; the average normalized accuracy: weights 1/(T * the task's fine-tuned test accuracy), a
constant). The bootstrap is stratified: each task's examples are resampled from that task alone, which is what
``scipy.stats.bootstrap`` does with one sample per task (``paired=False``). A paired interval resamples the
per-example differences of two rows scored on the same examples. Percentile method, ``N_RESAMPLES`` resamples,
a fixed seed: the same inputs give the same interval on every run.

The resamples are scipy's own draws (its generator seeded with ``SEED``, one ``(N_RESAMPLES, n)`` index draw per
task in order), so they depend on the tasks' sizes only: a report of hundreds of rows over the same tasks draws them
once, as per-task count matrices, and a row's resampled means are one matrix product per task. The interval is
``scipy.stats.bootstrap``'s bit for bit on integer-valued scores (0/1 outcomes, their differences) and up to
floating-point summation order on others (``tests/test_intervals.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache

import numpy as np

LEVEL = 0.95
N_RESAMPLES = 2000
METHOD = "percentile"
SEED = 0

Interval = tuple[float, float]


def weighted_means(samples: Sequence[np.ndarray], weights: Sequence[float]) -> float:
    """sum_t weights[t] * mean(samples[t]): the statistic every interval here is taken of."""
    return float(sum(w * np.mean(s) for s, w in zip(samples, weights)))


def stratified_interval(samples: Sequence[np.ndarray], weights: Sequence[float]) -> Interval:
    """The 95 % percentile-bootstrap interval of ``weighted_means(samples, weights)``, each task's sample
    resampled on its own (stratified). A sample without spread gives its value as both ends."""
    samples = [np.asarray(s, dtype=np.float64) for s in samples]
    if len(samples) != len(weights) or not samples or any(s.ndim != 1 or s.size == 0 for s in samples):
        raise ValueError("stratified_interval: one non-empty 1-d sample per weight")
    if all(np.all(s == s[0]) for s in samples):  # nothing to resample: the interval is the point
        value = weighted_means(samples, weights)
        return value, value

    from scipy.stats import quantile

    alpha = (1 - LEVEL) / 2
    # counts @ sample is exact for integer-valued scores (0/1 outcomes and their paired differences), so each
    # resample's mean is scipy's bit for bit there and an interval end that is exactly 0 stays 0 (the verdict)
    resampled = sum(w * ((counts @ s) / s.size) for s, w, counts
                    in zip(samples, weights, resample_counts(tuple(s.size for s in samples))))
    low, high = quantile(resampled, np.array([alpha, 1 - alpha]))
    return float(low), float(high)


@lru_cache(maxsize=8)
def resample_counts(sizes: tuple[int, ...]) -> tuple[np.ndarray, ...]:
    """Per task, the ``(N_RESAMPLES, n)`` matrix of how often resample r draws each example (as floats). The
    draws are ``scipy.stats.bootstrap``'s for these sizes and ``SEED``."""
    rng = np.random.default_rng(SEED)
    matrices = []
    for n in sizes:
        drawn = rng.integers(0, n, (N_RESAMPLES, n), dtype="int64")
        counts = np.bincount((drawn + n * np.arange(N_RESAMPLES)[:, None]).ravel(), minlength=N_RESAMPLES * n)
        matrix = counts.reshape(N_RESAMPLES, n).astype(np.float64)
        matrix.flags.writeable = False
        matrices.append(matrix)
    return tuple(matrices)


def paired_interval(row: Sequence[np.ndarray], base: Sequence[np.ndarray], weights: Sequence[float]) -> Interval:
    """The interval of ``row``'s statistic minus ``base``'s on the same examples: per-example differences,
    resampled within each task."""
    if len(row) != len(base) or any(len(a) != len(b) for a, b in zip(row, base)):
        raise ValueError("paired_interval: both rows need the same examples of every task")
    return stratified_interval([np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64)
                                for a, b in zip(row, base)], weights)


def significance(interval: Interval | None) -> str:
    """``gain`` when the interval of a change lies above 0, ``loss`` when below, else ``none``."""
    if interval is None:
        return "none"
    low, high = interval
    return "gain" if low > 0 else "loss" if high < 0 else "none"
