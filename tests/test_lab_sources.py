"""Where a lab's results come from (#62): which worker computed a cell (its Dask ``--name`` and process, never only
its host and checkout), the lab board across every experiment of the store (identities kept apart per experiment;
an invocation that computed nothing still listed as a source), and provenance in the lab repository's own commits
(a fresh smoke workspace records ``no-commit``, never the commit of the checkout it was copied from)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import yaml

from mergecal.errors import MergecalError
from mergecal.pipeline import workers
from mergecal.pipeline.cells import Cell
from mergecal.pipeline.config import Tracking
from mergecal.pipeline.tracking import NO_COMMIT, Tracker, cell_tags, code_version, provenance, tag

REPO = Path(__file__).resolve().parents[1]
TASKS = ("a", "b")


# --- which worker ---------------------------------------------------------------------------------------------------

def test_the_worker_tag_names_host_process_and_checkout_and_a_pools_thread(tmp_path):
    assert workers.worker_name(tmp_path) == f"{workers.host()}:{os.getpid()} root={tmp_path}"
    named = []
    thread = threading.Thread(target=lambda: named.append(workers.worker_name(tmp_path)), name="cells_0")
    thread.start()
    thread.join()
    assert named == [f"{workers.host()}:{os.getpid()} thread=cells_0 root={tmp_path}"]
    assert workers.dask_worker_name() is None  # this process is no Dask worker, even with distributed imported
    import distributed  # noqa: F401

    assert workers.dask_worker_name() is None and workers.who() == workers.host()


def test_a_dask_worker_is_labelled_by_its_name_and_address():
    from mergecal.pipeline.flow import dask_worker_label

    assert dask_worker_label("tcp://127.0.0.1:4000", "w1") == "w1 (tcp://127.0.0.1:4000)"
    assert dask_worker_label("tcp://127.0.0.1:4000", 0) == "0 (tcp://127.0.0.1:4000)"  # a LocalCluster's names
    # no name of its own: Dask names the worker by its address, shown once
    assert dask_worker_label("tcp://127.0.0.1:4000", "tcp://127.0.0.1:4000") == "tcp://127.0.0.1:4000"
    assert dask_worker_label("tcp://127.0.0.1:4000", None) == "tcp://127.0.0.1:4000"


# --- provenance in the lab repository's own commits -------------------------------------------------------------

def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", "-c", "user.name=lab", "-c", "user.email=lab@example.org", *args], cwd=cwd,
                          check=True, capture_output=True, text=True).stdout.strip()


@pytest.mark.slow  # copies the pipeline and runs git init + dvc init (a few seconds)
def test_a_smoke_workspaces_runs_record_its_own_commit_never_the_source_checkouts(tmp_path):
    from mergecal.pipeline.workspace import create_workspace

    source = code_version(REPO).removesuffix("-dirty")
    workspace = create_workspace(tmp_path / "smoke", root=REPO)
    first = provenance(workspace, "0")[tag("code_version")]
    assert first == NO_COMMIT  # its first invocation: the repository has no commit yet
    _git(workspace, "add", "-A")
    _git(workspace, "commit", "-qm", "the lab's first commit")
    own = _git(workspace, "rev-parse", "--short=12", "HEAD")
    assert provenance(workspace, "0")[tag("code_version")] == own != source
    (workspace / "params.yaml").write_text((workspace / "params.yaml").read_text() + "# edited\n")
    assert provenance(workspace, "0")[tag("code_version")] == f"{own}-dirty"


def test_a_copy_inside_another_repository_is_not_taken_for_it(tmp_path):
    """A copy without git of its own (create_workspace(git=False)) in another repository's tree: that repository's
    commit is not the copy's; the version it was copied from, marked as such."""
    _git(tmp_path, "init", "-q")
    (tmp_path / "README").write_text("outer\n")
    _git(tmp_path, "add", "README")
    _git(tmp_path, "commit", "-qm", "outer")
    copy = tmp_path / "copy"
    (copy / ".mergecal").mkdir(parents=True)
    (copy / ".mergecal" / "source_version").write_text("0123456789ab\n")
    assert code_version(copy) == "copy-of-0123456789ab"
    assert code_version(tmp_path) == _git(tmp_path, "rev-parse", "--short=12", "HEAD")


# --- the lab board across experiments -------------------------------------------------------------------------------

def _cell(merge: str) -> Cell:
    return Cell(track="vision", backbone="clip-small", task_set="ts", tasks=TASKS, regime="standard", merge=merge,
                chain="{merge}", calibration="none")


def _invocation(tracker: Tracker, invocation: str, computed: dict[str, float], reused: dict[str, str] = ()) -> dict:
    """One finished invocation: ``computed`` cells ({merge: accuracy}) logged as runs, ``reused`` ({cell id: run
    id of an earlier invocation}) only in its manifest, as the flow records a cell taken from the cache."""
    parent = tracker.start_invocation(invocation, {tag("cells"): str(len(computed) + len(reused))}, {})
    manifest = {}
    for merge, accuracy in computed.items():
        n_right = round(accuracy * 20)
        examples = {t: [1.0] * n_right + [0.0] * (20 - n_right) for t in TASKS}
        metrics = {**{f"acc.{t}": n_right / 20 for t in TASKS}, "avg_acc": n_right / 20,
                   **{f"norm_acc.{t}": n_right / 20 for t in TASKS}, "avg_norm_acc": n_right / 20}
        key = f"{tracker.experiment}-{merge}-{invocation}"
        run_id = tracker.log_cell(parent_run_id=parent, invocation_id=invocation, cell_id=key,
                                  tags=cell_tags(_cell(merge)), params={}, metrics=metrics, artifacts={},
                                  examples=examples)
        manifest[key] = {"status": "ok", "run_id": run_id, "label": merge, "regime": "standard"}
    for key, run_id in dict(reused).items():
        manifest[key] = {"status": "ok", "run_id": run_id, "label": key, "regime": "standard"}
    tracker.finish_invocation(parent, manifest, {})
    return manifest


@pytest.fixture(scope="module")
def two_experiments(tmp_path_factory):  # a new MLflow store takes ~15 s here (its migrations): its tests are slow
    """One store, two experiments. ``nightly``: Alice computes ties (80) and task arithmetic; then Carol's rerun
    computes nothing (every cell reused from Alice's runs). ``smoke``: Bob computes ties (40: the same identity,
    another experiment) and TSV-M."""
    base = tmp_path_factory.mktemp("lab")
    (base / "shared").mkdir()

    def member(name: str, experiment: str, commit: str) -> Tracker:
        shared = Tracking(uri=f"sqlite:///{base}/shared/mlruns.db", artifacts=(base / "shared" / "art").as_uri(),
                          experiment=experiment)
        return Tracker.of(base / name, shared, tags={tag("user"): name, tag("host"): f"{name}-pc",
                                                     tag("code_version"): commit, tag("params_sha256"): name})

    alice = _invocation(member("alice", "nightly", "aaaaaaaaaaaa"), "inv-alice",
                        {"ties": 0.8, "task_arithmetic": 0.7})
    time.sleep(0.02)  # distinct start times
    _invocation(member("carol", "nightly", "cccccccccccc"), "inv-carol", {},
                {key: entry["run_id"] for key, entry in alice.items()})
    time.sleep(0.02)
    _invocation(member("bob", "smoke", "bbbbbbbbbbbb"), "inv-bob", {"ties": 0.4, "tsv_m": 0.5})
    return f"sqlite:///{base}/shared/mlruns.db"


def _board(uri: str, out: Path, experiments=None) -> dict:
    from mergecal.reports.lab import write_lab_reports

    write_lab_reports(uri, experiments, out)
    return json.loads((out / "lab-leaderboard.json").read_text())


@pytest.mark.slow
def test_the_board_covers_every_experiment_and_keeps_their_identities_apart(two_experiments, tmp_path):
    document = _board(two_experiments, tmp_path)
    assert document["experiments"] == ["nightly", "smoke"]  # "Default", empty, shows nowhere
    nightly = document["leaderboard"]["nightly"]["clip-small"]["ts"]["standard"]
    smoke = document["leaderboard"]["smoke"]["clip-small"]["ts"]["standard"]
    assert set(nightly) == {"ties", "task_arithmetic"} and set(smoke) == {"ties", "tsv_m"}
    # one identity in two experiments: two rows, neither the newer one hiding the other, nor compared
    assert nightly["ties"]["values"]["avg_acc"] == pytest.approx(0.8)
    assert smoke["ties"]["values"]["avg_acc"] == pytest.approx(0.4)
    assert (nightly["ties"]["provenance"]["experiment"], nightly["ties"]["provenance"]["user"]) == ("nightly", "alice")
    assert (smoke["ties"]["provenance"]["experiment"], smoke["ties"]["provenance"]["user"]) == ("smoke", "bob")
    history = (tmp_path / "lab-history.md").read_text()
    assert "No cell identity was computed more than once." in history and "- none" in history
    markdown = (tmp_path / "lab-leaderboard.md").read_text()
    assert markdown.index("## Experiment `nightly`") < markdown.index("## Experiment `smoke`")
    assert "<h2>Experiment <code>smoke</code></h2>" in (tmp_path / "lab-leaderboard.html").read_text()


@pytest.mark.slow
def test_an_invocation_that_computed_nothing_is_a_source_not_a_computation(two_experiments, tmp_path):
    document = _board(two_experiments, tmp_path)
    by = {s["invocation_id"]: s for s in document["sources"]}
    assert [s["invocation_id"] for s in document["sources"]] == ["inv-alice", "inv-carol", "inv-bob"]
    carol = by["inv-carol"]
    assert (carol["experiment"], carol["user"], carol["code_version"]) == ("nightly", "carol", "cccccccccccc")
    assert (carol["computed"], carol["reused"], carol["rows"]) == (0, 2, 0)
    assert (by["inv-alice"]["computed"], by["inv-alice"]["reused"], by["inv-alice"]["rows"]) == (2, 0, 2)
    # Alice's computations stay hers: Carol's reuse is no second computation of either identity
    rows = document["leaderboard"]["nightly"]["clip-small"]["ts"]["standard"]
    assert {r["provenance"]["user"] for r in rows.values()} == {"alice"}
    markdown = (tmp_path / "lab-leaderboard.md").read_text()
    assert "| nightly | `inv-carol` | carol | carol-pc | `cccccccccccc` |" in markdown
    assert markdown.split("| `cccccccccccc` | ", 1)[1].split("\n", 1)[0].endswith("| 0 | 2 | 0 |")
    assert "from 3 invocation(s) by alice, bob, carol, 1 of which computed nothing" in markdown


@pytest.mark.slow
def test_the_board_narrows_to_the_named_experiments_and_refuses_an_unknown_one(two_experiments, tmp_path):
    document = _board(two_experiments, tmp_path, ["smoke"])
    assert list(document["leaderboard"]) == ["smoke"] and {s["user"] for s in document["sources"]} == {"bob"}
    assert "## Experiment" not in (tmp_path / "lab-leaderboard.md").read_text()  # one experiment: plain tables
    with pytest.raises(MergecalError) as err:
        _board(two_experiments, tmp_path / "none", ["smoke", "weekly"])
    assert str(err.value) == (f"--experiment weekly: no such experiment in {two_experiments} (it has: Default, "
                              "nightly, smoke)")
    assert not (tmp_path / "none").exists()  # nothing half-written


@pytest.mark.slow
def test_the_filters_keep_sources_by_their_own_provenance(two_experiments, tmp_path):
    from mergecal.reports.lab import Filters, write_lab_reports

    for filters, expected in ((Filters(user="alice"), ["inv-alice"]), (Filters(commit="bbbb"), ["inv-bob"]),
                              (Filters(track="vision"), ["inv-alice", "inv-carol", "inv-bob"])):
        write_lab_reports(two_experiments, None, tmp_path, filters)
        document = json.loads((tmp_path / "lab-leaderboard.json").read_text())
        assert [s["invocation_id"] for s in document["sources"]] == expected, filters


@pytest.mark.slow
def test_report_lab_reads_every_experiment_or_the_repeated_experiment_option(two_experiments, tmp_path, monkeypatch,
                                                                             capsys):
    from mergecal.cli import main

    monkeypatch.setenv("MLFLOW_TRACKING_URI", two_experiments)
    assert main(["report", "--root", str(REPO), "--lab", "--out", str(tmp_path / "all")]) == 0
    assert json.loads((tmp_path / "all" / "lab-leaderboard.json").read_text())["experiments"] == ["nightly", "smoke"]
    assert main(["report", "--root", str(REPO), "--lab", "--experiment", "smoke", "--experiment", "nightly", "--out",
                 str(tmp_path / "two")]) == 0
    assert json.loads((tmp_path / "two" / "lab-leaderboard.json").read_text())["experiments"] == ["nightly", "smoke"]
    capsys.readouterr()
    assert main(["report", "--root", str(REPO), "--experiment", "smoke"]) == 2
    assert capsys.readouterr().err.strip() == "mergecal: error: --experiment: a filter of the lab board; add --lab"


# --- which worker, on a real Dask cluster --------------------------------------------------------------------------

BLOCK_MERGECAL = '''"""Dask worker preload: this worker cannot import mergecal."""
import sys


class _NoMergecal:
    def find_spec(self, name, path=None, target=None):
        if name == "mergecal" or name.startswith("mergecal."):
            raise ModuleNotFoundError(f"No module named {name!r}")


sys.meta_path.insert(0, _NoMergecal())
'''


@pytest.mark.slow  # a vision smoke workspace built in process, a Prefect server, a Dask scheduler and 3 workers
def test_cells_computed_on_two_named_dask_workers_of_one_host_name_their_worker(tmp_path):
    """Two workers of one host, one checkout (the flow's): each cell's run names the worker that computed it by its
    --name and process; a third worker that cannot import mergecal is left out by name and address."""
    from lab_servers import dask_scheduler, dask_worker, prefect_env, prefect_server
    from mlflow import MlflowClient

    from mergecal.pipeline.config import load_params
    from mergecal.pipeline.tracks.clip.built import stages as vision
    from mergecal.pipeline.workspace import create_workspace

    root = create_workspace(tmp_path / "ws", root=REPO, git=False)
    data = yaml.safe_load((root / "params.yaml").read_text())
    data["text"]["enabled"] = data["llm"]["enabled"] = False
    data["vision"]["regimes"] = ["standard"]
    data["benchmark"]["merges"] = {"task_arithmetic": {"scaling": [0.3, 1.0]}, "ties": {}}
    data["benchmark"]["chains"], data["benchmark"]["fixed_scaling"] = ["{merge}"], []
    (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
    params = load_params(root / "params.yaml")
    vision.build_data(params, root, progress=False)
    vision.pretrain(params, root, progress=False)
    for task, variant in vision.finetune_runs(params.vision):
        vision.finetune(params, task, variant, root, progress=False)
    vision.multitask(params, root, progress=False)  # the standard regime's multi-task reference
    vision.task_vectors(params, root)
    (tmp_path / "no_mergecal.py").write_text(BLOCK_MERGECAL)
    with prefect_server(tmp_path / "prefect-home") as api_url, \
            dask_scheduler(tmp_path / "scheduler") as address, \
            dask_worker(address, tmp_path / "host-1", "w1"), dask_worker(address, tmp_path / "host-2", "w2"), \
            dask_worker(address, tmp_path / "host-3", "w3", preload=tmp_path / "no_mergecal.py"):
        from distributed import Client

        with Client(address, timeout=30) as client:
            client.wait_for_workers(3, timeout=60)
        data["runner"] = {**data["runner"], "kind": "dask", "address": address, "max_workers": 2}
        (root / "params.yaml").write_text(yaml.safe_dump(data, sort_keys=False))
        env = prefect_env(api_url, tmp_path / "prefect-home",
                          PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
        env.pop("MLFLOW_TRACKING_URI", None)
        done = subprocess.run([sys.executable, "-m", "flows.benchmark"], cwd=root, env=env, capture_output=True,
                              text=True, timeout=900, stdin=subprocess.DEVNULL)
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-6000:]
    left_out = [line for line in printed.splitlines() if "is left out" in line]
    assert len(left_out) == 1 and f"Dask worker w3 ({address.rsplit(':', 1)[0]}:" in left_out[0], printed[-4000:]
    running = [line for line in printed.splitlines() if "2 of 3 worker(s) run cells: " in line]
    # listed by address: which of the two comes first depends on their ports
    assert len(running) == 1 and "w1 (tcp://" in running[0] and "w2 (tcp://" in running[0], printed[-4000:]
    client = MlflowClient(f"sqlite:///{root / 'mlruns' / 'mlruns.db'}")
    experiment = client.get_experiment_by_name("mergecal")
    runs = client.search_runs([experiment.experiment_id], "tags.`mergecal.kind` = 'cell' and "
                              "tags.`mergecal.status` = 'ok'", max_results=100)
    tags = [r.data.tags[tag("worker")] for r in runs]
    assert len(runs) >= 2 and all(t.endswith(f" root={root}") for t in tags), tags
    names = {t.split(" name=")[1].split(" ")[0] for t in tags}
    assert names == {"w1", "w2"}, tags  # both workers computed cells, each named
    processes = {t.split(" ")[0] for t in tags}
    assert len(processes) == 2 and all(p.startswith(f"{workers.host()}:") for p in processes)  # one host, 2 pids
    recorded = client.get_run(runs[0].data.tags["mlflow.parentRunId"]).data.tags[tag("left_out")]
    assert recorded.startswith("w3 (tcp://") and "No module named 'mergecal'" in recorded
