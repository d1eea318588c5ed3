"""Stopping a served schedule (#62), against a real Prefect server (tests/lab_servers.py): SIGINT to the process
group (a terminal's Ctrl-C) or SIGTERM to the serving process alone (``kill PID``, systemd) leaves no run of the
deployment SCHEDULED, PENDING or RUNNING, the dvc repro it was running gone, and its concurrency slot free for the
next run; ``mergecal schedule --status`` names a stale run and the command that clears it, which frees the slot.

The checkout each rerun runs is a stand-in whose one DVC stage sleeps: the rerun stays RUNNING until it is stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lab_servers import prefect_env, prefect_server  # noqa: I001
from mergecal.pipeline.schedule import FULL_NAME, STALE_PENDING_SECONDS, stale_reason
from mergecal.ui import stop

BIN = Path(sys.executable).parent
UNFINISHED = {"SCHEDULED", "PENDING", "RUNNING", "CANCELLING"}


# ------------------------------------------------------------------------------------------------ without a server

@pytest.mark.parametrize("state, seconds, live, stale", [
    ("PENDING", 5, True, False),  # a run being started
    ("PENDING", STALE_PENDING_SECONDS, True, True),  # its slot's lease has lapsed: nothing started it
    ("RUNNING", 6 * 3600, True, False),  # a long rerun of the full benchmark, served
    ("RUNNING", 5, False, True),  # nothing polls the deployment: nothing will finish it
    ("CANCELLING", 5, False, True),
    ("SCHEDULED", 3600, False, False),  # it waits for the slot, it holds none
])
def test_a_run_is_stale_when_it_holds_the_slot_with_nothing_to_finish_it(state, seconds, live, stale):
    assert (stale_reason(state, seconds, live) is not None) == stale


# ------------------------------------------------------------------------------------------------ a real server

@pytest.fixture(scope="module")
def prefect(tmp_path_factory):
    base = tmp_path_factory.mktemp("schedule-stop")
    with prefect_server(base / "home") as api_url:
        yield api_url, base


def sleeping_checkout(root: Path) -> Path:
    """A git + DVC repository with what makes a mergecal checkout (dvc.yaml, stages/, flows/, mergecal/) whose one
    stage sleeps: its rerun is RUNNING until stopped."""
    root.mkdir()
    for name in ("stages", "flows", "mergecal"):
        (root / name).mkdir()
        (root / name / ".keep").write_text("")
    (root / "dvc.yaml").write_text("stages:\n  sleep:\n    cmd: sleep 600\n")
    for args in (["git", "init", "-q"], [str(BIN / "dvc"), "init", "-q"], ["git", "add", "-A"],
                 ["git", "-c", "user.name=t", "-c", "user.email=t@t.invalid", "commit", "-qm", "stand-in"]):
        subprocess.run(args, cwd=root, check=True, capture_output=True)
    return root


def client(api_url: str):
    """Prefect's client for the test server (its documented way to point the client at a server)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, temporary_settings

    class _Client:
        def __enter__(self):
            self._settings = temporary_settings({PREFECT_API_URL: api_url})
            self._settings.__enter__()
            self._client = get_client(sync_client=True)
            return self._client.__enter__()

        def __exit__(self, *exc):
            self._client.__exit__(*exc)
            self._settings.__exit__(*exc)

    return _Client()


def runs(api_url: str) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId

    with client(api_url) as c:
        deployment = c.read_deployment_by_name(FULL_NAME)
        return c.read_flow_runs(deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment.id])))


def taken_slots(api_url: str) -> int:
    with client(api_url) as c:
        return c.read_deployment_by_name(FULL_NAME).global_concurrency_limit.active_slots


def manual_run(api_url: str, take_slot: bool):
    """A run of the deployment made by hand (``prefect deployment run``); with ``take_slot``, proposed PENDING as a
    runner or worker does, which takes the slot or is put back to wait (AwaitingConcurrencySlot)."""
    from prefect.states import Pending

    with client(api_url) as c:
        run = c.create_flow_run_from_deployment(c.read_deployment_by_name(FULL_NAME).id)
        if take_slot:
            c.set_flow_run_state(run.id, Pending())
        return c.read_flow_run(run.id)


def set_state(api_url: str, run_id, state) -> str:
    with client(api_url) as c:
        c.set_flow_run_state(run_id, state)
        return c.read_flow_run(run_id).state_name


def processes_in(root: Path) -> list[str]:
    """Command lines of the processes whose working directory is ``root`` (a rerun's dvc repro and its stage)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and os.readlink(proc / "cwd") == str(root):
                found.append((proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return found


def wait_for(predicate, timeout: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate()
        if found:
            return found
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout:g} s" + (f"\n{log.read_text()[-4000:]}" if log else ""))


def mergecal(api_url: str, base: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "mergecal"), "schedule", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, env=prefect_env(api_url, base / "client-home"))


@pytest.mark.slow
@pytest.mark.integration
def test_status_names_a_stale_run_and_clearing_it_frees_the_slot(prefect, tmp_path):
    """A RUNNING run whose server is gone (its process killed, the machine rebooted) holds the slot: a manual run
    waits in AwaitingConcurrencySlot. ``--status`` names both and the command that clears the stale one."""
    from prefect.states import Running

    from mergecal.pipeline.schedule import deployment, served_live

    api_url, base = prefect
    checkout = sleeping_checkout(tmp_path / "checkout")
    from prefect.settings import PREFECT_API_URL, temporary_settings

    with temporary_settings({PREFECT_API_URL: api_url}):
        deployment("0 3 * * *", checkout).apply()  # registered, never polled: nothing serves it
    with client(api_url) as c:  # the stop tests of this module served it: Prefect calls it unserved 60 s later
        wait_for(lambda: not served_live(c.read_deployment_by_name(FULL_NAME)), 90, "unserved deployment")
    stale = manual_run(api_url, take_slot=True)
    assert stale.state_type.value == "PENDING" and set_state(api_url, stale.id, Running()) == "Running"
    waiting = manual_run(api_url, take_slot=True)
    assert waiting.state_name == "AwaitingConcurrencySlot" and taken_slots(api_url) == 1

    shown = mergecal(api_url, base, "--status", cwd=tmp_path)
    assert shown.returncode == 0, shown.stderr[-3000:]
    out = shown.stdout
    assert f"stale: {stale.id}: RUNNING and nothing serves the deployment" in out, out
    assert "clear with: mergecal schedule --clear-stale" in out, out
    assert "SCHEDULED (AwaitingConcurrencySlot)" in out and str(waiting.id) in out, out
    assert {r.id: r.state_type.value for r in runs(api_url)}[stale.id] == "RUNNING"  # --status changed nothing

    cleared = mergecal(api_url, base, "--clear-stale", cwd=tmp_path)
    assert cleared.returncode == 0, cleared.stderr[-3000:]
    assert f"{stale.id} {stale.name}: RUNNING -> CANCELLED" in cleared.stdout, cleared.stdout
    assert "1 stale run of mergecal-rerun/scheduled-benchmark cancelled; its concurrency slot is free" in \
        cleared.stdout, cleared.stdout
    assert taken_slots(api_url) == 0
    from prefect.states import Cancelled, Pending

    assert set_state(api_url, waiting.id, Pending()) == "Pending"  # the waiting run gets the slot now
    set_state(api_url, waiting.id, Cancelled())
    assert taken_slots(api_url) == 0


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.parametrize("signum, to_group, state", [(signal.SIGINT, True, "PENDING"),
                                                     (signal.SIGTERM, False, "RUNNING")],
                         ids=["ctrl-c-to-the-group-while-pending", "sigterm-to-the-process-while-running"])
def test_stopping_a_served_schedule_leaves_no_run_and_frees_the_slot(prefect, tmp_path, signum, to_group, state):
    """Ctrl-C while the first run is PENDING (the runner takes it some seconds before it is due, and its process
    imports mergecal before it is RUNNING: what the member met), SIGTERM while it RUNs its dvc repro."""
    api_url, base = prefect
    checkout = sleeping_checkout(tmp_path / "checkout")
    log = tmp_path / "serve.log"
    env = prefect_env(api_url, base / "client-home", PREFECT_RUNNER_POLL_FREQUENCY="2",
                      PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    with open(log, "wb") as sink:
        serving = subprocess.Popen([str(BIN / "mergecal"), "schedule", "--interval", "5", "--no-publish"],
                                   cwd=checkout, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        started = time.monotonic()
        wait_for(lambda: [r for r in runs_or_none(api_url) if r.state_type.value == state], 90, f"{state} rerun", log)
        if state == "RUNNING":
            wait_for(lambda: any("sleep 600" in cmd for cmd in processes_in(checkout)), 30, "dvc stage", log)
        queued = manual_run(api_url, take_slot=False)  # `prefect deployment run`: it waits for the slot
        if not to_group:  # the one deployment of this name is served: a second member's --pool may not take it
            refused = mergecal(api_url, base, "--cron", "0 3 * * *", "--pool", "gpu", cwd=checkout)
            assert refused.returncode == 2 and "is being served by a `mergecal schedule` process" in \
                refused.stderr.strip().splitlines()[-1], refused.stderr[-3000:]
        print(f"{state} after {time.monotonic() - started:.1f} s")
        if to_group:
            os.killpg(serving.pid, signum)
        else:
            serving.send_signal(signum)
        stopping = time.monotonic()
        assert serving.wait(timeout=90) == 0, log.read_text()[-4000:]
        print(f"stopped {time.monotonic() - stopping:.1f} s after {signal.Signals(signum).name}")
    finally:
        stop(serving, timeout=10)
    text = log.read_text()
    last = text.strip().splitlines()[-1]
    print(last)
    assert last.startswith(f"schedule: stopped serving {FULL_NAME} on {signal.Signals(signum).name}; its unfinished "
                           "runs ended: "), text[-4000:]
    assert last.endswith("schedule paused, its concurrency slot is free"), last
    assert f"({queued.id}) SCHEDULED -> CANCELLED" in last, last
    left = {(r.name, r.state_type.value, r.state_name) for r in runs(api_url) if r.state_type.value in UNFINISHED}
    assert not left, left
    assert not processes_in(checkout)  # the rerun's dvc repro and its stage went with it
    assert taken_slots(api_url) == 0
    with client(api_url) as c:
        assert c.read_deployment_by_name(FULL_NAME).paused
    from prefect.states import Cancelled

    after = manual_run(api_url, take_slot=True)  # the next run is not left AwaitingConcurrencySlot
    assert after.state_type.value == "PENDING", (after.state_name, after.state.message)
    set_state(api_url, after.id, Cancelled())


@pytest.mark.slow
@pytest.mark.integration
def test_pool_and_served_deployment_replace_each_other(prefect, tmp_path):
    """One deployment of this name: ``--pool`` moves it onto the pool (same deployment, schedule active again after
    a stopped serve paused it), and serving it again takes it off the pool, whose worker would otherwise go on
    taking its runs."""
    api_url, base = prefect
    checkout = sleeping_checkout(tmp_path / "checkout")
    env = prefect_env(api_url, base / "client-home", PREFECT_RUNNER_POLL_FREQUENCY="2",
                      PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}")
    created = subprocess.run([str(BIN / "prefect"), "work-pool", "create", "gpu", "--type", "process"], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert created.returncode == 0, created.stdout[-2000:] + created.stderr[-2000:]
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from mergecal.pipeline.schedule import deployment

    served = deployment(None, checkout, interval=3600)
    served.paused = True  # as a stopped `mergecal schedule` leaves it (the tests above)
    with temporary_settings({PREFECT_API_URL: api_url}):
        before = served.apply()
    pooled = mergecal(api_url, base, "--cron", "0 3 * * *", "--pool", "gpu", cwd=checkout)
    assert pooled.returncode == 0 and f"({before}) on work pool 'gpu'" in pooled.stdout, pooled.stderr[-3000:]
    with client(api_url) as c:
        current = c.read_deployment_by_name(FULL_NAME)
    assert (current.id, current.work_pool_name, current.paused) == (before, "gpu", False)

    log = tmp_path / "serve.log"
    with open(log, "wb") as sink:
        serving = subprocess.Popen([str(BIN / "mergecal"), "schedule", "--interval", "3600", "--no-publish"],
                                   cwd=checkout, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for(lambda: "serving " in log.read_text(), 90, "serving", log)
        serving.send_signal(signal.SIGTERM)
        assert serving.wait(timeout=90) == 0, log.read_text()[-4000:]
    finally:
        stop(serving, timeout=10)
    assert f"schedule: {FULL_NAME} was on work pool 'gpu'; it is served from this process now" in log.read_text()
    with client(api_url) as c:
        current = c.read_deployment_by_name(FULL_NAME)
    assert (current.id, current.work_pool_name, current.paused) == (before, None, True)


def runs_or_none(api_url: str) -> list:
    """The deployment's runs, none before ``mergecal schedule`` registered it."""
    from prefect.exceptions import ObjectNotFound

    try:
        return runs(api_url)
    except ObjectNotFound:
        return []
