"""Two runs' leaderboards side by side: how far each row moved against its own interval, and which verdicts flipped.

For every row in both `reports/leaderboard.json` files (same backbone, task set, regime and row name): the move
of its average accuracy in points against the half-width of the first run's 95 % interval, and, for a calibrated
row, the move of its change against its base merge and whether its verdict (gain / loss / none, from the paired
interval) is the same. Per backbone: rows compared, median and largest move, rows moved by more than their
half-width, verdicts flipped. Use it to check another machine, thread count or seed against the committed run:

    python scripts/compare_leaderboards.py reports/leaderboard.json OTHER/reports/leaderboard.json [--rows]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from mergecal.reports.seeds import METRIC, flat_rows


def row_moves(first: dict, second: dict) -> list[dict]:
    """One record per row of both: points moved, the first run's half-width, the change's move, the verdicts."""
    a, b = flat_rows(first), flat_rows(second)
    out = []
    for key in sorted(set(a) & set(b)):
        ra, rb = a[key], b[key]
        low, high = ra["ci95"][METRIC]
        record = {"key": key, "move": 100 * abs(rb["values"][METRIC] - ra["values"][METRIC]),
                  "half_width": 100 * (high - low) / 2}
        if ra.get("role") == "calibrated" and METRIC in ra.get("delta_points", {}) and METRIC in rb.get(
                "delta_points", {}):
            record["delta_move"] = abs(rb["delta_points"][METRIC] - ra["delta_points"][METRIC])
            record["verdicts"] = (ra["significant"][METRIC], rb["significant"][METRIC])
        out.append(record)
    return out


def summary(records: list[dict]) -> dict[str, dict]:
    """Per backbone: rows, median and largest move, rows moved beyond their half-width, verdicts flipped."""
    out = {}
    for backbone in sorted({r["key"][0] for r in records}):
        rows = [r for r in records if r["key"][0] == backbone]
        moves = [r["move"] for r in rows]
        calibrated = [r for r in rows if "verdicts" in r]
        largest = max(rows, key=lambda r: r["move"])
        out[backbone] = {
            "rows": len(rows), "identical": sum(m == 0 for m in moves), "median_move": statistics.median(moves),
            "largest_move": largest["move"], "largest_row": " / ".join(largest["key"][1:]),
            "beyond_half_width": sum(r["move"] > r["half_width"] for r in rows),
            "median_half_width": statistics.median(r["half_width"] for r in rows),
            "calibrated": len(calibrated),
            "median_delta_move": statistics.median(r["delta_move"] for r in calibrated) if calibrated else None,
            "verdicts_flipped": sum(r["verdicts"][0] != r["verdicts"][1] for r in calibrated)}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("first", type=Path)
    parser.add_argument("second", type=Path)
    parser.add_argument("--rows", action="store_true", help="also list every row that moved, largest first")
    args = parser.parse_args(argv)
    boards = []
    for path in (args.first, args.second):
        try:
            boards.append(json.loads(path.read_text()))
        except (OSError, json.JSONDecodeError) as err:
            print(f"compare_leaderboards: error: {path}: not a readable leaderboard.json ({err})", file=sys.stderr)
            return 2
    records = row_moves(*boards)
    if not records:
        print("compare_leaderboards: error: the two leaderboards have no row in common", file=sys.stderr)
        return 2
    print("| backbone | rows | identical | median move | largest move (row) | moved > half-width | median half-width "
          "| calibrated rows | median change move | verdicts flipped |")
    print("|---|---:|---:|---:|---|---:|---:|---:|---:|---:|")
    for backbone, s in summary(records).items():
        delta = "" if s["median_delta_move"] is None else f"{s['median_delta_move']:.2f}"
        print(f"| {backbone} | {s['rows']} | {s['identical']} | {s['median_move']:.2f} | {s['largest_move']:.2f} "
              f"({s['largest_row']}) | {s['beyond_half_width']} | {s['median_half_width']:.2f} | {s['calibrated']} "
              f"| {delta} | {s['verdicts_flipped']} |")
    if args.rows:
        for r in sorted(records, key=lambda r: -r["move"]):
            if r["move"] > 0:
                verdicts = " -> ".join(r["verdicts"]) if "verdicts" in r else ""
                print(f"{' / '.join(r['key'])}: moved {r['move']:.2f} (half-width {r['half_width']:.2f}) {verdicts}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
