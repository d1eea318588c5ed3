"""Each method's own cost (#61 item 4): the per-method table from the cells' cost metrics (``mergecal.reports.costs``),
``mergecal report --costs``, the lab board's cost columns and the time of MAGIC's Table VII, read from the committed
measurement file."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mergecal.errors import MergecalError
from mergecal.pipeline.cells import Cell
from mergecal.pipeline.config import Tracking
from mergecal.pipeline.tracking import Tracker, cell_tags, tag
from mergecal.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("a", "b")
DSC_A = "task_arithmetic>dsc_a(fsc={'n_samples_per_task': 16})"


def _cell(merge: str, chain: str) -> Cell:
    calibration = chain.replace("{merge}>", "").replace("{merge}", "") or "none"
    return Cell(track="vision", backbone="clip-small", task_set="ts", tasks=TASKS, regime="standard", merge=merge,
                chain=chain, calibration=calibration)


def _log(tracker: Tracker, parent: str, invocation: str, merge: str, chain: str, recipe: str,
         costs: dict[str, float]) -> dict:
    """One computed cell with the benchmark's tags, its accuracy, the cell's own measures and ``costs``."""
    cell = _cell(merge, chain)
    recipe_id = Recipe.parse(recipe).id if recipe else ""
    key = hashlib.sha256(f"{invocation}-{cell.label}-{recipe_id}".encode()).hexdigest()[:16]
    metrics = {"avg_acc": 0.7, "avg_norm_acc": 0.8, **{f"acc.{t}": 0.7 for t in TASKS}, "seconds": 60.0,
               "peak_rss_mib": 2048.0, **costs}
    run_id = tracker.log_cell(parent_run_id=parent, invocation_id=invocation, cell_id=key,
                              tags={**cell_tags(cell), tag("recipe_id"): recipe_id}, params={}, metrics=metrics,
                              artifacts={})
    return {key: {"status": "ok", "run_id": run_id, "cached": False, "label": cell.label, "regime": cell.regime}}


def _invocation(tracker: Tracker, invocation: str, profile: str, cells: list[tuple]) -> None:
    parent = tracker.start_invocation(invocation, {tag("cells"): str(len(cells))}, {"profile": profile})
    manifest = {}
    for cell in cells:
        manifest.update(_log(tracker, parent, invocation, *cell))
    tracker.finish_invocation(parent, manifest, {})


def ws(merge: float, peak: float, **steps: float) -> dict[str, float]:
    """Cost metrics of a cell whose calibrations stream with the merge (weight space: one peak)."""
    return {"cost.seconds.merge": merge, "cost.calls.merge": 1.0, "cost.peak_mib.weight_space": peak,
            **{f"cost.seconds.{n}": s for n, s in steps.items()}, **{f"cost.calls.{n}": 1.0 for n in steps}}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> str:
    """An older default run (to be ignored), the newest default run and a papers' run (its profile ``paper``)."""
    base = tmp_path_factory.mktemp("costs")
    (base / "shared").mkdir()
    shared = Tracking(uri=f"sqlite:///{base}/shared/mlruns.db", artifacts=(base / "shared" / "art").as_uri())
    tracker = Tracker.of(base / "checkout", shared, tags={tag("user"): "alice", tag("host"): "alice-pc",
                                                          tag("code_version"): "c" * 12, tag("params_sha256"): "p"})
    _invocation(tracker, "inv-old", "default", [("ties", "{merge}", "ties", ws(99.0, 999.0))])
    time.sleep(0.02)  # distinct start times
    _invocation(tracker, "inv-default", "default", [
        ("zeroshot", "{merge}", "", {}), ("finetuned", "{merge}", "", {}),
        ("ties", "{merge}", "ties", ws(2.0, 100.0)),
        ("ties", "{merge}>svc", "ties>svc", ws(4.0, 300.0, svc=1.0)),
        ("ties", "distac>{merge}", "distac>ties",
         {**ws(3.0, 120.0, distac=10.0), "cost.peak_mib.distac": 500.0}),
        ("task_arithmetic", "{merge}", "task_arithmetic", ws(1.0, 50.0)),
        ("task_arithmetic", "{merge}>dsc", "task_arithmetic>dsc",
         {**ws(3.0, 200.0, wsc=0.5, fsc=2.0), "cost.peak_mib.fsc": 40.0})])
    time.sleep(0.02)
    _invocation(tracker, "inv-paper", "paper", [
        ("task_arithmetic", "{merge}>dsc_a", DSC_A, {**ws(5.0, 220.0, wsc=1.5, fsc=6.0), "cost.peak_mib.fsc": 80.0}),
        ("task_arithmetic", "{merge}>wsc", "task_arithmetic>wsc", ws(2.0, 210.0, wsc=0.7))])
    return shared.uri


def _rows(table: list[dict]) -> dict[tuple, dict]:
    return {(r["kind"], r["method"], r["data"], r["data_per_task"]): r for r in table}


@pytest.fixture(scope="module")
def table(store):
    from mergecal.reports.costs import cost_table, measured_cells
    from mergecal.reports.runs import load_runs

    cells, chosen = measured_cells(load_runs(store))
    assert chosen == ["inv-default", "inv-paper"]  # the newest of each profile; inv-old is older than inv-default
    return cost_table(cells, distac_samples=512)


def test_the_table_has_each_methods_median_range_and_data_per_task(table):
    rows = _rows(table)
    assert {(r["track"], r["regime"]) for r in table} == {("vision", "standard")}
    assert set(rows) == {("merge", "ties", "none", 0), ("merge", "task_arithmetic", "none", 0),
                         ("calibration", "svc", "none", 0), ("calibration", "wsc", "none", 0),
                         ("calibration", "fsc", "task", 1), ("calibration", "fsc", "task_agnostic", 16),
                         ("calibration", "distac", "task", 512)}
    ties = rows["merge", "ties", "none", 0]
    assert ties["cells"] == 3 and ties["seconds"] == {"median": 3.0, "min": 2.0, "max": 4.0}  # not inv-old's 99
    # a merge's peak only where it streamed alone: not the SVC cell's 300 (the calibration's)
    assert ties["peak_mib"] == {"median": 110.0, "min": 100.0, "max": 120.0}
    ta = rows["merge", "task_arithmetic", "none", 0]
    assert ta["cells"] == 4 and ta["seconds"] == {"median": 2.5, "min": 1.0, "max": 5.0}
    assert ta["peak_mib"] == {"median": 50.0, "min": 50.0, "max": 50.0}
    wsc = rows["calibration", "wsc", "none", 0]
    assert wsc["seconds"] == {"median": 0.7, "min": 0.5, "max": 1.5}
    assert wsc["peak_mib"] == {"median": 210.0, "min": 200.0, "max": 220.0} and wsc["peak_scope"] == "weight_space"
    fsc, agnostic = rows["calibration", "fsc", "task", 1], rows["calibration", "fsc", "task_agnostic", 16]
    assert (fsc["cells"], fsc["seconds"]["median"], fsc["peak_mib"]["median"], fsc["peak_scope"]) == \
        (1, 2.0, 40.0, "own")
    assert (agnostic["seconds"]["median"], agnostic["peak_mib"]["median"]) == (6.0, 80.0)
    assert rows["calibration", "distac", "task", 512]["peak_mib"]["max"] == 500.0
    assert rows["calibration", "svc", "none", 0]["peak_mib"]["median"] == 300.0
    assert table[0]["kind"] == "merge"  # a track's merges before its calibrations


def test_one_invocation_alone_and_the_cell_costs_of_a_row(store):
    from mergecal.reports.costs import cell_costs, cost_table, measured_cells
    from mergecal.reports.runs import load_runs

    runs = load_runs(store)
    cells, chosen = measured_cells(runs, "inv-paper")
    assert chosen == ["inv-paper"] and len(cells) == 2
    assert {r["method"] for r in cost_table(cells)} == {"task_arithmetic", "wsc", "fsc"}
    dsc = cells[cells["recipe"] == "task_arithmetic>dsc_a"].iloc[0]
    assert cell_costs(dsc) == {"merge_s": 5.0, "calibration_s": 7.5, "peak_mib": 220.0}
    zeroshot = runs[(runs["recipe"] == "zeroshot") & (runs["kind"] == "cell")].iloc[0]
    assert cell_costs(zeroshot) is None


def _cli(*args: str, uri: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mergecal.cli", "report", *args], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "MLFLOW_TRACKING_URI": uri})


def test_report_costs_writes_the_markdown_and_json(store, table, tmp_path):
    done = _cli("--costs", "--output", str(tmp_path / "m" / "cell-costs"), uri=store)
    assert done.returncode == 0, done.stderr
    document = json.loads((tmp_path / "m" / "cell-costs.json").read_text())
    assert document["rows"] == table and document["invocations"] == ["inv-default", "inv-paper"]
    assert f"{os.cpu_count()} CPU(s)" in document["machine"] and "torch threads per cell" in document["machine"]
    markdown = (tmp_path / "m" / "cell-costs.md").read_text()
    assert "| vision | standard | calibration | `fsc` | 16 task-agnostic | 1 | 6.000 [6.000, 6.000] | 80.0 " \
           "[80.0, 80.0] | own |" in markdown
    assert "| vision | standard | merge | `task_arithmetic` | 0 | 4 | 2.500 [1.000, 5.000] |" in markdown
    refused = _cli("--output", str(tmp_path / "x"), uri=store)
    assert refused.returncode == 2 and "--output: the stem of the cost table's files; add --costs" in refused.stderr


def test_a_store_without_cost_metrics_is_one_line(tmp_path):
    empty = f"sqlite:///{tmp_path}/empty/mlruns.db"
    (tmp_path / "empty").mkdir()
    done = _cli("--costs", "--output", str(tmp_path / "c"), uri=empty)
    assert done.returncode == 2
    errors = [line for line in done.stderr.splitlines() if line.startswith("mergecal:")]  # MLflow logs its INFO
    assert len(errors) == 1 and "run `make run` first (cost metrics are logged since" in errors[0]
    # a store whose cells predate the cost metrics: the same advice
    shared = Tracking(uri=f"sqlite:///{tmp_path}/old/mlruns.db", artifacts=(tmp_path / "old" / "art").as_uri())
    (tmp_path / "old").mkdir()
    _invocation(Tracker.of(tmp_path / "co", shared), "inv-1", "default",
                [("ties", "{merge}", "ties", {}), ("zeroshot", "{merge}", "", {})])
    from mergecal.reports.costs import measured_cells
    from mergecal.reports.runs import load_runs

    with pytest.raises(MergecalError, match=r"^--costs: no cell with cost metrics in invocation\(s\) inv-1; run "):
        measured_cells(load_runs(shared.uri))
    assert not list(tmp_path.glob("c.*"))


def test_the_lab_board_shows_each_rows_cost(store, tmp_path):
    from mergecal.reports.lab import write_lab_reports

    write_lab_reports(store, "mergecal", tmp_path)
    rows = json.loads((tmp_path / "lab-leaderboard.json").read_text())["leaderboard"]["mergecal"]["clip-small"]["ts"][
        "standard"]
    assert rows["ties>svc"]["cost"] == {"merge_s": 4.0, "calibration_s": 1.0, "peak_mib": 300.0}
    assert rows["ties"]["cost"] == {"merge_s": 2.0, "peak_mib": 100.0}  # no calibration: none shown
    assert "cost" not in rows["zeroshot"] and "cost" not in rows["finetuned"]
    markdown = (tmp_path / "lab-leaderboard.md").read_text()
    header = next(line for line in markdown.splitlines() if line.startswith("| recipe |"))
    assert header.endswith("| merge s | calibration s | peak MiB |")
    lines = {line.split(" | ", 1)[0]: line for line in markdown.splitlines() if line.startswith("| `")}
    assert lines["| `ties>svc`"].endswith("| 4.00 | 1.00 | 300.0 |")
    assert lines["| `zeroshot`"].endswith("|  |  |  |")  # a reference: blank
    assert all(line.count("|") == header.count("|") for line in lines.values())
    html = (tmp_path / "lab-leaderboard.html").read_text()
    assert '<th class="cost">merge s</th><th class="cost">calibration s</th><th class="cost">peak MiB</th>' in html
    assert '<td class="num cost">4.00</td><td class="num cost">1.00</td><td class="num cost">300.0</td></tr>' in html


def _tab7():
    from mergecal.pipeline.experiments import load_experiments

    experiment = next(e for e in load_experiments()["magic"] if e.id == "magic.tab7")
    return experiment, list(experiment.variants), {"base": experiment.base, **experiment.variants}


def test_table_vii_reads_its_time_from_the_committed_file(table, tmp_path):
    from mergecal.reports.costs import write_costs
    from mergecal.reports.papers import TIMED, Group, experiment_section, time_section, to_markdown

    experiment, names, chains = _tab7()
    write_costs(table, tmp_path / TIMED[experiment.id].removesuffix(".json"), "test machine", ["inv-default"])
    blocks, document = time_section(experiment, names, chains, tmp_path)
    seconds = {r["variant"]: r["seconds"] for r in document}
    # one pass of the merge (median 2.5 s) and of each of its calibration steps' medians (WSC 0.7, FSC 2.0 with one
    # task sample, 6.0 with 16 task-agnostic ones)
    assert seconds == {"base": 2.5, "wsc": 3.2, "dsc_a": 9.2, "dsc": 5.2}
    assert {r["variant"]: r["samples_per_task"] for r in document} == \
        {"base": "0", "wsc": "0", "dsc_a": "0 (16 task-agnostic)", "dsc": "1"}
    text = to_markdown(blocks)
    assert "measured on test machine" in text and "| standard | `task_arithmetic` | `dsc_a` | 0 (16 task-agnostic) " \
                                                 "| 9.2 |" in text
    group = Group("standard", 0, TASKS, {})  # no cell computed: the time is the file's all the same
    shown, doc = experiment_section(experiment, [group], names, chains, "magic-tab7", (blocks, document))
    assert doc["time"] == document and ("table", *blocks[1][1:]) in shown


def test_table_vii_without_the_file_or_a_row_says_not_measured(table, tmp_path):
    from mergecal.reports.costs import write_costs
    from mergecal.reports.papers import TIMED, time_section, to_markdown

    experiment, names, chains = _tab7()
    blocks, document = time_section(experiment, names, chains, tmp_path)
    assert [r["seconds"] for r in document] == [None] * 4
    text = to_markdown(blocks)
    assert "holds no measurement yet: not measured" in text and text.count("| not measured |") == 4
    # the task-agnostic FSC never measured: DSC-A alone is not measured
    partial = [r for r in table if r["data"] != "task_agnostic"]
    write_costs(partial, tmp_path / TIMED[experiment.id].removesuffix(".json"), "m", [])
    seconds = {r["variant"]: r["seconds"] for r in time_section(experiment, names, chains, tmp_path)[1]}
    assert seconds == {"base": 2.5, "wsc": 3.2, "dsc_a": None, "dsc": 5.2}
    (tmp_path / TIMED[experiment.id]).write_text('{"rows": [{"track": "vision"}]}')
    with pytest.raises(MergecalError, match=r"cell-costs.json: not a `mergecal report --costs` JSON"):
        time_section(experiment, names, chains, tmp_path)
