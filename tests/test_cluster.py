"""Cells across machines (#40), the parts that need no cluster: what a worker checks before it runs a cell (its
checkout, its inputs and code, the flow's store), GPU leases per host (tests/test_devices.py), one result per cell
id when two members compute it at once, RUNNING runs cleaned up only where they are this checkout's, and one line
when the Prefect server is not there. The cluster itself: tests/test_lab_e2e.py."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab_servers import free_port
from mergecal.errors import MergecalError
from mergecal.pipeline import workers
from mergecal.pipeline.cells import Cell
from mergecal.pipeline.config import Tracking
from mergecal.pipeline.tracking import Tracker, tag, tracking_uri
from mergecal.pipeline.workspace import create_workspace

REPO = Path(__file__).resolve().parents[1]
CELL = Cell(track="vision", backbone="b", task_set="s", tasks=("a", "b"), regime="standard", merge="ties",
            chain="{merge}", recipe="ties")


def _store(tmp_path: Path) -> str:
    return f"sqlite:///{tmp_path / 'shared.db'}"


def _log(tracker: Tracker, cell_id: str, invocation: str = "i1") -> str:
    return tracker.log_cell(parent_run_id="", invocation_id=invocation, cell_id=cell_id, tags={}, params={},
                            metrics={"avg_acc": 0.5}, artifacts={})


# --- the worker's checks ------------------------------------------------------------------------------------------

def test_the_worker_reads_its_own_checkout_or_the_flows(tmp_path, monkeypatch):
    flow_root = tmp_path / "flow"
    flow_root.mkdir()
    (flow_root / "params.yaml").write_text("seed: 0\n")
    monkeypatch.delenv(workers.ROOT_ENV, raising=False)
    assert workers.worker_root(str(flow_root)) == flow_root.resolve()
    own = tmp_path / "clone"
    monkeypatch.setenv(workers.ROOT_ENV, str(own))
    with pytest.raises(workers.WorkerSetupError) as err:
        workers.worker_root(str(flow_root))
    assert str(err.value) == (f"worker {workers.host()}: no checkout at MERGECAL_ROOT={own} (no params.yaml); set "
                              "MERGECAL_ROOT in the worker's environment to its clone of the lab's repository (after "
                              "dvc pull)")
    own.mkdir()
    (own / "params.yaml").write_text("seed: 0\n")
    assert workers.worker_root(str(flow_root)) == own.resolve()


def test_a_worker_with_other_inputs_or_code_runs_nothing(tmp_path, monkeypatch):
    """The worker's own cell id is the proof: another id, or inputs it cannot read, is one line and no run."""
    monkeypatch.setattr(workers, "cell_id", lambda cell, params, root, source: "0" * 20)
    workers.check_cell(CELL, None, tmp_path, "0" * 20, None)
    with pytest.raises(workers.WorkerSetupError, match=rf"worker .*: cell ties \(standard\): inputs or code under "
                       rf"{tmp_path} differ from the flow's \(cell id 0{{20}} here, 1{{20}} in the flow\)"):
        workers.check_cell(CELL, None, tmp_path, "1" * 20, None)

    def missing(cell, params, root, source):
        return open(root / "models" / "missing.safetensors", "rb")

    monkeypatch.setattr(workers, "cell_id", missing)
    with pytest.raises(workers.WorkerSetupError, match=r"cannot read its inputs under .*: .*missing.safetensors: No "
                       r"such file or directory; dvc pull in the worker's checkout"):
        workers.check_cell(CELL, None, tmp_path, "1" * 20, None)


def test_the_checkouts_own_sqlite_store_is_refused_where_it_is_not(tmp_path):
    flow_root = tmp_path / "elsewhere"  # the flow's host: a path this worker does not have
    uri = tracking_uri(flow_root, "mlruns")
    with pytest.raises(workers.WorkerSetupError, match="is a file this worker does not see; cells on other hosts "
                       "need a tracking server"):
        workers.cell_tracker(str(flow_root), Tracking(), uri, None)
    assert not flow_root.exists()  # nothing created on the way
    with pytest.raises(workers.WorkerSetupError, match=r"the flow logs to postgresql://lab:\*\*\*@db/mlflow, this "
                       "worker's MLFLOW_TRACKING_URI / tracking.uri name"):
        workers.cell_tracker(str(tmp_path), Tracking(), "postgresql://lab:***@db/mlflow", None)
    (tmp_path / "shared.db").touch()  # a database file this worker sees (one host): used as the flow names it
    shared = workers.cell_tracker(str(tmp_path), Tracking(artifacts=(tmp_path / "a").as_uri()), _store(tmp_path), None)
    assert shared.uri == _store(tmp_path)


# --- one result per cell id -----------------------------------------------------------------------------------------

def test_two_members_computing_one_cell_keep_one_result(tmp_path, monkeypatch):
    artifacts = (tmp_path / "artifacts").as_uri()
    alice = Tracker(tmp_path, uri=_store(tmp_path), artifacts=artifacts, tags={tag("user"): "alice"})
    bob = Tracker(tmp_path, uri=_store(tmp_path), artifacts=artifacts, tags={tag("user"): "bob"})
    kept = _log(alice, "c1")
    assert _log(bob, "c1") == kept  # found by log_cell's lookup: never logged twice
    # the race that lookup cannot see: both looked before either finished. Bob's run ends after Alice's: it is
    # deleted, and Bob's invocation names Alice's run
    real, calls = bob.finished_cell_run, []

    def missed_once(cell_id, status="ok"):  # log_cell's lookup before computing missed Alice's run
        calls.append(cell_id)
        return None if len(calls) == 1 else real(cell_id, status)

    monkeypatch.setattr(bob, "finished_cell_run", missed_once)
    assert _log(bob, "c1") == kept and len(calls) == 2
    runs = alice.client.search_runs([alice.experiment_id], filter_string=f"tags.`{tag('cell_id')}` = 'c1'")
    assert [r.info.run_id for r in runs] == [kept]
    deleted = alice.client.search_runs([alice.experiment_id], run_view_type=2,  # ViewType.DELETED_ONLY
                                       filter_string=f"tags.`{tag('cell_id')}` = 'c1'")
    assert [r.data.tags[tag("user")] for r in deleted] == ["bob"]


def test_a_member_whose_run_was_not_kept_reports_the_kept_result_and_warns_when_it_differs(tmp_path, caplog):
    """The summary shows the board's result: the kept run's metrics (seconds included), not this computation's;
    a result that differs from it is a warning naming the cell (the lab test caught an LLM cell scored 0.1875 by
    one member and 0.125 by the other: two models loaded at once in threads, backbones.construction)."""
    artifacts = (tmp_path / "artifacts").as_uri()
    alice = Tracker(tmp_path, uri=_store(tmp_path), artifacts=artifacts, tags={tag("user"): "alice"})
    bob = Tracker(tmp_path, uri=_store(tmp_path), artifacts=artifacts, tags={tag("user"): "bob"})
    kept = alice.log_cell(parent_run_id="", invocation_id="i1", cell_id="c1", tags={}, params={}, artifacts={},
                          metrics={"avg_acc": 0.1875, "acc.a": float("nan"), "seconds": 3.0})
    with caplog.at_level("WARNING", logger="mergecal.pipeline.tracking"):
        same = bob.kept_metrics("c1", kept, {"avg_acc": 0.1875, "acc.a": float("nan")})
    warned = [r.getMessage() for r in caplog.records if r.name == "mergecal.pipeline.tracking"]
    assert same["avg_acc"] == 0.1875 and same["seconds"] == 3.0 and not warned  # NaN equals NaN here
    caplog.clear()
    with caplog.at_level("WARNING", logger="mergecal.pipeline.tracking"):
        other = bob.kept_metrics("c1", kept, {"avg_acc": 0.125, "acc.a": float("nan")})
    assert other["avg_acc"] == 0.1875
    assert [r.getMessage() for r in caplog.records if r.name == "mergecal.pipeline.tracking"] == [
        f"cell c1: computed here with {{'avg_acc': 0.125}}, but the run kept for it ({kept}) holds "
        "{'avg_acc': 0.1875}: the same cell gave two results"]


def test_only_this_checkouts_unfinished_runs_are_killed_in_a_shared_store(tmp_path):
    artifacts = (tmp_path / "artifacts").as_uri()
    mine = Tracker(tmp_path, uri=_store(tmp_path), artifacts=artifacts,
                   tags={tag("host"): workers.host(), tag("checkout"): str((tmp_path / "mine").resolve())})
    other = Tracker(tmp_path, uri=_store(tmp_path), artifacts=artifacts,
                    tags={tag("host"): workers.host(), tag("checkout"): str((tmp_path / "other").resolve())})
    left = mine.client.create_run(mine.experiment_id, tags=mine.tags).info.run_id
    running = other.client.create_run(other.experiment_id, tags=other.tags).info.run_id  # a colleague's
    assert mine.mark_unfinished_killed(tmp_path / "mine") == 1
    assert mine.client.get_run(left).info.status == "KILLED"
    assert mine.client.get_run(running).info.status == "RUNNING"
    # at an invocation's end: its cell runs a dead worker left RUNNING
    dead = mine.client.create_run(mine.experiment_id, tags={tag("invocation_id"): "i9", tag("kind"): "cell"})
    assert mine.kill_unfinished_cells("i9") == 1 and mine.kill_unfinished_cells("i9") == 0
    assert mine.client.get_run(dead.info.run_id).info.status == "KILLED"
    assert mine.client.get_run(running).info.status == "RUNNING"


def test_the_checkouts_own_store_is_cleaned_whole(tmp_path):
    own = Tracker(tmp_path)
    run = own.client.create_run(own.experiment_id, tags={tag("host"): "another-host"}).info.run_id
    assert own.mark_unfinished_killed(tmp_path) == 1  # one checkout's store: whatever is RUNNING was killed
    assert own.client.get_run(run).info.status == "KILLED"


# --- the Prefect server -------------------------------------------------------------------------------------------

def test_no_prefect_server_at_start_is_one_line_and_nothing_written(tmp_path):
    root = create_workspace(tmp_path / "ws", root=REPO, git=False)
    url = f"http://127.0.0.1:{free_port()}/api"
    env = {**os.environ, "PREFECT_API_URL": url}
    done = subprocess.run([sys.executable, "-m", "stages.benchmark"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-3000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: benchmark: no Prefect server answers at "
                                                   f"PREFECT_API_URL={url} (")
    assert not (root / "results").exists() and not (root / "mlruns").exists()


def test_the_flow_is_importable_without_the_checkout_on_the_path(tmp_path):
    """What a Dask or Prefect worker on another host does: import the flow by module name, from anywhere."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run([sys.executable, "-c", "import mergecal.pipeline.flow as f; print(f.compute_cell.name)"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "cell", done.stderr[-2000:]


def test_mergecal_error_is_not_retried_on_the_same_worker():
    from prefect.states import Failed

    from mergecal.pipeline.flow import _retry_unless_setup

    def failed(error):
        return Failed(data=error)

    assert _retry_unless_setup(None, None, failed(workers.WorkerSetupError("no checkout"))) is False
    assert _retry_unless_setup(None, None, failed(OSError("connection reset"))) is True
    assert issubclass(workers.WorkerSetupError, MergecalError)  # one line at the command line too


def test_preflight_names_a_server_the_worker_cannot_reach(tmp_path):
    dead = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(workers.WorkerSetupError, match=rf"worker .*: cannot reach the flow's Prefect server at "
                       rf"{dead}/api \("):
        workers.preflight(f"{dead}/api", _store(tmp_path))
    with pytest.raises(workers.WorkerSetupError, match=rf"cannot reach the flow's MLflow tracking server at {dead} "):
        workers.preflight(None, dead)
    with pytest.raises(workers.WorkerSetupError, match="is a file this worker does not see"):
        workers.preflight(None, _store(tmp_path))
    (tmp_path / "shared.db").touch()
    assert workers.preflight(None, _store(tmp_path))["host"] == workers.host()


def test_a_cells_lookup_filters_on_a_tag_keyed_by_its_id(tmp_path):
    """``mergecal.cell.<id>`` (value: the status) is what a lookup reads, an index lookup in MLflow's tags table
    (keyed by key and run); the ``cell_id`` tag's value alone, which every run's would be read for, finds nothing."""
    from mergecal.pipeline.tracking import cell_key

    artifacts = (tmp_path / "artifacts").as_uri()
    tracker = Tracker(tmp_path, uri=_store(tmp_path), artifacts=artifacts)
    kept = _log(tracker, "c1")
    assert tracker.client.get_run(kept).data.tags[cell_key("c1")] == "ok"
    assert tracker.finished_cell_run("c1") == kept and tracker.finished_cell_run("c1", "skipped") is None
    # a run with the cell_id tag but no keyed tag (as no writer of this library leaves) is not found
    parent = tracker.start_invocation("i2", {}, {})
    tracker.client.create_run(tracker.experiment_id, tags={"mlflow.parentRunId": parent, tag("kind"): "cell",
                                                           tag("cell_id"): "c2", tag("status"): "ok"})
    assert tracker.finished_cell_run("c2") is None
    # a cell killed while RUNNING: both status tags say so
    running = tracker.client.create_run(tracker.experiment_id, tags={tag("kind"): "cell", tag("cell_id"): "c3",
                                                                     tag("invocation_id"): "i3",
                                                                     cell_key("c3"): "ok", tag("status"): "ok"})
    assert tracker.kill_unfinished_cells("i3") == 1
    tags = tracker.client.get_run(running.info.run_id).data.tags
    assert tags[cell_key("c3")] == tags[tag("status")] == "killed"
