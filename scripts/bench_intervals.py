"""The leaderboard's interval against ``scipy.stats.bootstrap`` on the same draws, side by side in one process.

    python scripts/bench_intervals.py [--rows 200] [--tasks 8] [--examples 300]

Prints seconds per interval for both and their ratio, and the largest difference of the two intervals' ends.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.stats import bootstrap

from mergecal import intervals


def scipy_interval(samples, weights):
    def statistic(*resampled, axis=-1):
        return sum(w * np.mean(s, axis=axis) for s, w in zip(resampled, weights))

    ci = bootstrap(tuple(samples), statistic, n_resamples=intervals.N_RESAMPLES, confidence_level=intervals.LEVEL,
                   method=intervals.METHOD, paired=False, vectorized=True,
                   random_state=np.random.default_rng(intervals.SEED)).confidence_interval
    return float(ci.low), float(ci.high)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--examples", type=int, default=300)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    rows = [[(rng.random(args.examples) < rng.uniform(0.3, 0.9)).astype(float) for _ in range(args.tasks)]
            for _ in range(args.rows)]
    weights = [1 / args.tasks] * args.tasks
    timings, results = {}, {}
    for name, interval in (("scipy.stats.bootstrap", scipy_interval), ("mergecal", intervals.stratified_interval)):
        start = time.perf_counter()
        results[name] = [interval(row, weights) for row in rows]
        timings[name] = (time.perf_counter() - start) / len(rows)
    gap = max(abs(a - b) for x, y in zip(*results.values()) for a, b in zip(x, y))
    print(f"{args.rows} rows x {args.tasks} tasks x {args.examples} examples, {intervals.N_RESAMPLES} resamples")
    for name, seconds in timings.items():
        print(f"  {name:24s} {seconds * 1e3:8.2f} ms an interval")
    ratio = timings["scipy.stats.bootstrap"] / timings["mergecal"]
    print(f"  ratio {ratio:.1f}x; largest difference of ends {gap:.1e}")


if __name__ == "__main__":
    main()
