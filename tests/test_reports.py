"""Reports from a tmp MLflow store logged per the benchmark's contract: 2 invocations, a failed cell,
a cached cell, diagnostics artifacts, and an injected regression."""

import base64
import json
import socket
import subprocess
import sys
from pathlib import Path
from html.parser import HTMLParser

import pytest

mlflow = pytest.importorskip("mlflow")
pytest.importorskip("matplotlib")

from mlflow import MlflowClient  # noqa: E402
from mlflow.entities import Metric, Param  # noqa: E402

from mergecal import ui  # noqa: E402
from mergecal.errors import MergecalError, ParameterError  # noqa: E402
from mergecal.reports.write import write_reports  # noqa: E402
from mergecal.reports.history import find_regressions, history_frame  # noqa: E402
from mergecal.reports.leaderboard import build_tables, table_markdown  # noqa: E402
from mergecal.reports.plots import block_index, diagnostic_plots, natural_key, short_names  # noqa: E402
from mergecal.reports.runs import cells_of, invocations, load_diagnostics, load_runs, pick_invocation  # noqa: E402

pytestmark = pytest.mark.integration

TASKS = ("cars", "dtd")
DAY = 86_400_000
T0 = 1_790_000_000_000

# recipe -> (merge, calibration); accuracies per invocation: (acc.cars, acc.dtd, avg_norm_acc)
CELLS = {
    "zeroshot": ("zeroshot", "none"),
    "finetuned": ("finetuned", "none"),
    "task_arithmetic": ("task_arithmetic", "none"),
    "task_arithmetic>svc": ("task_arithmetic", "svc"),
    "tsv_m": ("tsv_m", "none"),
    "distac>tsv_m>svc>dsc": ("tsv_m", "distac>svc>dsc"),
    "ties>wsc": ("ties", "wsc"),
    "ties>dsc": ("ties", "dsc"),  # skipped: a chain the track cannot run
}
SKIP = "needs models and data: no adapter for this track"
VALUES = {
    "inv-1": {"zeroshot": (0.40, 0.30, 0.45), "finetuned": (0.90, 0.80, 1.00),
              "task_arithmetic": (0.678, 0.60, 0.80), "task_arithmetic>svc": (0.70, 0.62, 0.82),
              "tsv_m": (0.75, 0.66, 0.90), "distac>tsv_m>svc>dsc": (0.77, 0.68, 0.92),
              "ties>wsc": (0.70, 0.61, 0.83)},
    "inv-2": {"zeroshot": (0.40, 0.30, 0.45), "finetuned": (0.90, 0.80, 1.00),
              "task_arithmetic": (0.678, 0.60, 0.79),  # exactly 1.0 point lower: not a regression
              "task_arithmetic>svc": (0.712, 0.58, 0.82),
              "tsv_m": (0.73, 0.64, 0.85),  # 5 points lower: the injected regression
              "distac>tsv_m>svc>dsc": (0.80, 0.63, 0.93)},  # ties>wsc fails in inv-2
}
ERROR = "RuntimeError: out of memory in ties sign election"


def _log_cell(client, exp, parent, inv, recipe, start, regime="standard", like=None):
    """Log one cell of invocation ``inv`` with the values (and diagnostics) of invocation ``like`` (default inv)."""
    merge, calibration = CELLS[recipe]
    like = like or inv
    failed = recipe not in VALUES[like]
    status = "skipped" if recipe == "ties>dsc" else "failed" if failed else "ok"
    tags = {"mlflow.parentRunId": parent, "mergecal.kind": "cell", "mergecal.invocation_id": inv,
            "mergecal.cell_id": f"{recipe}-{regime}-hash", "mergecal.status": status,
            "mergecal.backbone": "mergecal-vit-tiny", "mergecal.task_set": "vision2", "mergecal.regime": regime,
            "mergecal.merge": merge, "mergecal.calibration": calibration, "mergecal.recipe": recipe,
            "mergecal.tasks": ",".join(TASKS)}
    if failed:
        tags["mergecal.error"] = SKIP if status == "skipped" else ERROR
    run = client.create_run(exp, start_time=start, tags=tags)
    rid = run.info.run_id
    metrics = []
    if not failed:
        cars, dtd, norm = VALUES[like][recipe] if regime == "standard" else (0.5, 0.5, 0.6)
        metrics = [Metric("acc.cars", cars, start, 0), Metric("acc.dtd", dtd, start, 0),
                   Metric("avg_acc", (cars + dtd) / 2, start, 0), Metric("avg_norm_acc", norm, start, 0)]
    client.log_batch(rid, metrics=metrics + [Metric("seconds", 1.5, start, 0)],
                     params=[Param("merge.scaling", "0.3")])
    if like == "inv-2" and regime == "standard" and not failed:
        if recipe == "task_arithmetic":
            client.log_metric(rid, "selected_scaling", 0.3, timestamp=start)
            client.log_dict(rid, [{"scaling": s, "avg_acc": 0.5 + s / 4, "avg_norm_acc": 0.6 + s / 4}
                                  for s in (0.1, 0.2, 0.3)], "diagnostics/scaling_curve.json")
        if recipe == "task_arithmetic>svc":
            client.log_dict(rid, {f"visual.transformer.resblocks.{b}.attn.in_proj_weight":
                                  {"before": [3.0, 2.0, 1.0], "after": [2.0, 2.0, 1.5]} for b in (0, 1)},
                            "diagnostics/svc_spectra.json")
        if recipe == "distac>tsv_m>svc>dsc":
            keys = [f"visual.transformer.resblocks.{b}.mlp.c_fc.weight" for b in (10, 2)]
            client.log_dict(rid, {"metric": "accuracy_drop", "scores": {keys[0]: 0.2, keys[1]: 0.05}},
                            "diagnostics/sensitivity.json")
            client.log_dict(rid, {"weight": {keys[0]: 0.9, keys[1]: 1.1},
                                  "feature": {"visual.transformer.resblocks.2": 0.95,
                                              "visual.transformer.resblocks.10": 1.05}},
                            "diagnostics/magic_coefficients.json")
            client.log_dict(rid, {"cars": {"norm": 2.5, "entropy": 0.3}, "dtd": {"norm": 1.5, "entropy": 0.6}},
                            "diagnostics/task_vectors.json")
    client.set_terminated(rid, "FINISHED" if status != "failed" else "FAILED", end_time=start + 1000)
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlstore")
    uri = f"sqlite:///{root}/mlruns.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("mergecal", artifact_location=str(root / "artifacts"))
    zeroshot_run = None  # inv-1's zeroshot run, which inv-2 reuses
    for i, inv in enumerate(("inv-1", "inv-2")):
        start = T0 + i * DAY
        parent = client.create_run(exp, start_time=start, tags={
            "mergecal.kind": "invocation", "mergecal.invocation_id": inv, "mergecal.code_version": f"sha{i}"})
        for j, recipe in enumerate(CELLS):
            if inv == "inv-2" and recipe == "zeroshot":
                # reused, as the flow records it: no run of its own, the earlier run listed in the manifest
                client.log_dict(parent.info.run_id, {"zeroshot-standard-hash": {
                    "status": "ok", "run_id": zeroshot_run, "cached": True, "label": "zeroshot",
                    "regime": "standard"}}, "cells.json")
                continue
            rid = _log_cell(client, exp, parent.info.run_id, inv, recipe, start + 10 * (j + 1))
            if recipe == "zeroshot":
                zeroshot_run = rid
        _log_cell(client, exp, parent.info.run_id, inv, "tsv_m", start + 500, regime="norm_mismatch")
        client.set_terminated(parent.info.run_id, end_time=start + 2000)
    return uri


@pytest.fixture(scope="module")
def report(store, tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    (out / "plots").mkdir()
    (out / "plots" / "stale.svg").write_text("<svg/>")
    return out, write_reports(store, "mergecal", out)


def _row(markdown: str, recipe: str, section: str = "standard") -> list[str]:
    """Cells of ``recipe``'s row in the table under the heading that ends with ``section``."""
    block = markdown.split(f"· {section}\n", 1)[1].split("\n## ", 1)[0]
    for line in block.splitlines():
        if line.startswith(f"| `{recipe}` |"):
            return [c.strip() for c in line.strip("|").split("|")][1:]
    raise AssertionError(f"no row {recipe} in {section}")


def test_runs_and_invocations(store):
    runs = load_runs(store)
    table = invocations(runs)
    assert list(table["invocation_id"]) == ["inv-1", "inv-2"]
    assert list(table["code_version"]) == ["sha0", "sha1"]
    assert list(table["n_cells"]) == [9, 9] and list(table["n_failed"]) == [0, 1]  # skipped is no failure
    assert list(table["n_skipped"]) == [1, 1]
    assert pick_invocation(runs) == "inv-2"
    assert pick_invocation(runs, "inv-1") == "inv-1"
    with pytest.raises(MergecalError, match="invocation 'nope'"):
        pick_invocation(runs, "nope")
    with pytest.raises(MergecalError, match="experiment 'other' not found"):
        load_runs(store, "other")
    cells = cells_of(runs, "inv-2")
    assert cells.loc[cells["recipe"] == "zeroshot", "cached"].item() is True
    assert cells.loc[cells["recipe"] == "ties>wsc", "error"].item() == ERROR
    assert cells.loc[cells["recipe"] == "tsv_m", "tasks"].iloc[0] == TASKS


def test_leaderboard_markdown(report):
    out, written = report
    md = (out / "leaderboard.md").read_text()
    # a skipped chain is neither a computed cell nor a failure
    assert "8 cells computed, 1 not ok; skipped chains (not supported on their track): 1." in md and "Results `" in md
    assert "inv-2" not in md and "sha1" not in md and "2026" not in md  # nothing of the run: see the history
    assert "| recipe | avg | norm. avg | cars | dtd |" in md  # the averages first
    # references first, then each base merge followed by its calibrated variants
    block = md.split("· standard\n", 1)[1].split("\n## ", 1)[0]
    order = [line.split("`")[1] for line in block.splitlines() if line.startswith("| `")]
    assert order == ["zeroshot", "finetuned", "task_arithmetic", "task_arithmetic>svc", "tsv_m", "distac>tsv_m>svc>dsc"]
    assert _row(md, "finetuned") == ["85.0", "100.0", "90.0", "80.0"]  # reference: never bold
    assert _row(md, "task_arithmetic") == ["63.9", "79.0", "67.8", "60.0"]
    assert _row(md, "task_arithmetic>svc") == ["64.6 (+0.7)", "82.0 (+3.0)", "71.2 (+3.4)", "58.0 (-2.0)"]
    # these cells logged no per-example results: no intervals, no significance mark, nothing significantly best
    assert _row(md, "distac>tsv_m>svc>dsc") == ["71.5 (+3.0)", "93.0 (+8.0)", "80.0 (+7.0)", "63.0 (-1.0)"]
    assert _row(md, "tsv_m") == ["68.5", "85.0", "73.0", "64.0"]
    assert "- `ties>wsc` (failed, cell `ties>wsc-standard-hash`): " + ERROR in md
    assert "Skipped chains (not supported on this track):\n\n- `ties>dsc`: " + SKIP in md
    assert _row(md, "tsv_m", "norm_mismatch") == ["50.0", "60.0", "50.0", "50.0"]  # a single row: no runner-up
    assert ("![mergecal-vit-tiny · vision2 · standard — MAGIC magnitude sensitivity per key]"
            "(plots/sensitivity__mergecal-vit-tiny__vision2__standard.svg)") in md


def test_leaderboard_json(report):
    out, written = report
    data = json.loads((out / "leaderboard.json").read_text())
    rows = data["leaderboard"]["mergecal-vit-tiny"]["vision2"]["standard"]
    assert data["results"]["n_computed"] == 8 and data["results"]["n_failed"] == 1
    assert data["results"]["n_skipped"] == 1 and set(data) == {"results", "leaderboard", "summary", "warnings"}
    assert data["warnings"] == []  # no stability document: nothing flagged
    assert rows["task_arithmetic>svc"]["values"]["acc.cars"] == pytest.approx(0.712)
    assert rows["task_arithmetic>svc"]["delta_points"]["acc.cars"] == pytest.approx(3.4)
    assert rows["zeroshot"]["role"] == "reference" and "cached" not in rows["zeroshot"]
    assert rows["ties>wsc"] == {"role": "failed", "cell_id": "ties>wsc-standard-hash", "status": "failed",
                                "error_message": ERROR}
    assert rows["ties>dsc"] == {"role": "skipped", "cell_id": "ties>dsc-standard-hash", "status": "skipped",
                                "error_message": SKIP}


def test_plots_written_and_skipped(report):
    out, written = report
    plots = sorted(p.name for p in (out / "plots").glob("*.svg"))
    assert "stale.svg" not in plots
    kinds = sorted(name.split("__")[0] for name in plots)
    # inv-2 standard has every artifact kind; norm_mismatch has none (no plot); the history's trend plots are
    # in history.html only
    assert kinds == ["magic_coefficients", "scaling_curve", "sensitivity", "svc_spectra", "task_scores",
                     "task_scores", "task_vectors"]
    assert all(f"plots/{name}" in written for name in plots)
    for name in plots:
        assert (out / "plots" / name).read_text().lstrip().startswith("<?xml")


class _Collector(HTMLParser):
    def __init__(self):
        super().__init__()
        self.tags, self.links, self.images, self.best = [], [], [], 0

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.append(tag)
        self.links += [v for k, v in attrs.items() if k in ("src", "href") and v]
        if tag == "img":
            self.images.append(attrs["src"])
        if tag == "td" and "best" in (attrs.get("class") or "").split():
            self.best += 1


def test_html_self_contained(report):
    out, _ = report
    text = (out / "leaderboard.html").read_text()
    parser = _Collector()
    parser.feed(text)
    parser.close()
    assert {"html", "style", "table", "figure"} <= set(parser.tags) and "script" not in parser.tags
    assert "<link" not in text
    assert not [link for link in parser.links if link.lower().startswith(("http:", "https:", "//"))]
    assert all(link.startswith(("#", "data:image/svg+xml;base64,")) or link == "history.html" for link in parser.links)
    svgs = {p.read_text() for p in (out / "plots").glob("*.svg")}
    embedded = {base64.b64decode(src.split(",", 1)[1]).decode() for src in parser.images}
    assert embedded == svgs
    assert parser.best == 0  # no cell kept per-example results: nothing is significantly best
    assert "71.2 <span class=\"delta unknown\">(+3.4)</span>" in text  # pos/neg only where significant
    assert ERROR in text and "History: avg_norm_acc per invocation" not in text
    history = (out / "history.html").read_text()
    assert "History: avg_norm_acc per invocation" in history and history.count("<figure>") == 2  # both groups


def test_history_flags_regressions(store, report):
    out, _ = report
    runs = load_runs(store)
    regressions = find_regressions(history_frame(runs))
    assert [(r.recipe, r.invocation_id, r.previous_invocation_id, r.status) for r in regressions] == [
        ("ties>wsc", "inv-2", "inv-1", "failed"), ("tsv_m", "inv-2", "inv-1", "ok")]
    assert regressions[1].drop_points == pytest.approx(5.0)
    assert [r.recipe for r in find_regressions(history_frame(runs), threshold=0.5)] == [
        "task_arithmetic", "ties>wsc", "tsv_m"]
    md = (out / "history.md").read_text()
    assert "mergecal-vit-tiny · vision2 · standard · tsv_m: 90.0 → 85.0 (−5.0) in inv-2 (previous inv-1)" in md
    assert "| `tsv_m` | 90.0 | 85.0 |" in md and "| `ties>wsc` | 83.0 | failed |" in md
    assert "task_arithmetic: " not in md  # 1.0 point exactly is not more than the threshold


def test_deterministic_and_older_invocation(store, report, tmp_path):
    out, written = report
    again = write_reports(store, "mergecal", tmp_path / "again", invocation="inv-2")
    assert sorted(again) == sorted(written)
    for name in written:
        assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name
    runs = load_runs(store)
    md = "\n".join(table_markdown(t) for t in build_tables(cells_of(runs, "inv-1")))
    assert "Failed cells" not in md
    assert _row(md, "ties>wsc") == ["65.5", "83.0", "70.0", "61.0"]  # no base ties row: no delta
    # without diagnostics only the per-task scores are plotted (they come from the metrics)
    assert {p.kind for p in diagnostic_plots(cells_of(runs, "inv-1"), {})} == {"task_scores"}


def test_load_diagnostics_by_artifact_uri(tmp_path):
    uri = f"sqlite:///{tmp_path}/unused.db"
    assert load_diagnostics(uri, str(tmp_path)) == {}  # no diagnostics/ folder: nothing to plot
    (tmp_path / "diagnostics").mkdir()
    (tmp_path / "diagnostics" / "task_vectors.json").write_text('{"cars": {"norm": 2.0, "entropy": 0.1}}')
    (tmp_path / "diagnostics" / "notes.json").write_text("not one of ours")
    assert load_diagnostics(uri, str(tmp_path)) == {"task_vectors": {"cars": {"norm": 2.0, "entropy": 0.1}}}
    (tmp_path / "diagnostics" / "sensitivity.json").write_text("{bad")
    with pytest.raises(MergecalError, match="diagnostics/sensitivity.json: not valid JSON"):
        load_diagnostics(uri, str(tmp_path))
    assert not (tmp_path / "unused.db").exists()


def test_plot_helpers():
    names = ["a.blocks.10.w", "a.blocks.2.w", "a.blocks.2.b"]
    assert sorted(names, key=natural_key) == ["a.blocks.2.b", "a.blocks.2.w", "a.blocks.10.w"]
    assert [block_index(n) for n in names] == [10, 2, 2] and block_index("text_projection") is None
    assert short_names(["v.t.r.0.w", "v.t.r.1.w"]) == ["r.0.w", "r.1.w"]


def test_task_scores_name_the_lm_eval_metric_of_each_task():
    import pandas as pd

    from mergecal.reports.plots import task_metric_names, task_scores_figure

    rows = (("zeroshot", "none"), ("task_arithmetic", "none"), ("task_arithmetic>svc", "svc"))
    group = pd.DataFrame([{"recipe": r, "calibration": c, "tasks": ("maximum", "sentiment"),
                           "metrics.acc.maximum": 0.2, "metrics.exact_match.maximum": 0.2, "metrics.acc.sentiment": 0.9,
                           "metrics.norm_acc.maximum": 0.2, "metrics.avg_acc": 0.5} for r, c in rows])
    assert task_metric_names(group, ["maximum", "sentiment"]) == {"maximum": "exact_match", "sentiment": "accuracy"}
    fig = task_scores_figure(group, "tiny-llama · llm3 · standard")
    bars = [p.get_height() for p in fig.axes[0].patches]
    assert bars == pytest.approx([20.0, 90.0, 20.0, 90.0])  # two uncalibrated rows x two tasks
    assert [t.get_text() for t in fig.axes[0].get_xticklabels()] == ["maximum\n(exact_match)", "sentiment\n(accuracy)"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_ui_commands():
    server = ui.mlflow_server("sqlite:////x/mlruns.db", 5123)
    assert server.command[1:] == ["-m", "mlflow", "ui", "--backend-store-uri", "sqlite:////x/mlruns.db",
                                  "--host", "127.0.0.1", "--port", "5123", "--workers", "1"]
    assert server.url == "http://127.0.0.1:5123"
    prefect = ui.prefect_server(4321)
    assert prefect.command[1:] == ["-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", "4321"]
    env = ui.server_env({"PATH": "/bin"})
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] == "false" and env["PATH"] == "/bin"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        with pytest.raises(ParameterError, match="--mlflow-port .*already in use"):
            ui.check_port_free(busy.getsockname()[1], "--mlflow-port")


def test_ui_signal_handlers_restored():
    import signal

    before = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    previous = ui._interrupt_on_signals()
    try:
        assert signal.getsignal(signal.SIGTERM) is ui._raise_interrupt
        with pytest.raises(KeyboardInterrupt):
            ui._raise_interrupt(signal.SIGTERM, None)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert previous == before


def test_ui_stop_kills_whole_group():
    """A stand-in server (an HTTP server plus a child of it) is stopped as one process group."""
    port = _free_port()
    server = ui.Server("stand-in", ["/bin/sh", "-c", f"sleep 60 & exec {sys.executable} -m http.server {port} "
                                    "--bind 127.0.0.1"], f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/")
    proc = ui.start(server, env=ui.server_env())
    try:
        ui.wait_until_up(server, proc, timeout=20)
        members = subprocess.run(["pgrep", "-g", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(members) == 2  # the server and its sleeping child
    finally:
        ui.stop(proc, timeout=5)
    assert not ui.group_alive(proc.pid)


def test_the_summary_opens_the_leaderboard_then_the_testbed_health_then_the_tables(store, tmp_path):
    """#62: what the run found first, with the testbed's verdict linking to its section; the diagnostics (#30) still
    come before any table."""
    from mergecal.reports.write import markdown_html

    testbed = ("## Testbed health (clip-tiny, seed 0): NOT healthy\n\n| criterion | holds |\n|---|---|\n"
               "| average fine-tuned accuracy (%) | **no** |\n")
    write_reports(store, "mergecal", tmp_path, testbed=testbed)
    markdown = (tmp_path / "leaderboard.md").read_text()
    assert markdown.index("# mergecal leaderboard\n\nResults `") == 0
    assert markdown.index("## What this run found") < markdown.index("## Testbed health") < markdown.index(
        "| `tsv_m` |")
    assert ("Diagnostics: [Testbed health (clip-tiny, seed 0): NOT healthy]"
            "(#testbed-health-clip-tiny-seed-0-not-healthy).") in markdown
    # no cell of this store kept per-example results: the changes are there, the verdicts are not
    assert "| `svc` | ▲0 ≈0 ▼0 ?1 · +0.7 |" in markdown
    assert "“SVC improves the merges it calibrates”: no cell of the testbed measured it (1 not measured)." in markdown
    page = (tmp_path / "leaderboard.html").read_text()
    assert "<h2>Testbed health (clip-tiny, seed 0): NOT healthy</h2>" in page
    first_table = page.index('<section id="mergecal-vit-tiny-vision2-standard">')
    assert page.index('id="summary"') < page.index('id="testbed"') < first_table
    assert '<a href="#mergecal-vit-tiny-vision2-standard">mergecal-vit-tiny · vision2 · standard</a>' in page
    assert '<a href="#testbed">Testbed health (clip-tiny, seed 0): NOT healthy</a>' in page
    summary = json.loads((tmp_path / "leaderboard.json").read_text())["summary"]
    svc = next(c for c in summary["calibrations"] if c["calibration"] == "svc")
    assert svc["unmeasured"] == ["task_arithmetic>svc"] and svc["median_points"] == pytest.approx(0.7)
    html_table = markdown_html(testbed)
    assert html_table.count("<tr>") == 2 and "<th>criterion</th>" in html_table and "<td>no</td>" in html_table



def _stability(stable: bool) -> dict:
    """A stability document (reports/stability.json) whose track is the store's backbone x task set."""
    return {"relative_size": 1e-6, "seeds": [0, 1, 2], "tracks": [
        {"track": "vision", "backbone": "mergecal-vit-tiny", "task_set": "vision2", "recipe": "task_arithmetic",
         "regime": "standard", "scaling": 0.3, "avg_acc": 64.0, "half_width": 2.5, "avg_acc_per_seed": [55.0],
         "largest_avg_move": 2.0 if stable else 9.0, "largest_task_move": {"task": "cars", "points": 12.0},
         "changed_fraction": 0.1, "n_examples": 600, "stable": stable}]}


def test_an_unstable_track_is_flagged_under_the_testbed_health_and_under_each_of_its_tables(store, tmp_path):
    """Issue #30: the leaderboard says which track round-off moves by more than its rows' interval."""
    testbed = "## Testbed health (clip-tiny, seed 0): healthy\n"
    write_reports(store, "mergecal", tmp_path, testbed=testbed, stability=_stability(stable=False))
    markdown = (tmp_path / "leaderboard.md").read_text()
    assert markdown.index("## Testbed health") < markdown.index("## Track stability") < markdown.index("| `tsv_m` |")
    assert "- vision (mergecal-vit-tiny · vision2): task_arithmetic at scaling 0.3, average accuracy moves by up " \
           "to 9.0 points under 1e-06 relative perturbations against a 95 % interval half-width of 2.5" in markdown
    warning = ("**Warning:** Rows of this track move by up to 9.0 points under 1e-06 relative perturbations, more "
               "than their interval: read differences as unreliable.")
    for regime in ("standard", "norm_mismatch"):  # every table of the track, right under its title
        assert f"## mergecal-vit-tiny · vision2 · {regime}\n\n{warning}\n\n| recipe |" in markdown
    page = (tmp_path / "leaderboard.html").read_text()
    assert page.index('id="testbed"') < page.index('id="stability"') < page.index(
        '<section id="mergecal-vit-tiny-vision2-standard">')
    # the summary says so too, and marks the flagged tables
    assert "[Track stability: 2 of 2 tables flagged unstable (mergecal-vit-tiny · vision2 · standard; " \
           "mergecal-vit-tiny · vision2 · norm_mismatch)](#track-stability)." in markdown
    assert "[mergecal-vit-tiny · vision2 · standard ⚠](#mergecal-vit-tiny--vision2--standard)" in markdown
    assert "<li>vision (mergecal-vit-tiny · vision2): task_arithmetic" in page and ": UNSTABLE</li>" in page
    assert page.count('<p class="warning">Warning: Rows of this track move by up to 9.0 points') == 2

    write_reports(store, "mergecal", tmp_path, stability=_stability(stable=True))
    markdown = (tmp_path / "leaderboard.md").read_text()
    assert "## Track stability" in markdown and ": stable" in markdown and "Warning" not in markdown
    assert "Warning" not in (tmp_path / "leaderboard.html").read_text()

def test_a_regime_unstable_under_a_refit_is_flagged_under_its_own_table_only(store, tmp_path):
    """Issue #30: the training-time diagnostic's verdict reaches the leaderboard: a line under Track stability and
    a warning under the unstable regime's table, not under the track's other tables."""
    refit = {"track": "vision", "backbone": "mergecal-vit-tiny", "task_set": "vision2", "recipe": "task_arithmetic",
             "threads": 2, "refit_threads": 1, "regime": "norm_mismatch",
             "refit": {"task": "cars", "variant": "norm_mismatch", "identical": False},
             "rows": [{"label": "task_arithmetic(scaling=0.3)", "scaling": 0.3, "avg_acc": 40.0, "half_width": 2.0,
                       "largest_avg_move": 4.2, "changed_fraction": 0.1, "stable": False}],
             "largest_avg_move": 4.2, "stable": False,
             "worst_row": {"label": "task_arithmetic(scaling=0.3)", "move": 4.2, "half_width": 2.0}}
    write_reports(store, "mergecal", tmp_path, stability={**_stability(stable=True), "refits": [refit]})
    markdown = (tmp_path / "leaderboard.md").read_text()
    warning = ("**Warning:** Refit at 1 thread(s) instead of 2, this regime's cars (norm_mismatch) fine-tune moves its "
               "task_arithmetic(scaling=0.3) row by 4.2 points, more than its interval (±2.0)")
    assert f"## mergecal-vit-tiny · vision2 · norm_mismatch\n\n{warning}" in markdown
    assert "## mergecal-vit-tiny · vision2 · standard\n\n| recipe |" in markdown and markdown.count("Warning") == 1
    assert "- vision (mergecal-vit-tiny · vision2) · norm_mismatch: cars (norm_mismatch) refit;" in markdown
    page = (tmp_path / "leaderboard.html").read_text()
    assert page.count('<p class="warning">Warning: Refit at 1 thread(s) instead of 2') == 1
    (flagged,) = json.loads((tmp_path / "leaderboard.json").read_text())["warnings"]
    assert (flagged["backbone"], flagged["task_set"], flagged["regime"]) == ("mergecal-vit-tiny", "vision2",
                                                                             "norm_mismatch")
    assert flagged["warning"].startswith("Refit at 1 thread(s) instead of 2, this regime's cars (norm_mismatch)")
    write_reports(store, "mergecal", tmp_path, stability=_stability(stable=True))
    assert json.loads((tmp_path / "leaderboard.json").read_text())["warnings"] == []


def test_reports_read_only_tags_that_the_pipeline_writes():
    """Regression: the reports read a `mergecal.cached` tag that nothing wrote (reuse is in the manifests)."""
    from mergecal.pipeline.tracking import TAGS
    from mergecal.reports.runs import TAG_COLUMNS

    root = Path(__file__).resolve().parents[1]
    writers = ((root / "mergecal" / "pipeline" / "tracking.py").read_text()
               + (root / "mergecal" / "pipeline" / "flow.py").read_text())
    assert set(TAG_COLUMNS) <= set(TAGS)  # named once, in the tracking module
    unwritten = [name for name in TAGS if f'tag("{name}")' not in writers]
    assert not unwritten


def test_leaderboard_bytes_do_not_depend_on_the_run(report, tmp_path):
    """Regression (#13 item 7): the same cells logged by another invocation (other id, date, code version, run
    ids, nothing reused) give byte-identical leaderboard files and plots, so DVC records the same hashes after a
    cold run; the history, which is dated, is no DVC output."""
    out, written = report
    uri = f"sqlite:///{tmp_path}/other.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("mergecal", artifact_location=str(tmp_path / "artifacts"))
    start = T0 + 40 * DAY
    parent = client.create_run(exp, start_time=start, tags={
        "mergecal.kind": "invocation", "mergecal.invocation_id": "20300101-000000-abcdef",
        "mergecal.code_version": "0123456789ab-dirty"})
    for j, recipe in enumerate(CELLS):
        _log_cell(client, exp, parent.info.run_id, "20300101-000000-abcdef", recipe, start + 7 * (j + 1), like="inv-2")
    _log_cell(client, exp, parent.info.run_id, "20300101-000000-abcdef", "tsv_m", start + 300,
              regime="norm_mismatch", like="inv-2")
    client.set_terminated(parent.info.run_id, end_time=start + 900)
    again = write_reports(uri, "mergecal", tmp_path / "again")
    assert sorted(again) == sorted(written)
    for name in written:
        if name.startswith("history."):
            assert (tmp_path / "again" / name).read_bytes() != (out / name).read_bytes(), name
        else:
            assert (tmp_path / "again" / name).read_bytes() == (out / name).read_bytes(), name


def _invocation(client, exp, inv, start, recipes, *, expected, like, status):
    """An invocation's parent run (tagged with the cells it sets out to compute, as the flow does), the cells of
    ``recipes`` logged under it, and the parent left in ``status`` (RUNNING: the benchmark was killed)."""
    parent = client.create_run(exp, start_time=start, tags={
        "mergecal.kind": "invocation", "mergecal.invocation_id": inv, "mergecal.code_version": "sha",
        "mergecal.cells": str(expected)}).info.run_id
    for j, recipe in enumerate(recipes):
        _log_cell(client, exp, parent, inv, recipe, start + 10 * (j + 1), like=like)
    if status != "RUNNING":
        client.set_terminated(parent, status, end_time=start + 1000)
    return parent


def test_a_killed_invocation_is_no_result(tmp_path, capsys):
    """Regression (hardening, second round, item 6): after a SIGKILL of the benchmark, its invocation (parent run
    still RUNNING, 1 of 3 cells) was the leaderboard's, and the history listed it as an ordinary invocation."""
    from mergecal.cli import main

    (tmp_path / "params.yaml").write_text("tracking: {store: mlruns}\n")
    (tmp_path / "mlruns").mkdir()
    uri = f"sqlite:///{tmp_path}/mlruns/mlruns.db"
    client = MlflowClient(tracking_uri=uri)
    exp = client.create_experiment("mergecal", artifact_location=str(tmp_path / "mlruns" / "artifacts"))
    recipes = ["zeroshot", "finetuned", "task_arithmetic"]
    killed = _invocation(client, exp, "killed-first", T0, recipes[:1], expected=3, like="inv-2", status="RUNNING")
    # no finished invocation yet: no report, one line saying why
    assert main(["report", "--root", str(tmp_path)]) == 2
    err = capsys.readouterr().err  # MLflow logs its store's creation before
    assert "Traceback" not in err and err.count("mergecal: error: ") == 1
    assert err[err.index("mergecal: error: "):].rstrip() == (
        "mergecal: error: tracking store: no finished benchmark invocation to report; the latest, killed-first, is no "
        "result (killed or still running (MLflow status RUNNING, never finished): 1 of 3 cells): rerun the benchmark "
        "(dvc repro)")
    assert not (tmp_path / "reports").exists()

    client.set_terminated(killed, "KILLED")  # as the next invocation marks it
    _invocation(client, exp, "finished", T0 + DAY, recipes, expected=3, like="inv-1", status="FINISHED")
    _invocation(client, exp, "killed-last", T0 + 2 * DAY, recipes[2:], expected=3, like="inv-2", status="RUNNING")
    out = tmp_path / "reports"
    write_reports(uri, "mergecal", out)
    data = json.loads((out / "leaderboard.json").read_text())
    assert data["results"]["n_computed"] == 3  # the finished invocation's, not the killed one's 1 of 3
    rows = data["leaderboard"]["mergecal-vit-tiny"]["vision2"]["standard"]
    assert rows["task_arithmetic"]["values"]["avg_norm_acc"] == pytest.approx(VALUES["inv-1"]["task_arithmetic"][2])
    history = (out / "history.md").read_text()
    assert "| finished |" in history
    assert "| killed (MLflow status KILLED): 1 of 3 cells |" in history
    assert "| killed or still running (MLflow status RUNNING, never finished): 1 of 3 cells |" in history
    assert "| recipe | `finished` |" in history  # only the finished invocation is compared
    assert "killed (MLflow status KILLED)" in (out / "history.html").read_text()
    with pytest.raises(MergecalError, match=r"invocation 'killed-last' is no result \(killed or still running .*"
                                            r"reports read finished invocations only: finished$"):
        pick_invocation(load_runs(uri), "killed-last")


def test_a_finished_invocation_missing_cells_is_incomplete():
    row = {"n_cells": 12, "n_skipped": 1, "n_expected": 42, "run_status": "FINISHED"}
    from mergecal.reports.runs import unfinished_state

    assert unfinished_state(row) == "incomplete: 11 of 42 cells"
    assert unfinished_state({**row, "n_cells": 43}) is None
    assert unfinished_state({**row, "n_expected": 0}) is None  # an older store: the parent records no count
    assert unfinished_state({**row, "run_status": "FAILED"}) == "not finished (MLflow status FAILED): 11 of 42 cells"
