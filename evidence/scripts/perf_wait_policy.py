"""OMP_WAIT_POLICY=PASSIVE against ACTIVE for the SVD-bound merges when other work holds the cores (#17).

Starts one busy-looping process per core (the "other job"), then times, in fresh subprocesses whose order
rotates every round (PASSIVE, ACTIVE and "unset", libgomp's default: spin a while, then sleep), one 3072 x 768
float32 SVD (torch: MKL threaded by GNU OpenMP) and the Gram route's pieces on the same matrix (torch's float64
eigh of the 768 x 768 Gram matrix, MKL / OpenMP, and scipy's dsyevd, which runs in scipy's OpenBLAS, a pthreads
pool that OMP_WAIT_POLICY does not govern, though torch's spinning OpenMP threads in the same process compete with
it). Each child uses the default thread count (all cores) unless --threads is given. Prints per-policy medians
and the ratio of each policy's time to PASSIVE's (> 1: the passive policy is faster). Wall-clock ratios measured
side by side in one run; absolute seconds depend on what else the machine runs.

    python scripts/perf_wait_policy.py [--rounds 3] [--repeats 3] [--threads N] [--no-busy]
                                       [--policies PASSIVE,ACTIVE,unset]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

CHILD = r"""
import json, statistics, time, sys
import numpy as np, scipy.linalg, torch
threads = int(sys.argv[1])
if threads:
    from threadpoolctl import threadpool_limits
    torch.set_num_threads(threads); threadpool_limits(threads)
repeats = int(sys.argv[2])
g = torch.Generator().manual_seed(0)
a = torch.randn(3072, 768, generator=g)
a64 = a.double()
gram = a64.T @ a64
def timed(f):
    f()  # warm-up
    out = []
    for _ in range(repeats):
        s = time.perf_counter(); f(); out.append(time.perf_counter() - s)
    return statistics.median(out)
print(json.dumps({
    "svd float32 (torch/MKL)": timed(lambda: torch.linalg.svd(a, full_matrices=False)),
    "gram eigh float64 (torch/MKL)": timed(lambda: torch.linalg.eigh(gram)),
    "gram eigh float64 (scipy/OpenBLAS)": timed(lambda: scipy.linalg.eigh(gram.numpy(), driver="evd")),
    "torch threads": torch.get_num_threads(),
}))
"""


def busy() -> None:
    x = 0
    while True:
        x += 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3, help="PASSIVE/ACTIVE pairs, alternated (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per child, median taken (default 3)")
    parser.add_argument("--threads", type=int, default=0, help="threads per child (default: the libraries' own)")
    parser.add_argument("--no-busy", action="store_true", help="no competing processes (the idle baseline)")
    parser.add_argument("--policies", default="PASSIVE,ACTIVE,unset",
                        help="comma-separated; 'unset' removes the variable (default PASSIVE,ACTIVE,unset)")
    args = parser.parse_args()
    policies = args.policies.split(",")
    hogs = [] if args.no_busy else [multiprocessing.Process(target=busy, daemon=True)
                                    for _ in range(os.cpu_count() or 1)]
    for hog in hogs:
        hog.start()
    results: dict[str, list[dict]] = {p: [] for p in policies}
    try:
        time.sleep(0.5)
        for i in range(args.rounds):
            for policy in policies[i % len(policies):] + policies[:i % len(policies)]:
                env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
                if policy != "unset":
                    env["OMP_WAIT_POLICY"] = policy
                out = subprocess.run([sys.executable, "-c", CHILD, str(args.threads), str(args.repeats)], env=env,
                                     capture_output=True, text=True, check=True)
                results[policy].append(json.loads(out.stdout))
                print(f"round {i} {policy:7s} " + ", ".join(f"{k} {v:.3f} s" for k, v in results[policy][-1].items()
                                                            if k != "torch threads"), flush=True)
    finally:
        for hog in hogs:
            hog.terminate()
    first = results[policies[0]][0]
    print(f"\n{len(hogs)} busy processes, {first['torch threads']} torch threads per child, "
          f"{args.rounds} rotated rounds, median of {args.repeats} calls each; seconds, and ratio to {policies[0]}:")
    print("| operation | " + " | ".join(policies) + " | " + " | ".join(f"{p} / {policies[0]}" for p in policies[1:])
          + " |\n|---|" + "---:|" * (2 * len(policies) - 1))
    for key in first:
        if key == "torch threads":
            continue
        med = {p: statistics.median(r[key] for r in results[p]) for p in policies}
        print(f"| {key} | " + " | ".join(f"{med[p]:.3f}" for p in policies) + " | "
              + " | ".join(f"{med[p] / med[policies[0]]:.2f}" for p in policies[1:]) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
