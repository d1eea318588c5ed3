"""One BLAS thread against the libraries' default for the Gram route, on an idle and on a shared machine (#17).

The Gram route (TSV-M, Iso-C, Iso-CTS and SVC's default solver) runs numpy/scipy's OpenBLAS, a pthreads pool that
``OMP_WAIT_POLICY=PASSIVE`` does not govern. This script times the four methods on the keys of ViT-B/32 blocks
(K task vectors, ``mergecal perf``'s synthetic ones) with numpy/scipy's BLAS limited to 1 thread and left at its
default (all cores), alternated call by call in one process (threadpoolctl switches the limit), first with the
cores to itself, then with ``--busy`` processes spinning beside it (the "other job": a training stage, the test
suite, a second worker). torch's own threads stay as they are (its OpenMP pool sleeps when idle under PASSIVE).
Prints per setting and method the median seconds (of ``--repeats``) and the ratio default / 1 thread (> 1: one
thread is faster). Wall-clock ratios measured side by side; absolute seconds depend on the machine.

    python scripts/perf_blas_threads.py [--blocks 1] [--K 8] [--repeats 3] [--busy 1]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal import offline  # noqa: E402
from scripts.perf_wait_policy import busy  # noqa: E402  (the spinning "other job")

# everything but the BLAS thread count, which this script switches itself (its "default" is OpenBLAS's: all cores)
os.environ.pop("OPENBLAS_NUM_THREADS", None)
offline.apply({k: v for k, v in offline.OFFLINE_ENV.items() if k != "OPENBLAS_NUM_THREADS"})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1, help="ViT-B/32 blocks (4 matrices each; default 1)")
    parser.add_argument("--K", type=int, default=8, help="task vectors (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per setting, median kept (default 3)")
    parser.add_argument("--busy", type=int, default=1,
                        help="spinning processes in the shared setting (default 1; 0: the idle setting alone)")
    args = parser.parse_args()

    import torch
    from threadpoolctl import threadpool_info, threadpool_limits

    from mergecal.methods.iso_c import iso_c_matrix
    from mergecal.methods.iso_cts import iso_cts_matrix
    from mergecal.methods.tsv_m import tsv_merge_matrix
    from mergecal.perf.merging import svc_after_ta, synthetic_task_vectors, vit_b32_shapes

    shapes = {k: s for k, s in vit_b32_shapes(args.blocks).items() if len(s) == 2}
    tvs = synthetic_task_vectors(shapes, args.K)
    keys = list(shapes)
    methods = {
        "tsv_m": lambda taus: tsv_merge_matrix(taus),
        "iso_c": lambda taus: iso_c_matrix(taus),
        "iso_cts": lambda taus: iso_cts_matrix(taus, 0.8),
        "svc after TA": lambda taus: svc_after_ta(taus),
    }
    blas = [i for i in threadpool_info() if i["user_api"] == "blas"]
    default_threads = max(i["num_threads"] for i in blas)
    print(f"{os.cpu_count()} cores; numpy/scipy BLAS: " + ", ".join(f"{i['internal_api']} {i['num_threads']} threads"
                                                                     for i in blas)
          + f"; torch {torch.get_num_threads()} threads; {len(keys)} matrices, K = {args.K}", flush=True)

    def run(fn, limit: int | None) -> float:
        start = time.perf_counter()
        with threadpool_limits(limits=limit, user_api="blas"):
            for key in keys:
                fn([tv[key] for tv in tvs])
        return time.perf_counter() - start

    rows = []
    settings = [("idle", 0)] + ([(f"{args.busy} busy process(es) beside", args.busy)] if args.busy else [])
    for setting, n_busy in settings:
        hogs = [multiprocessing.Process(target=busy, daemon=True) for _ in range(n_busy)]
        for hog in hogs:
            hog.start()
        try:
            time.sleep(0.5)
            for name, fn in methods.items():
                run(fn, 1)  # warm-up
                times: dict[str, list[float]] = {"1": [], "default": []}
                for i in range(args.repeats):
                    order = [("1", 1), ("default", None)]
                    for label, limit in (order if i % 2 == 0 else order[::-1]):
                        times[label].append(run(fn, limit))
                one, dflt = statistics.median(times["1"]), statistics.median(times["default"])
                rows.append((setting, name, one, dflt))
                print(f"{setting:28s} {name:13s} 1 thread {one:7.2f} s   {default_threads} threads {dflt:7.2f} s   "
                      f"ratio {dflt / one:5.2f}", flush=True)
        finally:
            for hog in hogs:
                hog.terminate()
    print(f"\n| setting | method | 1 BLAS thread (s) | {default_threads} BLAS threads (s) | "
          f"{default_threads} threads / 1 thread |\n|---|---|---:|---:|---:|")
    for setting, name, one, dflt in rows:
        print(f"| {setting} | {name} | {one:.2f} | {dflt:.2f} | {dflt / one:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
