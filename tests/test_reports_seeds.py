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
