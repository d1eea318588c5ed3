"""End to end at smoke size, as a user runs it: `dvc repro` (DVC stages → Prefect flow → MLflow → reports) in a
fresh workspace; a no-op second repro; one changed calibration parameter recomputes only its cells; a benchmark
killed with SIGKILL mid-run resumes without losing or duplicating anything; the scheduled-rerun flow."""

import difflib
import json
import os
import re
import shutil
import signal
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import yaml

from local_models import write_clip_track, write_llm_family
from mergecal.pipeline.workspace import create_workspace, smoke_overrides

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[1]


def _env():
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env['PATH']}"
    return env


def _repro(root):
    return _wait(_start_repro(root))


def _start_repro(root):
    # output to a file beside the workspace, not a pipe: two repros run at once and neither may block on a full pipe
    log = open(Path(root).parent / f"{Path(root).name}.repro.log", "w+")
    process = subprocess.Popen([str(BIN / "dvc"), "repro"], cwd=root, env=_env(), stdout=log, stderr=subprocess.STDOUT)
    process.log = log
    return process


def _wait(process):
    process.wait(timeout=900)
    with process.log as log:
        log.seek(0)
        output = log.read()
    assert process.returncode == 0, output[-6000:]
    return output


def _cell_runs(root, skipped=False):
    """(MLflow status, cell id) of the cell runs: computed (or failed) ones, or with ``skipped`` the chains a
    track cannot run, logged once with their reason."""
    with sqlite3.connect(root / "mlruns" / "mlruns.db") as con:
        return con.execute("select r.status, t.value from runs r join tags t on t.run_uuid = r.run_uuid "
                           "left join tags s on s.run_uuid = r.run_uuid and s.key = 'mergecal.status' "
                           "where t.key = 'mergecal.cell_id' and (coalesce(s.value, '') = 'skipped') = ?",
                           (skipped,)).fetchall()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """A cold `dvc repro` of the smoke pipeline with a lab's own models beside the embedded tracks (a `local_clip`
    track and a `local_llm` family, written to disk), and beside it (at the same time: each uses one core) a second
    cold repro in another directory, whose dvc.lock test_a_cold_repro_elsewhere_writes_the_same_dvc_lock reads."""
    torch.set_num_threads(1)
    lab = tmp_path_factory.mktemp("lab")
    overrides = {**smoke_overrides(), "local_clip": [write_clip_track(lab / "clip", "lab-clip")],
                 "local_llm": [write_llm_family(lab / "llm", "lab-llm")]}
    root = create_workspace(tmp_path_factory.mktemp("e2e") / "ws", overrides, root=REPO)
    other = create_workspace(root.parent / "elsewhere", overrides, root=REPO)
    start = time.perf_counter()
    running = [_start_repro(root), _start_repro(other)]
    output, _ = (_wait(process) for process in running)
    print(f"two cold dvc repro (smoke), side by side: {time.perf_counter() - start:.1f} s")
    shutil.copy2(root / "dvc.lock", root.parent / "dvc.lock.cold")  # later tests change the workspace
    return root, output


def test_cold_repro_builds_everything_and_reports(workspace):
    root, output = workspace
    summary = json.loads((root / "results" / "benchmark.json").read_text())
    assert summary["cells"] > 0 and summary["failed"] == 0
    assert len(_cell_runs(root)) == summary["cells"]
    assert len(_cell_runs(root, skipped=True)) == sum("skipped" in r for r in summary["rows"]) > 0
    html = (root / "reports" / "leaderboard.html").read_text()
    refs = []

    class Refs(HTMLParser):
        def handle_starttag(self, tag, attrs):
            refs.extend(v for k, v in attrs if k in ("src", "href") and v)

    Refs().feed(html)
    assert not [r for r in refs if r.startswith(("http://", "https://", "//"))]
    markdown = (root / "reports" / "leaderboard.md").read_text()
    assert "task_arithmetic" in markdown
    # the lab's own models went through the same stages and flow into the leaderboard (#16)
    own = [row for row in summary["rows"] if row.get("track", "").startswith(("local_clip:", "local_llm:"))]
    assert {row["track"] for row in own} == {"local_clip:lab-clip", "local_llm:lab-llm"}, summary["rows"][:3]
    clip_rows = [row for row in own if row["track"] == "local_clip:lab-clip"]
    assert not [row for row in clip_rows if "skipped" in row]  # its data chains (dsc, DisTaC) run
    assert {"task_arithmetic>dsc", "distac>task_arithmetic>svc>dsc"} <= {row["label"] for row in clip_rows}
    assert "lab-clip" in markdown and "lab-llm" in markdown
    shown = subprocess.run([str(BIN / "dvc"), "metrics", "show", "--json"], cwd=root, env=_env(), capture_output=True,
                           text=True)
    assert shown.returncode == 0 and "results/metrics.json" in shown.stdout


def test_a_cold_repro_elsewhere_writes_the_same_dvc_lock(workspace):
    """Regression (#13 item 7): nothing measured at run time (ids, dates, paths, seconds) is inside a DVC output,
    so a cold run in another directory records byte-identical outputs and hashes."""
    root, _ = workspace
    first, second = (root.parent / "dvc.lock.cold").read_text(), (root.parent / "elsewhere" / "dvc.lock").read_text()
    assert second == first, "".join(difflib.unified_diff(first.splitlines(True), second.splitlines(True), n=8))[:4000]


def test_second_repro_does_nothing(workspace):
    root, _ = workspace
    before = (root / "results" / "benchmark.json").read_text()
    # what running the stages writes where bytecode caching is on (PYTHONDONTWRITEBYTECODE unset)
    (root / "mergecal" / "methods" / "__pycache__").mkdir(exist_ok=True)
    (root / "mergecal" / "methods" / "__pycache__" / "ties.cpython-311.pyc").write_bytes(b"bytecode")
    output = _repro(root)
    # `local_inputs` always runs (it stats the files of the own-model tracks, none here) and changes nothing
    assert re.findall(r"Running stage '([^']+)'", output) == ["local_inputs"]
    assert (root / "results" / "benchmark.json").read_text() == before


def test_changing_one_calibration_parameter_recomputes_only_its_cells(workspace):
    root, _ = workspace
    params = yaml.safe_load((root / "params.yaml").read_text())
    n_before = len(_cell_runs(root))
    params["benchmark"]["chains"] = ["{merge}>svc(alpha=0.5)" if c == "{merge}>svc" else c
                                     for c in params["benchmark"]["chains"]]
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    output = _repro(root)
    assert "Running stage 'benchmark'" in output and "Running stage 'finetune" not in output
    # the task-arithmetic rows did not move, so the stability stage (its only reader of the results) is skipped
    assert "Running stage 'stability'" not in output and "Running stage 'report'" in output
    summary = {**json.loads((root / "results" / "benchmark.json").read_text()),
               **json.loads((root / "results" / "invocation.json").read_text())}
    tracks = (len(params["vision"]["regimes"]) + params["text"]["enabled"] + params["llm"]["enabled"]
              + len(params["local_clip"]) + len(params["local_llm"]))
    touched = tracks * len(params["benchmark"]["merges"])
    assert summary["cells"] - summary["cached"] == touched
    assert len(_cell_runs(root)) == n_before + touched


def test_sigkill_mid_benchmark_then_rerun_loses_and_duplicates_nothing(workspace):
    root, _ = workspace
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["benchmark"]["evaluation"]["max_validation"] = 7  # every cell id changes: the whole matrix reruns
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    finished_before = sum(status == "FINISHED" for status, _ in _cell_runs(root))
    process = subprocess.Popen([sys.executable, "-m", "stages.benchmark"], cwd=root, env=_env(),
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 600
    try:
        while time.time() < deadline:
            if (root / "mlruns" / "mlruns.db").exists() and \
                    sum(s == "FINISHED" for s, _ in _cell_runs(root)) >= finished_before + 3:
                break
            assert process.poll() is None, "the benchmark ended before it could be killed"
            time.sleep(0.05)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    done_before_kill = sum(s == "FINISHED" for s, _ in _cell_runs(root)) - finished_before
    assert done_before_kill >= 3

    _repro(root)
    summary = {**json.loads((root / "results" / "benchmark.json").read_text()),
               **json.loads((root / "results" / "invocation.json").read_text())}
    assert summary["failed"] == 0 and summary["cached"] >= done_before_kill
    runs = _cell_runs(root)
    finished = Counter(cell for status, cell in runs if status == "FINISHED")
    assert max(finished.values()) == 1  # no cell logged twice
    assert not [s for s, _ in runs if s == "RUNNING"]
    assert {row["cell_id"] for row in summary["rows"] if "skipped" not in row} <= set(finished)


def test_scheduled_rerun_deployment_and_flow(workspace):
    from mergecal.pipeline.schedule import deployment, rerun

    root, _ = workspace
    made = deployment("0 3 * * 1", str(root))
    assert made.name == "scheduled-benchmark" and made.parameters == {"root": str(root)}
    assert made.schedules[0].schedule.cron == "0 3 * * 1"
    result = rerun.fn(str(root))  # what each scheduled run does; here nothing changed since the last repro
    assert result["cells"] == json.loads((root / "results" / "benchmark.json").read_text())["cells"]
