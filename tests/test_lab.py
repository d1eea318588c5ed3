"""A lab's shared use (#39): the tracking URI (MLFLOW_TRACKING_URI, tracking.uri), provenance on every run, labels
that name every non-default hyperparameter, the lab-wide board with its filters and like-with-like history, secrets
kept out of what is stored, and the scheduled rerun's steps on a git checkout."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

from mergecal.errors import MergecalError, ParameterError
from mergecal.pipeline.cells import Cell
from mergecal.pipeline.config import Tracking, parse_params
from mergecal.pipeline.tracking import Tracker, cell_tags, provenance, redact, resolve_uri, tag, tracking_uri
from mergecal.recipe import Recipe
from mergecal.reports.labels import qualified_label, qualified_merge

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("a", "b")


# --- the tracking URI ------------------------------------------------------------------------------------------

def test_the_store_is_the_env_then_the_param_then_the_checkouts_own(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert resolve_uri(tmp_path, Tracking()) == tracking_uri(tmp_path, "mlruns") == \
        f"sqlite:///{tmp_path.resolve()}/mlruns/mlruns.db"
    assert resolve_uri(tmp_path, Tracking(uri="http://127.0.0.1:5999")) == "http://127.0.0.1:5999"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5998")
    assert resolve_uri(tmp_path, Tracking(uri="http://127.0.0.1:5999")) == "http://127.0.0.1:5998"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "ftp://lab:hunter2@host/x")
    with pytest.raises(MergecalError) as err:
        resolve_uri(tmp_path, Tracking())
    assert str(err.value).startswith("MLFLOW_TRACKING_URI=ftp://lab:***@host/x: expected a tracking server")
    assert "hunter2" not in str(err.value)


def test_a_bad_tracking_uri_param_is_one_line_without_the_password():
    with pytest.raises(ParameterError) as err:
        parse_params({"tracking": {"uri": "ftp://lab:hunter2@host/x"}}, "params")
    assert "tracking.uri" in str(err.value) and "hunter2" not in str(err.value)
    assert "\n" not in str(err.value)


def test_redact_hides_only_the_password():
    assert redact("postgresql+psycopg://bob:s3cret@db.lab:5432/mlflow") == "postgresql+psycopg://bob:***@db.lab:5432/mlflow"
    assert redact("http://alice:pw@mlflow.lab:5000/") == "http://alice:***@mlflow.lab:5000/"
    assert redact("http://127.0.0.1:5000") == "http://127.0.0.1:5000"
    assert redact("sqlite:////abs/mlruns.db") == "sqlite:////abs/mlruns.db"


def test_a_server_uris_credentials_go_to_mlflows_own_variables(tmp_path, monkeypatch):
    for name in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.setenv(name, "")  # recorded, so what resolve_uri sets is undone after the test
        monkeypatch.delenv(name)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://bob:s3cr%40t@127.0.0.1:5999/")
    assert resolve_uri(tmp_path, Tracking()) == "http://127.0.0.1:5999/"
    import os

    assert (os.environ["MLFLOW_TRACKING_USERNAME"], os.environ["MLFLOW_TRACKING_PASSWORD"]) == ("bob", "s3cr@t")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://eve:other@127.0.0.1:5999/")
    resolve_uri(tmp_path, Tracking())  # variables the user set stay as they are
    assert os.environ["MLFLOW_TRACKING_USERNAME"] == "bob"
    db = "postgresql+psycopg://bob:pw@127.0.0.1/mlflow"  # a database URI keeps its password (the driver's)
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert resolve_uri(tmp_path, Tracking(uri=db, artifacts="file:///x")) == db


def test_a_database_uri_needs_an_artifact_location(tmp_path):
    with pytest.raises(MergecalError, match="a database URI needs tracking.artifacts"):
        Tracker(tmp_path, uri=f"sqlite:///{tmp_path}/shared.db")


def test_two_checkouts_share_one_database_store_and_its_artifact_location(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    shared = Tracking(uri=f"sqlite:///{tmp_path}/shared/mlruns.db", artifacts=(tmp_path / "shared" / "art").as_uri())
    (tmp_path / "shared").mkdir()
    one = Tracker.of(tmp_path / "a", shared, tags={tag("user"): "alice"})
    two = Tracker.of(tmp_path / "b", shared, tags={tag("user"): "bob"})
    assert one.experiment_id == two.experiment_id and one.uri == two.uri
    assert not (tmp_path / "a" / "mlruns").exists()  # nothing in the checkout
    runs = [tracker.start_invocation(f"inv-{i}", {}, {}) for i, tracker in enumerate((one, two))]
    users = {one.client.get_run(r).data.tags[tag("user")] for r in runs}
    assert users == {"alice", "bob"}


def test_a_server_experiment_whose_artifacts_live_on_one_client_is_refused(tmp_path):
    from mergecal.pipeline import tracking

    class Found:
        experiment_id, artifact_location = "1", "file:///home/alice/mlruns/artifacts"

    class Client:
        def __init__(self, tracking_uri):
            pass

        def get_experiment_by_name(self, name):
            return Found()

    import mlflow.tracking

    original = mlflow.tracking.MlflowClient
    mlflow.tracking.MlflowClient = Client
    try:
        with pytest.raises(MergecalError, match="a path only the client that created it has"):
            tracking.Tracker(tmp_path, uri="http://127.0.0.1:5999")
    finally:
        mlflow.tracking.MlflowClient = original


def test_provenance_names_user_host_commit_and_params(tmp_path):
    tags = provenance(ROOT, "f" * 64)
    assert set(tags) == {tag(n) for n in ("user", "host", "code_version", "params_sha256", "checkout")}
    assert tags[tag("checkout")] == str(ROOT.resolve())
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert tags[tag("code_version")].startswith(head)
    # a copy without git history names the version it was copied from, marked as no commit of its own
    # (tests/test_lab_sources.py: a smoke workspace, a git repository, never does)
    copy = tmp_path / "copy"
    (copy / ".mergecal").mkdir(parents=True)
    (copy / ".mergecal" / "source_version").write_text("0123456789ab-dirty\n")
    assert provenance(copy, "0")[tag("code_version")] == "copy-of-0123456789ab-dirty"
    assert provenance(tmp_path, "0")[tag("code_version")] == "unknown"


# --- labels -----------------------------------------------------------------------------------------------------

def _recipe(text: str) -> str:
    return Recipe.parse(text).id


@pytest.mark.parametrize("label, recipe, expected", [
    ("ties", "ties(top_k=0.2)", "ties"),  # every value its default
    ("ties", "ties(top_k=0.3)", "ties(top_k=0.3)"),
    ("ties>svc", "ties(top_k=0.3,scaling=0.7)>svc", "ties(top_k=0.3)>svc"),  # the scaling is the protocol's
    ("tsv_m>svc", "tsv_m>svc", "tsv_m>svc"),  # SVC's alpha as the recipe fills it in after TSV-M: a default
    ("tsv_m>svc", "tsv_m>svc(alpha=0.5)", "tsv_m>svc(alpha=0.5)"),
    ("task_arithmetic>dsc", "task_arithmetic>dsc", "task_arithmetic>dsc"),
    ("task_arithmetic>dsc", "task_arithmetic>wsc(projection='least_squares')>fsc",
     "task_arithmetic>dsc(wsc.projection='least_squares')"),
    ("ties>svc(calibrate_at=chosen_scaling)", "ties>svc(calibrate_at='chosen_scaling')",
     "ties>svc(calibrate_at=chosen_scaling)"),  # what the chain names is not repeated
    ("task_arithmetic(scaling=0.3)>wsc", "task_arithmetic(scaling=0.3)>wsc", "task_arithmetic(scaling=0.3)>wsc"),
    ("zeroshot", "", "zeroshot"),
])
def test_a_label_names_every_non_default_hyperparameter(label, recipe, expected):
    assert qualified_label(label, _recipe(recipe) if recipe else "") == expected


def test_the_qualified_merge_is_the_base_of_its_calibrated_rows():
    rid = _recipe("ties(top_k=0.3)>svc")
    assert qualified_merge("ties", "ties>svc", rid) == "ties(top_k=0.3)"
    assert qualified_merge("ties", "ties>svc", _recipe("ties>svc")) == "ties"
    assert qualified_merge("task_arithmetic", "task_arithmetic(scaling=0.3)>wsc",
                           _recipe("task_arithmetic(scaling=0.3)>wsc")) == "task_arithmetic"


# --- a store with two members' checkouts --------------------------------------------------------------------------

def _cell(merge: str, chain: str = "{merge}", regime: str = "standard", track: str = "vision",
          backbone: str = "clip-small") -> Cell:
    calibration = chain.replace("{merge}>", "").replace("{merge}", "") or "none"
    return Cell(track=track, backbone=backbone, task_set="ts", tasks=TASKS, regime=regime, merge=merge, chain=chain,
                calibration=calibration)


def _log(tracker: Tracker, parent: str, invocation: str, cell: Cell, recipe_id: str, accuracy: float) -> dict:
    """One computed cell: its run with the cell's tags and per-example results (20 examples a task)."""
    n_right = round(accuracy * 20)
    examples = {t: [1.0] * n_right + [0.0] * (20 - n_right) for t in TASKS}
    metrics = {**{f"acc.{t}": n_right / 20 for t in TASKS}, "avg_acc": n_right / 20,
               **{f"norm_acc.{t}": n_right / 20 for t in TASKS}, "avg_norm_acc": n_right / 20}
    key = hashlib.sha256(f"{invocation}-{cell.regime}-{cell.label}-{recipe_id}".encode()).hexdigest()[:16]
    tags = {**cell_tags(cell), tag("recipe_id"): recipe_id}
    run_id = tracker.log_cell(parent_run_id=parent, invocation_id=invocation, cell_id=key, tags=tags, params={},
                              metrics=metrics, artifacts={}, examples=examples)
    return {key: {"status": "ok", "run_id": run_id, "cached": False, "label": cell.label, "regime": cell.regime}}


def _invocation(tracker: Tracker, invocation: str, cells: list[tuple[Cell, str, float]]) -> None:
    parent = tracker.start_invocation(invocation, {tag("cells"): str(len(cells))}, {})
    manifest = {}
    for cell, recipe, accuracy in cells:
        manifest.update(_log(tracker, parent, invocation, cell, _recipe(recipe) if recipe else "", accuracy))
    tracker.finish_invocation(parent, manifest, {})


def _member(root: Path, shared: Tracking, user: str, commit: str) -> Tracker:
    return Tracker.of(root, shared, tags={tag("user"): user, tag("host"): f"{user}-pc", tag("code_version"): commit,
                                          tag("params_sha256"): f"{user}-params"})


@pytest.fixture(scope="module")
def lab_store(tmp_path_factory):
    """Alice runs ties (default top_k) and task arithmetic; Bob, later, ties with top_k 0.3 (worse) and TSV-M, and
    reruns task arithmetic at a newer commit (worse by 10 points: a true regression of one identity)."""
    import time

    base = tmp_path_factory.mktemp("lab")
    (base / "shared").mkdir()
    shared = Tracking(uri=f"sqlite:///{base}/shared/mlruns.db", artifacts=(base / "shared" / "art").as_uri())
    alice = _member(base / "alice", shared, "alice", "aaaaaaaaaaaa")
    _invocation(alice, "inv-alice", [(_cell("zeroshot"), "", 0.3), (_cell("finetuned"), "", 0.95),
                                     (_cell("ties"), "ties", 0.8), (_cell("ties", "{merge}>svc"), "ties>svc", 0.85),
                                     (_cell("task_arithmetic"), "task_arithmetic(scaling=0.3)", 0.7)])
    time.sleep(0.02)  # distinct start times
    bob = _member(base / "bob", shared, "bob", "bbbbbbbbbbbb-dirty")
    _invocation(bob, "inv-bob", [(_cell("ties"), "ties(top_k=0.3)", 0.6),
                                 (_cell("ties", "{merge}>svc"), "ties(top_k=0.3)>svc", 0.65),
                                 (_cell("tsv_m"), "tsv_m", 0.75),
                                 (_cell("task_arithmetic"), "task_arithmetic(scaling=0.3)", 0.6)])
    return shared.uri


@pytest.fixture(scope="module")
def lab_board(lab_store, tmp_path_factory):
    from mergecal.reports.lab import write_lab_reports

    out = tmp_path_factory.mktemp("board")
    return out, write_lab_reports(lab_store, "mergecal", out)


def _rows(document: dict, experiment: str = "mergecal") -> dict:
    return document["leaderboard"][experiment]["clip-small"]["ts"]["standard"]


def test_the_lab_board_holds_both_members_rows_with_distinct_labels(lab_board):
    out, written = lab_board
    assert set(written) == {"lab-leaderboard.md", "lab-leaderboard.html", "lab-leaderboard.json", "lab-history.md"}
    rows = _rows(json.loads((out / "lab-leaderboard.json").read_text()))
    assert set(rows) == {"zeroshot", "finetuned", "ties", "ties>svc", "ties(top_k=0.3)", "ties(top_k=0.3)>svc",
                         "tsv_m", "task_arithmetic"}
    assert rows["ties"]["values"]["avg_acc"] == pytest.approx(0.8)
    assert rows["ties(top_k=0.3)"]["values"]["avg_acc"] == pytest.approx(0.6)
    # each calibrated row against the base merge of its own variant
    assert rows["ties>svc"]["delta_points"]["avg_acc"] == pytest.approx(5.0)
    assert rows["ties(top_k=0.3)>svc"]["delta_points"]["avg_acc"] == pytest.approx(5.0)
    # the newest computation of an identity is shown: Bob's task arithmetic
    assert rows["task_arithmetic"]["values"]["avg_acc"] == pytest.approx(0.6)
    assert rows["task_arithmetic"]["provenance"]["user"] == "bob"


def test_each_row_carries_its_provenance_in_json_and_html_not_in_markdown(lab_board):
    out, _ = lab_board
    rows = _rows(json.loads((out / "lab-leaderboard.json").read_text()))
    ties = rows["ties"]["provenance"]
    assert (ties["user"], ties["host"], ties["code_version"], ties["params_sha256"]) == \
        ("alice", "alice-pc", "aaaaaaaaaaaa", "alice-params")
    assert rows["tsv_m"]["provenance"]["code_version"] == "bbbbbbbbbbbb-dirty"
    assert ties["date"].endswith("UTC") and ties["invocation_id"] == "inv-alice"
    html = (out / "lab-leaderboard.html").read_text()
    assert 'title="computed by alice on alice-pc at aaaaaaaaaaaa' in html
    assert 'title="computed by bob on bob-pc at bbbbbbbbbbbb-dirty' in html
    markdown = (out / "lab-leaderboard.md").read_text()
    table = markdown.split("## clip-small", 1)[1]
    assert "alice" not in table and "bob" not in table  # the rows stay plain; the sources list names them
    assert "| `inv-alice` | alice | alice-pc | `aaaaaaaaaaaa` |" in markdown


def test_the_lab_history_compares_an_identity_with_itself_only(lab_board):
    out, _ = lab_board
    history = (out / "lab-history.md").read_text()
    regressions = history.split("Regressions", 1)[1].split("\n## ", 1)[0]
    # ties 80 -> ties(top_k=0.3) 60 is two recipes, no regression; task arithmetic 70 -> 60 is one identity
    assert "ties" not in regressions
    assert "`task_arithmetic`: 70.0 → 60.0 (aaaaaaaaaaaa → bbbbbbbbbbbb-dirty, bob" in regressions
    assert history.count("\n## ") == 1  # only task arithmetic was computed twice


def test_the_single_checkout_history_no_longer_reports_a_false_regression(lab_store):
    from mergecal.reports.history import find_regressions, history_frame
    from mergecal.reports.runs import load_runs

    found = find_regressions(history_frame(load_runs(lab_store)))
    assert [(r.recipe, r.invocation_id) for r in found] == [("task_arithmetic", "inv-bob")]


@pytest.mark.parametrize("filters, expected", [
    ({"user": "alice"}, {"zeroshot", "finetuned", "ties", "ties>svc", "task_arithmetic"}),
    ({"commit": "bbbb"}, {"ties(top_k=0.3)", "ties(top_k=0.3)>svc", "tsv_m", "task_arithmetic"}),
    ({"track": "vision", "user": "bob"}, {"ties(top_k=0.3)", "ties(top_k=0.3)>svc", "tsv_m", "task_arithmetic"}),
    ({"since": "2000-01-01"}, {"zeroshot", "finetuned", "ties", "ties>svc", "ties(top_k=0.3)", "ties(top_k=0.3)>svc",
                               "tsv_m", "task_arithmetic"}),
])
def test_the_lab_filters(lab_store, tmp_path, filters, expected):
    from mergecal.reports.lab import Filters, write_lab_reports

    write_lab_reports(lab_store, "mergecal", tmp_path, Filters(**filters))
    document = json.loads((tmp_path / "lab-leaderboard.json").read_text())
    assert set(_rows(document)) == expected
    assert document["filters"] == filters


def test_filters_that_leave_nothing_and_a_bad_date_are_one_line(lab_store, tmp_path):
    from mergecal.reports.lab import Filters, write_lab_reports

    with pytest.raises(MergecalError, match=r"lab board: no finished cell runs .*filters: track llm"):
        write_lab_reports(lab_store, "mergecal", tmp_path, Filters(track="llm"))
    with pytest.raises(ParameterError, match="--since 'yesterday': expected a date"):
        write_lab_reports(lab_store, "mergecal", tmp_path, Filters(since="yesterday"))
    assert not list(tmp_path.iterdir())  # nothing half-written


def _cli(*args: str, cwd: Path = ROOT, env: dict | None = None) -> subprocess.CompletedProcess:
    import os

    return subprocess.run([sys.executable, "-m", "mergecal.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={**os.environ, **(env or {})})


def test_report_lab_from_the_command_line_with_the_env_uri(lab_store, tmp_path):
    done = _cli("report", "--lab", "--user", "bob", "--out", str(tmp_path), env={"MLFLOW_TRACKING_URI": lab_store})
    assert done.returncode == 0, done.stderr
    assert "lab-leaderboard.html" in done.stdout
    assert "tsv_m" in (tmp_path / "lab-leaderboard.md").read_text()
    refused = _cli("report", "--user", "bob", env={"MLFLOW_TRACKING_URI": lab_store})
    assert refused.returncode == 2
    assert refused.stderr.strip() == "mergecal: error: --user: a filter of the lab board; add --lab"


# --- the scheduled rerun ------------------------------------------------------------------------------------------

def _git(cwd: Path, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


@pytest.fixture
def checkouts(tmp_path):
    """A lab's repository (bare), a checkout of it with a pipeline's shape and a dvc.lock naming one output, and a
    second clone where a member commits."""
    origin = tmp_path / "origin.git"
    _git(tmp_path, "init", "-q", "--bare", "-b", "main", str(origin))
    lab = tmp_path / "lab"
    _git(tmp_path, "clone", "-q", str(origin), str(lab))
    for name in ("stages", "flows", "mergecal", "reports"):
        (lab / name).mkdir()
        (lab / name / "README").write_text(name)
    (lab / "dvc.yaml").write_text("stages: {}\n")
    (lab / "dvc.lock").write_text("schema: '2.0'\nstages:\n  report:\n    cmd: x\n    outs:\n"
                                  "    - path: reports/leaderboard.md\n")
    (lab / "reports" / "leaderboard.md").write_text("old board\n")
    (lab / "params.yaml").write_text("seed: 0\n")
    for cwd in (lab,):
        _git(cwd, "-c", "user.name=lab", "-c", "user.email=lab@example.org", "add", ".")
        _git(cwd, "-c", "user.name=lab", "-c", "user.email=lab@example.org", "commit", "-qm", "first")
        _git(cwd, "push", "-q", "origin", "HEAD:main")
        _git(cwd, "branch", "-q", "--set-upstream-to=origin/main")
    member = tmp_path / "member"
    _git(tmp_path, "clone", "-q", str(origin), str(member))
    return lab, member


def _commit(cwd: Path, path: str, text: str) -> None:
    (cwd / path).write_text(text)
    _git(cwd, "-c", "user.name=m", "-c", "user.email=m@example.org", "commit", "-qam", f"edit {path}")


def test_the_rerun_fast_forwards_over_its_own_outputs(checkouts):
    from mergecal.pipeline.schedule import local_changes, pull_checkout

    lab, member = checkouts
    assert pull_checkout(lab).startswith("up to date with origin/main")
    _commit(member, "params.yaml", "seed: 1\n")
    _git(member, "push", "-q")
    (lab / "reports" / "leaderboard.md").write_text("the last rerun's board\n")  # written by dvc repro
    assert local_changes(lab) == ([], ["reports/leaderboard.md"])
    assert pull_checkout(lab).startswith("fast-forwarded")
    assert (lab / "params.yaml").read_text() == "seed: 1\n"


def test_a_checkout_with_local_changes_is_not_rerun_and_not_changed(checkouts):
    from mergecal.pipeline.schedule import RerunStopped, rerun

    lab, member = checkouts
    _commit(member, "params.yaml", "seed: 1\n")
    _git(member, "push", "-q")
    (lab / "params.yaml").write_text("seed: 7\n")
    with pytest.raises(RerunStopped) as err:
        rerun.fn(str(lab))
    assert str(err.value) == (f"rerun: {lab} has local changes (params.yaml); commit or stash them; nothing was "
                              "changed")
    assert (lab / "params.yaml").read_text() == "seed: 7\n"
    assert _git(lab, "rev-parse", "HEAD") != _git(member, "rev-parse", "HEAD")


def test_a_diverged_checkout_stops_before_anything_changes(checkouts):
    from mergecal.pipeline.schedule import RerunStopped, pull_checkout

    lab, member = checkouts
    _commit(member, "params.yaml", "seed: 1\n")
    _git(member, "push", "-q")
    _commit(lab, "dvc.yaml", "stages: {}\n# local\n")
    (lab / "reports" / "leaderboard.md").write_text("the last rerun's board\n")
    head = _git(lab, "rev-parse", "HEAD")
    with pytest.raises(RerunStopped, match="has commits that origin/main lacks .* nothing was changed"):
        pull_checkout(lab)
    assert _git(lab, "rev-parse", "HEAD") == head
    assert (lab / "reports" / "leaderboard.md").read_text() == "the last rerun's board\n"


def test_a_pull_that_fails_is_one_line(checkouts, tmp_path):
    from mergecal.pipeline.schedule import RerunStopped, pull_checkout

    lab, _ = checkouts
    _git(lab, "remote", "set-url", "origin", str(tmp_path / "gone.git"))
    with pytest.raises(RerunStopped, match=r"rerun: git fetch --quiet failed in .*; nothing was changed"):
        pull_checkout(lab)


def test_a_repository_without_commits_has_nothing_to_compare_or_pull(tmp_path):
    """What create_workspace makes (git init + dvc init, files staged, nothing committed) is rerun as it is."""
    from mergecal.pipeline.schedule import local_changes, pull_checkout

    _git(tmp_path, "init", "-q")
    (tmp_path / "params.yaml").write_text("seed: 0\n")
    _git(tmp_path, "add", "params.yaml")
    assert _git(tmp_path, "status", "--porcelain") == "A  params.yaml"
    assert local_changes(tmp_path) == ([], [])
    assert pull_checkout(tmp_path) == "skipped: the repository has no commits"


def test_the_deployment_is_a_module_path_on_a_schedule_or_a_pool():
    from mergecal.pipeline.schedule import DEPLOYMENT, deployment

    made = deployment("0 3 * * *", ROOT, parameters={"dvc_push": False})
    assert made.entrypoint == "mergecal.pipeline.schedule.rerun"
    assert made.name == DEPLOYMENT and made.parameters == {"root": str(ROOT), "dvc_push": False}
    assert made.schedules[0].schedule.cron == "0 3 * * *"
    pooled = deployment(None, ROOT, interval=600, pool="gpu")
    assert pooled.work_pool_name == "gpu" and pooled.schedules[0].schedule.interval.total_seconds() == 600
    with pytest.raises(ParameterError, match="exactly one of --cron and --interval"):
        deployment("0 3 * * *", ROOT, interval=5)


def test_ui_against_a_server_points_at_it_instead_of_starting_a_second_mlflow():
    done = _cli("ui", "--no-prefect", env={"MLFLOW_TRACKING_URI": "http://lab:pw@127.0.0.1:5999"})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "MLflow: http://127.0.0.1:5999 (the tracking server this checkout logs to)"
