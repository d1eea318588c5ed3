"""scripts/compare_leaderboards.py (#30): row moves against the first run's half-width and verdict flips, on two
constructed leaderboards whose answer is known."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("compare_leaderboards", ROOT / "scripts" / "compare_leaderboards.py")
compare = importlib.util.module_from_spec(spec)
spec.loader.exec_module(compare)


def board(rows: dict) -> dict:
    return {"leaderboard": {"bb": {"ts": {"standard": rows}}}}


def row(value: float, low: float, high: float, role: str = "base", delta: float | None = None,
        verdict: str = "none") -> dict:
    out = {"values": {"avg_acc": value}, "ci95": {"avg_acc": [low, high]}, "role": role}
    if delta is not None:
        out.update(delta_points={"avg_acc": delta}, significant={"avg_acc": verdict})
    return out


def test_moves_half_widths_and_flipped_verdicts_are_counted():
    first = board({"ta": row(0.70, 0.68, 0.72), "ta>svc": row(0.73, 0.71, 0.75, "calibrated", 3.0, "gain"),
                   "ties": row(0.60, 0.58, 0.62), "gone": row(0.5, 0.4, 0.6)})
    second = board({"ta": row(0.70, 0.68, 0.72), "ta>svc": row(0.715, 0.69, 0.74, "calibrated", 1.5, "none"),
                    "ties": row(0.65, 0.63, 0.67)})
    records = compare.row_moves(first, second)
    assert [r["key"][-1] for r in records] == ["ta", "ta>svc", "ties"]  # rows of both only
    moves = {r["key"][-1]: round(r["move"], 6) for r in records}
    assert moves == {"ta": 0.0, "ta>svc": 1.5, "ties": 5.0}
    s = compare.summary(records)["bb"]
    assert (s["rows"], s["identical"], s["beyond_half_width"], s["verdicts_flipped"]) == (3, 1, 1, 1)
    assert round(s["largest_move"], 6) == 5.0 and round(s["median_half_width"], 6) == 2.0
    assert round(s["median_delta_move"], 6) == 1.5


def test_an_unreadable_file_is_one_line_and_exit_2(tmp_path, capsys):
    good = tmp_path / "a.json"
    good.write_text(json.dumps(board({"ta": row(0.7, 0.68, 0.72)})))
    bad = tmp_path / "b.json"
    bad.write_text("{not json")
    assert compare.main([str(good), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and str(bad) in err and "leaderboard.json" in err
