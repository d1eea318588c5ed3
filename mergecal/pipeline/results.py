"""What a benchmark invocation writes under ``results/`` (the flow in ``mergecal/pipeline/flow.py`` only orchestrates).

``benchmark.json`` (a DVC output) holds only what the cells computed, so a cold run of the same inputs and code
writes the same bytes; ``metrics.json`` and ``leaderboard.csv`` are DVC's metrics and plots views of it; what
varies per run (invocation id, MLflow parent run, tracking URI, reuse, seconds) goes to ``invocation.json``,
which no stage declares.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from ..checkpoint import atomic_write_text

INVOCATION_FILE = "invocation.json"


def one_line(error: BaseException | Any) -> str:
    """An error as one line for MLflow, the manifest and the log (the first line, at most 500 characters)."""
    text = f"{type(error).__name__}: {error}" if isinstance(error, BaseException) else str(error)
    return text.strip().splitlines()[0][:500] if text.strip() else type(error).__name__


def summary_row(cell, cell_id: str, metrics: dict[str, float] | None = None, error: str | None = None,
                skipped: str | None = None) -> dict:
    """One row of ``benchmark.json``: the cell's identity and headline figures, its error, or why it is skipped."""
    row = {"cell_id": cell_id, "track": cell.track, "label": cell.label, "regime": cell.regime, "merge": cell.merge,
           "calibration": cell.calibration, "seed": cell.seed}
    if error is not None:
        return {**row, "error": error}
    if skipped is not None:
        return {**row, "skipped": skipped}
    return {**row, **{k: metrics[k] for k in ("avg_acc", "avg_norm_acc", "selected_scaling") if k in metrics}}


def skipped_id(cell, reason: str) -> str:
    """The id of a skipped chain: its cell and the reason (a new reason, or a chain that becomes supported,
    is a new id)."""
    payload = json.dumps({"cell": cell.to_dict(), "skipped": reason}, sort_keys=True)
    return "skip-" + hashlib.sha256(payload.encode()).hexdigest()[:15]


def write_results(output: Path, experiment: str, n_cells: int, failed: int, rows: list[dict],
                  invocation: dict[str, Any]) -> dict:
    """Write ``output`` (benchmark.json) and, beside it, invocation.json, metrics.json and leaderboard.csv;
    returns the summary the flow returns (the two JSON documents together)."""
    outcome = {"experiment": experiment, "cells": n_cells, "failed": failed,
               "rows": sorted(rows, key=lambda r: (r["track"], r["regime"], r["label"], r.get("seed", 0)))}
    atomic_write_text(output, json.dumps(outcome, indent=2))
    atomic_write_text(output.with_name(INVOCATION_FILE), json.dumps(invocation, indent=2))
    # with several fine-tuning seeds a row's key names its seed (one seed: the keys as they always were)
    several = len({r.get("seed", 0) for r in rows}) > 1
    regime = (lambda r: f"{r['regime']}@seed{r.get('seed', 0)}") if several else (lambda r: r["regime"])
    metrics = {"cells": n_cells, "failed": failed,
               **{f"{r['track']}/{regime(r)}/{r['label']}": round(r["avg_norm_acc"], 4)  # tracks share labels
                  for r in outcome["rows"] if "avg_norm_acc" in r}}
    atomic_write_text(output.with_name("metrics.json"), json.dumps(metrics, indent=2, sort_keys=True))
    csv = ["track,regime,label,avg_acc,avg_norm_acc"] + [
        f"{r['track']},{regime(r)},{r['label']},{r['avg_acc']:.4f},{r['avg_norm_acc']:.4f}"
        for r in outcome["rows"] if "avg_acc" in r]
    atomic_write_text(output.with_name("leaderboard.csv"), "\n".join(csv) + "\n")
    return {**invocation, **outcome}
