"""A lab end to end (#39), every server real and on 127.0.0.1: PostgreSQL, an MLflow tracking server on it with a
proxied artifact store, a Prefect server, a process work pool with a worker. Two members' smoke checkouts (Bob's
with an extra merge and TIES at top_k 0.3, logging through a URI that carries a password) log to the one server;
the lab board holds both members' rows with their provenance and distinct labels, and no false regression; the
password is nowhere in what is stored or printed; a deployment on the work pool runs on a worker, and a served
schedule fires by itself. More machines (#40): a real Dask scheduler with workers started as on other hosts runs
the matrix through a killed worker, each cell once; a fresh clone after ``dvc pull`` computes no cell. The
commands are those of docs/lab.md (checked at the end)."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
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
    return document["leaderboard"]["mergecal"]["clip-tiny"]["headroom8"][regime]


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


# --- more machines (#40) ------------------------------------------------------------------------------------------

BLOCK_MERGECAL = '''"""Dask worker preload: this worker cannot import mergecal (a host without the project)."""
import sys


class _NoMergecal:
    def find_spec(self, name, path=None, target=None):
        if name == "mergecal" or name.startswith("mergecal."):
            raise ModuleNotFoundError(f"No module named {name!r}")


sys.meta_path.insert(0, _NoMergecal())
'''


def _cell_runs(mlflow_url: str, experiment: str) -> list:
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_url)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return []
    return client.search_runs([found.experiment_id], filter_string="tags.`mergecal.kind` = 'cell'", max_results=5000)


def test_cells_split_across_dask_workers_of_other_hosts_and_survive_a_killed_one(lab, checkouts):
    """A real Dask scheduler and three workers, each started in its own directory without PYTHONPATH: A reads the
    flow's checkout (a shared file system), B its own clone (MERGECAL_ROOT), C cannot import mergecal. C is left
    out in one line; A is killed with SIGKILL after its first cells, then the tracking server the flow logs to is
    stopped and started again (a second MLflow server over the lab's database, on one port); every cell is
    computed exactly once, none is left RUNNING, with the results the threads runner gave."""
    from lab_servers import dask_scheduler, dask_worker, free_port, mlflow_server

    alice, _, _ = checkouts
    base = lab["base"] / "cluster"
    carol = base / "carol"  # the flow's checkout, the lab's matrix logged to a new experiment
    shutil.copytree(alice, carol, symlinks=True)
    clone = base / "host-b" / "checkout"  # another host's clone of the same commit, after dvc pull
    shutil.copytree(alice, clone, symlinks=True)
    (base / "no_mergecal.py").write_text(BLOCK_MERGECAL)
    with dask_scheduler(base / "scheduler") as address, \
            dask_worker(address, base / "host-a", "A") as worker_a, \
            dask_worker(address, base / "host-b", "B", MERGECAL_ROOT=str(clone)), \
            dask_worker(address, base / "host-c", "C", preload=base / "no_mergecal.py"):
        from distributed import Client

        with Client(address, timeout=30) as client:
            client.wait_for_workers(3, timeout=60)
        params = yaml.safe_load((carol / "params.yaml").read_text())
        params["tracking"]["experiment"] = "cluster"
        params["runner"].update(kind="dask", address=address, max_workers=2)
        (carol / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        port = free_port()
        server = contextlib.ExitStack()
        restartable = server.enter_context(mlflow_server(lab["database"], lab["base"] / "mlflow-artifacts",
                                                         log_path=base / "mlflow-restartable.log", port=port))
        env = _member_env(lab, "carol", restartable)
        COMMANDS.extend(["dask scheduler --host 127.0.0.1 --port 8786", "dask worker tcp://SCHEDULER:8786 --nthreads 1",
                         "MERGECAL_ROOT=/data/mergecal dask worker tcp://SCHEDULER:8786 --nthreads 1",
                         "python -m flows.benchmark"])
        log = base / "flow.log"
        with open(log, "wb") as sink:
            flow = subprocess.Popen([sys.executable, "-m", "flows.benchmark"], cwd=carol, env=env, stdout=sink,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            deadline = time.monotonic() + 600
            on_a = []
            while time.monotonic() < deadline and len(on_a) < 2 and flow.poll() is None:
                on_a = [r for r in _cell_runs(lab["mlflow"], "cluster")
                        if r.data.tags.get("mergecal.worker", "").endswith(f" root={carol}")]
                time.sleep(0.5)
            assert len(on_a) >= 2, f"worker A computed {len(on_a)} cells\n{log.read_text()[-4000:]}"
            os.kill(worker_a.pid, signal.SIGKILL)  # mid-matrix, most likely mid-cell
            server.close()  # the tracking server goes down while cells log to it ...
            time.sleep(3)
            server.enter_context(mlflow_server(lab["database"], lab["base"] / "mlflow-artifacts",
                                               log_path=base / "mlflow-restartable.log", port=port))  # ... and back
            assert flow.wait(timeout=900) == 0, log.read_text()[-6000:]
        finally:
            stop(flow, timeout=10)
            server.close()
    printed = log.read_text()
    left_out = [line for line in printed.splitlines() if "is left out" in line]
    assert len(left_out) == 1 and "ModuleNotFoundError" in left_out[0] and "No module named 'mergecal'" in left_out[0]
    assert "Dask worker C (tcp://127.0.0.1:" in left_out[0]  # its --name and its address
    assert "2 of 3 worker(s) run cells" in printed
    from mlflow import MlflowClient

    invocation = json.loads((carol / "results" / "invocation.json").read_text())
    recorded = MlflowClient(lab["mlflow"]).get_run(invocation["parent_run_id"]).data.tags["mergecal.left_out"]
    assert "No module named 'mergecal'" in recorded  # in MLflow too, on the invocation's run
    summary = json.loads((carol / "results" / "benchmark.json").read_text())
    assert summary["failed"] == 0
    runs = _cell_runs(lab["mlflow"], "cluster")
    ok = [r for r in runs if r.data.tags["mergecal.status"] == "ok"]
    assert not [r for r in runs if r.info.status not in ("FINISHED", "KILLED")]  # none left RUNNING
    finished = [r.data.tags["mergecal.cell_id"] for r in ok if r.info.status == "FINISHED"]
    assert sorted(finished) == sorted(row["cell_id"] for row in summary["rows"]
                                      if not row.get("skipped") and not row.get("error"))
    workers = {r.data.tags["mergecal.worker"].partition(" root=")[2] for r in ok}
    assert workers == {str(carol), str(clone)}  # both hosts computed cells
    # which worker: its --name, never only its host and checkout (two workers of one host are told apart)
    assert {r.data.tags["mergecal.worker"].split(" name=")[1].split(" ")[0] for r in ok} == {"A", "B"}
    expected = json.loads((alice / "results" / "benchmark.json").read_text())
    assert summary["rows"] == expected["rows"]  # the threads runner's results, cell for cell
    print(f"cluster: {summary['cells']} cells, {len(on_a)} on A before it was killed, "
          f"{sum(w.endswith(f' root={clone}') for w in (r.data.tags['mergecal.worker'] for r in ok))} on B")


def test_two_members_running_one_matrix_at_once_keep_one_result_per_cell(lab, checkouts):
    """Erin and Frank start the same matrix (a new experiment on the lab's server) at the same moment: a cell is
    computed by one of them, or by both with one run kept and the other deleted; never two results, and both
    summaries are the same."""
    alice, _, _ = checkouts
    members = []
    for name in ("erin", "frank"):
        root = lab["base"] / "together" / name
        shutil.copytree(alice, root, symlinks=True)
        params = yaml.safe_load((root / "params.yaml").read_text())
        params["tracking"]["experiment"] = "together"
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        members.append((root, open(root.parent / f"{name}.log", "w+")))
    flows = [subprocess.Popen([sys.executable, "-m", "flows.benchmark"], cwd=root, stdout=log, stderr=subprocess.STDOUT,
                              env=_member_env(lab, root.name, lab["mlflow"]), stdin=subprocess.DEVNULL)
             for root, log in members]
    for flow, (_, log) in zip(flows, members):
        flow.wait(timeout=900)
        log.seek(0)
        printed = log.read()
        assert flow.returncode == 0, printed[-6000:]
        # a cell both computed gives one result (Tracker.kept_metrics warns otherwise: two LLMs once loaded at once
        # in threads scored 0.125 instead of 0.1875, backbones.construction)
        assert "the same cell gave two results" not in printed, printed[-6000:]
        log.close()
    summaries = [json.loads((root / "results" / "benchmark.json").read_text()) for root, _ in members]
    assert summaries[0]["failed"] == 0 and summaries[0]["rows"] == summaries[1]["rows"]
    runs = [r for r in _cell_runs(lab["mlflow"], "together") if r.data.tags["mergecal.status"] == "ok"]
    ids = [r.data.tags["mergecal.cell_id"] for r in runs]
    assert len(ids) == len(set(ids)) == len([row for row in summaries[0]["rows"] if not row.get("skipped")])
    assert {r.info.status for r in runs} == {"FINISHED"}
    from mlflow import MlflowClient

    client = MlflowClient(lab["mlflow"])
    named = [json.loads((root / "results" / "invocation.json").read_text()) for root, _ in members]
    kept = {r.info.run_id for r in runs}
    for invocation in named:  # each member's manifest names only kept runs
        folder = lab["base"] / "manifests" / invocation["invocation_id"]
        folder.mkdir(parents=True)
        manifest = json.loads(Path(client.download_artifacts(invocation["parent_run_id"], "cells.json",
                                                             str(folder))).read_text())
        assert {c["run_id"] for c in manifest.values() if c["status"] == "ok"} == kept
    by = Counter(r.data.tags["mergecal.user"] for r in runs)
    print(f"together: {len(ids)} cells, computed by {dict(by)}, "
          f"{sum(n['cached'] for n in named)} taken from the other's runs")


def test_a_fresh_clone_after_dvc_pull_computes_no_cell(lab, checkouts):
    """A new member: git clone, dvc pull, then the benchmark against the lab's server: every cell is found there
    (0 computed) and the results are Alice's."""
    alice, _, _ = checkouts
    env = _member_env(lab, "dave", lab["mlflow"])
    remote = lab["base"] / "dvc-remote"
    git = ["git", "-c", "user.name=alice", "-c", "user.email=a@lab.invalid"]
    for args in (["dvc", "remote", "add", "-d", "lab", str(remote)], ["dvc", "push", "-q"]):
        _run([str(BIN / args[0]), *args[1:]], alice, env)
    shutil.copy2(REPO / ".gitignore", alice / ".gitignore")  # what the lab's repository versions, as in main
    for args in (["add", "-A"], ["commit", "-qm", "lab results"]):
        _run([*git, *args], alice, env)
    dave = lab["base"] / "dave"
    _run(["git", "clone", "-q", str(alice), str(dave)], lab["base"], env)
    assert not (dave / ".mergecal" / "cells").exists()  # no cell cache travels with the clone
    _run([str(BIN / "dvc"), "pull", "-q"], dave, env, "dvc pull")
    status = _run([str(BIN / "dvc"), "status"], dave, env)
    # the benchmark's summary is no cached output: the clone's repro runs the flow, which finds every cell
    done = _run([str(BIN / "dvc"), "repro", "benchmark"], dave, env)
    assert "Running stage 'benchmark'" in done.stdout and "Running stage 'pretrain'" not in done.stdout
    invocation = json.loads((dave / "results" / "invocation.json").read_text())
    summary = json.loads((dave / "results" / "benchmark.json").read_text())
    assert summary["failed"] == 0 and invocation["cached"] == summary["cells"] > 0, done.stdout[-3000:]
    assert summary["rows"] == json.loads((alice / "results" / "benchmark.json").read_text())["rows"]
    print(f"fresh clone: {summary['cells']} cells, {invocation['cached']} found in the lab's store; dvc status: "
          f"{status.stdout.strip()[:200]}")


def test_every_command_run_here_is_in_docs_lab(board):
    documented = (REPO / "docs" / "lab.md").read_text()
    missing = [c for c in COMMANDS if c not in documented]
    assert COMMANDS and not missing, missing
