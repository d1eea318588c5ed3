"""Read the benchmark's MLflow runs (one parent per invocation, one child per cell) into a DataFrame.

Reports only read: everything comes from ``MlflowClient.search_runs`` and the runs' ``diagnostics/``
artifacts, so a report can be rebuilt at any time from the tracking store alone. Tag names follow the
logging contract (``mergecal.kind``, ``mergecal.invocation_id``, ``mergecal.recipe``, ...).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pandas as pd

from ..errors import MergecalError
from ..pipeline.tracking import EXAMPLES, EXAMPLES_DIR, EXAMPLES_SPLIT, PREFIX, redact
from .run_cache import RunCache, cache_path, cached_examples, search_all

# tags (named in mergecal.pipeline.tracking, without the prefix) read into DataFrame columns
TAG_COLUMNS = ("kind", "invocation_id", "code_version", "cells", "cell_id", "status", "error", "backbone", "task_set",
               "regime", "merge", "calibration", "recipe", "tasks", "seed", "recipe_id", "track", "user", "host",
               "params_sha256")
GROUP = ("backbone", "task_set", "regime")
SEED = "seed"  # the fine-tuning seed's tag column ("" on a run logged before seeds were recorded)
DIAGNOSTICS = ("sensitivity", "magic_coefficients", "svc_spectra", "task_vectors", "scaling_curve")
MANIFEST_THREADS = 8  # the invocations' manifests are read 8 at a time: one small download each, hundreds a lab


def _row(run) -> dict[str, Any]:
    tags = run.data.tags
    row: dict[str, Any] = {
        "run_id": run.info.run_id,
        "parent_run_id": tags.get("mlflow.parentRunId", ""),
        "run_status": run.info.status,
        "start_time": int(run.info.start_time or 0),
        "artifact_uri": run.info.artifact_uri,
    }
    for name in TAG_COLUMNS:
        row[name] = tags.get(PREFIX + name, "")
    # A cell without a status tag never finished (killed or still running): show it, never as a result.
    if row["kind"] == "cell" and row["status"] not in ("ok", "failed", "skipped"):
        row["error"] = row["error"] or f"no {PREFIX}status tag (MLflow run status {run.info.status})"
        row["status"] = "incomplete"
    row["tasks"] = tuple(t for t in row["tasks"].split(",") if t)
    row["cached"] = False  # a run is its own invocation's result; reuse is read from manifests (_reused_cells)
    row.update({f"metrics.{k}": float(v) for k, v in run.data.metrics.items()})
    row.update({f"params.{k}": v for k, v in run.data.params.items()})
    return row


# a cache of rows read by another version of ``_row`` is rebuilt (``run_cache``)
ROW_FINGERPRINT = hashlib.sha256((inspect.getsource(_row) + repr(TAG_COLUMNS)).encode()).hexdigest()[:16]


def load_runs(tracking_uri: str, experiment: str = "mergecal", cache_dir: str | Path | None = None) -> pd.DataFrame:
    """Every active run of ``experiment``: one row, tag columns by short name, ``metrics.*`` and ``params.*``.
    ``cache_dir``: keep what was read there and ask the store only for what is new (``run_cache``).

    Sorted by (start_time, run_id) so everything built from it is deterministic.
    """
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        raise MergecalError(f"{redact(tracking_uri)}: experiment {experiment!r} not found")
    cache = None
    if cache_dir is None:
        rows = [_row(run) for run in search_all(client, found.experiment_id)]
    else:
        cache = RunCache(cache_path(cache_dir, tracking_uri, found.experiment_id), ROW_FINGERPRINT)
        rows = [{**row, "tasks": tuple(row["tasks"])} for row in cache.refresh(client, found.experiment_id, _row)]
    columns = ["run_id", "parent_run_id", "run_status", "start_time", "artifact_uri", *TAG_COLUMNS]
    rows.extend(_reused_cells(tracking_uri, rows, cache))
    if cache is not None:
        cache.save()
    frame = pd.DataFrame(rows, columns=None if rows else columns)
    extra = sorted(c for c in frame.columns if c not in columns)
    return frame[columns + extra].sort_values(["start_time", "run_id"], kind="stable").reset_index(drop=True)


def _reused_cells(tracking_uri: str, rows: list[dict[str, Any]], cache: RunCache | None = None) -> list[dict[str, Any]]:
    """A cell reused from the cache is not logged again (no duplicate runs): the invocation's parent run lists
    every cell it used in its ``cells.json`` artifact. Such a cell joins that invocation as a copy of its
    original row, marked ``cached``, so every invocation has its full set of cells."""
    by_id = {row["run_id"]: row for row in rows}
    extra = []
    parents = [r for r in rows if r["kind"] == "invocation" and r["run_status"] == "FINISHED"]

    def manifest(parent: dict) -> dict | None:
        def read():
            return _manifest(tracking_uri, parent["artifact_uri"])

        return read() if cache is None else cache.manifest(parent["run_id"], read)

    with _quiet_downloads(), ThreadPoolExecutor(MANIFEST_THREADS) as pool:
        manifests = list(pool.map(manifest, parents))
    for parent, manifest_of in zip(parents, manifests):
        for entry in (manifest_of or {}).values():
            original = by_id.get(entry.get("run_id"))
            if original is not None and original["invocation_id"] != parent["invocation_id"]:
                extra.append({**original, "invocation_id": parent["invocation_id"], "cached": True,
                              "start_time": parent["start_time"]})
    return extra


def _manifest(tracking_uri: str, artifact_uri: str) -> dict | None:
    """An invocation's ``cells.json``, None when it was logged without one."""
    from mlflow import artifacts

    with tempfile.TemporaryDirectory(prefix="mergecal-manifest-") as tmp:
        try:
            local = artifacts.download_artifacts(artifact_uri=f"{artifact_uri}/cells.json", dst_path=tmp,
                                                 tracking_uri=tracking_uri)
            return json.loads(Path(local).read_text())
        except Exception:  # an invocation logged without a manifest: its own cells only
            return None


def qualified(cells: pd.DataFrame) -> pd.DataFrame:
    """``cells`` with ``recipe`` and ``merge`` naming every non-default hyperparameter (``ties(top_k=0.3)>svc``;
    ``mergecal.reports.labels``): what tells rows of different invocations or checkouts apart."""
    from .labels import qualified_label, qualified_merge

    if cells.empty:
        return cells
    triples = list(zip(cells["recipe"], cells["recipe_id"], cells["merge"]))
    # each distinct recipe once (a label is parsed, a few ms): a lab's store repeats a few hundred over all its runs
    names = {t: (qualified_label(t[0], t[1]), qualified_merge(t[2], t[0], t[1])) for t in dict.fromkeys(triples)}
    return cells.assign(recipe=[names[t][0] for t in triples], merge=[names[t][1] for t in triples])


def invocations(runs: pd.DataFrame) -> pd.DataFrame:
    """One row per invocation in time order: id, start_time (ms), code_version, n_cells, n_failed, n_skipped
(n_cells counts the skipped chains' runs too: chains a track cannot run, logged with their reason), run_status
(its parent run's MLflow status, "" without one), n_expected (the cells it set out to compute, 0 when not
recorded) and state (``finished``, or why the invocation is no result: ``unfinished_state``).

    The time of an invocation is its parent run's start; cells logged without a parent fall back to
    their earliest cell.
    """
    cells = runs[runs["kind"] == "cell"]
    parents = runs[runs["kind"] == "invocation"].drop_duplicates("invocation_id", keep="first")
    ids = sorted(set(cells["invocation_id"]) | set(parents["invocation_id"]))
    # per invocation in one pass over the runs (a lab's store holds hundreds of invocations)
    counts = pd.DataFrame({"invocation_id": cells["invocation_id"], "start_time": cells["start_time"],
                           "failed": ~cells["status"].isin(["ok", "skipped"]),
                           "skipped": cells["status"] == "skipped"}).groupby("invocation_id", sort=False)
    n_cells, first_start = counts.size(), counts["start_time"].min()
    n_failed, n_skipped = counts["failed"].sum(), counts["skipped"].sum()
    by_parent = {row["invocation_id"]: row for row in parents.to_dict("records")}
    rows = []
    for inv in ids:
        parent = by_parent.get(inv)
        start = int(parent["start_time"]) if parent is not None else int(first_start[inv])
        code = parent["code_version"] if parent is not None else ""
        expected = str(parent["cells"]) if parent is not None else ""
        row = {"invocation_id": inv, "start_time": start, "code_version": code,
               "n_cells": int(n_cells.get(inv, 0)), "n_failed": int(n_failed.get(inv, 0)),
               "n_skipped": int(n_skipped.get(inv, 0)),
               "run_status": str(parent["run_status"]) if parent is not None else "",
               "n_expected": int(expected) if expected.isdigit() else 0}
        rows.append({**row, "state": unfinished_state(row) or FINISHED})
    frame = pd.DataFrame(rows, columns=["invocation_id", "start_time", "code_version", "n_cells", "n_failed",
                                        "n_skipped", "run_status", "n_expected", "state"])
    return frame.sort_values(["start_time", "invocation_id"], kind="stable").reset_index(drop=True)


FINISHED = "finished"  # the state of an invocation that is a result


def unfinished_state(invocation: dict[str, Any]) -> str | None:
    """Why an invocation (a row of ``invocations``) is no result, or None when it is one: its parent run ended
    FINISHED (the flow ends it only after every cell has a run) and, where the parent records how many cells it
    set out to compute, the store holds that many. A benchmark killed mid-run leaves its parent RUNNING (the next
    invocation marks it KILLED) with only the cells finished before the kill."""
    computed = invocation["n_cells"] - invocation["n_skipped"]
    expected = invocation["n_expected"]
    cells = f"{computed} of {expected} cells" if expected else f"{computed} cells"
    status = invocation["run_status"]
    if status == "FINISHED":
        return f"incomplete: {cells}" if expected and computed < expected else None
    if status == "RUNNING":
        return f"killed or still running (MLflow status RUNNING, never finished): {cells}"
    if status == "KILLED":
        return f"killed (MLflow status KILLED): {cells}"
    if not status:
        return f"no invocation run (cells logged without a parent): {cells}"
    return f"not finished (MLflow status {status}): {cells}"


def pick_invocation(runs: pd.DataFrame, invocation: str | None = None) -> str:
    """``invocation`` if it has cells and finished, else the latest finished invocation that has any; a killed,
    failed or still running invocation is never a result (MergecalError naming its state)."""
    table = invocations(runs)
    with_cells = table[table["n_cells"] > 0]
    finished = with_cells[with_cells["state"] == FINISHED]
    known = ", ".join(finished["invocation_id"]) or "none"
    if invocation is not None:
        if invocation not in set(with_cells["invocation_id"]):
            listed = ", ".join(with_cells["invocation_id"]) or "none"
            raise MergecalError(f"invocation {invocation!r}: no cells logged for it (invocations with cells: {listed})")
        state = with_cells.loc[with_cells["invocation_id"] == invocation, "state"].iloc[0]
        if state != FINISHED:
            raise MergecalError(f"invocation {invocation!r} is no result ({state}); reports read finished "
                                f"invocations only: {known}")
        return invocation
    if with_cells.empty:
        raise MergecalError("tracking store: no cell runs (mergecal.kind=cell) found")
    if finished.empty:
        latest = with_cells.iloc[-1]
        raise MergecalError(f"tracking store: no finished benchmark invocation to report; the latest, "
                            f"{latest['invocation_id']}, is no result ({latest['state']}): rerun the benchmark "
                            "(dvc repro)")
    return str(finished["invocation_id"].iloc[-1])


def cells_of(runs: pd.DataFrame, invocation: str) -> pd.DataFrame:
    """The invocation's cells, one per (backbone, task set, regime, fine-tuning seed, recipe).

    A recipe logged twice in one invocation (a retried cell) counts with its latest run.
    """
    cells = runs[(runs["kind"] == "cell") & (runs["invocation_id"] == invocation)]
    cells = cells.drop_duplicates([*GROUP, SEED, "recipe"], keep="last")
    return cells.sort_values([*GROUP, SEED, "recipe", "run_id"], kind="stable").reset_index(drop=True)


def seed_order(seed: str) -> tuple:
    """Sort key of a seed tag: "" (runs that recorded none) first, then numeric order."""
    return (seed != "", int(seed) if seed.isdigit() else 0, seed)


def seeds_of(cells: pd.DataFrame) -> list[str]:
    """The fine-tuning seeds of an invocation's cells, in numeric order ("" for runs that recorded none)."""
    return sorted(set(cells[SEED]), key=seed_order)


def metric(row: pd.Series, name: str) -> float | None:
    """A metric of one run row, None when it was not logged."""
    value = row.get(f"metrics.{name}")
    return None if value is None or pd.isna(value) else float(value)


@contextmanager
def _quiet_downloads():
    """MLflow draws a progress bar for every download; reports read a handful of small JSON files."""
    name = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"
    before = os.environ.get(name)
    os.environ[name] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before


def _load_json_artifacts(tracking_uri: str, artifact_uri: str, folder: str, names) -> dict[str, Any]:
    """The ``<folder>/<name>.json`` artifacts among ``names`` that exist under a run's ``artifact_uri``, by name.
    Addressed by artifact URI (not ``runs:/``), which spares a store lookup per file."""
    from mlflow import artifacts

    listing = artifacts.list_artifacts(artifact_uri=f"{artifact_uri}/{folder}", tracking_uri=tracking_uri)
    present = {Path(info.path).name for info in listing if not info.is_dir}
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="mergecal-artifacts-") as tmp, _quiet_downloads():
        for name in names:
            if f"{name}.json" not in present:
                continue
            local = artifacts.download_artifacts(artifact_uri=f"{artifact_uri}/{folder}/{name}.json", dst_path=tmp,
                                                 tracking_uri=tracking_uri)
            try:
                out[name] = json.loads(Path(local).read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise MergecalError(f"{artifact_uri}/{folder}/{name}.json: not valid JSON ({exc})") from None
    return out


def load_diagnostics(tracking_uri: str, artifact_uri: str) -> dict[str, Any]:
    """The ``diagnostics/*.json`` artifacts that exist under a run's ``artifact_uri``, by name without
    ``.json``."""
    return _load_json_artifacts(tracking_uri, artifact_uri, "diagnostics", DIAGNOSTICS)


def load_examples(tracking_uri: str, artifact_uri: str, cache_dir: str | Path | None = None,
                  run_id: str | None = None) -> dict[str, list] | None:
    """A cell's per-example test scores (``{task: [score per example]}``, the ``EXAMPLES`` artifact of the run that
    computed it), or None when the run logged none (a run older than the artifact, or a failed cell). With a
    ``cache_dir``, read once for the finished run ``run_id`` (``run_cache.cached_examples``)."""
    if cache_dir is not None and run_id is not None:
        return cached_examples(cache_dir, tracking_uri, run_id, lambda: load_examples(tracking_uri, artifact_uri))
    data = _load_json_artifacts(tracking_uri, artifact_uri, EXAMPLES_DIR, (EXAMPLES_SPLIT,)).get(EXAMPLES_SPLIT)
    if data is not None and (not isinstance(data, dict) or not all(isinstance(v, list) for v in data.values())):
        raise MergecalError(f"{artifact_uri}/{EXAMPLES}: expected {{task: [score per example]}}")
    return data
