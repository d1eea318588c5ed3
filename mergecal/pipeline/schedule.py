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

from ..errors import MergecalError, ParameterError
from .workspace import checkout_root

DEPLOYMENT = "scheduled-benchmark"
START_SERVER = ("start one with `mergecal ui` (or `prefect server start --host 127.0.0.1`), then "
                "export PREFECT_API_URL=http://127.0.0.1:4200/api")


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


def check_cron(cron: str) -> str:
    """``cron`` if Prefect reads it as a cron schedule, else one ParameterError saying what is expected."""
    from prefect.client.schemas.schedules import CronSchedule
    from pydantic import ValidationError

    try:
        CronSchedule(cron=cron)
    except ValidationError:
        raise ParameterError(f"--cron {cron!r}: not a cron schedule; expected five fields, minute hour day-of-month "
                             'month day-of-week, e.g. "0 3 * * 1" (Mondays at 03:00)') from None
    return cron


def check_server(api_url: str, timeout: float = 5.0) -> None:
    """One MergecalError, within ``timeout`` seconds, when no server answers at ``api_url`` (Prefect's client
    would raise httpx.ConnectError from deep inside ``serve``)."""
    import httpx

    try:
        httpx.get(f"{api_url.rstrip('/')}/health", timeout=timeout)
    except (httpx.HTTPError, httpx.InvalidURL) as err:
        reason = str(err) or type(err).__name__
        raise MergecalError(f"schedule: no Prefect server answers at PREFECT_API_URL={api_url} ({reason}); "
                            f"{START_SERVER}") from None


def deployment(cron: str, root: str | Path = "."):
    """The deployment object (nothing is started): the rerun flow on a cron schedule, in the checkout ``root``
    (MergecalError when it is not one, or when ``cron`` is no cron schedule)."""
    check_cron(cron)
    return rerun.to_deployment(name=DEPLOYMENT, cron=cron, parameters={"root": str(checkout_root(root))})


def serve(cron: str, root: str | Path, api_url: str) -> None:
    """Serve the deployment until interrupted, through the Prefect server at ``api_url`` (checked first)."""
    from prefect import serve as prefect_serve

    made = deployment(cron, root)
    check_server(api_url)
    prefect_serve(made)
