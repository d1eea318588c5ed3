"""mergecal.reports.seeds (#30): rows across seeds on constructed leaderboards with known answers, and
scripts/seed_spread.py's bad input."""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import pytest

from mergecal.reports.seeds import across_seeds, markdown, seed_rows, t_interval, verdict_counts

ROOT = Path(__file__).resolve().parents[1]


def board(rows: dict) -> dict:
    return {"leaderboard": {"bb": {"ts": {"standard": rows}}}}


def base(value: float) -> dict:
    return {"values": {"avg_acc": value}, "role": "base"}


def calibrated(value: float, change: float, verdict: str, ill_posed: bool = False) -> dict:
    row = {"values": {"avg_acc": value}, "role": "calibrated", "delta_points": {"avg_acc": change},
           "significant": {"avg_acc": verdict}}
    return {**row, "ill_posed": "why"} if ill_posed else row


def test_values_changes_and_verdicts_across_three_seeds():
    def seed(ta, svc, svc_change, wsc, wsc_change, wsc_verdict, **more):
        return board({"ta": base(ta), "ta>svc": calibrated(svc, svc_change, "gain"),
                      "ta>wsc": calibrated(wsc, wsc_change, wsc_verdict), **more})

    docs = {0: seed(0.70, 0.73, 3.0, 0.71, 1.0, "gain", only0=base(0.5)),
            1: seed(0.66, 0.68, 2.0, 0.65, -1.0, "loss"),
            2: seed(0.68, 0.72, 4.0, 0.68, 0.0, "none")}
    rows = {r.key[3]: r for r in seed_rows(docs)}
    assert set(rows) == {"ta", "ta>svc", "ta>wsc"}  # a row missing from one seed is left out
    ta = rows["ta"]
    assert ta.mean == pytest.approx(68.0) and ta.sd == pytest.approx(2.0) and ta.spread == pytest.approx(4.0)
    assert not ta.changes and ta.verdict == "none"
    svc = rows["ta>svc"]
    assert svc.mean_change == pytest.approx(3.0) and svc.verdict == "gain"
    # t-interval by hand: mean 3, sd 1, n 3, t_{0.975, 2} = 4.302653
    half = 4.302653 / math.sqrt(3)
    assert svc.change_interval == pytest.approx((3 - half, 3 + half), rel=1e-6)
    assert rows["ta>wsc"].verdict == "contradicting"
    assert verdict_counts(list(rows.values())) == {"bb": {"gain": 1, "loss": 0, "contradicting": 1,
                                                          "unreplicated": 0, "none": 0}}
    text = markdown(list(rows.values()), [0, 1, 2])
    assert "| ta>svc | 73.0 | 68.0 | 72.0 | 71.0 ± 2.6 | +3.0▲, +2.0▲, +4.0▲ | +3.0 [+0.5, +5.5] | gain |" in text


def test_verdict_rules_and_ill_posed_rows():
    assert across_seeds(["gain", "gain"]) == "gain" and across_seeds(["loss", "loss"]) == "loss"
    assert across_seeds(["gain", "none"]) == "unreplicated" and across_seeds(["none", "none"]) == "none"
    assert across_seeds(["gain", "loss", "none"]) == "contradicting"
    assert t_interval([1.0]) is None
    docs = {s: board({"iso_c": base(0.6), "iso_c>svc": calibrated(0.7, 10.0, "gain", ill_posed=True)}) for s in (0, 1)}
    row = {r.key[3]: r for r in seed_rows(docs)}["iso_c>svc"]
    assert not row.changes and row.verdict == "none"  # shown, never judged


def test_seed_spread_refuses_bad_items_in_one_line(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location("seed_spread", ROOT / "scripts" / "seed_spread.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    good = tmp_path / "lb.json"
    good.write_text(json.dumps(board({"ta": base(0.7)})))
    for argv, expected in ([[f"x={good}", f"1={good}"], "expected SEED=PATH"],
                           [[f"0={good}"], "at least two seeds"],
                           [[f"0={good}", f"0={good}"], "seed 0 given twice"],
                           [[f"0={good}", f"1={tmp_path / 'missing.json'}"], "not a readable leaderboard.json"]):
        assert script.main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert "\n" not in err and expected in err
    out = tmp_path / "seeds.md"
    assert script.main([f"0={good}", f"1={good}", "--out", str(out)]) == 0
    assert out.read_text().startswith("## Across seeds (0, 1)")


# --- one run with several fine-tuning seeds (`seeds:` in params.yaml): the leaderboard's "Across seeds" section ---

def _seeded_store(tmp_path, seeds, invocations=("inv",), drop=None):
    """A tmp MLflow store with finished invocations (a day apart) whose cells carry the ``mergecal.seed`` tag of
    each seed; ``drop``: (invocation, seed, recipe) whose accuracy is 5 points lower there."""
    from mlflow import MlflowClient

    uri = f"sqlite:///{tmp_path}/mlruns.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("mergecal", artifact_location=str(tmp_path / "artifacts"))
    cells = {"zeroshot": ("zeroshot", "none", 0.40), "finetuned": ("finetuned", "none", 0.90),
             "task_arithmetic": ("task_arithmetic", "none", 0.70),
             "task_arithmetic>svc": ("task_arithmetic", "svc", 0.72)}
    for day, inv in enumerate(invocations):
        start = 1_790_000_000_000 + day * 86_400_000
        parent = client.create_run(exp, start_time=start, tags={"mergecal.kind": "invocation",
                                                                "mergecal.invocation_id": inv})
        _seeded_cells(client, exp, parent.info.run_id, inv, start, seeds, cells, drop)
        client.set_terminated(parent.info.run_id, end_time=start + 200)
    return uri


def _seeded_cells(client, exp, parent, inv, start, seeds, cells, drop):
    from mlflow.entities import Metric

    for seed in seeds:
        for j, (recipe, (merge, calibration, acc)) in enumerate(cells.items()):
            acc += 0.01 * seed - (0.05 if drop == (inv, seed, recipe) else 0.0)  # each seed's models differ a little
            run = client.create_run(exp, start_time=start + j + 1, tags={
                "mlflow.parentRunId": parent, "mergecal.kind": "cell", "mergecal.invocation_id": inv,
                "mergecal.cell_id": f"{recipe}-{seed}", "mergecal.status": "ok", "mergecal.backbone": "vit",
                "mergecal.task_set": "two", "mergecal.regime": "standard", "mergecal.merge": merge,
                "mergecal.calibration": calibration, "mergecal.recipe": recipe, "mergecal.tasks": "a,b",
                "mergecal.seed": str(seed)})
            metrics = [Metric(n, acc, start, 0) for n in ("acc.a", "acc.b", "avg_acc")]
            client.log_batch(run.info.run_id, metrics=metrics + [Metric("avg_norm_acc", acc / 0.9, start, 0)])
            client.set_terminated(run.info.run_id, "FINISHED", end_time=start + 100)


@pytest.mark.integration
def test_a_run_with_two_seeds_reports_each_seeds_tables_and_the_across_seeds_section(tmp_path):
    pytest.importorskip("mlflow")
    from mergecal.reports.write import write_reports

    out = tmp_path / "reports"
    write_reports(_seeded_store(tmp_path, (0, 1)), "mergecal", out)
    document = json.loads((out / "leaderboard.json").read_text())
    assert sorted(document["leaderboard"]) == ["seed_0", "seed_1"]
    seed_1 = document["leaderboard"]["seed_1"]["vit"]["two"]["standard"]
    assert seed_1["task_arithmetic"]["values"]["avg_acc"] == pytest.approx(0.71)
    across = {r["row"]: r for r in document["across_seeds"]["rows"]}
    assert document["across_seeds"]["seeds"] == [0, 1]
    assert across["task_arithmetic"]["values"] == pytest.approx({"0": 70.0, "1": 71.0})
    assert across["task_arithmetic"]["mean"] == pytest.approx(70.5)
    assert across["task_arithmetic>svc"]["changes"] == pytest.approx({"0": 2.0, "1": 2.0})
    markdown = (out / "leaderboard.md").read_text()
    assert "## vit · two · standard · seed 1" in markdown and "## Across seeds (0, 1)" in markdown
    assert 'id="across-seeds"' in (out / "leaderboard.html").read_text()


@pytest.mark.integration
def test_a_run_with_one_seed_keeps_the_leaderboard_as_it_was(tmp_path):
    pytest.importorskip("mlflow")
    from mergecal.reports.write import write_reports

    out = tmp_path / "reports"
    write_reports(_seeded_store(tmp_path, (0,)), "mergecal", out)
    document = json.loads((out / "leaderboard.json").read_text())
    assert list(document["leaderboard"]) == ["vit"] and "across_seeds" not in document
    markdown = (out / "leaderboard.md").read_text()
    assert "## vit · two · standard\n" in markdown and "Across seeds" not in markdown


@pytest.mark.integration
def test_the_history_keeps_each_seeds_cells_apart_and_names_the_seed_of_a_regression(tmp_path):
    """With several seeds the same recipe is one cell per seed: the history shows each seed's group and a drop in
    seed 1 is seed 1's (before, the seeds shared a key and the history kept one of them)."""
    pytest.importorskip("mlflow")
    from mergecal.reports.write import find_regressions, history_frame, load_runs
    from mergecal.reports.history import history_markdown

    uri = _seeded_store(tmp_path, (0, 1), invocations=("inv-1", "inv-2"), drop=("inv-2", 1, "task_arithmetic"))
    runs = load_runs(uri, "mergecal")
    history = history_frame(runs)
    assert len(history) == 2 * 2 * 4  # invocations x seeds x recipes
    (regression,) = find_regressions(history)
    assert (regression.recipe, regression.seed, regression.invocation_id) == ("task_arithmetic", "1", "inv-2")
    assert regression.drop_points == pytest.approx(5.0 / 0.9)  # avg_norm_acc: accuracy over 0.9
    text = history_markdown(runs)
    assert "- vit · two · standard · seed 1 · task_arithmetic: 78.9 → 73.3 (−5.6) in inv-2" in text
    assert "## vit · two · standard · seed 0\n" in text and "## vit · two · standard · seed 1\n" in text
    # one seed: no seed in the groups or the regressions, as before seeds
    one = load_runs(_seeded_store(tmp_path / "one", (0,), ("inv-1", "inv-2"), ("inv-2", 0, "task_arithmetic")),
                    "mergecal")
    (regression,) = find_regressions(history_frame(one))
    assert regression.seed == "" and "## vit · two · standard\n" in history_markdown(one)
