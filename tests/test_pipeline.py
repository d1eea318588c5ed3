"""The pipeline at smoke size, in process: params validation, cells and their hashes, the Prefect flow with
caching, failures and MLflow tracking (no duplicate runs, concurrent logging)."""

import json
import re
import multiprocessing as mp
import shutil
import sqlite3
from collections import Counter
from pathlib import Path

import pytest
import torch
import yaml

from mergecal.errors import MergecalError, ParameterError
from mergecal.pipeline import cells as cells_mod
from mergecal.pipeline import code_digest
from mergecal.pipeline.tracks.causal_lm.built import stages as llm
from mergecal.pipeline.tracks.text.built import stages as text
from mergecal.pipeline.tracks.clip.built import stages as vision
from mergecal.pipeline import track_registry
from mergecal.pipeline.config import load_params, parse_params
from mergecal.pipeline.workspace import PIPELINE_FILES, SMOKE_PARAMS, create_workspace
from mergecal.recipe import Recipe

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


# ----------------------------------------------------------------------------------------------- params.yaml

def test_repository_params_yaml_is_valid_and_complete_for_dvc():
    params = load_params(REPO / "params.yaml")
    assert params.vision.enabled and len(params.vision.tasks) >= 8
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for stage in stages.values():  # every `params:` entry of dvc.yaml must exist in params.yaml
        for key in stage.get("do", stage).get("params", []):
            node = raw
            for part in key.split("."):
                assert isinstance(node, dict) and part in node, f"dvc.yaml lists {key!r}, missing from params.yaml"
                node = node[part]


@pytest.mark.parametrize("override, message", [
    ({"vison": {}}, r"vison: unknown key; allowed: seed, seeds, device, threads, vision"),
    ({"vision": {"tasks": ["shapes", "sahpes"]}}, r"vision.tasks: unknown task 'sahpes' in task set 'vision8'; "
                                                  r"choose from: shapes"),
    ({"benchmark": {"merges": {"tie": {}}}}, r"unknown merge method 'tie'; choose from: .*ties"),
    ({"benchmark": {"merges": {"ties": {"topk": 0.2}}}}, r"ties: unknown parameter 'topk'; allowed: scaling, top_k"),
    ({"benchmark": {"chains": ["{merge}>svcc"]}}, r"chain '\{merge\}>svcc': unknown recipe step 'svcc'"),
    ({"benchmark": {"chains": ["svc"]}}, r"must contain '\{merge\}' exactly once"),
    ({"vision": {"finetune": {"stepz": 3}}}, r"vision.finetune.stepz: unknown field; allowed: steps"),
    ({"runner": {"kind": "celery"}}, r"runner.kind: .*'threads', 'processes' or 'dask' \(got 'celery'\)"),
    ({"distac": {"kapa": 1}}, r"distac: unknown parameter 'kapa'"),
    ({"vision": {"regimes": ["low_confidence"], "finetune_variants": ["standard"]}},
     r"regime 'low_confidence' needs 'low_confidence' in finetune_variants"),
])
def test_params_errors_are_one_clear_line(override, message):
    with pytest.raises(ParameterError, match=message) as info:
        parse_params(override)
    assert "\n" not in str(info.value)


def test_missing_and_malformed_params_file(tmp_path):
    with pytest.raises(ParameterError, match="parameters file not found"):
        load_params(tmp_path / "params.yaml")
    (tmp_path / "params.yaml").write_text("vision: [unclosed\n")
    with pytest.raises(ParameterError, match=r"params.yaml: not valid YAML \(line \d+\)"):
        load_params(tmp_path / "params.yaml")


# ------------------------------------------------------------------------------------------ built workspace

@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """The smoke workspace with every DVC stage's outputs built in process (the stage functions)."""
    import torch

    torch.set_num_threads(1)
    root = create_workspace(tmp_path_factory.mktemp("pipeline"), root=REPO, git=False)
    params = load_params(root / "params.yaml")
    vision.build_data(params, root, progress=False)
    vision.pretrain(params, root, progress=False)
    for task in params.vision.tasks:
        for variant in params.vision.finetune_variants:
            vision.finetune(params, task, variant, root, progress=False)
    vision.finetune(params, params.vision.norm_mismatch_task, "norm_mismatch", root, progress=False)
    vision.multitask(params, root, progress=False)
    vision.task_vectors(params, root)
    vision.distac(params, root, progress=False)
    vision.probe(params, root, progress=False)
    text.build_data(params, root)
    for task in params.text.tasks:
        text.finetune(params, task, root, progress=False)
    text.references(params, root)
    llm.build_data(params, root)
    llm.pretrain(params, root, progress=False)
    for task in params.llm.tasks:
        llm.finetune(params, task, root, progress=False)
    llm.references(params, root)
    return root, params


def test_finetune_stage_reports_accuracy_on_the_true_validation_split(built):
    """Regression: the validation split was taken twice (pipeline, then finetune again), so the stage trained on
    about 81% of train and printed an accuracy measured on training images."""
    from mergecal.backbones import load_clip
    from mergecal.checkpoint import load_state_dict
    from mergecal.evaluation import evaluate

    root, params = built
    paths = vision.paths_for(params, root)
    task = params.vision.tasks[0]
    meta = json.loads(paths.finetuned("standard", task).with_suffix(".json").read_text())
    state = {**load_state_dict(paths.pretrained), **load_state_dict(paths.finetuned("standard", task))}
    images, labels = vision.task_split(paths.data, task, "validation")
    expected = evaluate(load_clip(params.vision.arch, state), load_state_dict(paths.heads)[task], images, labels)
    assert meta["val_accuracy"] == pytest.approx(expected["accuracy"])
    train = vision.task_split(paths.data, task, "train")[0]
    assert not {bytes(x) for x in images} & {bytes(x) for x in train}


def test_finetunes_on_two_worker_processes_train_the_in_process_bits(built, tmp_path):
    """Each fine-tune runs on one thread wherever it runs: two worker processes (the finetune stage at
    ``threads: 2``) write the same bytes as the fixture's in-process fine-tunes, and finetuned.json lists them in
    the runs' order whichever finished first."""
    root, params = built
    paths = vision.paths_for(params, root)
    copy = tmp_path / "workspace"
    shutil.copytree(paths.data, copy / paths.data.relative_to(root))
    for name in ("pretrained.safetensors", "heads.safetensors"):
        target = copy / paths.pretrained.parent.relative_to(root) / name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(paths.pretrained.parent / name, target)
    lines = []
    summary = vision.finetune_all(params, copy, workers=2, log=lines.append)
    runs = vision.finetune_runs(params.vision)
    assert len(lines) == len(runs) + 1  # and the multi-task reference
    assert [(t, v) for v in summary if v != "multitask" for t in summary[v]] == runs
    copied = vision.paths_for(params, copy)
    for task, variant in runs:
        assert copied.finetuned(variant, task).read_bytes() == paths.finetuned(variant, task).read_bytes(), task
    assert copied.multitask.read_bytes() == paths.multitask.read_bytes()
    assert json.loads((copied.seeded / "finetuned.json").read_text()) == summary


def test_cells_cover_the_matrix_with_distinct_ids(built):
    root, params = built
    cells = cells_mod.enumerate_cells(params)
    n_regimes, n_merges, n_chains = (len(params.vision.regimes), len(params.benchmark.merges),
                                     len(params.benchmark.chains))
    # plus the smoke matrix's one fixed-scaling protocol: task arithmetic at 0.3, alone and with WSC
    (fixed,) = params.benchmark.fixed_scaling
    n_fixed = len(fixed.merges) * len(fixed.chains)
    vision_cells = [c for c in cells if c.track == "vision"]
    assert len(vision_cells) == n_regimes * (2 + n_merges * n_chains + n_fixed) + 1  # + the standard regime's multitask
    assert {c.calibration for c in vision_cells if "@" in c.calibration} == {"none@λ=0.3", "wsc@λ=0.3"}
    # the text track runs the weight-space chains only ("{merge}" and "{merge}>svc" in the smoke matrix)
    text_cells = [c for c in cells if c.track == "text"]
    assert sorted(c.chain for c in text_cells if c.merge == "ties") == ["{merge}", "{merge}>svc"]
    assert len(text_cells) == 2 + n_merges * 2 + n_fixed
    # so does the LLM track; the chains with DisTaC or DSC are listed as skipped, with the reason
    llm_cells = [c for c in cells if c.track == "llm"]
    assert sorted(c.chain for c in llm_cells if c.merge == "ties") == ["{merge}", "{merge}>svc"]
    assert len(llm_cells) == 2 + n_merges * 2 + n_fixed
    from mergecal.pipeline.track_registry import skipped_cells

    skipped = skipped_cells(params)
    assert sorted({(c.track, c.chain) for c, _ in skipped}) == [
        (track, chain) for track in ("llm", "text") for chain in sorted(["{merge}>dsc", "distac>{merge}>svc>dsc"])]
    assert all("needs models and data" in reason for _, reason in skipped)
    ids = cells_mod.matrix_ids(cells, params, root)
    assert len(set(ids)) == len(ids)
    assert ids == cells_mod.matrix_ids(cells, params, root)  # stable


def test_changing_one_calibration_parameter_changes_only_the_cells_it_touches(built):
    root, params = built
    cells = cells_mod.enumerate_cells(params)
    before = {c.track + c.label + "/" + c.regime: i for c, i in zip(cells, cells_mod.matrix_ids(cells, params, root))}
    data = params.model_dump(mode="json")
    data["benchmark"]["chains"] = [c.replace("{merge}>svc", "{merge}>svc(alpha=0.5)") if c == "{merge}>svc" else c
                                   for c in data["benchmark"]["chains"]]
    changed = parse_params(data)
    cells = cells_mod.enumerate_cells(changed)
    after = {c.track + c.label.replace("svc(alpha=0.5)", "svc") + "/" + c.regime: i
             for c, i in zip(cells, cells_mod.matrix_ids(cells, changed, root))}
    assert before.keys() == after.keys()
    differing = {k for k in before if before[k] != after[k]}
    assert differing == {k for k in before if k.split("/")[0].endswith(">svc") and "distac" not in k}


def test_cell_id_follows_input_bytes(built, tmp_path):
    root, params = built
    cell = next(c for c in cells_mod.enumerate_cells(params)
                if c.track == "vision" and c.merge == "task_arithmetic" and c.chain == "{merge}")
    path = Path(cells_mod.cell_inputs(cell, params, root)["finetuned.symbols"])
    original = path.read_bytes()
    before = cells_mod.cell_id(cell, params, root)
    try:
        path.write_bytes(original[:-1] + bytes([original[-1] ^ 1]))
        assert cells_mod.cell_id(cell, params, root) != before
    finally:
        path.write_bytes(original)
    assert cells_mod.cell_id(cell, params, root) == before


def test_cell_code_digest_follows_the_modules_each_cell_imports(tmp_path, monkeypatch):
    """Editing a merge method or a calibration changes the ids of the cells whose recipe names it and no other;
    editing the shared core (cells.py, merge.py) changes every id, a track's evaluation its track's; reports,
    speed benchmarks, the command line and an unregistered new module change none. A comment is an edit."""
    import functools

    package = tmp_path / "mergecal"
    shutil.copytree(code_digest.PACKAGE_DIR, package, ignore=shutil.ignore_patterns("__pycache__"))
    params = load_params(REPO / "params.yaml")
    cells = cells_mod.enumerate_cells(params)
    first_regime = {c.track: c.regime for c in reversed(cells)}  # one regime a track: the code digest ignores it
    cells = [c for c in cells if c.regime == first_regime[c.track]]
    steps = [set(code_digest.recipe_steps(c.recipe)) for c in cells]
    monkeypatch.setattr(cells_mod, "cell_inputs", lambda cell, params, root: {})  # only the code changes here

    def ids(package_dir: Path) -> list[str]:
        """Every cell's id, the code digest computed afresh over ``package_dir``."""
        monkeypatch.setattr(cells_mod, "cell_code_digest", functools.lru_cache(maxsize=None)(
            functools.partial(code_digest.cell_code_digest.__wrapped__, package_dir=package_dir)))
        return cells_mod.matrix_ids(cells, params, ".")

    before = ids(package)
    assert before == ids(code_digest.PACKAGE_DIR)  # the copy: the same ids

    def changed_by(*edited: str) -> set[int]:
        originals = {name: (package / name).read_text() for name in edited}
        for name, source in originals.items():
            (package / name).write_text(source + "\n# edited\n")
        try:
            return {i for i, (old, new) in enumerate(zip(before, ids(package))) if old != new}
        finally:
            for name, source in originals.items():
                (package / name).write_text(source)

    ties = changed_by("methods/ties.py")  # and DARE's, built on TIES' core (`from .ties import TiesCore`)
    assert ties and ties == {i for i, s in enumerate(steps) if s & {"ties", "dare"}}
    assert not ties & {i for i, c in enumerate(cells) if c.merge == "task_arithmetic"}
    svc = changed_by("calibrations/svc.py")
    assert svc and svc == {i for i, s in enumerate(steps) if "svc" in s}
    fsc = changed_by("calibrations/fsc.py")
    assert fsc and fsc == {i for i, s in enumerate(steps) if "fsc" in s} and fsc != svc
    llm = changed_by("pipeline/tracks/causal_lm/built/cells.py")
    assert llm and llm == {i for i, c in enumerate(cells) if c.track == "llm"}
    # a track is one package: an edit to any module of it that computes its cells reruns that track's cells only
    text_stages = changed_by("pipeline/tracks/text/built/stages.py")
    assert text_stages and text_stages == {i for i, c in enumerate(cells) if c.track == "text"}
    for core in ("pipeline/cells.py", "merge.py"):
        assert changed_by(core) == set(range(len(cells))), core
    # the CLIP evaluation: the vision cells', and the LLM cells' through the lazy exports of mergecal.evaluation;
    # the text cells reached it only through the params schema's import of pipeline/vision.py, a cycle gone (#33)
    assert changed_by("evaluation/zeroshot.py") == {i for i, c in enumerate(cells) if c.track in ("vision", "llm")}
    assert changed_by("reports/leaderboard.py", "cli.py", "perf/merging.py", "perf/memory.py", "ui.py") == set()
    (package / "methods" / "new_method.py").write_text("from ..linalg import svd\n")
    code_digest._package_sources.cache_clear()  # the graph is read once a process: read it again with the new file
    assert ids(package) == before


def test_cell_code_digest_is_logged_per_cell():
    params = load_params(REPO / "params.yaml")
    by_merge = {c.merge: c for c in cells_mod.enumerate_cells(params) if c.track == "vision" and c.chain == "{merge}"}
    logged = {m: cells_mod.base_params(c)["mergecal_code"] for m, c in by_merge.items()}
    assert logged["ties"] == code_digest.cell_code_digest("vision", by_merge["ties"].recipe)[:16]
    assert logged["ties"] != logged["task_arithmetic"]


def test_same_params_give_identical_results(built):
    root, params = built
    chosen = [c for c in cells_mod.enumerate_cells(params) if c.merge == "ties"
              and (c.regime == "norm_mismatch" or c.track == "text")]
    for cell in chosen:
        first = cells_mod.run_cell(cell, params, root)
        second = cells_mod.run_cell(cell, params, root)
        assert first.metrics == second.metrics
        assert first.diagnostics.keys() == second.diagnostics.keys()



def test_stability_reevaluates_each_tracks_task_arithmetic_row_as_the_benchmark_scored_it(built):
    """The stability stage (issue #30) evaluates the benchmark's own row: unperturbed, its per-example outcomes
    are the cell's, on every track (vision through evaluate_tasks, text through TextModels, LLM through lm-eval)."""
    from mergecal.pipeline.stability import measure
    from mergecal.reports.stability import stability_markdown

    root, params = built
    rows, examples = [], {}
    for cell in cells_mod.enumerate_cells(params):
        if cell.regime == "standard" and cell.label == "task_arithmetic":
            result = cells_mod.run_cell(cell, params, root, scaling=0.3)
            rows.append({"track": cell.track, "regime": "standard", "label": "task_arithmetic",
                         "selected_scaling": 0.3})
            examples[cell.track] = result.examples
    document = measure(params, root, {"rows": rows})
    assert [e["track"] for e in document["tracks"]] == list(track_registry.DIAGNOSTICS)
    for entry in document["tracks"]:
        cell = examples[entry["track"]]
        expected = 100 * sum(sum(v) / len(v) for v in cell.values()) / len(cell)
        assert entry["avg_acc"] == pytest.approx(expected, abs=1e-5), entry["track"]
        assert entry["n_examples"] == sum(len(v) for v in cell.values())
        assert entry["stable"] == (entry["largest_avg_move"] <= entry["half_width"])
        assert len(entry["avg_acc_per_seed"]) == 3 and entry["scaling"] == 0.3
    assert stability_markdown(document).count("\n| ") == 1 + 3  # the header, one row per track
    assert not list((root / ".mergecal" / "llm").glob("stability-*"))  # the perturbed LLM copies are gone

def test_a_refit_at_the_pipelines_thread_count_is_the_stored_fine_tune_and_each_regime_is_measured(built):
    """The training-time diagnostic (issue #30) refits a fine-tune from what its file records: at the pipeline's
    own thread count the refit is the stored model bit for bit (vision, text; so a move at another count is the
    thread count's), the process's thread count is restored, and each track's regime with a task-arithmetic row
    gets a verdict (the LLM's refit and merges written in a scratch directory that is gone after)."""
    from mergecal.checkpoint import load_state_dict
    from mergecal.pipeline.refit_stability import measure_refits
    from mergecal.pipeline.tracks.text.built.diagnostics import refit as text_refit
    from mergecal.pipeline.tracks.clip.built.diagnostics import refit as vision_refit

    root, params = built
    task, variant = params.vision.norm_mismatch_task, "norm_mismatch"
    from mergecal.pipeline.tracks.clip.built.diagnostics import training_threads

    assert training_threads(params, "cpu") == 1  # finetune_all's one thread per fine-tune, whatever `threads` is
    again = vision_refit(params, root, task, variant, threads=training_threads(params, "cpu"))
    stored = load_state_dict(vision.paths_for(params, root).finetuned(variant, task))
    assert again.keys() == stored.keys() and all(torch.equal(again[k], stored[k]) for k in stored)
    encoder, head = text_refit(params, root, params.text.tasks[0], threads=params.threads)
    stored_encoder, stored_head = text.TextModels(params, root).finetuned(params.text.tasks[0])
    assert all(torch.equal(encoder[k], stored_encoder[k]) for k in stored_encoder)
    assert all(torch.equal(head[k], stored_head[k]) for k in stored_head)
    assert torch.get_num_threads() == 1
    rows = [{"track": track, "regime": regime, "seed": 0, "merge": "task_arithmetic", "label": label,
             "selected_scaling": scaling}
            for track, regime in (("vision", "standard"), ("vision", "norm_mismatch"), ("text", "standard"),
                                  ("llm", "standard"))
            for label, scaling in (("task_arithmetic", 0.3), ("task_arithmetic(scaling=1.0)", 1.0))]
    entries = {(e["track"], e["regime"]): e for e in measure_refits(params, root, {"rows": rows})}
    assert list(entries) == [*(("vision", r) for r in params.vision.regimes), ("text", "standard"),
                             ("llm", "standard")]
    assert torch.get_num_threads() == 1 and entries["vision", "low_confidence"]["stable"] is None
    # the 10x-lr model is the norm-mismatch regime's largest task vector, by construction
    assert entries["vision", "norm_mismatch"]["refit"] == {**entries["vision", "norm_mismatch"]["refit"],
                                                           "task": task, "variant": variant}
    examples = {"vision": 30 * len(params.vision.tasks), "text": None, "llm": None}
    for key, entry in entries.items():
        if entry["stable"] is None:
            continue
        assert entry["refit_threads"] == 2 and [r["scaling"] for r in entry["rows"]] == [0.3, 1.0], key
        assert entry["refit"]["task"] in _settings_tasks(params, key[0])
        assert entry["stable"] == all(r["largest_avg_move"] <= r["half_width"] for r in entry["rows"]), key
        if examples[key[0]]:
            assert all(r["n_examples"] == examples[key[0]] for r in entry["rows"])
    assert not list((root / ".mergecal" / "llm").glob("refit-*"))


def _settings_tasks(params, track):
    return {"vision": params.vision.tasks, "text": params.text.tasks, "llm": params.llm.tasks}[track]


def test_reference_cells_and_normalized_accuracy(built):
    root, params = built
    cells = {(c.regime, c.label): c for c in cells_mod.enumerate_cells(params) if c.track == "vision"}
    reference = json.loads((vision.paths_for(params, root).task_vectors("standard") / "diagnostics.json").read_text())
    finetuned = cells_mod.run_cell(cells[("standard", "finetuned")], params, root).metrics
    for task in params.vision.tasks:
        assert finetuned[f"acc.{task}"] == reference[task]["test_accuracy"]
        assert finetuned[f"norm_acc.{task}"] == pytest.approx(1.0)
    merged = cells_mod.run_cell(cells[("standard", "task_arithmetic")], params, root).metrics
    for task in params.vision.tasks:
        assert merged[f"norm_acc.{task}"] == pytest.approx(merged[f"acc.{task}"] / reference[task]["test_accuracy"])
    assert merged["avg_acc"] == pytest.approx(sum(merged[f"acc.{t}"] for t in params.vision.tasks) / 3)
    assert merged["selected_scaling"] in params.benchmark.merges["task_arithmetic"]["scaling"]


# ---------------------------------------------------------------------------------------------------- flow

@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _cell_runs(root, status="ok"):
    """(MLflow run status, cell id) of the cell runs with this mergecal.status (computed cells: ok)."""
    db = root / "mlruns" / "mlruns.db"
    with sqlite3.connect(db) as con:
        return con.execute(
            "select r.status, t.value from runs r join tags t on t.run_uuid = r.run_uuid "
            "join tags s on s.run_uuid = r.run_uuid and s.key = 'mergecal.status' "
            "where t.key = 'mergecal.cell_id' and s.value = ?", (status,)).fetchall()


def _must_not_run(cell, *args, **kwargs):
    raise AssertionError(f"cell {cell.label} ({cell.regime}) was computed again")


def test_flow_caches_cells_and_never_duplicates_runs(built, prefect_server, monkeypatch):
    import mergecal.pipeline.flow as flow_module
    from mergecal.pipeline.flow import run_benchmark as benchmark

    root, params = built
    first = benchmark(root=str(root))
    assert first["failed"] == 0 and first["cached"] == 0 and first["cells"] == len(cells_mod.enumerate_cells(params))
    runs = _cell_runs(root)
    assert len(runs) == first["cells"] and all(status == "FINISHED" for status, _ in runs)

    # the LLM cells carry lm-eval's per-task metric, its version and each task's configuration digest
    from importlib.metadata import version

    from mergecal.pipeline.tracking import Tracker

    tracker = Tracker(root, params.tracking.experiment)
    llm_runs = tracker.client.search_runs([tracker.experiment_id], "tags.`mergecal.track` = 'llm' and "
                                          "tags.`mergecal.status` = 'ok'", max_results=100)
    assert len(llm_runs) == len([c for c in cells_mod.enumerate_cells(params) if c.track == "llm"]) >= 2
    for run in llm_runs:
        assert {"exact_match.maximum", "acc.sentiment", "avg_norm_acc"} <= set(run.data.metrics)
        assert run.data.metrics["exact_match.maximum"] == run.data.metrics["acc.maximum"]
        assert run.data.params["lm_eval_version"] == version("lm_eval")
        assert {"lm_eval_task.maximum", "lm_eval_task.sentiment_validation"} <= set(run.data.params)

    # each recipe cell logs its merge's and calibrations' own cost (mergecal.cost); the references have none
    done = tracker.client.search_runs([tracker.experiment_id], "tags.`mergecal.status` = 'ok'", max_results=1000)
    for run in done:
        merge, recipe = run.data.tags["mergecal.merge"], run.data.tags["mergecal.recipe_id"]
        costs = {k for k in run.data.metrics if k.startswith("cost.")}
        if merge in cells_mod.REFERENCES:
            assert not costs, merge
            continue
        assert run.data.metrics["cost.seconds.merge"] > 0 and run.data.metrics["cost.calls.merge"] >= 1, merge
        assert run.data.metrics["cost.peak_mib.weight_space"] >= 0
        # every weight- and feature-space step's (a pre-merge one, DisTaC's, runs in its own stage)
        steps = [step.name for step in Recipe.parse(recipe).steps if step.phase in ("weight", "feature")]
        assert {f"cost.seconds.{name}" for name in steps} <= costs, recipe
        if "fsc" in steps:
            assert run.data.metrics["cost.peak_mib.fsc"] >= 0

    # chains a track cannot run are logged once each as skipped, with the reason, never computed
    skipped = [r for r in first["rows"] if "skipped" in r]
    assert {r["track"] for r in skipped} == {"text", "llm"} and len(_cell_runs(root, "skipped")) == len(skipped)

    second = benchmark(root=str(root))
    assert second["cached"] == second["cells"] and second["failed"] == 0
    assert len(_cell_runs(root)) == first["cells"]  # nothing logged twice
    assert len(_cell_runs(root, "skipped")) == len(skipped)
    assert [r.get("avg_acc") for r in first["rows"]] == [r.get("avg_acc") for r in second["rows"]]
    summary = json.loads((root / "results" / "benchmark.json").read_text())
    invocation = json.loads((root / "results" / "invocation.json").read_text())
    assert invocation["invocation_id"] == second["invocation_id"] and invocation["cached"] == second["cells"]
    # the DVC output holds what the cells computed, nothing of the run: the same bytes after a rerun
    assert summary == {k: first[k] for k in ("experiment", "cells", "failed", "rows")}
    assert not {"invocation_id", "parent_run_id", "tracking_uri", "cached", "seconds"} & set(summary)

    # without Prefect's result files (as after a kill between logging a cell and persisting its result), the
    # logged MLflow runs are the cache: nothing is computed (run_cell would fail) and nothing is logged twice
    shutil.rmtree(root / ".mergecal" / "cells")
    monkeypatch.setattr(flow_module, "run_cell", _must_not_run)
    third = benchmark(root=str(root))
    assert third["cached"] == third["cells"] and third["failed"] == 0
    assert len(_cell_runs(root)) == first["cells"]
    assert [r.get("avg_acc") for r in first["rows"]] == [r.get("avg_acc") for r in third["rows"]]
    monkeypatch.undo()

    # calibrated chains calibrate the scaling that their uncalibrated cell selected on validation
    runs = tracker.client.search_runs([tracker.experiment_id], "tags.`mergecal.kind` = 'cell' and "
                                      "tags.`mergecal.status` = 'ok'", max_results=1000)
    chosen = {(r.data.tags["mergecal.track"], r.data.tags["mergecal.regime"], r.data.tags["mergecal.recipe"]):
              r.data.metrics.get("selected_scaling") for r in runs}
    calibrated = [(k, v) for k, v in chosen.items() if k[2].startswith("task_arithmetic>")]
    assert len(calibrated) >= 4
    for (track, regime, _), value in calibrated:
        assert value == chosen[(track, regime, "task_arithmetic")]


def test_a_failing_cell_is_recorded_and_does_not_sink_the_matrix(built, prefect_server):
    from mergecal.pipeline.flow import run_benchmark as benchmark

    root, params = built
    target = vision.paths_for(params, root).distac("low_confidence") / "symbols.safetensors"
    original = target.read_bytes()
    try:
        target.write_bytes(b"not a safetensors file")
        result = benchmark(root=str(root))
    finally:
        target.write_bytes(original)
    failed = [r for r in result["rows"] if "error" in r]
    expected = [c for c in cells_mod.enumerate_cells(params)
                if c.track == "vision" and c.regime == "low_confidence" and c.chain.startswith("distac")]
    assert len(failed) == len(expected) == result["failed"]
    assert all("symbols.safetensors" in r["error"] for r in failed)
    assert result["cells"] - result["failed"] == sum("avg_acc" in r for r in result["rows"])
    with sqlite3.connect(root / "mlruns" / "mlruns.db") as con:
        errors = con.execute("select e.value from tags e join tags s on s.run_uuid = e.run_uuid and "
                             "s.key = 'mergecal.status' where e.key = 'mergecal.error' and s.value = 'failed'"
                             ).fetchall()
    assert len(errors) == len(expected)


def test_an_llm_expert_that_is_not_of_the_base_fails_its_cells_only(built, prefect_server):
    """An expert whose config.json differs from the base's: the LLM cells that merge it fail with one line naming
    the file and key; the LLM references and the other tracks' cells are computed."""
    from mergecal.pipeline.flow import run_benchmark as benchmark

    root, params = built
    target = llm.expert_dir(params, root, params.llm.tasks[0]) / "config.json"
    original = target.read_text()
    data = params.model_dump(mode="json")
    data["benchmark"]["merges"] = {"task_arithmetic": {"scaling": 0.5}}
    data["benchmark"]["chains"], data["benchmark"]["fixed_scaling"] = ["{merge}"], []
    data["vision"]["regimes"] = ["standard"]
    (root / "params-llm-bad.yaml").write_text(yaml.safe_dump(data))
    try:
        target.write_text(json.dumps({**json.loads(original), "rms_norm_eps": 0.5}))
        result = benchmark(params_path="params-llm-bad.yaml", root=str(root), output="results/llm-bad.json")
    finally:
        target.write_text(original)
    failed = {(r["track"], r["label"]): r["error"] for r in result["rows"] if "error" in r}
    assert list(failed) == [("llm", "task_arithmetic")]
    assert f"{target}: rms_norm_eps is 0.5, the base model" in failed[("llm", "task_arithmetic")]
    ok = {(r["track"], r["label"]) for r in result["rows"] if "avg_acc" in r}
    assert {("llm", "zeroshot"), ("llm", "finetuned"), ("vision", "task_arithmetic"),
            ("text", "task_arithmetic")} <= ok


def test_a_failed_source_cell_fails_the_cells_that_take_its_scaling(built, prefect_server, monkeypatch):
    import mergecal.pipeline.flow as flow_module

    root, params = built
    real = flow_module.run_cell

    def failing(cell, *args, **kwargs):
        if cell.track == "vision" and cell.regime == "standard" and cell.label == "task_arithmetic":
            raise RuntimeError("injected failure of the source cell")
        return real(cell, *args, **kwargs)

    monkeypatch.setattr(flow_module, "run_cell", failing)
    # a changed evaluation setting gives every cell a new id, so nothing comes from the cache
    data = params.model_dump(mode="json")
    data["benchmark"]["evaluation"]["max_validation"] = 11
    data["vision"]["regimes"], data["text"]["enabled"], data["llm"]["enabled"] = ["standard"], False, False
    (root / "params-failing.yaml").write_text(yaml.safe_dump(data))
    result = flow_module.run_benchmark(params_path="params-failing.yaml", root=str(root),
                                       output="results/failing.json")
    failed = {r["label"]: r["error"] for r in result["rows"] if "error" in r}
    dependents = {c.label for c in cells_mod.enumerate_cells(parse_params(data)) if c.scaling_from
                  and c.merge == "task_arithmetic"}
    assert set(failed) == {"task_arithmetic"} | dependents and len(dependents) == 2  # dsc, distac>svc>dsc
    assert "injected failure" in failed["task_arithmetic"]
    assert all("not run: the cell it takes its scaling from (task_arithmetic, standard) failed" in failed[label]
               for label in dependents)
    assert result["cells"] - result["failed"] == sum("avg_acc" in r for r in result["rows"])


def test_worker_process_runners_compute_and_reuse_cells_across_prefect_servers(built, prefect_server):
    """Cells computed in a process pool come back to the flow; a rerun on a local Dask cluster against a
    different Prefect server (another database, as a deployment's would be) reuses every one of them from the
    result storage and computes only the cell that is new: nothing recomputed, nothing logged twice."""
    from prefect.testing.utilities import prefect_test_harness

    from mergecal.pipeline.flow import run_benchmark as benchmark

    root, params = built
    data = params.model_dump(mode="json")
    # a small matrix of its own (new cell ids: nothing comes from the other tests' cache)
    data["benchmark"]["evaluation"]["max_validation"] = 13
    data["benchmark"]["merges"] = {"task_arithmetic": data["benchmark"]["merges"]["task_arithmetic"]}
    data["benchmark"]["chains"] = ["{merge}", "{merge}>svc"]
    data["vision"]["regimes"], data["text"]["enabled"], data["llm"]["enabled"] = ["standard"], False, False
    data["runner"] = {**data["runner"], "kind": "processes", "max_workers": 2}
    data["tracking"]["store"] = "mlruns-workers"
    (root / "params-processes.yaml").write_text(yaml.safe_dump(data))
    first = benchmark(params_path="params-processes.yaml", root=str(root), output="results/processes.json")
    n_first = len(cells_mod.enumerate_cells(parse_params(data)))
    assert (first["cells"], first["failed"], first["cached"]) == (n_first, 0, 0)

    data["benchmark"]["chains"].append("{merge}>dsc")
    data["runner"]["kind"] = "dask"
    (root / "params-dask.yaml").write_text(yaml.safe_dump(data))
    with prefect_test_harness(server_startup_timeout=120):
        second = benchmark(params_path="params-dask.yaml", root=str(root), output="results/dask.json")
    assert (second["cells"], second["failed"], second["cached"]) == (n_first + 1, 0, n_first)
    assert {r["label"]: r["avg_acc"] for r in first["rows"]}.items() <= \
        {r["label"]: r["avg_acc"] for r in second["rows"]}.items()
    with sqlite3.connect(root / "mlruns-workers" / "mlruns.db") as con:
        cell_runs = con.execute("select count(*) from tags where key = 'mergecal.cell_id'").fetchone()[0]
    assert cell_runs == n_first + 1


def _log_many(args):
    root, worker = args
    from mergecal.pipeline.tracking import Tracker

    tracker = Tracker(root, "concurrency")
    parent = tracker.start_invocation(f"inv-{worker}", {}, {})
    for i in range(8):
        tracker.log_cell(parent_run_id=parent, invocation_id=f"inv-{worker}", cell_id=f"cell-{worker}-{i}",
                         tags={"mergecal.merge": "ties"}, params={"p": str(i)},
                         metrics={f"acc.t{j}": worker + i / 10 + j for j in range(50)}, artifacts={"x": {"i": i}})
    tracker.finish_invocation(parent, {}, {"cells": 8})
    return worker


def test_concurrent_logging_from_several_processes_keeps_the_store_consistent(tmp_path):
    from mergecal.pipeline.tracking import Tracker

    Tracker(tmp_path, "concurrency")  # create the store and experiment once, in the parent
    with mp.get_context("spawn").Pool(3) as pool:
        assert sorted(pool.map(_log_many, [(str(tmp_path), w) for w in range(3)])) == [0, 1, 2]
    tracker = Tracker(tmp_path, "concurrency")
    runs = tracker.client.search_runs([tracker.experiment_id], "tags.`mergecal.kind` = 'cell'", max_results=100)
    assert len(runs) == 24 and all(r.info.status == "FINISHED" for r in runs)
    for run in runs:
        worker, i = map(int, run.data.tags["mergecal.cell_id"].split("-")[1:])
        assert run.data.metrics["acc.t7"] == pytest.approx(worker + i / 10 + 7)
    assert Counter(r.data.tags["mergecal.cell_id"] for r in runs).most_common(1)[0][1] == 1


def test_smoke_params_file_is_what_the_workspace_uses(tmp_path):
    root = create_workspace(tmp_path / "ws", root=REPO, git=False)
    assert load_params(root / "params.yaml") == parse_params(yaml.safe_load(SMOKE_PARAMS.read_text()))
    assert all((root / name).exists() for name in PIPELINE_FILES + (".dvcignore",))


def test_a_workspace_needs_a_checkout_and_another_directory(tmp_path):
    with pytest.raises(MergecalError, match=r"is not a mergecal checkout \(no dvc.yaml, stages, flows, mergecal\)"):
        create_workspace(tmp_path / "ws", root=tmp_path)
    assert not (tmp_path / "ws").exists()
    with pytest.raises(MergecalError, match="another directory than the checkout"):
        create_workspace(REPO, root=REPO)


def test_the_scheduled_rerun_deployment_is_built_for_a_checkout_only(tmp_path):
    from mergecal.pipeline.schedule import deployment

    made = deployment("0 3 * * 1", REPO)
    assert made.name == "scheduled-benchmark" and made.parameters == {"root": str(REPO)}
    with pytest.raises(MergecalError, match="is not a mergecal checkout"):
        deployment("0 3 * * 1", tmp_path)


def test_svc_takes_the_authors_alpha_per_merge_method():
    params = parse_params({"benchmark": {"merges": {"tsv_m": {}, "ties": {}},
                                         "chains": ["{merge}>svc", "{merge}>svc(alpha=0.5)"]}})
    recipes = {c.label: c.recipe for c in cells_mod.enumerate_cells(params) if c.regime == "standard"}
    assert "svc(alpha=1.0," in recipes["tsv_m>svc"]  # suppression only after TSV-M
    assert "svc(alpha=None," in recipes["ties>svc"]  # 1/K
    assert "svc(alpha=0.5," in recipes["tsv_m>svc(alpha=0.5)"]  # an explicit value wins


# ------------------------------------------------------------------------- scaling of calibrated chains

@pytest.mark.parametrize("chain, chains, source", [
    ("{merge}", ["{merge}", "{merge}>svc"], ""),
    ("distac>{merge}", ["{merge}", "distac>{merge}"], ""),
    ("{merge}>svc", ["{merge}", "{merge}>svc"], ""),  # SVC reads the unit merge: it searches with itself in place
    ("{merge}>svc(calibrate_at=chosen_scaling)", ["{merge}", "{merge}>svc(calibrate_at=chosen_scaling)"], "{merge}"),
    ("{merge}>dsc", ["{merge}>dsc", "{merge}"], "{merge}"),
    ("distac>{merge}>svc>dsc", ["{merge}", "distac>{merge}>svc>dsc"], "{merge}"),
    ("distac>{merge}>svc>dsc", ["{merge}", "distac->{merge}", "distac>{merge}>svc>dsc"], "distac->{merge}"),
    ("{merge}>wsc", ["{merge}>wsc"], None),
])
def test_scaling_source_of_a_chain(chain, chains, source):
    assert cells_mod.scaling_source(chain, chains) == source


def test_selected_scaling_needs_the_uncalibrated_chain():
    with pytest.raises(ParameterError, match=r"benchmark: .*chain '\{merge\}>wsc': calibrated_scaling 'selected' takes "
                                             r"the scaling chosen by the uncalibrated chain '\{merge\}'"):
        parse_params({"benchmark": {"chains": ["{merge}>wsc"]}})
    parse_params({"benchmark": {"chains": ["{merge}>wsc"], "calibrated_scaling": "grid"}})
    parse_params({"benchmark": {"chains": ["{merge}>wsc"], "merges": {"ties": {"scaling": 0.5}}}})  # nothing to select
    parse_params({"benchmark": {"chains": ["{merge}>svc"]}})  # SVC searches its own grid


def test_calibrated_cells_take_their_scaling_from_the_uncalibrated_cell():
    data = {"benchmark": {"merges": {"task_arithmetic": {"scaling": [0.1, 0.3]}, "ties": {}},
                          "chains": ["{merge}", "{merge}>wsc", "distac>{merge}>wsc"]}}
    cells = [c for c in cells_mod.enumerate_cells(parse_params(data)) if c.regime == "standard" and c.track == "vision"]
    source = {c.label: c.scaling_from for c in cells}
    assert source["task_arithmetic"] == "" and source["task_arithmetic>wsc"] == "{merge}"
    assert source["distac>task_arithmetic>wsc"] == "{merge}"
    assert source["ties>wsc"] == ""  # a fixed scaling: nothing to select
    data["benchmark"]["calibrated_scaling"] = "grid"
    assert not any(c.scaling_from for c in cells_mod.enumerate_cells(parse_params(data)))
    sources = cells_mod.source_index(cells)
    by_label = {c.label: i for i, c in enumerate(cells)}
    assert sources[by_label["task_arithmetic>wsc"]] == by_label["task_arithmetic"]
    assert sources[by_label["distac>task_arithmetic>wsc"]] == by_label["task_arithmetic"]
    assert sources[by_label["ties>wsc"]] is None


def test_a_calibrated_cell_calibrates_the_merge_at_the_given_scaling(built):
    """Given its source's choice s, a calibrated cell equals the same chain run with the merge fixed at s (SVC in
    the old order, on the scaled merge: a chain whose scaling its source chooses)."""
    root, params = built
    data = params.model_dump(mode="json")
    data["benchmark"]["chains"] = ["{merge}", "{merge}>svc(calibrate_at=chosen_scaling)"]
    params = parse_params(data)
    cells = {(c.track, c.label): c for c in cells_mod.enumerate_cells(params) if c.regime == "standard"}
    cell = cells[("vision", "task_arithmetic>svc(calibrate_at=chosen_scaling)")]
    assert cell.scaling_from == "{merge}" and len(cell.grid) == 2
    with pytest.raises(MergecalError, match="needs the scaling chosen by its source cell"):
        cells_mod.run_cell(cell, params, root)
    given = cells_mod.run_cell(cell, params, root, scaling=1.0).metrics
    data = params.model_dump(mode="json")
    data["benchmark"]["merges"]["task_arithmetic"]["scaling"] = 1.0
    fixed_params = parse_params(data)
    fixed = next(c for c in cells_mod.enumerate_cells(fixed_params)
                 if c.regime == "standard" and c.track == "vision"
                 and c.label == "task_arithmetic>svc(calibrate_at=chosen_scaling)")
    assert fixed.grid == () and fixed.scaling_from == ""
    assert cells_mod.run_cell(fixed, fixed_params, root).metrics == given
    assert given["selected_scaling"] == 1.0


def test_a_sweeps_cell_equals_the_same_recipe_run_alone_bit_for_bit(built):
    """An experiment's sweep (mergecal.pipeline.experiments) runs cells of the benchmark: SVC with alpha = 1/K
    written out is another cell than the matrix's fixed-scaling `{merge}>svc` (alpha left to its default 1/K),
    and gives the same metrics and the same per-example scores; the base it is paired with is the matrix's cell."""
    from mergecal.pipeline.experiments import Experiment, experiment_cells

    root, params = built
    alpha = 1.0 / len(params.vision.tasks)
    sweep = Experiment.model_validate({"id": "svc.sweep", "item": "Fig. 5", "shows": "a test", "scaling": 1.0,
                                       "merges": ["task_arithmetic"], "sweep": {
                                           "parameter": "alpha", "chain": "{merge}>svc(alpha={value})",
                                           "values": [alpha]}})
    made = {e.variant: e.cell for e in experiment_cells(params, sweep) if e.cell.regime == "standard"}
    data = params.model_dump(mode="json")
    data["benchmark"]["fixed_scaling"] = [{"scaling": 1.0, "merges": ["task_arithmetic"],
                                           "chains": ["{merge}", "{merge}>svc"]}]
    matrix = {c.label: c for c in cells_mod.enumerate_cells(parse_params(data))
              if c.track == "vision" and c.regime == "standard"}
    assert made["base"] == matrix["task_arithmetic(scaling=1.0)"]
    swept, alone = made[str(alpha)], matrix["task_arithmetic(scaling=1.0)>svc"]
    assert swept != alone and swept.recipe != alone.recipe
    a, b = cells_mod.run_cell(swept, params, root), cells_mod.run_cell(alone, params, root)
    assert a.metrics == b.metrics and a.examples == b.examples and a.examples


@pytest.mark.parametrize("method", ["weight_averaging", "task_arithmetic", "ties", "dare", "consensus", "tsv_m",
                                    "iso_c", "iso_cts"])
def test_a_grid_merged_once_and_rescaled_equals_merging_at_each_value(method, pretrained, finetuned):
    from mergecal.recipe import Recipe
    from mergecal.run_recipe import RecipeInputs, recipe_trials, run_recipe

    grid = (0.3, 0.7, 1.5)
    steps = [(method, {"scaling": grid[0]})]
    trial = recipe_trials(Recipe(steps), pretrained, finetuned, RecipeInputs(progress=False), grid)
    for value in grid:
        direct = run_recipe(Recipe([(method, {"scaling": value})]), pretrained, finetuned, RecipeInputs(progress=False))
        rescaled = trial(value).state_dict
        assert rescaled.keys() == direct.state_dict.keys()
        for key in direct.state_dict:
            assert torch.equal(rescaled[key], direct.state_dict[key]), (method, value, key)
            assert rescaled[key].dtype == direct.state_dict[key].dtype


def test_testbed_health_reports_each_criterion_from_the_built_files(built):
    from mergecal.pipeline.testbed import CRITERIA, health_markdown, vision_health

    root, params = built
    paths = vision.paths_for(params, root)
    diag = {r: json.loads((paths.task_vectors(r) / "diagnostics.json").read_text()) for r in params.vision.regimes}
    tasks = params.vision.tasks
    results = {"rows": [{"track": "vision", "regime": "standard", "label": "task_arithmetic", "avg_acc": 0.5,
                         "avg_norm_acc": 0.8, "selected_scaling": 0.3},
                        {"track": "vision", "regime": "low_confidence", "label": "task_arithmetic", "avg_acc": 0.45,
                         "avg_norm_acc": 0.76, "selected_scaling": 0.3},
                        # a text row with the same label must not be read as the vision track's
                        {"track": "text", "regime": "standard", "label": "task_arithmetic", "avg_acc": 0.9,
                         "avg_norm_acc": 0.9, "selected_scaling": 1.0}]}
    health = vision_health(params, root, results)
    measured = {c["key"]: c["value"] for c in health["criteria"]}
    assert [c["key"] for c in health["criteria"]] == [c.key for c in CRITERIA]
    ft = [100 * diag["standard"][t]["test_accuracy"] for t in tasks]
    assert measured["min_finetuned"] == pytest.approx(min(ft))
    assert measured["ta_below_finetuned"] == pytest.approx(sum(ft) / len(ft) - 50.0)
    assert measured["low_confidence_loss"] == pytest.approx(80.0 - 76.0)
    hot = params.vision.norm_mismatch_task
    others = [diag["standard"][t]["norm"] for t in tasks if t != hot]
    assert measured["norm_mismatch_ratio_min"] == pytest.approx(diag["norm_mismatch"][hot]["norm"]
                                                                / (sum(others) / len(others)))
    grid = params.benchmark.merges["task_arithmetic"]["scaling"]
    assert health["merges"]["task_arithmetic"]["interior"] == (min(grid) < 0.3 < max(grid))
    ranking = json.loads(paths.sensitivity("standard").read_text())
    assert ranking["metadata"]["metric"] == params.probing.metric  # nll: the baseline is a log-likelihood
    assert measured["probe_over_chance"] == pytest.approx(ranking["metadata"]["baseline_accuracy"] / 0.05)
    for check in health["criteria"]:
        if check["value"] is not None:
            assert check["holds"] == (check["value"] >= check["threshold"] if check["direction"] == ">="
                                      else check["value"] <= check["threshold"])
    assert health["healthy"] == all(c["holds"] for c in health["criteria"])
    text = health_markdown(health)
    assert text.count("\n| ") >= len(CRITERIA) + len(tasks) and "Testbed health" in text


def test_committed_stage_outputs_carry_no_wall_clock_figures(built):
    """Regression: checkpoints' metadata and JSON sidecars held `seconds`, so every cold run rewrote them."""
    from safetensors import safe_open

    root, params = built
    paths = vision.paths_for(params, root)
    files = [paths.models / "pretrained.json", *sorted(paths.seeded.glob("finetuned/*/*.json")),
             *sorted((root / "models" / params.text.backbone).glob("seeds/*/finetuned/*/*.json"))]
    assert len(files) > 3
    timing = re.compile(r"second|time|date|elapsed|host", re.I)
    for path in files:
        text = path.read_text()
        assert not timing.search(text), f"{path}: {timing.search(text).group()}"
        weights = path.with_suffix(".safetensors")
        if weights.exists():
            with safe_open(str(weights), "pt") as fh:
                assert not timing.search(json.dumps(fh.metadata())), weights


def test_svc_alpha_default_is_the_libraries_so_api_and_pipeline_agree(pretrained, finetuned):
    """Regression (#18 defect 4): the authors' alpha after TSV-M lived in the pipeline only, so `run_recipe`
    on "tsv_m>svc" calibrated with 1/K while the pipeline's cell used 1. Now the recipe itself carries it."""
    from mergecal.recipe import Recipe
    from mergecal.run_recipe import run_recipe

    params = parse_params({"benchmark": {"merges": {"tsv_m": {"scaling": 1.0}}, "chains": ["{merge}>svc"]}})
    cell = next(c for c in cells_mod.enumerate_cells(params) if c.label == "tsv_m>svc" and c.regime == "standard")
    assert Recipe.parse("tsv_m>svc").id == cell.recipe
    api = run_recipe("tsv_m>svc", pretrained, finetuned).state_dict
    explicit = run_recipe("tsv_m>svc(alpha=1.0)", pretrained, finetuned).state_dict
    one_over_k = run_recipe(f"tsv_m>svc(alpha={1 / len(finetuned)})", pretrained, finetuned).state_dict
    assert all(torch.equal(api[k], explicit[k]) for k in api)
    assert any(not torch.equal(api[k], one_over_k[k]) for k in api)


def test_stages_write_only_what_a_later_stage_reads(built):
    """Regression (#18 defect 5): the task_vectors stage wrote tau safetensors that nothing read (cells, DisTaC
    and probing compute tau from the checkpoints); it writes its diagnostics only."""
    root, params = built
    out = vision.paths_for(params, root).seeded / "task_vectors"
    assert sorted(p.name for p in out.rglob("*") if p.is_file()) == ["diagnostics.json"] * len(params.vision.regimes)


def test_every_registered_track_implements_the_track_protocol():
    """#33: the interface is written down (``tracks.Track``) and every registered track provides all of it, so the
    cells call it without probing for optional parts."""
    from mergecal.pipeline.tracks.protocol import Track
    from mergecal.pipeline.track_registry import MODULES, get_track

    for name in MODULES:
        track = get_track(name)
        assert isinstance(track, Track), name
        assert track.NAME == name
        assert callable(track.reference) and callable(track.session), name  # #33: the search is the cells'


def test_no_track_runs_the_scaling_search_itself():
    """#33: the scaling search lives once, in cells.run_cell: no track package imports the search, the grid or
    the recipe's trials from the cells (a track offers models, cells.py calls them; never the other way back)."""
    import ast

    from mergecal.pipeline import tracks

    search = {"select_scaling", "cell_grid", "recipe_trials"}
    for path in sorted(Path(tracks.__file__).parent.rglob("*.py")):
        tree = ast.parse(path.read_text())
        names = {alias.name for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                 and node.module in ("cells", "mergecal.pipeline.cells") and node.level != 1 for alias in node.names}
        assert not names & search, (path.name, names & search)


def test_run_cell_searches_the_grid_on_the_session_its_track_opens(monkeypatch):
    """#33: run_cell dispatches a reference row to ``Track.reference`` and runs a recipe cell's search itself on
    ``Track.session``: each scaling merged then validated in grid order, the first best kept (ties: the first),
    the curve logged, the chosen merge evaluated once, inside the session (closed after)."""
    from contextlib import contextmanager

    from mergecal.pipeline.tracks.protocol import Session
    from mergecal.recipe import Recipe

    calls = []
    scores = {0.3: 0.5, 0.7: 0.9, 1.0: 0.9}  # 0.7 and 1.0 tie: 0.7, the first, wins

    @contextmanager
    def session(cell, recipe, grid, params, root, *, device):
        calls.append(("open", grid, recipe.id, device))

        def merged(value):
            calls.append(("merged", value))
            return f"model@{value}"

        def validate(model):
            calls.append(("validate", model))
            value = float(model.split("@")[1])
            return value, scores[value]

        def result(model, value, curve):
            calls.append(("result", model, value))
            return cells_mod.CellResult({"selected_scaling": value}, {}, {"scaling_curve": curve})

        yield Session(merged, validate, result)
        calls.append(("closed",))

    def reference(cell, params, root, *, device):
        calls.append(("reference", cell.merge))
        return cells_mod.CellResult({}, {})

    class FakeTrack:
        pass

    track = FakeTrack()
    track.session, track.reference = session, reference
    monkeypatch.setattr(cells_mod, "track_of", lambda cell: track)
    recipe = Recipe.parse("task_arithmetic(scaling=0.3)")
    cell = cells_mod.Cell("fake", "b", "t", ("a", "b"), "standard", "task_arithmetic", "{merge}", recipe.id,
                          (0.3, 0.7, 1.0))
    out = cells_mod.run_cell(cell, None, "root", device="cuda")
    assert calls == [("open", (0.3, 0.7, 1.0), recipe.id, "cuda"),
                     ("merged", 0.3), ("validate", "model@0.3"), ("merged", 0.7), ("validate", "model@0.7"),
                     ("merged", 1.0), ("validate", "model@1.0"), ("result", "model@0.7", 0.7), ("closed",)]
    assert [point["scaling"] for point in out.diagnostics["scaling_curve"]] == [0.3, 0.7, 1.0]
    calls.clear()  # a given scaling: one merge, no validation spent
    assert cells_mod.run_cell(cell, None, "root", scaling=1.0).metrics == {"selected_scaling": 1.0}
    assert calls == [("open", (1.0,), recipe.id, "cpu"), ("merged", 1.0), ("result", "model@1.0", 1.0), ("closed",)]
    calls.clear()
    for merge in ("zeroshot", "finetuned"):
        cells_mod.run_cell(cells_mod.Cell("fake", "b", "t", ("a",), "standard", merge, ""), None, "root")
    assert calls == [("reference", "zeroshot"), ("reference", "finetuned")]


def test_a_recipe_cell_logs_the_chosen_scaling_not_its_recipes_nominal_one():
    """The text and LLM tracks and a lab's CLIP tracks logged `<merge>.scaling` before the steps' parameters,
    which overwrote it with the recipe's nominal value (0.3 where the grid chose 1.0); every track now logs
    through ``recipe_params``."""
    from mergecal.pipeline.cells import recipe_params
    from mergecal.recipe import Recipe

    recipe = Recipe.parse("task_arithmetic(scaling=0.3)>svc")
    cell = cells_mod.Cell("text", "minilm", "text4", ("a", "b"), "standard", "task_arithmetic", "{merge}>svc",
                          grid=(0.3, 1.0))
    logged = recipe_params(cell, recipe, 1.0, {"track": "text"})
    assert logged["task_arithmetic.scaling"] == "1.0" and logged["track"] == "text"
    assert logged["grid"] == "[0.3, 1.0]" and logged["scaling_from"] == "own grid"
    assert logged["svc.calibrate_at"] == "unit_scaling"
    tracks = Path(__file__).resolve().parents[1] / "mergecal" / "pipeline" / "tracks"
    for module in ("clip/session.py", "text/built/cells.py", "causal_lm/family.py"):
        text = (tracks / module).read_text()
        assert "recipe_params(cell, recipe, scaling" in text and ".scaling\": json.dumps" not in text, module
