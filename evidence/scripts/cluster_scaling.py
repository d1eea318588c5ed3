"""Scale-out of the benchmark's cells: the same matrix on the threads runner and on a Dask cluster of 1 and 2
workers (one thread each), side by side in one process, every cell computed (a new MLflow experiment per run).

    python -m scripts.cluster_scaling --root WORKSPACE [--repeats 1]

WORKSPACE: a built checkout (``mergecal smoke`` or ``dvc repro`` done), whose params.yaml gives the matrix. Each
configuration runs ``python -m flows.benchmark`` in WORKSPACE with its own params file (written beside
params.yaml, removed after) and summary (``results/scaling-<name>.json``); the Dask ones against a
``distributed.LocalCluster`` of worker processes started here. One Prefect server on 127.0.0.1 (started here,
its home a temporary folder) serves every run, as a lab's does: without one, every Dask worker process would start
a temporary server of its own. Prints wall time, the flow's own seconds, cells per minute and the ratio to the
one-thread threads runner; nothing is written into a cached output.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import yaml

from mergecal.ui import prefect_server, server_env, start, stop, wait_until_up

CONFIGS = (  # name, runner, threads (one per cell in every configuration)
    ("threads x1", {"kind": "threads", "max_workers": 1}, 1),
    ("threads x2", {"kind": "threads", "max_workers": 2}, 2),
    ("dask 1 worker", {"kind": "dask", "max_workers": 1}, 1),
    ("dask 2 workers", {"kind": "dask", "max_workers": 2}, 2),
)


def run_config(root: Path, name: str, runner: dict, threads: int) -> dict:
    slug = name.replace(" ", "-")
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["tracking"]["experiment"] = f"scaling-{slug}-{uuid.uuid4().hex[:6]}"  # nothing found: every cell computed
    params["threads"] = threads
    params["runner"].update(runner)
    cluster = None
    if runner["kind"] == "dask":
        from distributed import LocalCluster

        cluster = LocalCluster(n_workers=runner["max_workers"], threads_per_worker=1, processes=True,
                               dashboard_address=None, host="127.0.0.1")
        params["runner"]["address"] = cluster.scheduler_address
    path = root / f"params-scaling-{slug}.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    output = f"results/scaling-{slug}.json"
    try:
        start = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "flows.benchmark", "--params", path.name, "--output", output],
                              cwd=root, capture_output=True, text=True)
        wall = time.perf_counter() - start
    finally:
        path.unlink()
        if cluster is not None:
            cluster.close()
    if done.returncode != 0:
        raise SystemExit(f"{name}: exit {done.returncode}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    summary = json.loads((root / output).read_text())
    invocation = json.loads((root / "results" / "invocation.json").read_text())
    return {"name": name, "wall_s": wall, "flow_s": invocation["seconds"], "cells": summary["cells"],
            "computed": summary["cells"] - invocation["cached"], "failed": summary["failed"],
            "rows": summary["rows"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args(argv)
    root = args.root.resolve()
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = prefect_server(port)
    with tempfile.TemporaryDirectory(prefix="mergecal-scaling-prefect-") as home:
        env = server_env({**os.environ, "PREFECT_HOME": home, "PREFECT_UI_ENABLED": "false"})
        env.pop("PREFECT_API_URL", None)
        process = start(server, env)
        try:
            wait_until_up(server, process, timeout=180)
            os.environ["PREFECT_API_URL"] = f"http://127.0.0.1:{port}/api"  # the flows and the Dask workers
            results = [run_config(root, *config) for _ in range(args.repeats) for config in CONFIGS]
        finally:
            stop(process)
    base = {r["name"]: r for r in results[:len(CONFIGS)]}["threads x1"]
    print(f"{'configuration':<16} {'wall s':>8} {'flow s':>8} {'cells':>6} {'computed':>9} {'cells/min':>10} "
          f"{'x threads x1':>13}")
    for r in results:
        print(f"{r['name']:<16} {r['wall_s']:8.1f} {r['flow_s']:8.1f} {r['cells']:6d} {r['computed']:9d} "
              f"{60 * r['computed'] / r['flow_s']:10.1f} {base['flow_s'] / r['flow_s']:13.2f}")
    if args.repeats > 1:  # each configuration's spread over the repeats (the runs alternate configurations)
        print(f"\n{'configuration':<16} {'flow s (median, min-max)':>26} {'x threads x1 (median)':>22}")
        base_median = statistics.median(r["flow_s"] for r in results if r["name"] == "threads x1")
        for name, *_ in CONFIGS:
            seconds = [r["flow_s"] for r in results if r["name"] == name]
            median = statistics.median(seconds)
            print(f"{name:<16} {median:10.1f} ({min(seconds):.1f}-{max(seconds):.1f}) {base_median / median:22.2f}")
    same = sorted({r["name"] for r in results if r["rows"] == base["rows"]})
    print(f"rows equal to threads x1's, value for value: {', '.join(same)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
