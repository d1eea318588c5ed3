"""Each method's own cost, per track and regime, from the cells' MLflow runs (``mergecal report --costs``).

Every computed cell logs its merge's and each calibration step's own cost (``mergecal.cost``): ``cost.seconds.<step>``
(one pass), ``cost.calls.<step>``, and the peak memory, ``cost.peak_mib.<step>`` for a pre-merge or feature-space
step (DisTaC, rescale, FSC) and ``cost.peak_mib.weight_space`` for the merge and the weight-space calibrations
together (they stream key by key). ``<step>`` is ``merge`` for the merge, else the calibration's name (a composite
DSC logs its parts, WSC and FSC).

The table has one row per track, regime, method and the unlabelled data it reads: the cells that ran it, the median
and range (min-max) of their per-pass seconds and of their peak MiB. A merge's peak is read from the cells where no
weight-space calibration streamed with it; a weight-space calibration's is the stream's, the merge's included.

Timings are no DVC output (results/ and reports/ are byte-for-byte reproducible): the table lives in a measurement
file committed by hand (``docs/measurements/cell-costs.{md,json}``), which reports/papers reads as committed.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import pandas as pd

from ..checkpoint import atomic_write_text
from ..cost import WEIGHT_SPACE
from ..errors import MergecalError
from ..recipe import Recipe
from .runs import FINISHED, invocations, metric

SECONDS, CALLS, PEAK = "cost.seconds.", "cost.calls.", "cost.peak_mib."
MERGE = "merge"  # the merge's step name in the cost metrics
DEFAULT_STEM = "docs/measurements/cell-costs"
DEFAULT_PROFILE = "default"  # the profile of an invocation whose parent run logged none
NO_DATA, TASK_DATA, AGNOSTIC_DATA = "none", "task", "task_agnostic"
KEY = ("track", "regime", "kind", "method", "data", "data_per_task")  # a row of the table
NO_COSTS = ("run `make run` first (cost metrics are logged since mergecal.cost: each cell's merge and calibration "
            "steps)")


def has_costs(row: pd.Series) -> bool:
    """Whether a cell run logged its steps' cost (cells computed before ``mergecal.cost`` did not)."""
    return bool(step_seconds(row))


def step_seconds(row: pd.Series) -> dict[str, float]:
    """A cell's per-pass seconds by step name (``merge`` and each calibration), as logged."""
    out = {}
    for column in row.index:
        if isinstance(column, str) and column.startswith("metrics." + SECONDS):
            value = metric(row, column[len("metrics."):])
            if value is not None:
                out[column[len("metrics." + SECONDS):]] = value
    return out


def cell_costs(row: pd.Series) -> dict[str, float | None] | None:
    """A cell's cost as the lab board shows it: the merge's seconds, its calibration steps' summed (one pass each),
    and the largest of its peak figures (MiB); None for a run without cost metrics (a reference, an older run)."""
    seconds = step_seconds(row)
    if not seconds:
        return None
    calibrations = [s for name, s in seconds.items() if name != MERGE]
    peaks = [v for column in row.index if isinstance(column, str) and column.startswith("metrics." + PEAK)
             and (v := metric(row, column[len("metrics."):])) is not None]
    return {"merge_s": seconds.get(MERGE), "calibration_s": sum(calibrations) if calibrations else None,
            "peak_mib": max(peaks) if peaks else None}


def step_data(step, distac_samples: int) -> tuple[str, int]:
    """(the kind of unlabelled data a recipe step reads, how many samples per task): FSC's ``n_samples_per_task``
    of task or task-agnostic data, DisTaC's ``distac_samples``, none for the merge and data-free steps."""
    if step.name == "fsc":
        data = AGNOSTIC_DATA if step.params.data == "task_agnostic" else TASK_DATA
        return data, int(step.params.n_samples_per_task)
    if step.name == "distac":
        return TASK_DATA, int(distac_samples)
    return NO_DATA, 0


def data_text(data: str, per_task: int) -> str:
    """``0``, ``1``, ``16 task-agnostic``: the data a step reads per task, as the tables show it."""
    return f"{per_task} task-agnostic" if data == AGNOSTIC_DATA else str(per_task) if data == TASK_DATA else "0"


def _steps(recipe_id: str, cache: dict[str, list]) -> list:
    if recipe_id not in cache:
        try:
            cache[recipe_id] = Recipe.parse(recipe_id).steps if recipe_id else []
        except MergecalError:
            cache[recipe_id] = []  # a recipe this checkout no longer parses: its steps read no data here
    return cache[recipe_id]


def step_records(cells: pd.DataFrame, distac_samples: int) -> list[dict[str, Any]]:
    """One record per (cell, step it timed): the row's key (``KEY``), its per-pass seconds and its peak MiB (None
    for a merge that streamed with a weight-space calibration: that peak is the calibration's)."""
    parsed: dict[str, list] = {}
    records = []
    for _, row in cells.iterrows():
        seconds = step_seconds(row)
        if not seconds:
            continue
        steps = {s.name: s for s in _steps(str(row.get("recipe_id") or ""), parsed)}
        own_peak = {name: metric(row, PEAK + name) for name in seconds if name != MERGE}
        weight_space = metric(row, PEAK + WEIGHT_SPACE)
        # a calibration without a peak of its own streamed with the merge (weight space)
        merge_alone = all(peak is not None for peak in own_peak.values())
        for name, value in sorted(seconds.items()):
            if name == MERGE:
                kind, method, data, peak = MERGE, str(row["merge"]), (NO_DATA, 0), weight_space if merge_alone else None
            else:
                step = steps.get(name)
                data = step_data(step, distac_samples) if step is not None else (NO_DATA, 0)
                kind, method = "calibration", name
                peak = own_peak[name] if own_peak[name] is not None else weight_space
            records.append({"track": str(row["track"]), "regime": str(row["regime"]), "kind": kind, "method": method,
                            "data": data[0], "data_per_task": data[1], "seconds": value, "peak_mib": peak,
                            "peak_scope": "own" if kind == "calibration" and own_peak[name] is not None
                            else WEIGHT_SPACE})
    return records


def _spread(values: list[float], digits: int) -> dict[str, float] | None:
    if not values:
        return None
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def cost_table(cells: pd.DataFrame, distac_samples: int = 0) -> list[dict[str, Any]]:
    """The per-method cost rows of ``cells`` (runs.load_runs rows of computed cells), sorted by ``KEY``: each with
    ``cells`` (how many ran it), ``seconds`` and ``peak_mib`` (``{median, min, max}``: per-pass seconds, peak MiB;
    peak None where no cell measured it apart) and ``peak_scope`` (``own`` or ``weight_space``: the merge's and
    weight-space calibrations' stream). ``distac_samples``: DisTaC's unlabelled samples per task (params'
    ``benchmark.evaluation.distac_samples``)."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for record in step_records(cells, distac_samples):
        groups.setdefault(tuple(record[k] for k in KEY), []).append(record)
    rows = []
    for key in sorted(groups, key=lambda k: (k[0], k[1], k[2] != MERGE, *k[3:])):
        found = groups[key]
        peaks = [r["peak_mib"] for r in found if r["peak_mib"] is not None]
        rows.append({**dict(zip(KEY, key)), "cells": len(found),
                     "seconds": _spread([r["seconds"] for r in found], 4), "peak_mib": _spread(peaks, 1),
                     "peak_scope": found[0]["peak_scope"]})
    return rows


def _profiles(runs: pd.DataFrame) -> dict[str, str]:
    """Invocation id -> the profile its parent run logged (``default`` when it logged none)."""
    parents = runs[runs["kind"] == "invocation"]
    column = "params.profile"
    values = parents[column] if column in parents else pd.Series([""] * len(parents), index=parents.index)
    return {str(i): str(p) if isinstance(p, str) and p else DEFAULT_PROFILE
            for i, p in zip(parents["invocation_id"], values)}


def chosen_invocations(runs: pd.DataFrame, invocation: str | None = None) -> list[str]:
    """``invocation`` alone, or the newest finished invocation of each profile (the default run's and the papers'
    ``make paper``), in time order."""
    if invocation is not None:
        from .runs import pick_invocation

        return [pick_invocation(runs, invocation)]
    table = invocations(runs)
    finished = table[(table["state"] == FINISHED) & (table["n_cells"] > 0)]
    profiles = _profiles(runs)
    newest = {profiles.get(i, DEFAULT_PROFILE): i for i in finished["invocation_id"]}  # time order: the last wins
    return [i for i in finished["invocation_id"] if i in set(newest.values())]


def measured_cells(runs: pd.DataFrame, invocation: str | None = None) -> tuple[pd.DataFrame, list[str]]:
    """The computed cells (status ok, with cost metrics) of the chosen invocations (``chosen_invocations``), one
    per cell id (its newest run), and those invocations. MergecalError (one line) when none has cost metrics."""
    chosen = chosen_invocations(runs, invocation) if not runs.empty else []
    cells = runs[(runs["kind"] == "cell") & runs["invocation_id"].isin(chosen) & (runs["status"] == "ok")] \
        if chosen else runs.iloc[0:0]
    cells = cells.sort_values(["start_time", "run_id"], kind="stable").drop_duplicates("run_id", keep="last")
    cells = cells.drop_duplicates("cell_id", keep="last")
    cells = cells[[has_costs(row) for _, row in cells.iterrows()]] if not cells.empty else cells
    if cells.empty:
        where = f"invocation(s) {', '.join(chosen)}" if chosen else "the tracking store"
        raise MergecalError(f"--costs: no cell with cost metrics in {where}; {NO_COSTS}")
    return cells.reset_index(drop=True), chosen


def _fmt(spread: Mapping[str, float] | None, digits: int) -> str:
    if spread is None:
        return "—"
    return f"{spread['median']:.{digits}f} [{spread['min']:.{digits}f}, {spread['max']:.{digits}f}]"


def costs_markdown(rows: list[dict[str, Any]], machine: str, sources: Iterable[str]) -> str:
    """The table as Markdown, headed by the machine and the invocations it was read from."""
    listed = ", ".join(f"`{s}`" for s in sources) or "none"
    lines = ["# Each method's own cost per cell", "",
             "Measured, not recomputed: written by `mergecal report --costs` from the MLflow runs of the benchmark's "
             "cells (`mergecal.cost`), committed by hand. Seconds are one pass of the step (a scaling search runs "
             "some steps once per value); the merge and the weight-space calibrations stream key by key, so their "
             "peak is one figure (`weight_space`: a calibration's includes its merge; a merge's is read from the "
             "cells where it streamed alone). Median [min, max] over the cells that ran the step.", "",
             f"Machine: {machine}.", "", f"Invocations: {listed}.", ""]
    if not rows:
        return "\n".join(lines + ["Not measured yet: run `make run`, then `mergecal report --costs`.", ""])
    lines += ["| track | regime | step | method | data per task | cells | seconds per pass | peak MiB | peak of |",
              "|---|---|---|---|---:|---:|---:|---:|---|"]
    lines += [f"| {r['track']} | {r['regime']} | {r['kind']} | `{r['method']}` | "
              f"{data_text(r['data'], r['data_per_task'])} | {r['cells']} | {_fmt(r['seconds'], 3)} | "
              f"{_fmt(r['peak_mib'], 1)} | {r['peak_scope']} |" for r in rows]
    return "\n".join(lines) + "\n"


def costs_json(rows: list[dict[str, Any]], machine: str, sources: Iterable[str]) -> str:
    return json.dumps({"machine": machine, "invocations": list(sources), "rows": rows}, indent=2, sort_keys=True) + "\n"


def write_costs(rows: list[dict[str, Any]], stem: str | Path, machine: str, sources: Iterable[str]) -> dict[str, Path]:
    """``<stem>.md`` and ``<stem>.json`` (each written atomically); returns {name: path}."""
    stem, sources = Path(stem), list(sources)
    markdown, document = costs_markdown(rows, machine, sources), costs_json(rows, machine, sources)
    return {path.name: atomic_write_text(path, text)
            for path, text in ((stem.with_name(stem.name + ".md"), markdown),
                               (stem.with_name(stem.name + ".json"), document))}


# ------------------------------------------------------------------------------------- a chain's time, for a paper

def read_costs(path: str | Path) -> dict[str, Any] | None:
    """A committed cost file (``{machine, invocations, rows}``), None when it is absent; MergecalError (one line)
    when it is no such file."""
    path = Path(path)
    if not path.is_file():
        return None
    try:
        document = json.loads(path.read_text())
        rows = document["rows"]
        if not isinstance(rows, list) or not all(isinstance(r, dict) and set(KEY) <= set(r) for r in rows):
            raise TypeError(f"rows must be objects with {', '.join(KEY)}")
    except (ValueError, KeyError, TypeError) as err:
        raise MergecalError(f"{path}: not a `mergecal report --costs` JSON with `rows` ({type(err).__name__}: "
                            f"{err})") from None
    return document


def chain_seconds(rows: list[dict[str, Any]], track: str, regime: str, recipe: str) -> float | None:
    """One pass of ``recipe``'s merge and calibration steps: the sum of each step's median per-pass seconds in
    ``rows`` (its track, regime, and for FSC the data it reads); None when a step was not measured."""
    total = 0.0
    for step in Recipe.parse(recipe).steps:
        kind, method = (MERGE, step.name) if step.phase == "merge" else ("calibration", step.name)
        data, per_task = step_data(step, 0)
        found = next((r for r in rows if (r["track"], r["regime"], r["kind"], r["method"], r["data"]) ==
                      (track, regime, kind, method, data)
                      and (step.name == "distac" or r["data_per_task"] == per_task)), None)
        if found is None or not found.get("seconds"):
            return None
        total += float(found["seconds"]["median"])
    return total


__all__ = ["DEFAULT_STEM", "cell_costs", "chain_seconds", "chosen_invocations", "cost_table", "costs_json",
           "costs_markdown", "data_text", "measured_cells", "read_costs", "step_data", "write_costs"]
