"""A lab end to end (#39), every server real and on 127.0.0.1: PostgreSQL, an MLflow tracking server on it with a
proxied artifact store, a Prefect server, a process work pool with a worker. Two members' smoke checkouts (Bob's
with an extra merge and TIES at top_k 0.3, logging through a URI that carries a password) log to the one server;
the lab board holds both members' rows with their provenance and distinct labels, and no false regression; the
password is nowhere in what is stored or printed; a deployment on the work pool runs on a worker, and a served
schedule fires by itself. The commands are those of docs/lab.md (checked at the end)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from lab_servers import completed_run, mlflow_server, postgres_server, prefect_env, prefect_server  # noqa: I001
from mergecal.pipeline.workspace import create_workspace
from mergecal.ui import stop

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
SECRET = "s3cr3t-pw"
FLOW, DEPLOYMENT = "mergecal-rerun", "scheduled-benchmark"
COMMANDS: list[str] = []  # every command line run here, placeholders restored: each must be in docs/lab.md


def _run(args: list[str], cwd: Path, env: dict, documented: str | None = None, timeout: float = 1200
         ) -> subprocess.CompletedProcess:
    if documented:
        COMMANDS.append(documented)
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL)
    assert done.returncode == 0, (f"{' '.join(args)}: exit {done.returncode}\n{done.stdout[-4000:]}\n"
                                  f"{done.stderr[-4000:]}")
    return done


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    base = tmp_path_factory.mktemp("lab")
    start = time.perf_counter()
    with postgres_server(base / "pg") as database, \
            mlflow_server(database, base / "mlflow-artifacts") as mlflow_url, \
            prefect_server(base / "prefect-home") as api_url:
        print(f"servers up: {time.perf_counter() - start:.1f} s")
        yield {"base": base, "database": database, "mlflow": mlflow_url, "api": api_url,
               "env": prefect_env(api_url, base / "prefect-home", PATH=f"{BIN}:{os.environ['PATH']}")}


def _member_env(lab: dict, user: str, uri: str) -> dict:
    # getpass.getuser() reads USER first: two members on one machine
    return {**lab["env"], "USER": user, "LOGNAME": user, "MLFLOW_TRACKING_URI": uri}


def _with_password(url: str, user: str) -> str:
    return url.replace("http://", f"http://{user}:{SECRET}@")


@pytest.fixture(scope="module")
def checkouts(lab):
    """Alice's smoke checkout, built cold; Bob's, a copy with an extra merge and TIES at top_k 0.3, rerun. Both log
    to the lab's server (Bob through a URI with a password: the MLflow server has no auth app, so it is ignored)."""
    alice = create_workspace(lab["base"] / "alice", root=REPO)
    for args in (["add", "-A"], ["-c", "user.name=alice", "-c", "user.email=a@lab.invalid", "commit", "-qm", "lab"]):
        subprocess.run(["git", *args], cwd=alice, check=True, capture_output=True)  # a checkout, as a clone is
    start = time.perf_counter()
    repro_a = _run([str(BIN / "dvc"), "repro"], alice, _member_env(lab, "alice", lab["mlflow"]), "dvc repro")
    print(f"alice: cold dvc repro {time.perf_counter() - start:.1f} s")
    bob = lab["base"] / "bob"
    shutil.copytree(alice, bob, symlinks=True)
    params = yaml.safe_load((bob / "params.yaml").read_text())
    params["benchmark"]["merges"]["ties"] = {"top_k": 0.3}
    params["benchmark"]["merges"]["tsv_m"] = {}
    (bob / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    start = time.perf_counter()
    repro_b = _run([str(BIN / "dvc"), "repro"], bob, _member_env(lab, "bob", _with_password(lab["mlflow"], "bob")))
    print(f"bob: dvc repro with an extra merge {time.perf_counter() - start:.1f} s")
    return alice, bob, repro_a.stdout + repro_a.stderr + repro_b.stdout + repro_b.stderr


@pytest.fixture(scope="module")
def board(lab, checkouts):
    alice, _, _ = checkouts
    out = lab["base"] / "board"
    env = {**lab["env"], "MLFLOW_TRACKING_URI": lab["mlflow"]}
    printed = _run([str(BIN / "mergecal"), "report", "--lab", "--out", str(out)], alice, env,
                   "mergecal report --lab --out /srv/lab-board")
    return json.loads((out / "lab-leaderboard.json").read_text()), out, printed.stdout + printed.stderr


def _rows(document: dict, regime: str = "standard") -> dict:
    return document["leaderboard"]["clip-tiny"]["headroom8"][regime]


def test_one_board_holds_both_members_rows_with_provenance_and_distinct_labels(board):
    document, out, _ = board
    rows = _rows(document)
    assert {"ties", "ties>svc", "ties(top_k=0.3)", "ties(top_k=0.3)>svc", "tsv_m", "task_arithmetic"} <= set(rows)
    by = {recipe: row["provenance"]["user"] for recipe, row in rows.items() if "provenance" in row}
    assert by["ties"] == by["ties>svc"] == "alice"
    assert by["ties(top_k=0.3)"] == by["tsv_m"] == "bob"
    assert by["task_arithmetic"] == "alice"  # Bob's repro reused Alice's cell: one computation, hers
    source = rows["tsv_m"]["provenance"]
    assert source["host"] and source["params_sha256"] and source["code_version"] not in ("", "unknown")
    assert {s["user"] for s in document["sources"]} == {"alice", "bob"}
    assert 'title="computed by bob on ' in (out / "lab-leaderboard.html").read_text()


def test_no_false_regression_between_two_recipes(board, checkouts):
    _, out, _ = board
    regressions = (out / "lab-history.md").read_text().split("Regressions", 1)[1].split("\n## ", 1)[0]
    assert "- none" in regressions
    _, bob, _ = checkouts
    history = (bob / "reports" / "history.md").read_text()  # Bob's own report reads Alice's invocation too
    assert history.split("## Regressions", 1)[1].split("\n## ", 1)[0].strip().endswith("None.")
    assert "`ties(top_k=0.3)`" in history and "`ties`" in history  # two rows, never compared


def test_the_artifacts_live_on_the_server_not_in_a_checkout(lab, checkouts):
    alice, bob, _ = checkouts
    assert not (alice / "mlruns").exists() and not (bob / "mlruns").exists()
    stored = list((lab["base"] / "mlflow-artifacts").rglob("examples/test.json"))
    assert len(stored) >= 40  # every computed cell's per-example results, proxied by the server


def test_the_password_is_nowhere_stored_or_printed(lab, checkouts, board):
    from sqlalchemy import create_engine, text

    _, bob, printed = checkouts
    engine = create_engine(lab["database"])
    with engine.connect() as connection:
        values = [row[0] for table in ("params", "tags", "experiment_tags") for row in connection.execute(
            text(f"SELECT value FROM {table}"))]
        locations = [row[0] for row in connection.execute(text("SELECT artifact_uri FROM runs"))]
    engine.dispose()
    assert values and not [v for v in values + locations if SECRET in (v or "")]
    files = [p for folder in ("results", "reports") for p in (bob / folder).rglob("*") if p.is_file()]
    assert files and not [p for p in files if SECRET in p.read_text(errors="replace")]
    assert SECRET not in printed and SECRET not in board[2]
    # the credentials went to MLflow's basic-auth variables: the URI every file and message shows is bare
    assert json.loads((bob / "results" / "invocation.json").read_text())["tracking_uri"] == lab["mlflow"]


def test_a_deployment_on_a_work_pool_runs_on_a_worker(lab, checkouts):
    alice, _, _ = checkouts
    env = {**_member_env(lab, "alice", lab["mlflow"])}
    _run([str(BIN / "prefect"), "work-pool", "create", "gpu", "--type", "process"], alice, env,
         "prefect work-pool create gpu --type process")
    registered = _run([str(BIN / "mergecal"), "schedule", "--cron", "0 3 * * *", "--pool", "gpu"], alice, env,
                      'mergecal schedule --cron "0 3 * * *" --pool gpu')
    assert "on work pool 'gpu'" in registered.stdout
    _run([str(BIN / "prefect"), "deployment", "ls"], alice, env, "prefect deployment ls")
    _run([str(BIN / "prefect"), "deployment", "run", f"{FLOW}/{DEPLOYMENT}"], alice, env,
         f"prefect deployment run {FLOW}/{DEPLOYMENT}")
    COMMANDS.append("prefect worker start --pool gpu")
    log = lab["base"] / "worker.log"
    with open(log, "wb") as sink:  # --run-once: the test's form of the documented worker
        worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", "gpu", "--run-once"],
                                  cwd=lab["base"], env=env, stdout=sink, stderr=subprocess.STDOUT,
                                  stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        start = time.perf_counter()
        run = completed_run(lab["api"], FLOW, DEPLOYMENT, 600, worker)
        print(f"worker: rerun completed in {time.perf_counter() - start:.1f} s")
    except AssertionError as err:
        raise AssertionError(f"{err}\n--- worker log ---\n{log.read_text()[-6000:]}") from None
    finally:
        stop(worker, timeout=10)
    assert run["state_type"] == "COMPLETED"
    text = log.read_text()
    assert "rerun: dvc repro: done" in text and "rerun: git pull: skipped" in text
    from mlflow import MlflowClient

    invocation = json.loads((alice / "results" / "invocation.json").read_text())
    published = [a.path for a in MlflowClient(lab["mlflow"]).list_artifacts(invocation["parent_run_id"], "reports")]
    assert "reports/leaderboard.md" in published and "reports/history.md" in published


def test_a_served_schedule_fires_by_itself(lab, checkouts):
    alice, _, _ = checkouts
    env = _member_env(lab, "alice", lab["mlflow"])
    COMMANDS.append('mergecal schedule --interval 60 --publish-dir /srv/lab-board')
    board = lab["base"] / "published"
    log = lab["base"] / "serve.log"
    before = {r["id"] for r in _runs(lab["api"])}
    with open(log, "wb") as sink:
        serving = subprocess.Popen([str(BIN / "mergecal"), "schedule", "--interval", "60", "--publish-dir",
                                    str(board)], cwd=alice, env={**env, "PREFECT_RUNNER_POLL_FREQUENCY": "2"},
                                   stdout=sink, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                   start_new_session=True)
    try:
        deadline, fired = time.monotonic() + 420, None
        while time.monotonic() < deadline and fired is None and serving.poll() is None:
            fired = next((r for r in _runs(lab["api"], "COMPLETED") if r["id"] not in before), None)
            time.sleep(2)
        assert fired is not None, f"no scheduled run completed; runs: {_runs(lab['api'])}\n{log.read_text()[-6000:]}"
        assert fired["auto_scheduled"], fired  # created by the scheduler, not by hand
    finally:
        os.killpg(serving.pid, signal.SIGINT)
        stop(serving, timeout=20)
    assert (board / "leaderboard.md").read_text() == (alice / "reports" / "leaderboard.md").read_text()


def _runs(api_url: str, state: str | None = None) -> list[dict]:
    from lab_servers import flow_runs

    return flow_runs(api_url, FLOW, DEPLOYMENT, state)


def test_every_command_run_here_is_in_docs_lab(board):
    documented = (REPO / "docs" / "lab.md").read_text()
    missing = [c for c in COMMANDS if c not in documented]
    assert COMMANDS and not missing, missing
