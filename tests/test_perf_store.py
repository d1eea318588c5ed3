"""scripts/perf_store.py (#62: a lab's tracking store at scale): its synthetic invocations carry the tags the
benchmark writes, and at smoke size the whole script runs against a real MLflow server on PostgreSQL: the runs it
writes in bulk read back as the ones ``Tracker`` writes, and every route is measured."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load_script():
    spec = importlib.util.spec_from_file_location("perf_store", ROOT / "scripts" / "perf_store.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # 4-20 s: the matrix of params.yaml (Prefect imported for its skipped chains)
def test_a_synthetic_invocation_has_the_benchmarks_shape():
    """An invocation's runs: the default profile's 320 cells with their ``cell_tags`` and only tags of the tracking
    contract, a manifest naming every cell and skipped chain; a killed one stops early, without a manifest."""
    from mergecal.pipeline.tracking import PREFIX, TAGS, cell_key, cell_tags, tag

    script = load_script()
    cells, skipped = script.matrix()
    inv = script.invocation_runs(0, script.EXPERIMENT, cells, skipped, first=True)
    assert len(inv["cells"]) == len(cells) + len(skipped) and len(cells) == 321 and len(skipped) == 60
    keys = {k for run in [inv["parent"], *inv["cells"]] for k in run["tags"]}
    assert {k[len(PREFIX):] for k in keys if not k.startswith(cell_key(""))} <= set(TAGS)
    assert all(run["tags"][cell_key(run["cell_id"])] == run["tags"][tag("status")] for run in inv["cells"])
    first = inv["cells"][0]
    assert first["tags"].items() >= cell_tags(cells[0]).items() and first["tags"][tag("kind")] == "cell"
    assert set(inv["manifest"]) == {run["cell_id"] for run in inv["cells"]}
    statuses = [run["tags"][tag("status")] for run in inv["cells"]]
    assert statuses.count("skipped") == 60 and 0 < statuses.count("failed") < 30
    ok = next(run for run in inv["cells"] if run["tags"][tag("status")] == "ok")
    assert {f"acc.{t}" for t in cells[0].tasks} | {"avg_acc", "seconds"} <= set(ok["metrics"])
    killed = script.invocation_runs(script.KILLED_EVERY - 1, script.EXPERIMENT, cells, skipped, first=False)
    assert killed["manifest"] is None and killed["parent"]["status"] == "KILLED" and len(killed["cells"]) < len(cells)
    assert killed["cells"][-1]["status"] == "KILLED"
    assert script.invocation_runs(0, script.EXPERIMENT, cells, skipped, first=True)["cells"][5]["cell_id"] == \
        inv["cells"][5]["cell_id"]  # deterministic: a store filled in two steps is the one filled at once


@pytest.mark.slow  # 56 s (2-3 min on a loaded machine): PostgreSQL, an MLflow server, a process per route
def test_perf_store_runs_end_to_end_at_smoke_size(tmp_path):
    """``--smoke``: the API-against-bulk check passes, and every route of the table has a figure."""
    script = load_script()
    out = tmp_path / "store.md"
    assert script.main(["--smoke", "--workdir", str(tmp_path / "work"), "--output", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    row = result["results"][script.SMOKE_RUNS]["this checkout"]
    assert all(row[key] > 0 for key, _, _ in script.COLUMNS), row  # the CLI's included
    assert row["sources"] >= 1
    assert f"| {int(script.SMOKE_RUNS):,} | this checkout |" in out.read_text()
