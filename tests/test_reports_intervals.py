"""Intervals, paired significance, protocol-aware bases and ill-posed rows in the leaderboard, and the per-example
artifact a cell logs for them."""

import json

import numpy as np
import pandas as pd
import pytest
import torch

from mergecal.evaluation.zeroshot import logit_scores
from mergecal.pipeline.cells import finetuned_reference, per_example_results
from mergecal.reports.leaderboard import build_tables, table_html, table_markdown, tables_json

TASKS = ("a", "b")
N = 200


def _ones(k: int) -> list[int]:
    return [1] * k + [0] * (N - k)


FT = {"a": _ones(180), "b": _ones(160)}
# recipe -> (merge, calibration, {task: examples}); deltas are against the same merge's base of the same protocol
ROWS = {
    "finetuned": ("finetuned", "none", FT),
    "task_arithmetic": ("task_arithmetic", "none", {"a": _ones(100), "b": _ones(100)}),
    # a: +40 examples (significant gain); b: +2 of 200 (+1.0 point, interval touches 0: not significant)
    "task_arithmetic>svc": ("task_arithmetic", "svc", {"a": _ones(140), "b": _ones(102)}),
    "task_arithmetic@λ=0.3": ("task_arithmetic", "none@λ=0.3", {"a": _ones(120), "b": _ones(100)}),
    "task_arithmetic>dsc@λ=0.3": ("task_arithmetic", "dsc@λ=0.3", {"a": _ones(120), "b": _ones(90)}),
    "iso_c": ("iso_c", "none", {"a": _ones(100), "b": _ones(100)}),
    "iso_c>svc": ("iso_c", "svc", {"a": _ones(190), "b": _ones(100)}),  # the highest a, but ill-posed
}


def _cells(with_examples=True):
    rows, examples = [], {}
    for i, (recipe, (merge, calibration, ex)) in enumerate(ROWS.items()):
        acc = {t: float(np.mean(ex[t])) for t in TASKS}
        row = {"backbone": "vit", "task_set": "v2", "regime": "standard", "status": "ok", "recipe": recipe,
               "merge": merge, "calibration": calibration, "cell_id": f"c{i}", "run_id": f"r{i}", "cached": False,
               "error": "", "tasks": TASKS, "metrics.avg_acc": sum(acc.values()) / 2,
               "metrics.avg_norm_acc": sum(acc[t] / np.mean(FT[t]) for t in TASKS) / 2}
        row.update({f"metrics.acc.{t}": acc[t] for t in TASKS})
        rows.append(row)
        examples[f"r{i}"] = ex if with_examples else None
    return pd.DataFrame(rows), examples


@pytest.fixture(scope="module")
def table():
    cells, examples = _cells()
    (table,) = build_tables(cells, examples)
    return table


def _row(table, recipe):
    return next(r for r in table.rows if r.recipe == recipe)


def test_each_protocol_has_its_own_base_before_its_calibrated_rows(table):
    assert [r.recipe for r in table.rows] == list(ROWS)
    assert _row(table, "task_arithmetic>dsc@λ=0.3").deltas["acc.a"] == pytest.approx(0.0)  # vs none@λ=0.3
    assert _row(table, "task_arithmetic>dsc@λ=0.3").deltas["acc.b"] == pytest.approx(-5.0)
    assert _row(table, "task_arithmetic>svc").deltas["acc.a"] == pytest.approx(20.0)  # vs plain none
    assert _row(table, "task_arithmetic@λ=0.3").role == "base" and not _row(table, "task_arithmetic@λ=0.3").deltas


def test_values_have_intervals_and_deltas_paired_significance(table):
    svc = _row(table, "task_arithmetic>svc")
    low, high = svc.intervals["avg_acc"]
    assert low < svc.values["avg_acc"] < high and high - low < 0.1
    low, high = svc.intervals["avg_norm_acc"]
    assert low < svc.values["avg_norm_acc"] < high
    assert svc.significance("acc.a") == "gain" and svc.significance("acc.b") == "none"
    assert _row(table, "task_arithmetic>dsc@λ=0.3").significance("acc.b") == "loss"
    assert _row(table, "finetuned").intervals["acc.a"][0] < 0.9 < _row(table, "finetuned").intervals["acc.a"][1]


def test_significant_and_not_significant_deltas_render_differently(table):
    md = table_markdown(table)
    line = next(line for line in md.splitlines() if line.startswith("| `task_arithmetic>svc` |"))
    cells = [c.strip() for c in line.strip("|").split("|")][1:]
    assert cells[0] == "**60.5 [55.8, 64.8] (+10.5▲)**"  # the averages (first) show their interval
    assert cells[2] == "**70.0 (+20.0▲)**"  # significantly best in its column too
    assert cells[3] == "51.0 (+1.0≈)"
    html = table_html(table)
    assert '<span class="delta pos"' in html and '<span class="delta ns"' in html and '<span class="delta neg"' in html
    assert "paired 95% interval" in html


def test_an_ill_posed_row_is_marked_and_never_best(table):
    iso = _row(table, "iso_c>svc")
    assert iso.ill_posed and iso.significance("acc.a") == "none" and iso.deltas["acc.a"] == pytest.approx(45.0)
    assert table.best["acc.a"] == "task_arithmetic>svc"  # 95.0 on iso_c>svc is not ranked
    md = table_markdown(table)
    line = next(line for line in md.splitlines() if line.startswith("| `iso_c>svc` |"))
    assert "95.0† (+45.0≈)" in line and "▲" not in line  # never significant
    assert "† SVC on Iso-C is ill-posed" in md
    assert "† SVC on Iso-C is ill-posed" in table_html(table)


def test_best_only_where_the_top_beats_the_runner_up(table):
    assert "acc.b" not in table.best  # 51.0 vs 50.0: the paired interval contains 0
    cells, _ = _cells()
    (plain,) = build_tables(cells)  # no per-example results: nothing can be significant
    assert plain.best == {} and "▲" not in table_markdown(plain) and "[" not in table_markdown(plain)


def test_json_has_intervals_significance_and_ill_posed(table):
    rows = tables_json([table])["vit"]["v2"]["standard"]
    svc = rows["task_arithmetic>svc"]
    assert set(svc["ci95"]) == {"acc.a", "acc.b", "avg_acc", "avg_norm_acc"}
    assert svc["delta_ci95"]["acc.a"][0] > 0 and svc["delta_ci95"]["acc.b"][0] <= 0 <= svc["delta_ci95"]["acc.b"][1]
    assert svc["significant"] == {"acc.a": "gain", "acc.b": "none", "avg_acc": "gain", "avg_norm_acc": "gain"}
    assert svc["best"] == ["acc.a", "avg_acc", "avg_norm_acc"]
    assert rows["iso_c>svc"]["ill_posed"].startswith("SVC on Iso-C is ill-posed")
    assert set(rows["iso_c>svc"]["significant"].values()) == {"none"}
    json.dumps(rows)  # plain JSON


def test_cells_keep_per_example_results():
    scores = logit_scores(torch.tensor([[2.0, 0.0], [0.0, 1.0], [3.0, 1.0]]), np.array([0, 0, 0]), per_example=True)
    assert scores["correct"] == [1, 0, 1] and scores["accuracy"] == pytest.approx(2 / 3)
    assert "correct" not in logit_scores(torch.tensor([[2.0, 0.0]]), np.array([0]))  # what stages write: unchanged
    assert per_example_results(["a"], {"a": scores}) == {"a": [1, 0, 1]}
    assert per_example_results(["a"], {"a": {"accuracy": 1.0}}) == {}
    reference = {t: {"test_accuracy": 0.5, "entropy": 0.1, "ece": 0.0, "norm": 1.0, "test_correct": [1, 0]}
                 for t in ("a", "b")}
    assert finetuned_reference(["a", "b"], reference, {}).examples == {"a": [1, 0], "b": [1, 0]}
    del reference["b"]["test_correct"]  # references written before: no interval for the row
    assert finetuned_reference(["a", "b"], reference, {}).examples == {}


def test_write_reports_reads_the_examples_artifact_of_the_run_that_computed_each_cell(tmp_path):
    pytest.importorskip("mlflow")
    from mergecal.pipeline.tracking import EXAMPLES, Tracker
    from mergecal.reports.write import write_reports

    tracker = Tracker(tmp_path, "mergecal", "mlruns")
    cells, examples = _cells()
    subset = cells[cells["recipe"].isin(["finetuned", "task_arithmetic", "task_arithmetic>svc"])]
    manifests = {}
    for inv in ("inv-1", "inv-2"):  # inv-2 reuses inv-1's runs: log_cell returns the existing run
        parent = tracker.start_invocation(inv, {}, {})
        manifest = {}
        for _, row in subset.iterrows():
            tags = {f"mergecal.{k}": row[k] for k in ("backbone", "task_set", "regime", "merge", "calibration",
                                                      "recipe")}
            tags["mergecal.tasks"] = ",".join(TASKS)
            metrics = {k[len("metrics."):]: v for k, v in row.items() if k.startswith("metrics.")}
            run_id = tracker.log_cell(parent_run_id=parent, invocation_id=inv, cell_id=row["cell_id"], tags=tags,
                                      params={}, metrics=metrics, artifacts={}, examples=examples[row["run_id"]])
            manifest[row["cell_id"]] = {"status": "ok", "run_id": run_id, "label": row["recipe"],
                                        "regime": "standard"}
        tracker.finish_invocation(parent, manifest, {})
        manifests[inv] = manifest
    assert manifests["inv-1"] == manifests["inv-2"]
    logged = [json.loads(p.read_text()) for p in (tmp_path / "mlruns" / "artifacts").rglob(EXAMPLES.split("/")[-1])]
    assert len(logged) == 3 and FT in logged  # one per computed cell, none for the reused ones
    write_reports(tracker.uri, "mergecal", tmp_path / "reports", "inv-2")
    data = json.loads((tmp_path / "reports" / "leaderboard.json").read_text())
    svc = data["leaderboard"]["vit"]["v2"]["standard"]["task_arithmetic>svc"]
    assert svc["significant"]["acc.a"] == "gain" and "avg_acc" in svc["ci95"]
    assert "(+20.0▲)" in (tmp_path / "reports" / "leaderboard.md").read_text()
    assert '<span class="delta pos"' in (tmp_path / "reports" / "leaderboard.html").read_text()


def test_every_svc_protocol_after_iso_is_ill_posed_and_other_rows_are_not():
    from mergecal.reports.leaderboard import ill_posed

    for calibration in ("svc", "svc@λ=1", "svc(calibrate_at=chosen_scaling)", "distac>svc>dsc"):
        assert ill_posed("iso_cts", calibration) and ill_posed("iso_c", calibration), calibration
    assert not ill_posed("iso_c", "wsc") and not ill_posed("tsv_m", "svc") and not ill_posed("iso_c", "none@λ=1")
