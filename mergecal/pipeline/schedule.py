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
    mergecal schedule --status                          # the runs that hold or wait for its slot; stale ones

Its entrypoint is a module path (``mergecal.pipeline.schedule.rerun``), so a worker that has mergecal installed
imports it wherever its working directory is.

Stopping a served schedule (SIGINT or SIGTERM) cancels its runs. Prefect 3.8.8's own ``serve`` does not: on Ctrl-C
its KeyboardInterrupt skips ``Runner.astop`` (which cancels the runs in flight), and its SIGTERM handler calls the
async ``stop`` from inside the running loop without awaiting it; either way the runner's teardown kills the flow
run's process and sets no state. The run stays PENDING or RUNNING for good, and its deployment concurrency slot
(taken on PENDING, on a lease the run's engine renews every 300 s) stays taken until that lease runs out: a manual
run meanwhile waits in AwaitingConcurrencySlot. :func:`serve` therefore runs Prefect's Runner itself, stops it
with ``astop`` on either signal, and then cancels whatever run of the deployment is still unfinished.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import signal
import subprocess
import tempfile
from datetime import datetime, timezone
from pathlib import Path

import yaml
from prefect import flow

from mergecal.checkpoint import atomic_write_text
from mergecal.errors import MergecalError, ParameterError
from mergecal.pipeline.prefect_api import (HOLDING, NOT_FINISHED, START_SERVER, cancel_run, check_server,
                                           deployment_runs, leave_work_pool, read_deployment)
from mergecal.pipeline.workspace import checkout_root

__all__ = ["START_SERVER", "check_server"]  # re-exported for the command line

FLOW = "mergecal-rerun"
DEPLOYMENT = "scheduled-benchmark"
FULL_NAME = f"{FLOW}/{DEPLOYMENT}"
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


@flow(name=FLOW, log_prints=True)
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


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
# how long the runner may take to stop once asked: Prefect gives a cancelled run's process 30 s to exit, then kills it
TEARDOWN_SECONDS = 60.0


def serve(cron: str | None, root: str | Path, api_url: str, *, interval: float | None = None,
          parameters: dict | None = None) -> str:
    """Serve the deployment from this process, through the Prefect server at ``api_url`` (checked first), until
    SIGINT or SIGTERM; then stop the runner, cancel every unfinished run of the deployment (the module docstring
    says why) and return one line saying what was cancelled."""
    made = deployment(cron, root, interval=interval, parameters=parameters)
    check_server(api_url)
    current = read_deployment(FULL_NAME)
    if current is not None and current.work_pool_name:
        # one deployment of this name, and registering it again without a pool keeps its pool: the pool's worker
        # would go on taking its runs. The served one replaces it, as --pool replaces a served one.
        leave_work_pool(current.id)
        print(f"schedule: {FULL_NAME} was on work pool {current.work_pool_name!r}; it is served from this process "
              "now (--pool moves it back)", flush=True)
    deployment_id, signum, held = asyncio.run(_serve_until_signal(made))
    return stop_serving(deployment_id, signal.Signals(signum).name, held)


async def _serve_until_signal(made) -> tuple:
    """Run Prefect's Runner on ``made`` until SIGINT or SIGTERM, then stop it as Prefect means it to stop
    (``Runner.astop``: the runs it is executing are cancelled, its polling ends; leaving, it pauses the schedule,
    which deletes the runs the scheduler made ahead). (deployment id, the signal, the runs that held the slot when
    it came). A signal while the runner starts stops it once started."""
    from prefect.runner import Runner

    class StoppedByTheLoop(Runner):
        def handle_sigterm(self, *args, **kwargs) -> None:
            """Runner.start installs this for SIGTERM; Prefect 3.8.8's calls the async ``stop`` unawaited and exits.
            SIGTERM is the event loop's handler's here (below), which the signal reaches all the same."""

    received: list[int] = []
    asked = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in STOP_SIGNALS:  # in place of the command line's handlers (KeyboardInterrupt would skip astop)
        loop.add_signal_handler(signum, lambda signum=signum: (received.append(signum), asked.set()))
    runner = StoppedByTheLoop(pause_on_shutdown=True)
    deployment_id = await runner.aadd_deployment(made)
    print(f"serving {FULL_NAME} ({deployment_id}) from this process; Ctrl-C or SIGTERM stops it and cancels its "
          "unfinished runs", flush=True)
    serving = asyncio.create_task(runner.start())
    asking = asyncio.create_task(asked.wait())
    await asyncio.wait({serving, asking}, return_when=asyncio.FIRST_COMPLETED)
    if not received:  # the runner ended by itself: its error as it is
        asking.cancel()
        serving.result()
        raise MergecalError(f"schedule: serving {FULL_NAME} ended by itself")
    while not runner.started and not serving.done():  # a signal while it started
        await asyncio.sleep(0.05)
    held = await asyncio.to_thread(deployment_runs, deployment_id, HOLDING)
    if made.work_pool_name is None and (await asyncio.to_thread(read_deployment, FULL_NAME)).work_pool_name:
        runner.pause_on_shutdown = False  # registered on a pool meanwhile (--pool): its schedule is the pool's now
    if runner.started:
        await runner.astop()
    try:
        await asyncio.wait_for(serving, TEARDOWN_SECONDS)  # cancels the runner's teardown past the limit
    except TimeoutError:
        pass
    return deployment_id, received[0], held


def stop_serving(deployment_id, signal_name: str, held: list) -> str:
    """After the runner stopped: cancel every run of the deployment still SCHEDULED (its auto-scheduled runs are
    gone with the pause; a manual one would wait for a server that is gone), PENDING, RUNNING or CANCELLING (its
    process was killed); the one line that says what was cancelled and whether the slot is free. Nothing is
    cancelled when the deployment was registered on a work pool meanwhile: its runs are the pool workers' now."""
    current = read_deployment(FULL_NAME)
    if current is not None and current.work_pool_name:
        return (f"schedule: stopped by {signal_name}; {FULL_NAME} is now on work pool {current.work_pool_name!r}, "
                "its runs are left to that pool's workers")
    why = f"mergecal schedule stopped by {signal_name}: nothing serves {FULL_NAME} now"
    leftovers = deployment_runs(deployment_id, NOT_FINISHED)
    ended = {run.id: cancel_run(run.id, why) for run in leftovers}
    before = {run.id: run for run in held} | {run.id: run for run in leftovers}
    for run_id in before.keys() - ended.keys():  # cancelled by the runner itself, or finished meanwhile
        ended[run_id] = _state_type(run_id)
    # a run whose process took the signal too (Ctrl-C reaches the terminal's whole process group) ends CRASHED
    shown = [f"{run.name} ({run.id}) {run.state_type.value} -> {ended[run.id]}" for run in before.values()]
    what = f"its unfinished runs ended: {', '.join(shown)}" if shown else "no run of it was unfinished"
    return (f"schedule: stopped serving {FULL_NAME} on {signal_name}; {what}; schedule paused, "
            f"{_slot_words(read_deployment(FULL_NAME))}")


def _state_type(run_id) -> str:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(run_id).state_type.value


def _slot_words(current) -> str:
    limit = current.global_concurrency_limit if current is not None else None
    if limit is None:
        return "the deployment has no concurrency limit"
    taken = limit.active_slots
    return "its concurrency slot is free" if taken == 0 else f"{taken} of its {limit.limit} slots taken"


def register(cron: str | None, root: str | Path, api_url: str, pool: str, *, interval: float | None = None,
             parameters: dict | None = None) -> str:
    """Register the deployment on work pool ``pool`` (a ``prefect worker start --pool <pool>`` on the lab's machine
    runs it); returns the deployment's id."""
    made = deployment(cron, root, interval=interval, pool=pool, parameters=parameters)
    check_server(api_url)
    current = read_deployment(FULL_NAME)
    if current is not None and served_live(current) and not current.work_pool_name and not current.paused:
        # one deployment of this name: registering it on a pool replaces the served one, which would go on
        # polling it and run its runs beside the pool's worker
        raise MergecalError(f"schedule --pool {pool}: {FULL_NAME} is being served by a `mergecal schedule` process "
                            "(polled within the last minute); stop it (Ctrl-C) first: the pool's deployment "
                            "replaces the served one")
    return str(made.apply(work_pool_name=pool))


# ------------------------------------------------------------------------------------------------ --status

# a healthy run is PENDING for seconds (Submitting, then its process starts and sets it RUNNING); the slot that
# PENDING took is on a lease of 300 s (the server's initial_deployment_lease_duration) that only the run's engine
# renews, so a run still PENDING after that has no live engine and its slot has lapsed
STALE_PENDING_SECONDS = 300.0
# Prefect's own word for "a serve process or a worker polled this deployment within the last 60 s"
READY = "READY"


def served_live(current) -> bool:
    """Whether a serve process or a worker is polling the deployment ``current`` (Prefect marks it READY when one
    polled it within the last 60 s, NOT_READY after)."""
    status = getattr(current.status, "value", current.status)
    return str(status).upper() == READY


def stale_reason(state_type: str, seconds: float, live: bool) -> str | None:
    """Why a run in ``state_type`` for ``seconds`` is stale (holds the slot with nothing to finish it), or None.
    ``live``: something polls the deployment. A RUNNING run is never stale by its age alone: a rerun's dvc repro
    takes as long as its cells (hours for the full benchmark)."""
    if state_type not in HOLDING:
        return None
    if not live:
        return f"{state_type} and nothing serves the deployment (no process or worker polled it for over 60 s)"
    if state_type == "PENDING" and seconds >= STALE_PENDING_SECONDS:
        return (f"PENDING for {_age(seconds)}: a run starts within seconds, and the {STALE_PENDING_SECONDS:.0f} s "
                "lease on its slot has lapsed")
    return None


def _age(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def slot_runs(current, now: datetime | None = None) -> list[tuple]:
    """The runs of deployment ``current`` that hold its slot (PENDING, RUNNING, CANCELLING) or wait for it
    (SCHEDULED and AwaitingConcurrencySlot, or due: Late, a manual run), oldest first, each as (run, seconds it has
    held the slot or waited, why it is stale or None)."""
    now = now or datetime.now(timezone.utc)
    live = served_live(current)
    found = []
    for run in deployment_runs(current.id, NOT_FINISHED):
        kind = run.state_type.value
        since = run.state.timestamp if run.state else run.created
        if kind == "SCHEDULED":
            # AwaitingConcurrencySlot is put back 30 s ahead at each try: it has waited since its expected start
            since = run.expected_start_time or since
            if run.state_name != "AwaitingConcurrencySlot" and (since is None or since > now):
                continue
        seconds = max(0.0, (now - since).total_seconds())
        found.append((run, seconds, stale_reason(kind, seconds, live)))
    return found


def _read(api_url: str, who: str):
    check_server(api_url, who)
    current = read_deployment(FULL_NAME)
    if current is None:
        raise MergecalError(f"{who}: no deployment {FULL_NAME} on the Prefect server at {api_url}; make one with "
                            '`mergecal schedule --cron "0 3 * * *"` (or --pool POOL)')
    return current


def status(api_url: str) -> str:
    """What ``mergecal schedule --status`` prints: the deployment, who serves it, its slot, and the runs that hold or
    wait for the slot (state, age, id, name), each stale one with the command that clears it. Changes nothing."""
    current = _read(api_url, "schedule --status")
    where = f"on work pool {current.work_pool_name!r}" if current.work_pool_name else "served from a process"
    polled = (f"last polled {_age((datetime.now(timezone.utc) - current.last_polled).total_seconds())} ago"
              if current.last_polled else "never polled")
    lines = [f"{FULL_NAME} ({current.id}): {where}, {'polled now' if served_live(current) else 'NOT polled'} "
             f"({polled}), schedule {'paused' if current.paused else 'active'}; {_slot_words(current)}"]
    runs = slot_runs(current)
    for run, seconds, _ in runs:
        kind = run.state_type.value
        label = kind if run.state_name in (None, kind.title()) else f"{kind} ({run.state_name})"
        wait = "waiting" if kind == "SCHEDULED" else "held"
        lines.append(f"  {label:<36} {wait} {_age(seconds):>7}  {run.id}  {run.name}")
    if not runs:
        lines.append("  no run holds or waits for its slot")
    stale = [(run, reason) for run, _, reason in runs if reason]
    for run, reason in stale:
        lines.append(f"stale: {run.id}: {reason}")
    if stale:
        lines.append("clear with: mergecal schedule --clear-stale")
    return "\n".join(lines)


def clear_stale(api_url: str) -> str:
    """Cancel the runs ``--status`` calls stale (each set Cancelled, which gives its slot back); what was done."""
    current = _read(api_url, "schedule --clear-stale")
    stale = [(run, reason) for run, _, reason in slot_runs(current) if reason]
    lines = [f"{run.id} {run.name}: {run.state_type.value} -> "
             f"{cancel_run(run.id, f'cleared by mergecal schedule --clear-stale: {reason}')} ({reason})"
             for run, reason in stale]
    lines.append(f"schedule --clear-stale: {len(stale)} stale run{'s' * (len(stale) != 1)} of {FULL_NAME} cancelled; "
                 f"{_slot_words(read_deployment(FULL_NAME))}")
    return "\n".join(lines)
