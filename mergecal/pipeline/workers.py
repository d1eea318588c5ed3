"""What a benchmark cell needs on whichever worker runs it, checked there: on a Dask worker of another host, or a
worker started in another directory, a cell finds its checkout, proves its inputs and code are the flow's, and
logs to the flow's tracking store; when it cannot, it fails with one line that says which worker and why.

* The checkout: ``MERGECAL_ROOT`` in the worker's environment (its own clone of the lab's repository, after
  ``git checkout <the flow's commit>`` and ``dvc pull``), else the flow's own path (one host, or a shared file
  system).
* Inputs and code: the worker computes the cell's id from its own files (every input's content hash and the
  package's cell code, ``mergecal.pipeline.cells.cell_id``) and compares it with the id the flow computed. A
  worker at another commit, or with other data, never logs a result under an id it did not compute.
* The tracking store: the flow's URI (without credentials: a worker's own ``MLFLOW_TRACKING_USERNAME`` /
  ``_PASSWORD``, or its own ``MLFLOW_TRACKING_URI`` when the store's URI holds a password). A store that is a file
  of the flow's host (the checkout's SQLite, the default) is refused on a worker that does not see that file:
  cells on several hosts need a tracking server (docs/lab.md, "More machines").
* Who ran a cell (``worker_name``, the ``mergecal.worker`` tag of its run): this host and process, the Dask
  worker's name (its ``--name``; Dask's default name is the worker's address) or, off Dask, the thread, and the
  checkout it read, so that two workers of one host and checkout are told apart.
"""

from __future__ import annotations

import os
import socket
import sys
import threading
from pathlib import Path

from ..errors import MergecalError
from .cells import cell_id
from .tracking import Tracker, is_server, redact, resolve_uri, tracking_uri

ROOT_ENV = "MERGECAL_ROOT"


class WorkerSetupError(MergecalError):
    """This worker cannot run the cell (no checkout, other inputs or code, no tracking store): retrying on the
    same worker cannot help."""


def host() -> str:
    return socket.gethostname()


def dask_worker_name() -> str | None:
    """The name of the Dask worker this runs on (its ``--name``, else its address, Dask's default), None off
    Dask."""
    if "distributed" not in sys.modules:  # never imported: this process is no Dask worker
        return None
    from distributed import get_worker

    try:
        return str(get_worker().name)
    except ValueError:  # a process that imported distributed (a client, a local cluster's parent) but is no worker
        return None


def worker_name(root: Path) -> str:
    """Who computed a cell (the ``worker`` tag of its run), apart from every other worker: ``host:pid``, then the
    Dask worker's ``name=`` or, off Dask, the ``thread=`` (a thread of a thread pool; none in a process's main
    thread), then the checkout it read, last: ``gpu1:4711 name=w1 root=/data/mergecal``."""
    name = dask_worker_name()
    thread = threading.current_thread()
    where = (f" name={name}" if name is not None
             else "" if thread is threading.main_thread() else f" thread={thread.name}")
    return f"{host()}:{os.getpid()}{where} root={root}"


def who() -> str:
    """This worker in an error's first words: its host, and its Dask name when it is a Dask worker."""
    name = dask_worker_name()
    return host() if name is None else f"{host()} (Dask worker {name})"


def worker_root(flow_root: str) -> Path:
    """The checkout this worker reads: ``MERGECAL_ROOT``, else the flow's path; one line when it is not there."""
    given = os.environ.get(ROOT_ENV)
    root = Path(given or flow_root)
    if not (root / "params.yaml").is_file():
        source = f"{ROOT_ENV}={given}" if given else f"the flow's checkout {flow_root}"
        raise WorkerSetupError(f"worker {who()}: no checkout at {source} (no params.yaml); set {ROOT_ENV} in the "
                               "worker's environment to its clone of the lab's repository (after dvc pull)")
    return root.resolve()


def check_cell(cell, params, root: Path, key: str, source_key: str | None) -> None:
    """One line when the cell's inputs or code on this worker differ from the flow's (its id would differ)."""
    try:
        here = cell_id(cell, params, root, source_key)
    except (OSError, MergecalError) as err:
        reason = f"{err.filename}: {err.strerror}" if isinstance(err, OSError) and err.filename else str(err)
        raise WorkerSetupError(f"worker {who()}: cell {cell.label} ({cell.regime}): cannot read its inputs under "
                               f"{root}: {reason}; dvc pull in the worker's checkout") from None
    if here != key:
        raise WorkerSetupError(f"worker {who()}: cell {cell.label} ({cell.regime}): inputs or code under {root} "
                               f"differ from the flow's (cell id {here} here, {key} in the flow); check out the "
                               "flow's commit and dvc pull in the worker's checkout")


def cell_tracker(flow_root: str, tracking, shown_uri: str, tags: dict[str, str] | None) -> Tracker:
    """The flow's tracking store (``shown_uri``: its URI as the flow shows it), reached from this worker."""
    if "***" in shown_uri:  # a database URI with a password: the worker's own environment must name it
        uri = resolve_uri(flow_root, tracking)
        if redact(uri) != shown_uri:
            raise WorkerSetupError(f"worker {who()}: the flow logs to {shown_uri}, this worker's "
                                   f"MLFLOW_TRACKING_URI / tracking.uri name {redact(uri)}; set MLFLOW_TRACKING_URI "
                                   "(with the password) in the worker's environment")
    else:
        uri = shown_uri
    check_store_seen(uri)
    if uri == tracking_uri(flow_root, tracking.store):  # the checkout's own SQLite store (the flow's default)
        return Tracker(flow_root, tracking.experiment, tracking.store, tags=tags)
    return Tracker(flow_root, tracking.experiment, tracking.store, uri=uri, artifacts=tracking.artifacts, tags=tags)


def check_store_seen(uri: str) -> None:
    """One line when the tracking store is an SQLite file this worker does not see (a file of the flow's host)."""
    if uri.startswith("sqlite:") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise WorkerSetupError(f"worker {who()}: the flow's tracking store {uri} is a file this worker does not "
                               "see; cells on other hosts need a tracking server (MLFLOW_TRACKING_URI or "
                               "tracking.uri, see docs/lab.md)")


def preflight(api_url: str | None, store: str) -> dict[str, str]:
    """Run on every Dask worker before any cell (``Client.run``): this worker's host, once it has reached the
    flow's Prefect server (``api_url``; cells report their states to it) and tracking store (``store``, as
    shown). A worker that cannot import this module, or reach either, fails here, and the flow
    leaves it out with that one line."""
    import httpx

    for what, url in (("Prefect server", api_url), ("MLflow tracking server", store if is_server(store) else None)):
        if url is None:
            continue
        health = f"{url.rstrip('/')}/health"
        try:
            httpx.get(health, timeout=10).raise_for_status()
        except httpx.HTTPError as err:
            raise WorkerSetupError(f"worker {who()}: cannot reach the flow's {what} at {url} ({err}); an "
                                   "ephemeral Prefect server or a 127.0.0.1 address is not reachable from other "
                                   "hosts (PREFECT_API_URL, MLFLOW_TRACKING_URI of the lab's servers)") from None
    check_store_seen(store)
    return {"host": host()}
