"""A lab's tracking store at scale (#62): a real MLflow server on PostgreSQL filled with N synthetic benchmark cell
runs, then the store's three costs measured as the store grows: one cell's cache lookup, the start of a 320-cell
benchmark, and the lab board.

    python scripts/perf_store.py [--runs 10000,100000] [--workdir DIR] [--output FILE.md] [--repeats 15]
        [--before CHECKOUT] [--smoke]

The store: PostgreSQL and an MLflow server (artifacts proxied), started here on 127.0.0.1 with
tests/lab_servers.py, in ``--workdir`` (default: a temporary directory, removed at the end). Its runs are the ones a
benchmark writes (mergecal.pipeline.tracking, mergecal.pipeline.flow): per invocation a parent run (provenance tags,
``mergecal.kind=invocation``, the cell count, its params, its end metrics and its ``cells.json`` manifest) and one
run per cell of the default profile's real 320 (``enumerate_cells``: their ``cell_tags``, a cell id, status,
provenance, device and worker tags; an ok cell's params, its ``acc.*``, ``norm_acc.*``, ``entropy.*``, ``ece.*``
per task and their ``avg_*``, ``selected_scaling`` of a recipe, ``seconds``, ``peak_rss_mib``, and its
``examples/test.json`` of 100 scores a task; a failed cell its error, no params nor metrics). The matrix's 60
skipped chains are logged once per experiment, as the flow does, and reused through the manifests after. The
invocations run nightly, one after the other, by three members (own host, checkout and commit each) into three
experiments (8 of 10 into ``mergecal``, the one the board and the lookups read; 1 into ``mergecal-paper``, 1 into
``mergecal-scratch``); 3 % of the cells fail, one invocation in 25 was killed (its parent and one cell KILLED, the
cells before the kill finished) and the newest of one member is still RUNNING.

Writing runs through the REST API (``Tracker.log_cell``: about 8 requests a cell, two artifacts) goes at about 2
runs a second on the 2-core machine, 13 hours for 100,000; so the runs are written into the schema the running
server created (``runs``, ``tags``, ``params``, ``metrics``, ``latest_metrics``, with PostgreSQL's COPY) and their
artifacts into its artifact folder, then ANALYZEd as PostgreSQL's autovacuum would. Before any of that, one
invocation (4 ok cells, a failed one, a skipped one) is written both ways, through ``Tracker`` and in bulk, and must
read back through the MLflow client identically (run info, tags, params, metrics, artifacts; ids and times aside).

Measured at each ``--runs`` size (cell runs in the store, all experiments), each route in a fresh process:
(a) ``Tracker.finished_cell`` for a present and an absent cell id (median of ``--repeats``), (b) the start of a
320-cell benchmark as the flow does it: ``mark_unfinished_killed`` then 320 ``finished_cell`` (half of the ids
present, half new), (c) ``write_lab_reports`` (what ``mergecal report --lab`` runs) split into loading the runs,
reading the shown rows' examples and the rest (tables, files), and ``mergecal report --lab`` end to end in a process
of its own. ``--before CHECKOUT`` (e.g. ``git archive <commit> mergecal params.yaml | tar -x -C DIR``) measures that
library too, alternated with this checkout's, so a change is read as a ratio under the same load.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # lab_servers: the servers the tests start

EXPERIMENT = "mergecal"  # params.yaml's tracking.experiment: what the board and the lookups read
EXPERIMENTS = (EXPERIMENT, "mergecal-paper", "mergecal-scratch")
CHECK_EXPERIMENT = "perf-store-check"  # the API-against-bulk check's own experiment
MEMBERS = (("alice", "lab-a"), ("bob", "lab-b"), ("carol", "lab-c"))
FAILED_SHARE, KILLED_EVERY, EXAMPLES_PER_TASK = 0.03, 25, 100
NIGHT_MS, CELL_MS = 86_400_000, 2_700  # a member's invocation a night; a cell every 2.7 s (320 in ~15 min)
BASE_MS = 1_767_225_600_000  # 2026-01-01 UTC
SMOKE_RUNS, SMOKE_CELLS = "300", 40
TAG_INDEX = "perf_store_tags_value_hash"


# ------------------------------------------------------------------------------------------------ synthetic runs

def matrix():
    """The default profile's 320 cells and its 60 skipped chains with their reasons (params.yaml)."""
    from mergecal.pipeline.cells import enumerate_cells
    from mergecal.pipeline.config import load_params
    from mergecal.pipeline.flow import skipped_cells
    from mergecal.pipeline.results import skipped_id

    params = load_params(ROOT / "params.yaml")
    return enumerate_cells(params), [(cell, reason, skipped_id(cell, reason)) for cell, reason in skipped_cells(params)]


def member_tags(member: int, code_version: str) -> dict[str, str]:
    """A member's provenance tags (``mergecal.pipeline.tracking.provenance``'s keys)."""
    from mergecal.pipeline.tracking import tag

    user, host = MEMBERS[member]
    return {tag("user"): user, tag("host"): host, tag("code_version"): code_version,
            tag("params_sha256"): f"{member:02d}" + "ab" * 31, tag("checkout"): f"/home/{user}/mergecal"}


def cell_run(cell, cell_id: str, invocation: str, status: str, provenance: dict, rng: random.Random,
             error: str | None = None) -> dict:
    """A cell's run as ``Tracker.log_cell`` writes it (its parent id added at writing): name, tags, params, metrics,
    examples."""
    from mergecal.pipeline.tracking import cell_key, cell_tags, tag

    tags = {**provenance, tag("kind"): "cell", tag("invocation_id"): invocation, tag("cell_id"): cell_id,
            tag("status"): status, cell_key(cell_id): status, **cell_tags(cell), tag("device"): "cpu",
            tag("worker"): provenance[tag("host")]}
    if error:
        tags[tag("error")] = error
    params, metrics, examples = {}, {}, {}
    if status == "ok":
        params = {"backbone": cell.backbone, "task_set": cell.task_set, "regime": cell.regime, "seed": str(cell.seed),
                  "grid": json.dumps(list(cell.grid)), "scaling_from": cell.scaling_from or "own grid",
                  f"{cell.merge}.scaling": "0.3", "dtype": "float32"}
        for task in cell.tasks:
            acc = round(rng.uniform(0.3, 0.95), 6)
            metrics.update({f"acc.{task}": acc, f"norm_acc.{task}": round(acc / 0.97, 6),
                            f"entropy.{task}": round(rng.uniform(0.1, 2.0), 6),
                            f"ece.{task}": round(rng.uniform(0.0, 0.2), 6)})
            examples[task] = [int(rng.random() < acc) for _ in range(EXAMPLES_PER_TASK)]
        for name in ("acc", "norm_acc", "entropy", "ece"):
            metrics[f"avg_{name}"] = sum(metrics[f"{name}.{t}"] for t in cell.tasks) / len(cell.tasks)
        if cell.recipe:
            metrics["selected_scaling"] = 0.3
        metrics.update({"seconds": round(rng.uniform(1, 60), 3), "peak_rss_mib": round(rng.uniform(500, 3000), 1)})
    return {"name": f"{cell.regime} {cell.label}", "tags": tags, "params": params, "metrics": metrics,
            "examples": examples, "status": "FINISHED", "cell_id": cell_id}


def invocation_runs(index: int, experiment: str, cells, skipped, first: bool) -> dict:
    """Invocation ``index``'s runs (deterministic in ``index``): its parent, its cell runs (and, on its
    experiment's first invocation, the skipped chains' runs), and its manifest's entries by cell id."""
    from mergecal.pipeline.tracking import tag

    rng = random.Random(index)
    member = index % len(MEMBERS)
    code = f"{rng.getrandbits(48):012x}"
    provenance = member_tags(member, code)
    start = BASE_MS + (index // len(MEMBERS)) * NIGHT_MS + member * 3_600_000
    invocation = time.strftime("%Y%m%d-%H%M%S-", time.gmtime(start / 1000)) + f"{rng.getrandbits(24):06x}"
    killed = index % KILLED_EVERY == KILLED_EVERY - 1
    n = rng.randrange(30, len(cells)) if killed else len(cells)
    runs, manifest = [], {}
    for cell in cells[:n]:
        cell_id = f"{rng.getrandbits(80):020x}"
        failed = rng.random() < FAILED_SHARE
        run = cell_run(cell, cell_id, invocation, "failed" if failed else "ok", provenance, rng,
                       error="RuntimeError: synthetic failure" if failed else None)
        runs.append(run)
        manifest[cell_id] = {"status": run["tags"][tag("status")], "label": cell.label, "regime": cell.regime,
                             **({"error": run["tags"][tag("error")]} if failed else {"cached": False})}
    if killed:  # the cell being logged at the kill: marked KILLED by the next invocation (Tracker._kill)
        runs[-1]["status"] = "KILLED"
        runs[-1]["tags"][tag("status")] = "killed"
    for cell, reason, key in skipped:
        if first:
            runs.append(cell_run(cell, key, invocation, "skipped", provenance, rng, error=reason))
        manifest[key] = {"status": "skipped", "error": reason, "label": cell.label, "regime": cell.regime}
    for i, run in enumerate(runs):
        run["start"] = start + 60_000 + i * CELL_MS
        run["end"] = run["start"] + CELL_MS - 200
    parent = {"name": f"benchmark {invocation}", "status": "KILLED" if killed else "FINISHED",
              "tags": {**provenance, tag("kind"): "invocation", tag("invocation_id"): invocation,
                       tag("cells"): str(len(cells)), **({tag("status"): "killed"} if killed else {})},
              "params": {"params_sha256": provenance[tag("params_sha256")], "cells": str(len(cells)),
                         "runner": "threads", "device": "cpu", "profile": "default"},
              "metrics": {} if killed else {"cells": len(cells), "failed_cells": sum(
                  r["tags"][tag("status")] == "failed" for r in runs), "cached_cells": 0,
                  "skipped_cells": len(skipped), "seconds": round(len(runs) * CELL_MS / 1000, 1)},
              "start": start, "end": runs[-1]["end"] + 1000, "examples": {}}
    return {"index": index, "experiment": experiment, "member": member, "invocation": invocation, "parent": parent,
            "cells": runs, "manifest": None if killed else manifest}


def experiment_of(index: int) -> str:
    return EXPERIMENTS[{8: 1, 9: 2}.get(index % 10, 0)]


# ------------------------------------------------------------------------------------------------ bulk writing

class BulkStore:
    """Writes runs into the MLflow server's PostgreSQL schema and its artifact folder, as the server would."""

    def __init__(self, database_uri: str, artifacts: Path, experiment_ids: dict[str, str]):
        import psycopg

        self.conn = psycopg.connect(database_uri.replace("postgresql+psycopg://", "postgresql://"), autocommit=False)
        self.artifacts = artifacts
        self.experiment_ids = experiment_ids
        self.skip_runs: dict[tuple[str, str], str] = {}  # (experiment, skipped id): its run id, reused

    def write(self, invocations: list[dict]) -> int:
        """Every run of ``invocations``, in one transaction; returns the cell runs written."""
        from mergecal.pipeline.tracking import EXAMPLES, tag

        rows = {"runs": [], "tags": [], "params": [], "metrics": [], "latest_metrics": []}
        files: list[tuple[Path, str]] = []
        written = 0
        for inv in invocations:
            experiment_id = self.experiment_ids[inv["experiment"]]
            parent_id = uuid.uuid4().hex
            self._rows(rows, experiment_id, parent_id, inv["parent"], {})
            run_ids = {}
            for run in inv["cells"]:
                run_id = uuid.uuid4().hex
                run_ids[run["cell_id"]] = run_id
                if run["tags"][tag("status")] == "skipped":
                    self.skip_runs[(inv["experiment"], run["cell_id"])] = run_id
                self._rows(rows, experiment_id, run_id, run, {"mlflow.parentRunId": parent_id})
                if run["examples"]:
                    files.append((self._artifact(experiment_id, run_id) / EXAMPLES,
                                  json.dumps(run["examples"], sort_keys=True, separators=(",", ":"))))
                written += 1
            if inv["manifest"] is not None:
                manifest = {key: {**entry, "run_id": run_ids.get(key) or self.skip_runs[(inv["experiment"], key)]}
                            for key, entry in inv["manifest"].items()}
                files.append((self._artifact(experiment_id, parent_id) / "cells.json",
                              json.dumps(manifest, sort_keys=True, indent=1)))
        with self.conn.cursor() as cur:
            for table, columns in (("runs", RUN_COLUMNS), ("tags", "key, value, run_uuid"),
                                   ("params", "key, value, run_uuid"),
                                   ("metrics", "key, value, timestamp, run_uuid, step, is_nan"),
                                   ("latest_metrics", "key, value, timestamp, step, is_nan, run_uuid")):
                with cur.copy(f"COPY {table} ({columns}) FROM STDIN") as copy:
                    for row in rows[table]:
                        copy.write_row(row)
        self.conn.commit()
        for path, text in files:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        return written

    def _artifact(self, experiment_id: str, run_id: str) -> Path:
        return self.artifacts / experiment_id / run_id / "artifacts"

    @staticmethod
    def _rows(rows: dict, experiment_id: str, run_id: str, run: dict, extra_tags: dict) -> None:
        rows["runs"].append((run_id, run["name"], "UNKNOWN", "", "", "unknown", run["status"], run["start"],
                             None if run["status"] == "RUNNING" else run["end"], "", "active",
                             f"mlflow-artifacts:/{experiment_id}/{run_id}/artifacts", int(experiment_id), None))
        tags = {**run["tags"], **extra_tags, "mlflow.runName": run["name"]}
        rows["tags"].extend((k, v, run_id) for k, v in tags.items())
        rows["params"].extend((k, v, run_id) for k, v in run["params"].items())
        stamp = run["end"] - 100
        rows["metrics"].extend((k, float(v), stamp, run_id, 0, False) for k, v in run["metrics"].items())
        rows["latest_metrics"].extend((k, float(v), stamp, 0, False, run_id) for k, v in run["metrics"].items())

    def still_running(self, invocation: dict) -> None:
        """Leave ``invocation`` (already written) RUNNING, as a member's benchmark in progress: its parent and its
        last cell run."""
        from mergecal.pipeline.tracking import tag

        with self.conn.cursor() as cur:
            cur.execute("UPDATE runs SET status = 'RUNNING', end_time = NULL WHERE run_uuid IN (SELECT run_uuid FROM "
                        "tags WHERE key = %s AND value = %s) AND start_time >= %s",
                        (tag("invocation_id"), invocation["invocation"], invocation["cells"][-1]["start"]))
            cur.execute("UPDATE runs SET status = 'RUNNING', end_time = NULL WHERE run_uuid IN (SELECT run_uuid FROM "
                        "tags WHERE key = %s AND value = %s AND run_uuid IN (SELECT run_uuid FROM tags WHERE key = %s "
                        "AND value = 'invocation'))", (tag("invocation_id"), invocation["invocation"], tag("kind")))
        self.conn.commit()

    def analyze(self) -> None:
        self.conn.commit()
        self.conn.autocommit = True
        self.conn.execute("VACUUM ANALYZE")
        self.conn.autocommit = False

    def close(self) -> None:
        self.conn.close()


RUN_COLUMNS = ("run_uuid, name, source_type, source_name, entry_point_name, user_id, status, start_time, end_time, "
               "source_version, lifecycle_stage, artifact_uri, experiment_id, deleted_time")


# ------------------------------------------------------------------------------------------------ the API check

def check_bulk_against_api(url: str, bulk: BulkStore, experiment_id: str, cells, skipped) -> int:
    """One invocation (4 ok cells, a failed one, a skipped one) written through ``Tracker`` and in bulk reads back
    identically through the MLflow client; returns the runs compared. AssertionError naming what differs."""
    from mlflow import MlflowClient, artifacts

    from mergecal.pipeline.tracking import Tracker, tag

    inv = invocation_runs(0, CHECK_EXPERIMENT, cells, skipped[:1], first=True)
    ok = [c for c in inv["cells"] if c["tags"][tag("status")] == "ok"]
    inv["cells"] = ok[:4] + [c for c in inv["cells"] if c["tags"][tag("status")] == "failed"][:1] + inv["cells"][-1:]
    assert [c["tags"][tag("status")] for c in inv["cells"]] == ["ok"] * 4 + ["failed", "skipped"]
    inv["manifest"] = {k: v for k, v in inv["manifest"].items() if k in {c["cell_id"] for c in inv["cells"]}}
    parent = inv["parent"]
    provenance = {k: v for k, v in parent["tags"].items() if k in member_tags(0, "").keys()}
    tracker = Tracker(ROOT, CHECK_EXPERIMENT, uri=url, tags=provenance)
    own = {k: v for k, v in parent["tags"].items() if k not in provenance and k not in (tag("kind"),
                                                                                           tag("invocation_id"))}
    api_parent = tracker.start_invocation(inv["invocation"], own, parent["params"])
    api_ids = {}
    for run in inv["cells"]:
        status = run["tags"][tag("status")]
        cell_tags = {k: v for k, v in run["tags"].items() if k not in provenance and k not in (
            tag("kind"), tag("invocation_id"), tag("cell_id"), tag("status"), tag("error"))}
        api_ids[run["cell_id"]] = tracker.log_cell(
            parent_run_id=api_parent, invocation_id=inv["invocation"], cell_id=run["cell_id"], tags=cell_tags,
            params=run["params"], metrics=run["metrics"], artifacts={}, status=status,
            error=run["tags"].get(tag("error")), examples=run["examples"] or None)
    manifest = {k: {**v, "run_id": api_ids[k]} for k, v in inv["manifest"].items()}
    tracker.finish_invocation(api_parent, manifest, parent["metrics"])
    client = MlflowClient(tracking_uri=url)
    before = {r.info.run_id for r in client.search_runs([experiment_id], max_results=100)}
    bulk.write([inv])
    bulk_runs = [r for r in client.search_runs([experiment_id], max_results=100) if r.info.run_id not in before]
    api_runs = [client.get_run(run_id) for run_id in [api_parent, *api_ids.values()]]

    def normal(run) -> dict:
        tags = dict(run.data.tags)
        kind = tags[tag("kind")]
        key = tags.get(tag("cell_id"), "parent")
        tags.pop("mlflow.parentRunId", None) if kind == "invocation" else tags.update({"mlflow.parentRunId": "P"})
        listing = sorted(a.path for a in artifacts.list_artifacts(artifact_uri=run.info.artifact_uri,
                                                                 tracking_uri=url))
        files = {}
        for name in ("cells.json", "examples/test.json"):
            with tempfile.TemporaryDirectory() as tmp:
                try:
                    local = artifacts.download_artifacts(artifact_uri=f"{run.info.artifact_uri}/{name}",
                                                         dst_path=tmp, tracking_uri=url)
                except Exception:
                    continue
                files[name] = json.loads(Path(local).read_text())
        if "cells.json" in files:
            ids = {r.info.run_id: r.data.tags[tag("cell_id")] for r in (api_runs + bulk_runs) if
                   tag("cell_id") in r.data.tags}
            files["cells.json"] = {k: {**v, "run_id": ids[v["run_id"]]} for k, v in files["cells.json"].items()}
        info = run.info
        return {"key": key, "tags": tags, "params": dict(run.data.params), "metrics": dict(run.data.metrics),
                "status": info.status, "user": info.user_id, "lifecycle": info.lifecycle_stage,
                "name": info.run_name, "ended": info.end_time is not None,
                "artifact_uri": info.artifact_uri.replace(info.run_id, "RUN"), "artifacts": listing, "files": files,
                "metric_steps": sorted((m.key, m.step) for m in client.get_metric_history(info.run_id, "avg_acc"))}

    api = sorted((normal(r) for r in api_runs), key=lambda d: d["key"])
    bulked = sorted((normal(r) for r in bulk_runs), key=lambda d: d["key"])
    assert len(api) == len(bulked) == len(inv["cells"]) + 1, (len(api), len(bulked))
    for a, b in zip(api, bulked):
        assert a == b, f"run {a['key']}: API-written and bulk-written differ:\n{a}\n{b}"
    return len(api)


# ------------------------------------------------------------------------------------------------ filling

def fill(bulk: BulkStore, target: int, state: dict, cells, skipped) -> None:
    """Invocations after ``state['next']`` until the store holds ``target`` cell runs (``state['cells']``)."""
    started = time.perf_counter()
    batch: list[dict] = []
    while state["cells"] < target:
        index = state["next"]
        experiment = experiment_of(index)
        first = experiment not in state["seen"]
        inv = invocation_runs(index, experiment, cells, skipped, first=first)
        room = target - state["cells"]
        cut = len(inv["cells"]) > room
        if cut:  # the last invocation cut short, as killed mid-run (its skipped chains then logged by the next)
            inv["cells"] = inv["cells"][:room]
            inv["manifest"], inv["parent"]["status"], inv["parent"]["metrics"] = None, "KILLED", {}
            state["cut"].add(index)
        if not cut or not first:
            state["seen"].add(experiment)
        batch.append(inv)
        state["cells"] += len(inv["cells"])
        state["next"] += 1
        state["last"][experiment] = inv
        if inv["manifest"] is not None:
            state["complete"][experiment] = inv
        if sum(len(b["cells"]) for b in batch) >= 5000:
            bulk.write(batch)
            batch = []
    if batch:
        bulk.write(batch)
    bulk.analyze()
    state["fill_s"] = time.perf_counter() - started


# ------------------------------------------------------------------------------------------------ measuring

def probe(args) -> int:
    """One route, in this process, on the library ``mergecal`` imports here; prints one JSON line."""
    import mergecal
    from mergecal.pipeline.tracking import Tracker

    ids = json.loads(Path(args.ids).read_text())
    out: dict = {"library": str(Path(mergecal.__file__).resolve().parents[1])}
    if args.probe == "lookup":
        tracker = Tracker(ROOT, EXPERIMENT, uri=args.uri)
        for name in ("present", "absent"):
            times = []
            for i in range(args.repeats):
                cell = ids[name][i % len(ids[name])]
                start = time.perf_counter()
                found = tracker.finished_cell(cell)
                times.append(time.perf_counter() - start)
                assert (found is not None) == (name == "present"), (name, cell)
            out[f"lookup_{name}_ms"] = 1000 * statistics.median(times)
    elif args.probe == "start":
        tracker = Tracker(ROOT, EXPERIMENT, uri=args.uri)
        start = time.perf_counter()
        tracker.mark_unfinished_killed(ids["checkout"])
        out["cleanup_s"] = time.perf_counter() - start
        hits = sum(tracker.finished_cell(cell) is not None for cell in ids["start"])
        out["start_s"] = time.perf_counter() - start
        assert hits == len(ids["start"]) // 2, hits
    elif args.probe == "board_cached":  # the lab board with its cache: built (the first), then from it
        from mergecal.reports import lab

        with tempfile.TemporaryDirectory(prefix="perf-store-board-") as tmp:
            for name in ("board_cold_cached_s", "board_warm_s"):
                start = time.perf_counter()
                lab.write_lab_reports(args.uri, EXPERIMENT, Path(tmp) / "board", cache_dir=Path(tmp) / "cache")
                out[name] = time.perf_counter() - start
    elif args.probe == "board":
        from mergecal.reports import lab

        spent = {"load_runs": 0.0, "load_examples": 0.0}

        def timed(name, function):
            def wrapper(*a, **k):
                begin = time.perf_counter()
                try:
                    return function(*a, **k)
                finally:
                    spent[name] += time.perf_counter() - begin
            return wrapper

        lab.load_runs = timed("load_runs", lab.load_runs)
        lab.load_examples = timed("load_examples", lab.load_examples)
        with tempfile.TemporaryDirectory(prefix="perf-store-board-") as tmp:
            start = time.perf_counter()
            lab.write_lab_reports(args.uri, EXPERIMENT, tmp)
            total = time.perf_counter() - start
            out["sources"] = len(json.loads((Path(tmp) / "lab-leaderboard.json").read_text())["sources"])
            out["board_md_lines"] = len((Path(tmp) / "lab-leaderboard.md").read_text().splitlines())
        out.update(board_s=total, load_runs_s=spent["load_runs"], examples_s=spent["load_examples"],
                   rest_s=total - spent["load_runs"] - spent["load_examples"])
    print(json.dumps(out), flush=True)
    return 0


def run_probe(library: Path, what: str, uri: str, ids_file: Path, repeats: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(library), "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    result = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--probe", what, "--uri", uri, "--ids",
                             str(ids_file), "--repeats", str(repeats)], env=env, cwd=library, capture_output=True,
                            text=True, timeout=7200)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        raise RuntimeError(f"probe {what} ({library}) failed (exit {result.returncode}):\n{result.stderr[-4000:]}")
    found = json.loads(lines[-1])
    if Path(found["library"]) != library.resolve():
        raise RuntimeError(f"probe {what}: imported mergecal from {found['library']}, not {library}")
    return found


def run_cli_board(library: Path, uri: str, out: Path) -> float:
    env = {**os.environ, "PYTHONPATH": str(library), "MLFLOW_TRACKING_URI": uri,
           "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR": "false"}
    command = [sys.executable, "-m", "mergecal.cli", "report", "--lab", "--root", str(library), "--out", str(out)]
    if "--experiment" in (library / "mergecal" / "cli.py").read_text():  # a board of several experiments: one
        command += ["--experiment", EXPERIMENT]
    start = time.perf_counter()
    result = subprocess.run(command, env=env, cwd=library, capture_output=True, text=True, timeout=7200)
    if result.returncode != 0:
        raise RuntimeError(f"mergecal report --lab ({library}) failed:\n{result.stderr[-4000:]}")
    return time.perf_counter() - start


def sample_ids(uri: str, state: dict, cells) -> dict:
    """Present ids (ok cells of the measured experiment, spread over its invocations), absent ones, the 320 ids a
    benchmark starts with (half present), and a checkout whose RUNNING runs the cleanup looks for."""
    from mergecal.pipeline.tracking import tag

    rng = random.Random(62)
    chosen = [i for i in range(state["next"]) if experiment_of(i) == EXPERIMENT and i not in state["cut"]]
    present = []
    for index in rng.sample(chosen, min(len(chosen), 12)):
        inv = invocation_runs(index, EXPERIMENT, cells, [], first=False)
        ok = [r["cell_id"] for r in inv["cells"] if r["tags"][tag("status")] == "ok"]
        present.append(rng.choice(ok))
    latest = state["complete"][EXPERIMENT]  # the newest invocation that finished whole
    ok_latest = [r["cell_id"] for r in latest["cells"] if r["tags"][tag("status")] == "ok"
                 and r["status"] == "FINISHED"]
    half = len(cells) // 2
    start = ok_latest[:half] + [f"{rng.getrandbits(80):020x}" for _ in range(len(cells) - min(half, len(ok_latest)))]
    if len(ok_latest) < half:  # a smoke store: fewer ok cells than half a benchmark
        start = start[:2 * len(ok_latest)]
    return {"present": present, "absent": [f"{rng.getrandbits(80):020x}" for _ in range(12)], "start": start,
            "checkout": f"/home/{MEMBERS[0][0]}/mergecal"}


ROUTES = ("lookup", "start", "board", "board_cached")


def measure(libraries: list[tuple[str, Path]], uri: str, ids_file: Path, repeats: int, workdir: Path,
            size: int, cli: bool = True, routes: tuple[str, ...] = ROUTES) -> dict[str, dict]:
    """Every route of ``routes`` of every library at this size, alternated: lookups, start, board, CLI board."""
    results = {name: {} for name, _ in libraries}
    for what in routes:
        for name, library in libraries:
            results[name].update(run_probe(library, what, uri, ids_file, repeats))
            log(f"{size} runs, {name}, {what}: " + ", ".join(f"{k} {v:.3f}" for k, v in results[name].items()
                                                             if isinstance(v, float)))
    for name, library in libraries if cli and "board" in routes else []:
        results[name]["cli_s"] = run_cli_board(library, uri, workdir / f"board-{name}-{size}")
        log(f"{size} runs, {name}: mergecal report --lab {results[name]['cli_s']:.1f} s")
    return results


INDEXED = "this checkout, tags.value hash index"


def measure_indexed(bulk: BulkStore, uri: str, ids_file: Path, repeats: int, size: int) -> dict:
    """The lookups and the start with a hash index on ``tags.value`` (PostgreSQL's ``CREATE INDEX``, no MLflow
    change: its tag filters become index lookups), dropped after."""
    started = time.perf_counter()
    bulk.conn.execute(f"CREATE INDEX {TAG_INDEX} ON tags USING hash (value)")
    bulk.analyze()
    result = {"index_build_s": time.perf_counter() - started}
    try:
        for what in ("lookup", "start"):
            result.update(run_probe(ROOT, what, uri, ids_file, repeats))
    finally:
        bulk.conn.execute(f"DROP INDEX {TAG_INDEX}")
        bulk.conn.commit()
    log(f"{size} runs, with the tags.value index (built in {result['index_build_s']:.0f} s): "
        + ", ".join(f"{k} {v:.3f}" for k, v in result.items() if isinstance(v, float)))
    return result


def log(line: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {line}", flush=True)


# ------------------------------------------------------------------------------------------------ the report

COLUMNS = (("lookup_present_ms", "lookup, present id (ms)", "{:.1f}"),
           ("lookup_absent_ms", "lookup, absent id (ms)", "{:.1f}"),
           ("cleanup_s", "RUNNING cleanup (s)", "{:.2f}"), ("start_s", "start: cleanup + 320 lookups (s)", "{:.1f}"),
           ("load_runs_s", "board: load runs (s)", "{:.1f}"), ("examples_s", "board: examples (s)", "{:.1f}"),
           ("rest_s", "board: tables, files (s)", "{:.1f}"), ("board_s", "board in all (s)", "{:.1f}"),
           ("cli_s", "`mergecal report --lab` (s)", "{:.1f}"),
           ("board_cold_cached_s", "board, building its cache (s)", "{:.1f}"),
           ("board_warm_s", "board from its cache (s)", "{:.1f}"))


def report(table: dict[int, dict[str, dict]], sizes: list[int], meta: dict) -> str:
    names = list(dict.fromkeys(name for size in sizes for name in table[size]))

    def value(size: int, name: str, column: tuple) -> str:
        row = table[size].get(name, {})
        return column[2].format(row[column[0]]) if column[0] in row else "–"

    def ratio(a: dict, b: dict, key: str) -> str:
        return f"{a[key] / b[key]:.1f}" if key in a and key in b and b[key] > 0 else "–"

    head = " | ".join(c[1] for c in COLUMNS)
    lines = [f"Store: {meta['store']}", "", f"| runs | library | {head} |", "|---:|---|" + "---:|" * len(COLUMNS)]
    lines += [f"| {size:,} | {name} | " + " | ".join(value(size, name, c) for c in COLUMNS) + " |"
              for size in sizes for name in names if name in table[size]]
    if len(sizes) > 1:
        low, high = sizes[0], sizes[-1]
        lines += ["", f"Growth from {low:,} to {high:,} runs ({high / low:.0f}x the rows), later over earlier:", "",
                  f"| library | {head} |", "|---|" + "---:|" * len(COLUMNS)]
        lines += [f"| {name} | " + " | ".join(ratio(table[high].get(name, {}), table[low].get(name, {}), c[0])
                                             for c in COLUMNS) + " |" for name in names]
    if len(names) > 1:
        lines += ["", f"Ratio {names[0]} / each other (above 1: the other is faster):", "",
                  f"| runs | against | {head} |", "|---:|---|" + "---:|" * len(COLUMNS)]
        lines += [f"| {size:,} | {name} | " + " | ".join(ratio(table[size][names[0]], table[size].get(name, {}), c[0])
                                                        for c in COLUMNS) + " |"
                  for size in sizes for name in names[1:]]
    lines += ["", f"Fill: {meta['fill']}", f"Machine: {meta['machine']}", f"Command: `{meta['command']}`", ""]
    return "\n".join(lines)


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), "unknown CPU")
    memory = int(Path("/proc/meminfo").read_text().split()[1]) / 2**20
    return f"{os.cpu_count()} cores ({model}), {memory:.0f} GiB, load average {os.getloadavg()[0]:.1f} at the end"


# ------------------------------------------------------------------------------------------------ main

def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", default="10000,100000", help="comma-separated store sizes, in cell runs")
    parser.add_argument("--workdir", type=Path, help="where the servers keep their data (default: a temporary one)")
    parser.add_argument("--output", type=Path, help="write the Markdown table here too (and a .json beside it)")
    parser.add_argument("--repeats", type=int, default=15, help="lookups per id kind (their median is reported)")
    parser.add_argument("--before", type=Path, help="another checkout (or git archive of one) measured alongside")
    parser.add_argument("--cells", type=int, default=0, help="cells per invocation: the matrix's first N (default "
                        "all 320; fewer for a quick run: the board's cost follows the cells it shows)")
    parser.add_argument("--tag-index", action="store_true", help="also measure the lookups with a hash index on "
                        "tags.value added to the database (what a lab's database administrator can add)")
    parser.add_argument("--routes", default=",".join(ROUTES),
                        help="comma-separated routes measured: lookup, start, board, board_cached (the lab board "
                             "with its cache: built, then read from it) (default: all)")
    parser.add_argument("--no-cli", action="store_true", help="leave out `mergecal report --lab` in a process of its "
                        "own (the board in the probe is what it runs, without its imports)")
    parser.add_argument("--smoke", action="store_true",
                        help=f"one small store ({SMOKE_RUNS} runs of {SMOKE_CELLS}-cell invocations), 3 repeats")
    parser.add_argument("--probe", choices=ROUTES, help=argparse.SUPPRESS)
    parser.add_argument("--uri", help=argparse.SUPPRESS)
    parser.add_argument("--ids", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.runs, args.repeats, args.cells = SMOKE_RUNS, 3, SMOKE_CELLS
    try:
        args.sizes = sorted({int(n) for n in args.runs.split(",")})
    except ValueError:
        parser.error(f"--runs {args.runs!r}: expected comma-separated counts such as 10000,100000")
    if not args.sizes or args.sizes[0] < 1:
        parser.error(f"--runs {args.runs!r}: expected positive counts")
    args.routes = tuple(dict.fromkeys(r.strip() for r in args.routes.split(",") if r.strip()))
    if not args.routes or not set(args.routes) <= set(ROUTES):
        parser.error(f"--routes {args.routes!r}: expected some of {', '.join(ROUTES)}")
    if args.before is not None and not (args.before / "mergecal" / "__init__.py").is_file():
        parser.error(f"--before {args.before}: expected a checkout (a folder holding mergecal/__init__.py)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.probe:
        return probe(args)
    from lab_servers import mlflow_server, postgres_server
    from mlflow import MlflowClient

    libraries = ([("before", args.before.resolve())] if args.before else []) + [("this checkout", ROOT)]
    full = cells, skipped = matrix()
    if args.cells:
        cells, skipped = cells[:args.cells], skipped[:max(1, args.cells * len(skipped) // len(cells))]
    with ExitStack() as stack:
        workdir = args.workdir or Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="perf-store-")))
        workdir.mkdir(parents=True, exist_ok=True)
        database = stack.enter_context(postgres_server(workdir / "pg"))
        url = stack.enter_context(mlflow_server(database, workdir / "artifacts"))
        client = MlflowClient(tracking_uri=url)
        experiment_ids = {name: client.create_experiment(name) for name in (*EXPERIMENTS, CHECK_EXPERIMENT)}
        bulk = BulkStore(database, workdir / "artifacts", experiment_ids)
        stack.callback(bulk.close)
        compared = check_bulk_against_api(url, bulk, experiment_ids[CHECK_EXPERIMENT], *full)
        log(f"API-written and bulk-written runs read back identically ({compared} runs of each)")
        state = {"cells": 0, "next": 0, "seen": set(), "last": {}, "complete": {}, "cut": set()}
        table, fills = {}, []
        for size in args.sizes:
            fill(bulk, size, state, cells, skipped)
            fills.append(f"{size:,} cell runs ({state['next']} invocations) in {state['fill_s']:.0f} s")
            log(f"store filled to {state['cells']} cell runs, {state['next']} invocations, {state['fill_s']:.0f} s")
            if size == args.sizes[-1] and EXPERIMENTS[1] in state["last"]:  # one member's newest still running
                bulk.still_running(state["last"][EXPERIMENTS[1]])
            ids_file = workdir / f"ids-{size}.json"
            ids_file.write_text(json.dumps(sample_ids(url, state, cells)))
            table[size] = measure(libraries, url, ids_file, args.repeats, workdir, size, cli=not args.no_cli,
                                  routes=args.routes)
            if args.tag_index:
                table[size][INDEXED] = measure_indexed(bulk, url, ids_file, args.repeats, size)
    meta = {"store": f"MLflow {__import__('mlflow').__version__} server (1 worker) on PostgreSQL "
                     f"({postgres_version()}), 127.0.0.1; each route in a fresh process, libraries alternated",
            "fill": "; ".join(fills), "machine": machine(), "command": " ".join(["python scripts/perf_store.py",
                                                                                 *(argv or sys.argv[1:])])}
    text = report(table, args.sizes, meta)
    print("\n" + text, flush=True)
    if args.output:
        from mergecal.checkpoint import atomic_write_text

        atomic_write_text(args.output, text)
        atomic_write_text(args.output.with_suffix(".json"), json.dumps(
            {"meta": meta, "results": {str(k): v for k, v in table.items()}}, indent=1, sort_keys=True) + "\n")
    return 0


def postgres_version() -> str:
    from lab_servers import find_pg_bindir

    bindir = find_pg_bindir()
    try:
        return subprocess.run([str(bindir / "postgres"), "--version"], capture_output=True, text=True,
                              timeout=30).stdout.strip()
    except (OSError, subprocess.SubprocessError, TypeError):
        return "PostgreSQL"


if __name__ == "__main__":
    sys.exit(main())
