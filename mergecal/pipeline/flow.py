"""The benchmark flow: one Prefect task per cell of the matrix (merge → calibrate → evaluate → track).

* Caching: a cell's cache key is its content hash (``mergecal.pipeline.cells.cell_id``); results persist as
  JSON under ``<root>/.mergecal/cells/<store>`` (one folder per tracking store and experiment: a result names a
  run of that experiment) so interrupted or repeated runs reuse finished cells. A result file cut
  short by a kill does not deserialize and Prefect treats it as absent. A cell without a result file whose
  MLflow run was already logged (killed in between, or the result directory deleted) is taken from that run,
  not computed again; either way it counts as cached.
* Retries for transient failures (``runner.retries``); a cell that still fails is recorded in MLflow with its
  error and the rest of the matrix goes on.
* Task runner (``runner.kind``): threads (default), processes, or prefect-dask's DaskTaskRunner (a local
  cluster, or ``runner.address`` of an existing one, whose workers may run on other hosts: this module is part
  of the installed package, and each cell checks on its worker that the checkout, its inputs, its code and the
  tracking store are the flow's, ``mergecal.pipeline.workers``). Workers of an existing cluster that cannot
  import the package are named in one line each and left out. A cell on CUDA leases one GPU of its host while
  it runs (``mergecal.pipeline.devices``): one cell per GPU, whatever the runner.
* Calibrated chains under ``benchmark.calibrated_scaling: selected`` receive the future of the cell that
  chooses their scaling: they run after it, and are recorded as not run when it failed.
* Chains a track cannot run (DisTaC or FSC on the text and LLM tracks) are logged as ``skipped`` runs with the
  reason, once, and listed in the invocation's manifest, so the leaderboard says why they have no row.
* Tracking: see ``mergecal.pipeline.tracking``.

Run it through DVC (``dvc repro``; stage ``benchmark``) or directly: ``python -m flows.benchmark``.
(the command line; the flow lives here, in the installed package, so that workers on other hosts import it)
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import queue
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE, CachePolicy
from prefect.filesystems import LocalFileSystem

from mergecal import cost
from mergecal.device import resolve_device
from mergecal.errors import MergecalError
from mergecal.pipeline.cells import Cell, enumerate_cells, matrix_ids, measure, run_cell, source_index
from mergecal.pipeline.config import Params, load_params, parse_params
from mergecal.pipeline.devices import device_lease
from mergecal.pipeline.prefect_api import check_server, configured_api_url
from mergecal.pipeline.progress import Progress, progress_interval, running_cells
from mergecal.pipeline.quiet import quietly
from mergecal.pipeline.results import one_line, skipped_id, summary_row, write_results
from mergecal.pipeline.threads import pin_threads, worker_threads
from mergecal.pipeline.tracking import Tracker, cell_tags, provenance, tag
from mergecal.pipeline.track_registry import get_track, skipped_cells
from mergecal.pipeline.workers import (WorkerSetupError, cell_tracker, check_cell, preflight, worker_name,
                                      worker_root)

CELL_CACHE = Path(".mergecal") / "cells"
DEVICE_LOCKS = Path(".mergecal") / "devices"


def _cell_cache_key(context, arguments: dict[str, Any]) -> str:
    return f"cell-{arguments['key']}"


# a policy, not a cache_key_fn: with_options cannot unset a key function, and a cluster's cells run uncached
CELL_CACHE_POLICY = CachePolicy.from_cache_key_fn(_cell_cache_key)


def _retry_unless_setup(task, task_run, state) -> bool:
    """Prefect's retry condition: a worker without the cell's checkout, inputs or store fails at once."""
    try:
        state.result()
    except WorkerSetupError:
        return False
    except Exception:
        return True
    return True


@task(name="cell", cache_policy=CELL_CACHE_POLICY, persist_result=True, result_serializer="json",
      retry_condition_fn=_retry_unless_setup)
@quietly  # no inner progress bars or misleading notices in the flow's output (mergecal.pipeline.quiet)
def compute_cell(key: str, cell: dict, params: dict, root: str, parent_run_id: str, invocation_id: str,
                 source: dict | None = None, run_tags: dict | None = None, store: str | None = None,
                 source_key: str | None = None) -> dict:
    """Compute one cell and log it as one MLflow run; returns what the invocation manifest needs. ``root``: the
    flow's checkout; ``source``: the result of the cell that chose this cell's scaling (passed as a Prefect
    future, so this cell waits for it and does not run when it failed) and ``source_key`` its id; ``run_tags``:
    the invocation's provenance, on the cell's run too; ``store``: the flow's tracking URI as shown (None: the
    one params and environment name)."""
    settings = parse_params(params, "params")
    pin_threads(worker_threads(settings.threads, settings.runner.max_workers))  # its share of params' `threads`
    cell_obj = Cell(**{**cell, "tasks": tuple(cell["tasks"]), "grid": tuple(cell["grid"])})
    tracker = (cell_tracker(root, settings.tracking, store, run_tags) if store is not None
               else Tracker.of(root, settings.tracking, tags=run_tags))
    logged = tracker.finished_cell(key)
    if logged is not None:
        run_id, metrics = logged
        return {"cell_id": key, "run_id": run_id, "status": "ok", "label": cell_obj.label, "regime": cell_obj.regime,
                "metrics": metrics, "from_run": True}
    here = worker_root(root)  # this worker's checkout: the flow's, or MERGECAL_ROOT's clone of it
    check_cell(cell_obj, settings, here, key, source_key)
    scaling = source["metrics"]["selected_scaling"] if source is not None else None
    # one cell per GPU: a CUDA cell holds a device lease while it runs (mergecal.pipeline.devices)
    with device_lease(resolve_device(settings.device), here / DEVICE_LOCKS) as device:
        if device.startswith("cuda"):
            import torch

            torch.cuda.reset_peak_memory_stats(device)
        with cost.recording() as costs:  # each method's own cost, beside the cell's (mergecal.cost)
            result, seconds, peak_mib = measure(run_cell, cell_obj, settings, here, device=device, scaling=scaling)
        metrics = {**result.metrics, "seconds": seconds, "peak_rss_mib": peak_mib, **costs.metrics()}
        if device.startswith("cuda"):
            metrics["peak_gpu_mib"] = torch.cuda.max_memory_allocated(device) / 2**20
    run_id = tracker.log_cell(parent_run_id=parent_run_id, invocation_id=invocation_id, cell_id=key,
                              tags={**cell_tags(cell_obj), tag("device"): device, tag("worker"): worker_name(here)},
                              params=result.params, metrics=metrics, artifacts=result.diagnostics,
                              examples=result.examples)
    # the kept run's metrics: another member's when both computed the cell at once (the summary shows the board's)
    metrics = tracker.kept_metrics(key, run_id, result.metrics)
    return {"cell_id": key, "run_id": run_id, "status": "ok", "label": cell_obj.label, "regime": cell_obj.regime,
            "metrics": metrics}


def engine_error(future) -> str | None:
    """Why a cell's Dask task never ran Prefect's engine (its worker could not unpickle it, or died too often),
    in one line; None for any other runner."""
    wrapped = getattr(future, "wrapped_future", None)
    if wrapped is None or getattr(wrapped, "status", None) != "error":
        return None
    error = wrapped.exception()
    return f"not run on a Dask worker: {type(error).__name__}: {one_line(str(error))}"


def dask_worker_label(address: str, name: Any) -> str:
    """A Dask worker as its cells' ``worker`` tag names it: its ``--name`` and its address (the address alone when
    the worker has no name of its own: Dask's default name is its address)."""
    return address if name is None or str(name) in ("", address) else f"{name} ({address})"


def dask_workers(address: str, api_url: str | None, store: str) -> tuple[dict[str, str], dict[str, str]]:
    """The workers of the cluster at ``address`` that can run cells ({address: "name (address) on host"}: they
    import mergecal and reach the Prefect server ``api_url`` and the tracking ``store``) and those that cannot
    ({"name (address)": why, in one line}); a worker is named by its ``--name`` (``dask_worker_label``), which the
    scheduler knows even for a worker that cannot import mergecal."""
    from distributed import Client

    with Client(address, timeout=30) as client:
        answers = client.run(preflight, api_url, store, on_error="return")
        names = {worker: info.get("name") for worker, info in client.scheduler_info(n_workers=-1)["workers"].items()}
    label = {worker: dask_worker_label(worker, names.get(worker)) for worker in answers}
    good = {worker: f"{label[worker]} on {answer['host']}" for worker, answer in sorted(answers.items())
            if isinstance(answer, dict)}
    left_out = {label[worker]: one_line(f"{type(answer).__name__}: {answer}")
                for worker, answer in sorted(answers.items()) if not isinstance(answer, dict)}
    if not good:
        reasons = "; ".join(f"{worker}: {why}" for worker, why in left_out.items()) or "it has no worker"
        raise MergecalError(f"runner.address {address}: no Dask worker can run cells ({reasons})")
    return good, left_out


def task_runner(params: Params):
    runner = params.runner
    if runner.kind == "threads":
        from prefect.task_runners import ThreadPoolTaskRunner

        return ThreadPoolTaskRunner(max_workers=runner.max_workers)
    if runner.kind == "processes":
        from prefect.task_runners import ProcessPoolTaskRunner

        return ProcessPoolTaskRunner(max_workers=runner.max_workers)
    try:
        from prefect_dask import DaskTaskRunner
    except ImportError:
        raise MergecalError("runner.kind=dask needs prefect-dask (pip install -e '.[pipeline]')") from None
    if runner.address:
        return DaskTaskRunner(address=runner.address)
    return DaskTaskRunner(cluster_kwargs={"n_workers": runner.max_workers, "threads_per_worker": 1,
                                          "processes": True, "dashboard_address": None})


def preload(cells: list[Cell]) -> None:
    """Import, in the flow's own thread, the libraries each track's cells import on first use (``PRELOAD`` of the
    track's module). Two worker threads importing a library for the first time at once can leave one with a
    half-built module: lm-eval's HFLM then held a ``transformers`` that was not ``sys.modules``' and every LLM
    cell of a run whose other cells were all cached failed ("module 'transformers' has no attribute
    'AutoConfig'", 2026-12-04). Third-party libraries only: a project module named here would be a dep that the
    import graph (``mergecal.pipeline.imports``) does not see."""
    from pkgutil import resolve_name

    for track in dict.fromkeys(c.track for c in cells):
        for name in getattr(get_track(track), "PRELOAD", ()):
            if name.split(".")[0] == __name__.split(".")[0]:
                raise MergecalError(f"track {track!r}: PRELOAD names the project's module {name!r}; import it "
                                    "statically")
            resolve_name(name)


@flow(name="mergecal-benchmark", log_prints=True)
def benchmark(params_path: str = "params.yaml", root: str = ".", output: str = "results/benchmark.json",
              cells: list[dict] | None = None, profile: str = "default") -> dict:
    """Run every cell of the matrix in ``params_path`` (or the given ``cells``, as ``Cell.to_dict`` writes them:
    the papers' experiments, ``profile="paper"``); write a summary to ``output`` (relative to ``root``)."""
    logger = get_run_logger()
    root_path = Path(root).resolve()
    params = load_params(root_path / params_path if not Path(params_path).is_absolute() else params_path)
    interval = progress_interval(os.environ)  # seconds between progress lines
    params_json = json.dumps(params.model_dump(mode="json"), sort_keys=True)
    params_sha256 = hashlib.sha256(params_json.encode()).hexdigest()
    run_tags = provenance(root_path, params_sha256)
    tracker = Tracker.of(root_path, params.tracking, tags=run_tags)
    killed = tracker.mark_unfinished_killed(root_path)
    if killed:
        logger.warning("marked %d unfinished MLflow run(s) of an interrupted benchmark as KILLED", killed)

    given = cells
    cells = enumerate_cells(params) if given is None else [Cell(**{**c, "tasks": tuple(c["tasks"]),
                                                                   "grid": tuple(c["grid"])}) for c in given]
    keys = matrix_ids(cells, params, root_path)
    sources = source_index(cells)
    preload(cells)
    invocation_id = time.strftime("%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:6]
    parent = tracker.start_invocation(
        invocation_id, tags={tag("cells"): str(len(cells))},
        params={"params_sha256": params_sha256, "cells": str(len(cells)), "runner": params.runner.kind,
                "device": params.device, "profile": profile})
    logger.info("benchmark %s: %d cells (MLflow %s)", invocation_id, len(cells), tracker.shown_uri)

    # Prefect takes a task's result storage only as a saved block: saved on whichever server runs this flow,
    # one per repository root. Cached cells are found by key under this directory, so results computed under
    # one Prefect server are reused under another (tests/test_pipeline.py, worker-process runners).
    # A result names its MLflow run, so the cache is one folder per tracking store and experiment: switching to a
    # lab's server, or to another experiment, never reuses a result whose run lives elsewhere.
    store = hashlib.sha256(f"{tracker.shown_uri}\0{params.tracking.experiment}".encode()).hexdigest()[:12]
    storage = LocalFileSystem(basepath=str(root_path / CELL_CACHE / store))
    storage.save(f"mergecal-cells-{hashlib.sha256(str(root_path).encode()).hexdigest()[:12]}-{store}",
                 overwrite=True)
    # workers of another host write no result file the flow could read: there the lab's cache is the tracking
    # store (a finished run with the cell's id), looked up by every cell before it computes
    remote = params.runner.kind == "dask" and params.runner.address is not None
    runnable = compute_cell.with_options(retries=params.runner.retries,
                                         retry_delay_seconds=params.runner.retry_delay_seconds,
                                         result_storage=storage, persist_result=not remote,
                                         cache_policy=NO_CACHE if remote else CELL_CACHE_POLICY)
    placement = contextlib.nullcontext()
    if remote:  # workers that cannot run cells are named and left out; the others take every cell
        import dask

        good, left_out = dask_workers(params.runner.address, configured_api_url(), tracker.shown_uri)
        for worker, why in left_out.items():
            logger.warning("Dask worker %s is left out: %s", worker, why)
        print(f"Dask cluster {params.runner.address}: {len(good)} of {len(good) + len(left_out)} worker(s) run "
              "cells: " + ", ".join(good.values()))
        if left_out:
            tracker.client.set_tag(parent, tag("left_out"), "; ".join(f"{w}: {why}" for w, why in left_out.items()))
            placement = dask.annotate(workers=list(good), allow_other_workers=False)
    start = time.perf_counter()
    params_dict = params.model_dump(mode="json")
    # cells that choose their own scaling first; a cell calibrating a selected scaling gets its source's future
    futures: list = [None] * len(cells)
    with placement:
        for i in sorted(range(len(cells)), key=lambda i: sources[i] is not None):
            source = futures[sources[i]] if sources[i] is not None else None
            # named after the cell, so Prefect's log and UI show which cell started, finished or failed
            # (Prefect formats the name with the task's parameters: a recipe's own braces are escaped)
            name = f"{cells[i].track}/{cells[i].regime}/{cells[i].label}".replace("{", "{{").replace("}", "}}")
            named = runnable.with_options(task_run_name=name)
            futures[i] = named.submit(keys[i], cells[i].to_dict(), params_dict, str(root_path), parent,
                                      invocation_id, source=source, run_tags=run_tags, store=tracker.shown_uri,
                                      source_key=keys[sources[i]] if sources[i] is not None else None)
    # each cell's line as it completes (not in submission order), a progress line every `interval` seconds
    # (mergecal.pipeline.progress); the manifest and the rows in matrix order, whatever the order of completion
    completed: queue.SimpleQueue = queue.SimpleQueue()
    for i, future in enumerate(futures):
        future.add_done_callback(lambda _, i=i: completed.put(i))
    progress = Progress(len(cells), start)
    manifest_at, rows_at = [None] * len(cells), [None] * len(cells)
    while progress.done < len(cells):
        try:  # waking each second: a progress line may be due
            i = completed.get(timeout=1.0)
        except queue.Empty:
            i = None
        if i is not None:
            key, cell, future = keys[i], cells[i], futures[i]
            future.wait()
            state = future.state
            if state.is_final():
                outcome = future.result(raise_on_failure=False)
            else:  # Prefect leaves a task whose input future failed pending ("NotReady") and never runs it
                source = cells[sources[i]] if sources[i] is not None else None
                outcome = (f"not run: the cell it takes its scaling from ({source.label}, {source.regime}) failed"
                           if source is not None else engine_error(future) or f"not run (state {state.name})")
            ok = state.is_completed() and isinstance(outcome, dict)
            was_cached = ok and (state.name == "Cached" or outcome.get("from_run", False))
            progress.record(time.perf_counter(), cached=was_cached, failed=not ok)
            if ok:
                manifest_at[i] = {"status": "ok", "run_id": outcome["run_id"], "cached": was_cached,
                                  "label": cell.label, "regime": cell.regime}
                rows_at[i] = summary_row(cell, key, outcome["metrics"])
                line = f"avg {outcome['metrics']['avg_acc']:.3f}{' (cached)' if was_cached else ''}"
            else:
                error = one_line(outcome if outcome is not None else state.message)
                run_id = tracker.log_cell(parent_run_id=parent, invocation_id=invocation_id, cell_id=key,
                                          tags=cell_tags(cell), params={}, metrics={}, artifacts={},
                                          status="failed", error=error)
                manifest_at[i] = {"status": "failed", "run_id": run_id, "error": error, "label": cell.label,
                                  "regime": cell.regime}
                rows_at[i] = summary_row(cell, key, error=error)
                line = f"FAILED: {error}"
            print(f"[{progress.done}/{len(cells)}] {cell.regime:<14} {cell.label:<40} {line}")
        now = time.perf_counter()
        if progress.due(now, interval) or progress.done == len(cells):
            print(progress.line(now, time.time(), running_cells(futures)))
            progress.last_line = now
    manifest = dict(zip(keys, manifest_at))  # in matrix order, as the loop over the futures in order built it
    rows, failed, cached = rows_at, progress.failed, progress.cached
    skipped = skipped_cells(params) if given is None else []  # the matrix's own: given cells are all runnable
    for cell, reason in skipped:  # never computed: one run per (cell, reason), reused by every invocation
        key = skipped_id(cell, reason)
        run_id = tracker.log_cell(parent_run_id=parent, invocation_id=invocation_id, cell_id=key, tags=cell_tags(cell),
                                  params={}, metrics={}, artifacts={}, status="skipped", error=reason)
        manifest[key] = {"status": "skipped", "run_id": run_id, "error": reason, "label": cell.label,
                         "regime": cell.regime}
        rows.append(summary_row(cell, key, skipped=reason))
    if skipped:
        print(f"{len(skipped)} chains skipped (not supported on their track), e.g. {skipped[0][0].track}/"
              f"{skipped[0][0].label}: {skipped[0][1]}")
    seconds = time.perf_counter() - start
    left = tracker.kill_unfinished_cells(invocation_id)
    if left:
        logger.warning("%d cell run(s) of this invocation were left RUNNING (a worker died while logging; the cell "
                       "was computed again): marked KILLED", left)
    tracker.finish_invocation(parent, manifest, {"cells": len(cells), "failed_cells": failed, "cached_cells": cached,
                                                 "skipped_cells": len(skipped), "seconds": seconds})
    result = write_results(root_path / output, params.tracking.experiment, len(cells), failed, rows,
                           {"invocation_id": invocation_id, "parent_run_id": parent,
                            "tracking_uri": tracker.shown_uri,
                            "cached": cached, "seconds": round(seconds, 1)})
    print(f"benchmark {invocation_id}: {len(cells)} cells, {cached} cached, {failed} failed, {seconds:.1f} s")
    return result


def run_benchmark(params_path: str = "params.yaml", root: str = ".", output: str = "results/benchmark.json",
                  cells: list | None = None, profile: str = "default") -> dict:
    """The flow with the task runner that ``runner`` in params.yaml asks for (the flow's own default would run
    every cell at once); ``cells`` (``Cell`` objects) instead of the matrix, under the name ``profile``."""
    root_path = Path(root).resolve()
    params = load_params(root_path / params_path if not Path(params_path).is_absolute() else params_path)
    progress_interval(os.environ)  # a bad MERGECAL_PROGRESS_SECONDS: one line now, before the flow starts
    api_url = configured_api_url()
    if api_url:  # a lab's Prefect server: one line now rather than a traceback from inside the flow
        check_server(api_url, "benchmark")
    given = None if cells is None else [cell.to_dict() for cell in cells]
    return benchmark.with_options(task_runner=task_runner(params))(params_path=params_path, root=root, output=output,
                                                                   cells=given, profile=profile)


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("--root", default=".")
    parser.add_argument("--output", default="results/benchmark.json")
    args = parser.parse_args(argv)
    try:
        result = run_benchmark(params_path=args.params, root=args.root, output=args.output)
    except MergecalError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 1 if result["failed"] == result["cells"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
