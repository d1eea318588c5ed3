"""MLflow tracking of the benchmark: one parent run per invocation, one child run per computed cell.

Store (``resolve_uri``): ``MLFLOW_TRACKING_URI`` when set (MLflow's own convention), else ``tracking.uri`` in
params.yaml, else the checkout's own ``<root>/<tracking.store>/mlruns.db`` (SQLite) with artifacts under
``<root>/<tracking.store>/artifacts``. On a tracking server (``http(s)://``) the experiment is created without an
artifact location, so artifacts go where the server says (``mlflow-artifacts:`` when it proxies them), never to one
client's local path; a database URI other than the default needs ``tracking.artifacts``. Every run carries its
provenance (user, host, code version, params digest: ``provenance``); a URI is shown only redacted (``redact``).
The code version is always a commit of the repository the benchmark runs in (``code_version``): a repository
without a commit yet (a fresh smoke workspace) records ``no-commit``, never the commit of the checkout it was
copied from. A computed cell's run also names the worker that computed it, ``mergecal.worker``
(``mergecal.pipeline.workers.worker_name``): ``host:pid``, the Dask worker's ``name=`` (its ``--name``, else its
address) or, off Dask, the pool's ``thread=``, and last the checkout it read, ``root=``; one tag, written for people
(``gpu1:4711 name=w1 root=/data/mergecal``), which an MLflow search matches with ``LIKE '% name=w1 %'``.
A cell's run is created only once its result is complete, and everything is logged in a few batched calls
right before the run is ended, so a killed benchmark leaves at most one unfinished run, which the next
invocation marks KILLED (reports read FINISHED runs only). A cell whose id already has a FINISHED run is not
logged again: cached and repeated cells never duplicate runs; the invocation's manifest points at the run.
That run is also a cache: a cell killed after its run was logged but before Prefect persisted its result is
taken from the run (``finished_cell``) instead of being computed again.
"""

from __future__ import annotations

import getpass
import json
import logging
import math
import os
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit, urlunsplit

from ..errors import MergecalError
from .config import STORE_SCHEMES

logger = logging.getLogger(__name__)

MAX_METRICS, MAX_PARAMS, MAX_TAGS = 1000, 100, 100
# a cell's per-example test scores, {task: [score per example, in the split's order]} (0/1 for accuracy): the
# leaderboard's confidence intervals resample them (mergecal.intervals)
EXAMPLES_DIR, EXAMPLES_SPLIT = "examples", "test"
EXAMPLES = f"{EXAMPLES_DIR}/{EXAMPLES_SPLIT}.json"

# Every tag the pipeline writes, named once here; the reports read them by these names (mergecal.reports.runs).
PREFIX = "mergecal."
TAGS = ("kind", "invocation_id", "code_version", "cells", "cell_id", "status", "error", "backbone", "task_set",
        "regime", "merge", "calibration", "recipe", "recipe_id", "tasks", "track", "device", "seed", "user", "host",
        "params_sha256", "checkout", "worker", "left_out")
# what says who computed a run, where and from what (``provenance``): on the invocation and on every cell run
PROVENANCE = ("user", "host", "code_version", "params_sha256")
URI_ENV = "MLFLOW_TRACKING_URI"
SERVER_SCHEMES = ("http", "https")
# the version of the checkout a workspace was copied from (mergecal.pipeline.workspace): where the workspace came
# from, never its code version while it is a git repository (that is the workspace repository's own commit)
SOURCE_VERSION = Path(".mergecal") / "source_version"
NO_COMMIT = "no-commit"  # the code version in a git repository that has no commit yet
COPY_OF = "copy-of-"  # the code version of a copy outside any git repository: not a commit of any repository here


def tag(name: str) -> str:
    """The MLflow tag key of one of ``TAGS``."""
    if name not in TAGS:
        raise KeyError(f"unknown mergecal tag {name!r}")
    return PREFIX + name


def cell_tags(cell) -> dict[str, str]:
    """The tags that identify a cell's run (a ``mergecal.pipeline.cells.Cell``)."""
    return {tag("backbone"): cell.backbone, tag("task_set"): cell.task_set, tag("regime"): cell.regime,
            tag("merge"): cell.merge, tag("calibration"): cell.calibration, tag("recipe"): cell.label,
            tag("recipe_id"): cell.recipe or cell.merge, tag("tasks"): ",".join(cell.tasks), tag("track"): cell.track,
            tag("seed"): str(cell.seed)}


def cell_key(cell_id: str) -> str:
    """The tag whose key names a cell and whose value is its run's status (ok, failed, skipped): what a cell's
    lookup filters on. MLflow's tags table is keyed by (key, run) and has no index on the value, so a filter on the
    ``cell_id`` tag's value reads that tag of every run of the store (linear in a lab's accumulated runs), one on
    this key is an index lookup (docs/performance.md, "A lab's store at scale")."""
    return f"{PREFIX}cell.{cell_id}"


def store_dir(root: str | Path, store: str) -> Path:
    return (Path(root) / store).resolve()


def tracking_uri(root: str | Path, store: str = "mlruns") -> str:
    """The checkout's own store: ``sqlite:///<root>/<store>/mlruns.db``."""
    return f"sqlite:///{store_dir(root, store) / 'mlruns.db'}"


def resolve_uri(root: str | Path, tracking) -> str:
    """The tracking URI of a checkout: ``MLFLOW_TRACKING_URI`` when set, else ``tracking.uri``, else the checkout's
    own SQLite store (``tracking``: params.yaml's ``tracking`` section). A server URI's ``user:password@`` moves to
    MLflow's own ``MLFLOW_TRACKING_USERNAME`` / ``MLFLOW_TRACKING_PASSWORD`` (unless they are set): MLflow prints a
    run's address when it ends it, and that address must not carry a password."""
    uri = os.environ.get(URI_ENV) or tracking.uri
    if not uri:
        return tracking_uri(root, tracking.store)
    return without_credentials(check_uri(uri, URI_ENV if os.environ.get(URI_ENV) else "tracking.uri"))


def without_credentials(uri: str) -> str:
    """An http(s) ``uri`` without its user and password, which go to MLflow's basic-auth variables (see
    ``resolve_uri``); any other URI as it is (a database URI's password is the database driver's)."""
    parts = urlsplit(uri)
    if not is_server(uri) or parts.username is None:
        return uri
    os.environ.setdefault("MLFLOW_TRACKING_USERNAME", unquote(parts.username))
    if parts.password is not None:
        os.environ.setdefault("MLFLOW_TRACKING_PASSWORD", unquote(parts.password))
    return urlunsplit(parts._replace(netloc=parts.netloc.rpartition("@")[2]))


def check_uri(uri: str, source: str) -> str:
    """``uri`` when it has a scheme MLflow stores runs behind, else one MergecalError naming ``source``."""
    if urlsplit(uri).scheme.split("+")[0] not in STORE_SCHEMES:
        raise MergecalError(f"{source}={redact(uri)}: expected a tracking server (http://host:5000) or a database "
                            "URI (postgresql://..., sqlite:////abs/path/mlruns.db)")
    return uri


def is_server(uri: str) -> bool:
    return urlsplit(uri).scheme in SERVER_SCHEMES


def redact(uri: str) -> str:
    """``uri`` with any password replaced by ``***`` (what may be printed, logged or stored)."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    host = parts.netloc.rpartition("@")[2]
    return urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{host}"))


def _git(root: str | Path, *args: str) -> str:
    """``git args`` in ``root``: its output, "" when git fails or is not installed."""
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def code_version(root: str | Path = ".") -> str:
    """The commit of the repository at ``root`` (12 hex digits), ``-dirty`` with uncommitted changes to tracked
    files; ``no-commit`` in a repository without a commit yet (a fresh smoke workspace: its own history starts with
    its first commit, and the checkout it was copied from is another repository). A workspace copy that is no git
    repository of its own names the version it was copied from as ``copy-of-<version>``, which no commit filter
    takes for a commit; else ``unknown``."""
    source = Path(root) / SOURCE_VERSION
    # a copy inside another repository's tree (not a repository of its own) would take that repository's commit
    copy = source.is_file() and _git(root, "rev-parse", "--show-toplevel") != str(Path(root).resolve())
    if not copy and _git(root, "rev-parse", "--is-inside-work-tree") == "true":
        sha = _git(root, "rev-parse", "--verify", "--quiet", "--short=12", "HEAD")
        if not sha:
            return NO_COMMIT
        return sha + ("-dirty" if _git(root, "status", "--porcelain", "--untracked-files=no") else "")
    return COPY_OF + source.read_text().strip() if source.is_file() else "unknown"


def provenance(root: str | Path, params_sha256: str) -> dict[str, str]:
    """Who computes a run, where, from which code and parameters: the tags of ``PROVENANCE``, and the checkout's
    path (which runs a restarted benchmark of this checkout may mark KILLED in a shared store)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no name for the uid (a container)
        user = str(os.getuid())
    return {tag("user"): user, tag("host"): socket.gethostname(), tag("code_version"): code_version(root),
            tag("params_sha256"): params_sha256, tag("checkout"): str(Path(root).resolve())}


class Tracker:
    """Thin wrapper over ``MlflowClient`` bound to one experiment."""

    def __init__(self, root: str | Path, experiment: str = "mergecal", store: str = "mlruns", *,
                 uri: str | None = None, artifacts: str | None = None, tags: dict[str, str] | None = None):
        """``uri`` None: the checkout's own SQLite store; else a tracking server or a database (``artifacts``: where
        a database URI's experiment keeps its artifacts). ``tags``: added to every run it creates (provenance)."""
        from mlflow.tracking import MlflowClient

        if uri is None:
            directory = store_dir(root, store)
            directory.mkdir(parents=True, exist_ok=True)
            uri, artifacts = tracking_uri(root, store), (directory / "artifacts").as_uri()
        elif not is_server(uri) and not artifacts:
            raise MergecalError(f"tracking.uri {redact(uri)}: a database URI needs tracking.artifacts (an artifact "
                                "location every machine of the lab reaches, e.g. s3://bucket/mlflow), or use an MLflow "
                                "tracking server (http://host:5000), which says where artifacts go")
        self.uri = uri
        self.store = store
        self.tags = dict(tags or {})
        self.client = MlflowClient(tracking_uri=self.uri)
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            try:  # on a server: no artifact location, the server chooses (mlflow-artifacts: when it proxies them)
                self.experiment_id = self.client.create_experiment(
                    experiment, artifact_location=None if is_server(uri) else artifacts)
            except Exception:  # created concurrently by another process
                found = self.client.get_experiment_by_name(experiment)
                if found is None:
                    raise
                self.experiment_id = found.experiment_id
        else:
            self.experiment_id = found.experiment_id
            location = found.artifact_location or ""
            if is_server(uri) and location.startswith("file:"):
                raise MergecalError(f"experiment {experiment!r} on {redact(uri)} keeps its artifacts at {location}, a "
                                    "path only the client that created it has: set tracking.experiment to a new name "
                                    "(the server then chooses the artifact store)")
        self.experiment = experiment

    @classmethod
    def of(cls, root: str | Path, tracking, tags: dict[str, str] | None = None) -> "Tracker":
        """The tracker of a checkout's params (``tracking``: params.yaml's section; ``resolve_uri`` picks the
        store)."""
        uri = resolve_uri(root, tracking)
        default = uri == tracking_uri(root, tracking.store)
        return cls(root, tracking.experiment, tracking.store, uri=None if default else uri,
                   artifacts=tracking.artifacts, tags=tags)

    @property
    def shown_uri(self) -> str:
        return redact(self.uri)

    # -- invocations -------------------------------------------------------------------------------------
    def mark_unfinished_killed(self, root: str | Path | None = None) -> int:
        """Runs left RUNNING by a killed benchmark are marked KILLED (never reported). In the checkout's own store,
        every one; in a store the lab shares, only those started from the checkout ``root`` on this host (another
        member's benchmark may be running)."""
        where = "attributes.status = 'RUNNING'"
        if root is not None and self.uri != tracking_uri(root, self.store):
            where += (f" and tags.`{tag('host')}` = '{socket.gethostname()}' "
                      f"and tags.`{tag('checkout')}` = '{Path(root).resolve()}'")
        return self._kill(where)

    def kill_unfinished_cells(self, invocation_id: str) -> int:
        """Cell runs of this invocation still RUNNING at its end (a worker died while it logged; the cell was
        computed again elsewhere) are marked KILLED."""
        return self._kill(f"attributes.status = 'RUNNING' and tags.`{tag('invocation_id')}` = '{invocation_id}' "
                          f"and tags.`{tag('kind')}` = 'cell'")

    def _kill(self, where: str) -> int:
        runs = self.client.search_runs([self.experiment_id], filter_string=where, max_results=5000)
        for run in runs:
            self.client.set_tag(run.info.run_id, tag("status"), "killed")
            if tag("cell_id") in run.data.tags:
                self.client.set_tag(run.info.run_id, cell_key(run.data.tags[tag("cell_id")]), "killed")
            self.client.set_terminated(run.info.run_id, "KILLED")
        return len(runs)

    def start_invocation(self, invocation_id: str, tags: dict[str, str], params: dict[str, str]) -> str:
        run = self.client.create_run(self.experiment_id, run_name=f"benchmark {invocation_id}",
                                     tags={**self.tags, tag("kind"): "invocation", tag("invocation_id"): invocation_id,
                                           **tags})
        self._log_batch(run.info.run_id, {}, params, {})
        return run.info.run_id

    def finish_invocation(self, run_id: str, manifest: dict[str, Any], metrics: dict[str, float]) -> None:
        self._log_batch(run_id, metrics, {}, {})
        self._log_json(run_id, {"cells": manifest})
        self.client.set_terminated(run_id, "FINISHED")

    # -- cells -------------------------------------------------------------------------------------------
    def finished_cell(self, cell_id: str, status: str = "ok") -> tuple[str, dict[str, float]] | None:
        """The run id and metrics of the cell's FINISHED run with this status (ok, or skipped), if it has one: the
        one that finished first, which ``log_cell`` keeps when two computed the cell at once."""
        runs = self._finished_runs(cell_id, status)
        if not runs:
            return None
        first = min(runs, key=lambda run: (run.info.end_time, run.info.run_id))
        return first.info.run_id, dict(first.data.metrics)

    def finished_cell_run(self, cell_id: str, status: str = "ok") -> str | None:
        found = self.finished_cell(cell_id, status)
        return found[0] if found else None

    def _finished_runs(self, cell_id: str, status: str) -> list:
        return self.client.search_runs(
            [self.experiment_id], max_results=50, order_by=["attributes.end_time ASC"],
            filter_string=f"tags.`{cell_key(cell_id)}` = '{status}' and attributes.status = 'FINISHED'")

    def log_cell(self, *, parent_run_id: str, invocation_id: str, cell_id: str, tags: dict[str, str],
                 params: dict[str, str], metrics: dict[str, float], artifacts: dict[str, Any], status: str = "ok",
                 error: str | None = None, examples: dict[str, list] | None = None) -> str:
        """One run for a computed cell (or a failed or skipped one); an ok or skipped cell that already has a
        run is not logged twice. ``examples`` ({task: per-example test scores}) goes to ``EXAMPLES``."""
        if status in ("ok", "skipped"):
            existing = self.finished_cell_run(cell_id, status)
            if existing is not None:
                return existing
        all_tags = {**self.tags, "mlflow.parentRunId": parent_run_id, tag("kind"): "cell",
                    tag("invocation_id"): invocation_id, tag("cell_id"): cell_id, tag("status"): status,
                    cell_key(cell_id): status, **tags}
        if error:
            all_tags[tag("error")] = error.replace("\n", " ")[:4000]
        name = f"{tags.get(tag('regime'), '')} {tags.get(tag('recipe'), cell_id)}".strip()
        run = self.client.create_run(self.experiment_id, run_name=name, tags=all_tags)
        run_id = run.info.run_id
        try:
            self._log_batch(run_id, metrics, params, {})
            if artifacts:
                self._log_json(run_id, artifacts, "diagnostics")
            if examples:
                self._log_json(run_id, {EXAMPLES_SPLIT: examples}, EXAMPLES_DIR, compact=True)
        except Exception:
            self.client.set_terminated(run_id, "FAILED")
            raise
        self.client.set_terminated(run_id, "FINISHED")
        if status not in ("ok", "skipped"):
            return run_id
        # two members (or a worker presumed dead) computed the cell at once: the first to finish is kept, every
        # later one deleted, so the store holds one result per cell id. Each decides once no other run of the cell
        # is still being logged, so both decide on the same finished runs (end times are the clients' clocks: one
        # that finished first by its clock may become visible last)
        self._wait_for_siblings(cell_id, status, run_id)
        kept = self.finished_cell_run(cell_id, status) or run_id  # the first to finish (ties: the smaller run id)
        if kept != run_id:
            self.client.delete_run(run_id)
        return kept

    def kept_metrics(self, cell_id: str, run_id: str, computed: dict[str, float]) -> dict[str, float]:
        """The metrics of ``run_id``, the run ``log_cell`` kept for the cell: the store's (the board's) result, which
        a summary reports. When another computation of the cell was kept (two members at once), a result here that
        differs from it (``computed``: the cell's results, no timings) is a warning naming the cell: a cell's result
        must not depend on who computed it (tests/test_lab_e2e.py computes cells twice at once to check it)."""
        kept = dict(self.client.get_run(run_id).data.metrics)
        differing = sorted(k for k in computed if k in kept and kept[k] != float(computed[k])
                           and not (math.isnan(kept[k]) and math.isnan(float(computed[k]))))
        if differing:
            logger.warning("cell %s: computed here with %s, but the run kept for it (%s) holds %s: the same cell "
                           "gave two results", cell_id, {k: computed[k] for k in differing[:4]}, run_id,
                           {k: kept[k] for k in differing[:4]})
        return kept

    def _wait_for_siblings(self, cell_id: str, status: str, run_id: str, timeout: float = 60.0) -> None:
        """Until no other RUNNING run of the cell exists (one being logged now), at most ``timeout`` seconds (a
        member killed mid-logging leaves a RUNNING run behind)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            running = self.client.search_runs(
                [self.experiment_id], max_results=10,
                filter_string=f"tags.`{cell_key(cell_id)}` = '{status}' and attributes.status = 'RUNNING'")
            if not any(run.info.run_id != run_id for run in running):
                return
            time.sleep(0.5)

    # -- helpers -----------------------------------------------------------------------------------------
    def _log_batch(self, run_id: str, metrics: dict[str, float], params: dict[str, str], tags: dict[str, str]) -> None:
        from mlflow.entities import Metric, Param, RunTag

        now = int(time.time() * 1000)
        ms = [Metric(k, float(v), now, 0) for k, v in sorted(metrics.items())]
        ps = [Param(k, str(v)[:6000]) for k, v in sorted(params.items())]
        ts = [RunTag(k, str(v)) for k, v in sorted(tags.items())]
        while ms or ps or ts:
            self.client.log_batch(run_id, metrics=ms[:MAX_METRICS], params=ps[:MAX_PARAMS], tags=ts[:MAX_TAGS])
            ms, ps, ts = ms[MAX_METRICS:], ps[MAX_PARAMS:], ts[MAX_TAGS:]

    def _log_json(self, run_id: str, files: dict[str, Any], artifact_path: str | None = None, *,
                  compact: bool = False) -> None:
        with tempfile.TemporaryDirectory(prefix="mergecal-artifacts-") as tmp:
            for name, content in files.items():
                text = json.dumps(content, sort_keys=True, **({"separators": (",", ":")} if compact else {"indent": 1}))
                (Path(tmp) / f"{name}.json").write_text(text)
            self.client.log_artifacts(run_id, tmp, artifact_path)
