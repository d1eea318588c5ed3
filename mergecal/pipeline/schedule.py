"""Scheduled reruns: a Prefect deployment with a cron schedule whose flow runs ``dvc repro`` in a mergecal
checkout (so data, checkpoints and the benchmark are brought up to date, reusing every cached cell) and then
rebuilds the reports; MLflow keeps one invocation per rerun and ``reports/history.md`` compares them.

    prefect server start --host 127.0.0.1 &         # or: mergecal ui
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    mergecal schedule --cron "0 3 * * 1"            # in the checkout (or --root DIR); Ctrl-C stops serving
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from prefect import flow

from .workspace import checkout_root

DEPLOYMENT = "scheduled-benchmark"


@flow(name="mergecal-rerun", log_prints=True)
def rerun(root: str = ".") -> dict:
    """``dvc repro`` in the checkout ``root``; returns the benchmark summary (results/benchmark.json,
    invocation.json)."""
    root_path = checkout_root(root)
    process = subprocess.run(["dvc", "repro"], cwd=root_path, capture_output=True, text=True)
    for line in (process.stdout + process.stderr).splitlines()[-40:]:
        print(line)
    if process.returncode != 0:
        raise RuntimeError(f"dvc repro failed in {root_path} (exit {process.returncode})")
    summary = json.loads((root_path / "results" / "benchmark.json").read_text())
    invocation = json.loads((root_path / "results" / "invocation.json").read_text())
    return {"invocation_id": invocation["invocation_id"], "cells": summary["cells"], "cached": invocation["cached"],
            "failed": summary["failed"], "seconds": invocation["seconds"]}


def deployment(cron: str, root: str | Path = "."):
    """The deployment object (nothing is started): the rerun flow on a cron schedule, in the checkout ``root``
    (MergecalError when it is not one)."""
    return rerun.to_deployment(name=DEPLOYMENT, cron=cron, parameters={"root": str(checkout_root(root))})


def serve(cron: str, root: str | Path = ".") -> None:
    from prefect import serve as prefect_serve

    prefect_serve(deployment(cron, root))
