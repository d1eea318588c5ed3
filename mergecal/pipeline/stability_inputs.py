"""What the stability stage reads of the benchmark's results: its uncalibrated task-arithmetic rows (track,
regime, seed, label, chosen scaling). The benchmark stage writes them to a file of their own, the stability stage's
DVC input instead of the whole ``results/benchmark.json``, so that an edit that moves only other rows (another
merge method, a calibration) leaves the file as it was and ``dvc repro`` skips the stability stage (~5 min on
2 cores)."""

from __future__ import annotations

import json

PATH = "results/task_arithmetic_rows.json"
MERGE = "task_arithmetic"
FIELDS = ("track", "regime", "seed", "label", "merge", "selected_scaling")


def task_arithmetic_rows(results: dict) -> dict:
    """``results`` (benchmark.json) reduced to its uncalibrated task-arithmetic rows and their ``FIELDS``, in a
    fixed order: the same rows give the same file whatever else the benchmark computed."""
    rows = [{f: row[f] for f in FIELDS if f in row} for row in results.get("rows", [])
            if row.get("merge") == MERGE and ">" not in row.get("label", ">")]
    return {"rows": sorted(rows, key=lambda row: json.dumps(row, sort_keys=True))}
