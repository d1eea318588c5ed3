"""The leaderboard's bootstrap intervals on constructed cases with known answers."""

import numpy as np
import pytest

from mergecal.intervals import paired_interval, significance, stratified_interval, weighted_means


def _tasks(rates, n=300):
    """One 0/1 sample per task with exactly ``rate * n`` ones."""
    return [np.array([1] * round(r * n) + [0] * (n - round(r * n))) for r in rates]


def test_paired_difference_of_one_on_ten_percent_of_examples():
    base = _tasks([0.5, 0.6])
    row = [b.copy() for b in base]
    for r in row:  # +1 on 10 % of each task's examples (ones where the base has zeros)
        zeros = np.flatnonzero(r == 0)[: len(r) // 10]
        r[zeros] = 1
    low, high = paired_interval(row, base, [0.5, 0.5])
    assert low <= 0.1 <= high and low > 0
    assert significance((low, high)) == "gain" and significance((-high, -low)) == "loss"


def test_identical_rows_give_zero_width():
    base = _tasks([0.5, 0.7])
    assert paired_interval(base, [b.copy() for b in base], [0.5, 0.5]) == (0.0, 0.0)
    assert significance((0.0, 0.0)) == "none" and significance(None) == "none"


def test_width_matches_the_normal_approximation():
    samples = _tasks([0.7] * 8)  # 8 tasks x 300: 2,400 examples at 70 %
    weights = [1 / 8] * 8
    low, high = stratified_interval(samples, weights)
    half = 1.96 * np.sqrt(0.7 * 0.3 / 2400)  # the stratified mean's normal half-width (0.9 points)
    assert weighted_means(samples, weights) == pytest.approx(0.7) and low < 0.7 < high
    assert (high - low) / 2 == pytest.approx(half, rel=0.15)


def test_weights_scale_the_interval():
    samples = _tasks([0.6, 0.8])
    low, high = stratified_interval(samples, [0.5, 0.5])
    low2, high2 = stratified_interval(samples, [1.0, 1.0])  # twice the statistic: twice the interval
    assert (low2, high2) == pytest.approx((2 * low, 2 * high))


def test_the_same_inputs_give_the_same_interval():
    samples = _tasks([0.55, 0.65])
    assert stratified_interval(samples, [0.5, 0.5]) == stratified_interval(samples, [0.5, 0.5])


def test_mismatched_examples_are_refused():
    with pytest.raises(ValueError, match="same examples"):
        paired_interval(_tasks([0.5], n=10), _tasks([0.5], n=12), [1.0])


def test_equal_to_scipy_bootstrap_with_the_same_draws():
    """The count-matrix bootstrap is scipy's: same seed, same per-task draws, same percentile; only the summation
    order of a resample's mean differs."""
    from scipy.stats import bootstrap

    from mergecal import intervals

    rng = np.random.default_rng(7)
    samples = [rng.normal(size=120), (rng.random(75) < 0.6).astype(float), rng.normal(2.0, 3.0, size=33)]
    weights = [0.2, 0.5, 0.3]

    def statistic(*resampled, axis=-1):
        return sum(w * np.mean(s, axis=axis) for s, w in zip(resampled, weights))

    expected = bootstrap(tuple(samples), statistic, n_resamples=intervals.N_RESAMPLES,
                         confidence_level=intervals.LEVEL, method=intervals.METHOD, paired=False, vectorized=True,
                         random_state=np.random.default_rng(intervals.SEED)).confidence_interval
    assert stratified_interval(samples, weights) == pytest.approx((expected.low, expected.high), rel=1e-12, abs=1e-14)
    # another order of the tasks draws other resamples: the draws follow the sizes, not the values
    assert stratified_interval(samples[::-1], weights[::-1]) != stratified_interval(samples, weights)


def test_bit_equal_to_scipy_on_outcomes_so_a_zero_end_stays_zero():
    """Regression (#43): 0/1 outcomes and paired differences are summed exactly, as scipy's mean does, so an
    interval end that is exactly 0 is 0 (not 1e-17 > 0, which flipped a verdict from none to gain)."""
    from scipy.stats import bootstrap

    from mergecal import intervals

    rng = np.random.default_rng(3)
    base = [(rng.random(n) < 0.6).astype(float) for n in (300, 300, 150)]
    row = [b.copy() for b in base]
    row[0][np.flatnonzero(base[0] == 0)[:3]] = 1  # +3 examples on one task: a lower end at or near 0
    weights = [1 / 3] * 3
    diffs = [r - b for r, b in zip(row, base)]

    def statistic(*resampled, axis=-1):
        return sum(w * np.mean(s, axis=axis) for s, w in zip(resampled, weights))

    expected = bootstrap(tuple(diffs), statistic, n_resamples=intervals.N_RESAMPLES, confidence_level=intervals.LEVEL,
                         method=intervals.METHOD, paired=False, vectorized=True,
                         random_state=np.random.default_rng(intervals.SEED)).confidence_interval
    assert paired_interval(row, base, weights) == (float(expected.low), float(expected.high))
