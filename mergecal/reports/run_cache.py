"""A checkout's local copy of what a board has read from a tracking store, so that the next board asks the store
only for what is new (#62; docs/performance.md, "A lab's store at scale").

A lab's store grows every night, and MLflow returns whole runs (every tag, param and metric) at 10-16 ms a run
on a loaded server: a board that read every run again grew with the store, not with what it shows. What never
changes once written is kept here, under ``.mergecal/board-cache/`` (one JSON file per store and experiment):

* each run's row (``mergecal.reports.runs._row``) once the run has ended (FINISHED, FAILED, KILLED); a run that
  has not is asked for again by id on the next read;
* the runs started since the newest one kept, less ``SLACK_MS`` (MLflow takes a run's ``start_time`` from the
  member's own clock, which may be behind the others'), are asked for by one ``start_time`` filter;
* the runs deleted since (a member's duplicate computation of a cell, ``Tracker.log_cell``) are dropped: one
  search of the deleted runs, of which a store holds few;
* each finished invocation's manifest (``cells.json``), read once; each shown cell's per-example scores, read once
  into a file of their own (``cached_examples``: a shown cell's run has ended).

A cache written by another reader (``fingerprint``: the row reader's source and the tag columns) or unreadable is
ignored and rebuilt. JSON only (nothing unpickled), written atomically. Reading a store without a cache
(``cache_dir=None``) reads every run, as before.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from ..checkpoint import atomic_write_text
from ..pipeline.tracking import redact

SLACK_MS = 3_600_000  # runs up to an hour older than the newest kept are asked for again
ENDED = frozenset({"FINISHED", "FAILED", "KILLED"})
PAGE = 1000  # MLflow's default page (a 10,000-run page ran the server out of memory: docs/performance.md)


def cache_path(cache_dir: str | Path, tracking_uri: str, experiment_id: str) -> Path:
    """The cache file of one experiment of one store (named by a digest: the URI may hold a host and port)."""
    digest = hashlib.sha256(f"{redact(tracking_uri)}\n{experiment_id}".encode()).hexdigest()[:20]
    return Path(cache_dir) / f"runs-{digest}.json"


def _read(path: Path, fingerprint: str) -> dict[str, Any]:
    empty = {"fingerprint": fingerprint, "rows": {}, "manifests": {}}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return empty
    if not isinstance(data, dict) or data.get("fingerprint") != fingerprint:
        return empty
    return {**empty, **{k: data[k] for k in ("rows", "manifests") if isinstance(data.get(k), dict)}}


def search_all(client, experiment_id: str, filter_string: str = "", view_type: int | None = None) -> Iterable:
    """Every run of the experiment matching ``filter_string``, page by page."""
    token = None
    while True:
        kwargs = {"run_view_type": view_type} if view_type is not None else {}
        page = client.search_runs([experiment_id], filter_string=filter_string, max_results=PAGE,
                                  page_token=token, **kwargs)
        yield from page
        token = page.token
        if not token:
            return


class RunCache:
    """The cached rows of one experiment, brought up to date by ``refresh``; ``save`` writes them back."""

    def __init__(self, path: Path, fingerprint: str):
        self.path, self.fingerprint = path, fingerprint
        self.data = _read(path, fingerprint)
        self.asked = 0  # runs the store returned in this refresh (for the measurements)

    def refresh(self, client, experiment_id: str, row: Callable[[Any], dict[str, Any]]) -> list[dict[str, Any]]:
        """Every active run's row: the kept ones, those started since, the unended ones again, the deleted ones
        dropped."""
        from mlflow.entities import ViewType

        rows: dict[str, dict] = self.data["rows"]
        newest = max((r["start_time"] for r in rows.values()), default=None)
        since = "" if newest is None else f"attributes.start_time >= {max(newest - SLACK_MS, 0)}"
        fresh = {run.info.run_id: row(run) for run in search_all(client, experiment_id, since)}
        self.asked = len(fresh)
        for run_id in [i for i, r in rows.items() if r["run_status"] not in ENDED and i not in fresh]:
            try:
                fresh[run_id] = row(client.get_run(run_id))
                self.asked += 1
            except Exception:  # gone (deleted for good): dropped below
                rows.pop(run_id)
        rows.update(fresh)
        if rows and newest is not None:
            for run in search_all(client, experiment_id, view_type=ViewType.DELETED_ONLY):
                rows.pop(run.info.run_id, None)
                self.data["manifests"].pop(run.info.run_id, None)
        return list(rows.values())

    def manifest(self, run_id: str, read: Callable[[], dict | None]) -> dict | None:
        """An ended invocation's manifest, read once."""
        found = self.data["manifests"].get(run_id)
        if found is None:
            found = read()
            if found is not None and self.data["rows"].get(run_id, {}).get("run_status") in ENDED:
                self.data["manifests"][run_id] = found
        return found

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(self.path, json.dumps(self.data, separators=(",", ":"), sort_keys=True))


def cached_examples(cache_dir: str | Path, tracking_uri: str, run_id: str, read: Callable[[], Any]) -> Any:
    """A finished cell run's per-example scores (an artifact never rewritten), read once into
    ``<cache_dir>/examples-<store>/<run_id>.json``."""
    store = hashlib.sha256(redact(tracking_uri).encode()).hexdigest()[:20]
    path = Path(cache_dir) / f"examples-{store}" / f"{run_id}.json"
    try:
        return json.loads(path.read_text())["examples"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    found = read()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, json.dumps({"examples": found}, separators=(",", ":")))
    return found
