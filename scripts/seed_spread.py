"""Every leaderboard row across seeds, from one run's `reports/leaderboard.json` per seed (#30).

    python scripts/seed_spread.py 0=reports/leaderboard.json 1=../seed1/reports/leaderboard.json [--out FILE]

Prints (or writes, atomically) the Markdown of ``mergecal.reports.seeds``: each row's value per seed, mean ± sd,
and each calibration's change per seed with its verdict, the mean change with a 95 % t-interval across seeds, and
the verdict across seeds (a gain or a loss only when every seed's paired interval says so).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mergecal.checkpoint import atomic_write_text
from mergecal.reports.seeds import markdown, seed_rows


def parse_runs(items: list[str]) -> dict[int, dict]:
    """``SEED=PATH`` items -> {seed: leaderboard document}; ValueError (one line) on a bad item or file."""
    runs = {}
    for item in items:
        seed, sep, path = item.partition("=")
        if not sep or not seed.isdigit() or not path:
            raise ValueError(f"{item!r}: expected SEED=PATH (a non-negative integer, '=', a leaderboard.json)")
        if int(seed) in runs:
            raise ValueError(f"seed {seed} given twice")
        try:
            document = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable leaderboard.json ({err})") from None
        if not isinstance(document, dict) or "leaderboard" not in document:
            raise ValueError(f"{path}: no 'leaderboard' key (expected reports/leaderboard.json)")
        runs[int(seed)] = document
    if len(runs) < 2:
        raise ValueError("give at least two seeds' leaderboards (SEED=PATH SEED=PATH ...)")
    return runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="SEED=PATH")
    parser.add_argument("--out", type=Path, help="write the Markdown here instead of printing it")
    args = parser.parse_args(argv)
    try:
        runs = parse_runs(args.runs)
    except ValueError as err:
        print(f"seed_spread: error: {err}", file=sys.stderr)
        return 2
    text = markdown(seed_rows(runs), list(runs))
    if args.out:
        atomic_write_text(args.out, text)
    else:
        print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
