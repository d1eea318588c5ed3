"""Scheduled reruns: a Prefect deployment of the ``rerun`` flow, which brings a mergecal checkout up to date and
reruns it the way a lab means it, each step optional and logged:

1. ``git pull --ff-only`` of the checkout's branch (skipped without an upstream);
2. ``dvc pull --allow-missing`` (skipped without a DVC remote): a member's pushed checkpoints and outputs;
3. ``dvc repro``: only what changed reruns, every cached cell is reused;
4. ``dvc push`` (skipped without a DVC remote);
5. the reports published: as artifacts (``reports/``) of the invocation's run on the tracking store, and/or copied
   into a folder (``publish_dir``).

A checkout with local changes (tracked files other than what the pipeline itself writes: dvc.lock and the stages'
outputs), or whose pull cannot fast-forward, stops the rerun with one line before anything is changed.

Two ways to run it on a schedule, as Prefect users do (docs/lab.md):

    mergecal schedule --cron "0 3 * * *"               # serve from this process (Ctrl-C stops serving)
    mergecal schedule --cron "0 3 * * *" --pool gpu     # a deployment on work pool gpu, for `prefect worker start`

Its entrypoint is a module path (``mergecal.pipeline.schedule.rerun``), so a worker that has mergecal installed
imports it wherever its working directory is.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
from pathlib import Path

import yaml
from prefect import flow

from mergecal.checkpoint import atomic_write_text
from mergecal.errors import MergecalError, ParameterError
from mergecal.pipeline.prefect_api import START_SERVER, check_server
from mergecal.pipeline.workspace import checkout_root

__all__ = ["START_SERVER", "check_server"]  # re-exported for the command line

DEPLOYMENT = "scheduled-benchmark"
# the report files a rerun publishes (beside the leaderboard: the history, dated, which DVC does not track)
PUBLISHED = ("leaderboard.md", "leaderboard.html", "leaderboard.json", "history.md", "history.html", "testbed.md",
             "stability.md")


class RerunStopped(MergecalError):
    """The checkout cannot be rerun as it is (local changes, a pull that fails): nothing was changed."""


def _git(root: Path, *args: str, check: bool = False) -> subprocess.CompletedProcess:
    done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
    if check and done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip()).splitlines()[-1:] or [f"exit {done.returncode}"]
        raise RerunStopped(f"rerun: git {' '.join(args)} failed in {root}: {last[0]}; nothing was changed")
    return done


def pipeline_outputs(root: Path) -> list[str]:
    """What ``dvc repro`` itself writes in the checkout: dvc.lock and every stage output it records."""
    lock = root / "dvc.lock"
    outs = ["dvc.lock"]
    if lock.exists():
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
        outs += [out["path"] for stage in stages.values() for out in stage.get("outs", []) if "path" in out]
    return outs


def _owned(path: str, outputs: list[str]) -> bool:
    return any(path == out or path.startswith(out.rstrip("/") + "/") for out in outputs)


def has_commits(root: Path) -> bool:
    """Whether ``root`` is inside a git repository with at least one commit (a fresh ``git init`` + ``dvc init``
    workspace has none: nothing to compare with or pull)."""
    return _git(root, "rev-parse", "--verify", "--quiet", "HEAD").returncode == 0


def local_changes(root: Path) -> tuple[list[str], list[str]]:
    """(tracked files changed by hand, tracked files the pipeline wrote) in the checkout, against its last commit;
    none in a repository without commits."""
    if not has_commits(root):
        return [], []
    status = _git(root, "status", "--porcelain", "--untracked-files=no", check=True).stdout
    paths = [line[3:].split(" -> ")[-1].strip('"') for line in status.splitlines() if line.strip()]
    outputs = pipeline_outputs(root)
    return [p for p in paths if not _owned(p, outputs)], [p for p in paths if _owned(p, outputs)]


def pull_checkout(root: Path) -> str:
    """Fast-forward the checkout to its upstream; what was done, in words. Stops (nothing changed) on local
    changes, a failed fetch or a branch that has diverged; the pipeline's own outputs are set back to the commit's
    before the fast-forward (``dvc repro`` writes them again)."""
    if _git(root, "rev-parse", "--is-inside-work-tree").returncode != 0:
        return "skipped: not a git checkout"
    if not has_commits(root):
        return "skipped: the repository has no commits"
    upstream = _git(root, "rev-parse", "--abbrev-ref", "--symbolic-full-name", "@{u}")
    if upstream.returncode != 0:
        return "skipped: the branch has no upstream"
    upstream_name = upstream.stdout.strip()
    _git(root, "fetch", "--quiet", check=True)
    head, target = (_git(root, "rev-parse", ref, check=True).stdout.strip() for ref in ("HEAD", "@{u}"))
    if head == target:
        return f"up to date with {upstream_name} ({head[:12]})"
    if _git(root, "merge-base", "--is-ancestor", "HEAD", "@{u}").returncode != 0:
        raise RerunStopped(f"rerun: {root} has commits that {upstream_name} lacks (git pull --ff-only cannot "
                           "fast-forward); push or reset them; nothing was changed")
    _, written = local_changes(root)
    if written:
        _git(root, "checkout", "--", *written, check=True)
    _git(root, "merge", "--ff-only", "--quiet", "@{u}", check=True)
    return f"fast-forwarded {head[:12]} -> {target[:12]} ({upstream_name})"


def _dvc(root: Path, *args: str) -> subprocess.CompletedProcess:
    import sys

    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, capture_output=True, text=True)


def _remote(root: Path) -> bool:
    return bool(_dvc(root, "remote", "list").stdout.strip())


def _run_dvc(root: Path, *args: str) -> str:
    done = _dvc(root, *args)
    for line in (done.stdout + done.stderr).splitlines()[-40:]:
        print(line)
    if done.returncode != 0:
        raise MergecalError(f"rerun: dvc {' '.join(args)} failed in {root} (exit {done.returncode})")
    return "done"


def publish(root: Path, tracking: bool, folder: str | None) -> list[str]:
    """The reports of the checkout's last invocation, logged as ``reports/`` artifacts of its run (``tracking``)
    and copied into ``folder`` (each file written atomically); where they went, in words."""
    from mergecal.pipeline.config import load_params
    from mergecal.pipeline.results import INVOCATION_FILE
    from mergecal.pipeline.tracking import redact, resolve_uri

    reports = [root / "reports" / name for name in PUBLISHED if (root / "reports" / name).exists()]
    done = []
    if tracking:
        from mlflow import MlflowClient

        invocation = json.loads((root / "results" / INVOCATION_FILE).read_text())
        uri = resolve_uri(root, load_params(root / "params.yaml").tracking)
        with tempfile.TemporaryDirectory(prefix="mergecal-publish-") as tmp:
            for path in reports:
                shutil.copy2(path, Path(tmp) / path.name)
            MlflowClient(tracking_uri=uri).log_artifacts(invocation["parent_run_id"], tmp, "reports")
        done.append(f"{len(reports)} files as artifacts reports/ of run {invocation['parent_run_id']} on "
                    f"{redact(uri)}")
    if folder:
        target = Path(folder)
        for path in reports:
            atomic_write_text(target / path.name, path.read_text())
        done.append(f"{len(reports)} files into {target}")
    return done


@flow(name="mergecal-rerun", log_prints=True)
def rerun(root: str = ".", git_pull: bool = True, dvc_pull: bool = True, dvc_push: bool = True,
          publish_tracking: bool = True, publish_dir: str | None = None) -> dict:
    """Bring the checkout ``root`` up to date and rerun it (the module docstring's steps); returns the benchmark
    summary and what each step did."""
    root_path = checkout_root(root)
    steps: dict[str, str] = {}

    def step(name: str, outcome: str) -> None:
        steps[name] = outcome
        print(f"rerun: {name}: {outcome}")

    if _git(root_path, "rev-parse", "--is-inside-work-tree").returncode == 0:
        changed, _ = local_changes(root_path)
        if changed:
            shown = ", ".join(changed[:5]) + (f" and {len(changed) - 5} more" if len(changed) > 5 else "")
            raise RerunStopped(f"rerun: {root_path} has local changes ({shown}); commit or stash them; nothing "
                               "was changed")
    step("git pull", pull_checkout(root_path) if git_pull else "skipped: not asked")
    remote = _remote(root_path)
    step("dvc pull", (_run_dvc(root_path, "pull", "--allow-missing") if remote else "skipped: no DVC remote")
         if dvc_pull else "skipped: not asked")
    step("dvc repro", _run_dvc(root_path, "repro"))
    step("dvc push", (_run_dvc(root_path, "push") if remote else "skipped: no DVC remote")
         if dvc_push else "skipped: not asked")
    published = publish(root_path, publish_tracking, publish_dir)
    step("publish", "; ".join(published) or "skipped: not asked")
    summary = json.loads((root_path / "results" / "benchmark.json").read_text())
    invocation = json.loads((root_path / "results" / "invocation.json").read_text())
    return {"invocation_id": invocation["invocation_id"], "cells": summary["cells"], "cached": invocation["cached"],
            "failed": summary["failed"], "seconds": invocation["seconds"], "steps": steps}


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


def deployment(cron: str | None = None, root: str | Path = ".", *, interval: float | None = None,
               pool: str | None = None, parameters: dict | None = None):
    """The deployment object (nothing is started): the rerun flow on a cron schedule (or every ``interval``
    seconds) in the checkout ``root``, on work pool ``pool`` when given; ``parameters``: the rerun's other
    arguments (which steps, where to publish). MergecalError when ``root`` is no checkout or ``cron`` no cron
    schedule."""
    from prefect.deployments.runner import EntrypointType

    if (cron is None) == (interval is None):
        raise ParameterError("schedule: give exactly one of --cron and --interval")
    if cron is not None:
        check_cron(cron)
    if interval is not None and not interval > 0:
        raise ParameterError(f"--interval {interval}: expected a positive number of seconds")
    # one rerun of a checkout at a time: a late run waits rather than racing the previous one's dvc repro
    return rerun.to_deployment(name=DEPLOYMENT, cron=cron, interval=interval, work_pool_name=pool,
                               parameters={"root": str(checkout_root(root)), **(parameters or {})},
                               entrypoint_type=EntrypointType.MODULE_PATH, concurrency_limit=1)


def serve(cron: str | None, root: str | Path, api_url: str, *, interval: float | None = None,
          parameters: dict | None = None) -> None:
    """Serve the deployment until interrupted, through the Prefect server at ``api_url`` (checked first)."""
    from prefect import serve as prefect_serve

    made = deployment(cron, root, interval=interval, parameters=parameters)
    check_server(api_url)
    prefect_serve(made)


def register(cron: str | None, root: str | Path, api_url: str, pool: str, *, interval: float | None = None,
             parameters: dict | None = None) -> str:
    """Register the deployment on work pool ``pool`` (a ``prefect worker start --pool <pool>`` on the lab's machine
    runs it); returns the deployment's id."""
    made = deployment(cron, root, interval=interval, pool=pool, parameters=parameters)
    check_server(api_url)
    return str(made.apply(work_pool_name=pool))
