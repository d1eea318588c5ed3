"""LLM families from local directories (``local_llm:``): params, content hashes cached by mtime, the stages'
checks and the Prefect flow end to end on a micro Llama base and its experts written to disk (random weights,
the real key layout, no network)."""

import json
import os
import pickle
import shutil
import sqlite3
from pathlib import Path

import pytest
import torch
import yaml

from local_models import CreatesAFile, write_unrelated_files
from mergecal.errors import CheckpointError, MergecalError, ParameterError
from mergecal.pipeline import cells as cells_mod
from mergecal.pipeline import hashing
from mergecal.pipeline import own_models
from mergecal.pipeline.tracks import lab_files
from mergecal.pipeline.tracks.causal_lm.files import stages as local_llm
from mergecal.pipeline.config import load_params, parse_params

MICRO = dict(vocab_size=300, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
             num_key_value_heads=1, max_position_embeddings=64)
DATA = {"n_pretrain": 20, "n_train": 4, "n_validation": 4, "n_test": 4}
EVALUATION = {"max_validation": 4, "batch_size": 8}


def _track(name, experts, **extra):
    return {"name": name, "base": "ckpt/base", "experts": experts, "data": DATA, "evaluation": EVALUATION,
            "min_test": DATA["n_test"], **extra}


# ------------------------------------------------------------------------------------------------ params

@pytest.mark.parametrize("track, message", [
    (_track("lab", {"maximum": "m"}), r"local_llm.0.experts: expected at least 2 experts"),
    (_track("lab", {"maximum": "m", "sentimnt": "s"}), r"local_llm.0.experts.sentimnt: not a task of the LLM suite"),
    (_track("lab", {"maximum": "m", "sentiment": "s"}, allow_unsafe_pickle="yes"),
     r"local_llm.0.allow_unsafe_pickle: Input should be a valid boolean"),
    (_track("lab", {"maximum": "m", "sentiment": "s"}, bsae="x"), r"local_llm.0.bsae: unknown key; allowed: enabled"),
    (_track("tiny-llama", {"maximum": "m", "sentiment": "s"}), r"local_llm.0.name: 'tiny-llama' is already the name"),
    ({"name": "lab", "base": "b", "experts": {"a": "m", "b": "s"}, "task_dir": "t",
      "tasks": {"a": {"metric": "acc"}}}, r"local_llm.0.tasks.b: missing: give the metric"),
    (_track("lab", {"maximum": "m", "sentiment": "s"}, tasks={"maximum": {"metric": "acc"}}),
     r"local_llm.0.tasks: only with task_dir"),
    (_track("lab", {"maximum": "m", "sentiment": "s"}, trust_task_code=True),
     r"local_llm.0.trust_task_code: only with task_dir \(the suite's YAMLs hold no code; registry tasks run "
     r"lm-eval's own\)"),
    (_track("lab", {"maximum": "m", "sentiment": "s"}, min_test=50),
     r"local_llm.0.data.n_test: 4 test documents per task, fewer than min_test 50"),
    (_track("lab", {"maximum": "m", "sentiment": "s"}, min_test=0), r"local_llm.0.min_test: "),
    (_track("lab", {"maximum": "m"}, unscored={"maximum": "s"}),
     r"local_llm.0.unscored.maximum: also an expert with a task: name each expert once"),
    (_track("lab", {}, unscored={"a": "m", "b": "s"}),
     r"local_llm.0.experts: expected at least one expert with a task"),
    (_track("lab", {"maximum": "m"}, unscored={"chat model": "s"}), r"local_llm.0.unscored.chat model: a name"),
])
def test_local_llm_params_errors_are_one_clear_line(track, message):
    with pytest.raises(ParameterError, match=message) as info:
        parse_params({"local_llm": [track]})
    assert "\n" not in str(info.value)


def test_default_params_have_no_local_track():
    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    assert params.local_llm == [] and not [c for c in cells_mod.enumerate_cells(params)
                                           if c.track.startswith("local_llm")]
    tasks = {"x": {"metric": "acc"}, "y": {"metric": "f1", "validation": "y_dev"}}
    own = parse_params({"local_llm": [{"name": "lab", "base": "b", "experts": {"x": "m", "y": "s"}, "task_dir": "t",
                                       "tasks": tasks}]})
    assert {t: s.validation for t, s in own.local_llm[0].tasks.items()} == {"x": "x_validation", "y": "y_dev"}


def test_a_disabled_track_has_no_cells_and_a_cell_names_its_own_track():
    """Cells are named local_llm:<track name> and read their own track's settings; a cell of a track that
    params.yaml no longer has is one line."""
    from mergecal.errors import MergecalError
    from mergecal.pipeline.tracks.causal_lm.files import cells as track_mod

    lab, off = (_track(name, {"maximum": "m", "sentiment": "s"}, **extra)
                for name, extra in (("lab", {}), ("lab-off", {"enabled": False})))
    params = parse_params({"local_llm": [lab, off]})
    cells = track_mod.cells(params)
    assert cells and {c.track for c in cells} == {"local_llm:lab"} and track_mod.enabled(params)
    assert {track_mod.cell_fingerprint(c, params)["track"]["name"] for c in cells} == {"lab"}
    without = parse_params({"local_llm": [off]})
    assert not track_mod.enabled(without) and track_mod.cells(without) == []
    with pytest.raises(MergecalError, match=r"^local_llm: no track named 'lab' in params.yaml$"):
        track_mod.cell_fingerprint(cells[0], without)


# ----------------------------------------------------------------------------------------- content hashes

def test_content_hashes_are_cached_on_disk_by_path_size_and_mtime(tmp_path, monkeypatch):
    cache = tmp_path / "hashes"
    files = [tmp_path / "a.bin", tmp_path / "b.bin"]
    for i, f in enumerate(files):
        f.write_bytes(bytes([i]) * 3000)
    first = [hashing.file_digest(f, cache) for f in files]
    assert len(list(cache.iterdir())) == 2

    reads = []
    real = hashing._sha256_file
    monkeypatch.setattr(hashing, "_sha256_file", lambda path: reads.append(Path(path).name) or real(path))
    hashing.file_digest_at.cache_clear()  # as a new process: only the on-disk records
    assert [hashing.file_digest(f, cache) for f in files] == first and reads == []

    files[1].write_bytes(bytes([7]) * 3000)  # same size, new bytes, new mtime
    stat = files[1].stat()
    os.utime(files[1], ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    hashing.file_digest_at.cache_clear()
    again = [hashing.file_digest(f, cache) for f in files]
    assert reads == ["b.bin"] and again[0] == first[0] and again[1] != first[1]
    assert hashing.content_record(files[1], cache) == {"size": 3000, "sha256": again[1]}
    assert reads == ["b.bin"]  # the new record serves it


# ------------------------------------------------------------------------------------------ checkpoints

@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """A micro Llama base and experts (random perturbations of it) in the layouts a lab has on disk: single
    and sharded safetensors; and the bad ones (config of another model, a shard missing, pickled only)."""
    from mergecal.backbones.hf_causal_lm import causal_lm_state_dict, save_causal_lm, save_causal_lm_weights
    from mergecal.train.lm import TinyLlamaShape, create_tiny_llama, train_tokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("local_llm")
    corpus = ["max(12, 7) = 12", "The movie was great. Sentiment: positive", "Is 5 larger than 3? Yes."] * 30
    tokenizer = train_tokenizer(corpus, MICRO["vocab_size"])
    base = save_causal_lm(create_tiny_llama(tokenizer, TinyLlamaShape(**MICRO), seed=1), tokenizer,
                          root / "ckpt" / "base")
    state = causal_lm_state_dict(base)

    def expert(name, seed, **kwargs):
        g = torch.Generator().manual_seed(seed)
        perturbed = {k: v + 0.05 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                     for k, v in state.items()}
        return save_causal_lm_weights(perturbed, root / "ckpt" / name, like=base, **kwargs)

    expert("max", 2)
    expert("sent", 3, max_shard_bytes=4096)  # sharded, with model.safetensors.index.json
    expert("sent2", 4)
    bad_config = expert("sent-config", 5)
    config = json.loads((bad_config / "config.json").read_text())
    (bad_config / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 0.5}))
    shards = expert("sent-shard", 6, max_shard_bytes=4096)
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    (shards / sorted(set(index["weight_map"].values()))[-1]).unlink()
    pickled = root / "ckpt" / "sent-pickle"
    pickled.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        if (base / name).exists():
            shutil.copy2(base / name, pickled / name)
    marker = root / "UNPICKLED"
    (pickled / "pytorch_model.bin").write_bytes(pickle.dumps(CreatesAFile(marker)))
    return root, marker


def test_model_directory_checks_are_one_line_and_never_unpickle(checkpoints):
    root, marker = checkpoints
    ckpt = root / "ckpt"
    cases = [("nowhere", r"nowhere: model directory not found"),
             ("sent-config", r"sent-config/config.json: rms_norm_eps is 0.5, the base model"),
             ("sent-shard", r"model.safetensors.index.json: shard 'model-\d+-of-\d+.safetensors' for key .* not found"),
             ("sent-pickle", r"sent-pickle/pytorch_model.bin: pickled weights \(pytorch_model\*.bin\) and no "
                             r"\*.safetensors; unpickling can run arbitrary code, so they are not read")]
    for name, message in cases:
        with pytest.raises(CheckpointError, match=message) as err:
            local_llm.check_expert(ckpt / "base", ckpt / name)
        assert "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match=r"pytorch_model.bin: pickled weights; the streaming merge reads "
                                              r"safetensors only, so convert it once to safetensors"):
        local_llm.check_expert(ckpt / "base", ckpt / "sent-pickle", allow_unsafe_pickle=True)
    local_llm.check_expert(ckpt / "base", ckpt / "sent")
    assert not marker.exists()


# --------------------------------------------------------------------------- what local_inputs reads and records

def test_local_inputs_record_only_the_files_the_loaders_read_and_refuse_a_path_holding_none(checkpoints, tmp_path,
                                                                                              capsys):
    """A model directory beside unrelated files (a `shadow`, notes): inputs.json names and hashes the model's
    config, tokenizer and weights, none of the others; a directory, or a link to one, that holds no model file
    is refused by the stage with one line naming its key and the path, and inputs.json is left as it was."""
    from stages import local_inputs

    root, _ = checkpoints
    lab = tmp_path / "lab"
    shutil.copytree(root / "ckpt" / "base", lab / "base")
    unrelated = write_unrelated_files(lab / "base")
    experts = {"maximum": str(root / "ckpt" / "max"), "sentiment": str(root / "ckpt" / "sent")}
    params = parse_params({"local_llm": [_track("lab", experts, base=str(lab / "base"))]})
    files = lab_files.record_inputs(params, lab)["lab"]["files"]
    written = own_models.inputs_path(lab).read_text()
    base = {name.removeprefix("base/") for name in files if name.startswith("base/")}
    assert {"config.json", "tokenizer.json", "model.safetensors"} <= base and not set(unrelated) & base, base
    shadow_digest = hashing.file_digest(lab / "base" / "shadow")
    assert not [name for name in unrelated if name in written] and shadow_digest not in written
    assert "expert.sentiment/model.safetensors.index.json" in files  # a sharded expert: its index and shards

    write_unrelated_files(lab / "etc")
    (lab / "link").symlink_to(lab / "etc", target_is_directory=True)
    for bad in ("etc", "link"):
        (lab / "params-bad.yaml").write_text(yaml.safe_dump(
            {"local_llm": [_track("lab", experts, base=str(lab / bad))]}))
        assert local_inputs.run(local_inputs.stage, ["--root", str(lab), "--params", "params-bad.yaml"]) == 2
        err = capsys.readouterr().err
        assert err == (f"error: params.yaml: local_llm.0.base: {lab / bad} holds no model files (expected "
                       "config.json, tokenizer files and *.safetensors or pytorch_model*.bin); nothing of it is "
                       "read\n"), err
        assert own_models.inputs_path(lab).read_text() == written


def test_a_task_directory_records_the_yamls_of_its_tasks_alone_and_one_defining_none_is_refused(tmp_path):
    """task_dir: the YAMLs defining the track's tasks (and the data they name) are recorded, not another YAML
    or file of the folder; a folder whose YAMLs define none of the tasks is refused with one line."""
    from mergecal.data.llm import LlmSuiteConfig, build_llm_suite
    from mergecal.evaluation.lm_eval_tasks import write_task_yamls

    build_llm_suite(tmp_path / "data", LlmSuiteConfig(**DATA), tasks=("maximum", "sentiment"))
    yamls = tmp_path / "yamls"
    write_task_yamls(tmp_path / "data", yamls, ("maximum", "sentiment"), splits=("validation", "test"))
    write_unrelated_files(yamls)
    (yamls / "other.yaml").write_text(yaml.safe_dump({"task": "other", "dataset_path": "json"}))
    track = {"name": "lab-yaml", "base": "ckpt/base", "experts": {"maximum": "ckpt/max", "sentiment": "ckpt/sent"},
             "task_dir": str(yamls), "tasks": {"maximum": {"metric": "exact_match"}, "sentiment": {"metric": "acc"}}}
    config = parse_params({"local_llm": [track]}).local_llm[0]
    files = local_llm.task_files(config, tmp_path)
    assert {n for n in files if n.startswith("task_dir/")} == {f"task_dir/{t}{s}.yaml" for t in ("maximum", "sentiment")
                                                               for s in ("", "_validation")}
    assert len([n for n in files if n.startswith("data/")]) == 4
    write_unrelated_files(tmp_path / "etc")
    (tmp_path / "etc" / "netplan.yaml").write_text(yaml.safe_dump({"network": {"version": 2}}))
    elsewhere = parse_params({"local_llm": [{**track, "task_dir": str(tmp_path / "etc")}]})
    with pytest.raises(ParameterError, match=r"^params.yaml: local_llm.0.task_dir: .*/etc defines none of the track's "
                                             r"lm-eval tasks \(expected \*.yaml files with task: maximum, "
                                             r"maximum_validation, sentiment, sentiment_validation\)") as info:
        lab_files.record_inputs(elsewhere, tmp_path)
    assert "\n" not in str(info.value) and not own_models.inputs_path(tmp_path).exists()


# ---------------------------------------------------------------------------------------------- the flow

@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _write_params(root: Path, tracks: list[dict], name: str, chains=("{merge}", "{merge}>svc", "{merge}>dsc"),
                  scaling=(0.3, 1.0)) -> str:
    data = {"vision": {"enabled": False}, "text": {"enabled": False}, "llm": {"enabled": False},
            "benchmark": {"merges": {"task_arithmetic": {"scaling": list(scaling)}}, "chains": list(chains)},
            "local_llm": tracks}
    (root / name).write_text(yaml.safe_dump(data))
    return name


def _stages(root: Path, params_name: str):
    """The stages `local_inputs` and `local_tracks`, in process."""
    params = load_params(root / params_name)
    lab_files.record_inputs(params, root)
    return lab_files.all_references(params, root)


@pytest.mark.integration
def test_local_tracks_run_through_the_flow_cache_and_recompute_exactly_what_changed(checkpoints, prefect_server,
                                                                                    monkeypatch):
    import mergecal.pipeline.flow as flow_module
    from mergecal.pipeline.tracking import Tracker

    root, marker = checkpoints
    name = _write_params(root, [_track("lab-a", {"maximum": "ckpt/max", "sentiment": "ckpt/sent"}),
                                _track("lab-b", {"maximum": "ckpt/max", "sentiment": "ckpt/sent2"})], "params.yaml")
    references = _stages(root, name)
    assert set(references) == {"lab-a", "lab-b"} and not any("error" in r for r in references.values())
    assert json.loads((root / "models/local/tracks/index.json").read_text()) == ["lab-a", "lab-b"]
    recorded = json.loads((root / "models/local/inputs.json").read_text())
    entry = recorded["lab-a"]["files"]["expert.sentiment/model.safetensors.index.json"]
    assert entry["size"] > 0 and len(entry["sha256"]) == 64
    assert not list((root / "models").rglob("*.safetensors"))  # nothing copied

    first = flow_module.run_benchmark(params_path=name, root=str(root))
    assert (first["cells"], first["failed"], first["cached"]) == (8, 0, 0)
    tracks = {r["track"] for r in first["rows"]}
    assert tracks == {"local_llm:lab-a", "local_llm:lab-b"}
    skipped = [r for r in first["rows"] if "skipped" in r]
    assert {r["label"] for r in skipped} == {"task_arithmetic>dsc"} and len(skipped) == 2

    tracker = Tracker(root, "mergecal")
    runs = tracker.client.search_runs([tracker.experiment_id], "tags.`mergecal.track` = 'local_llm:lab-a' and "
                                      "tags.`mergecal.status` = 'ok'", max_results=100)
    assert len(runs) == 4 and {r.data.tags["mergecal.backbone"] for r in runs} == {"lab-a"}
    for run in runs:
        assert {"exact_match.maximum", "acc.sentiment", "acc.maximum", "avg_norm_acc"} <= set(run.data.metrics)
        assert {"lm_eval_version", "lm_eval_task.maximum", "lm_eval_task.sentiment_validation"} <= set(run.data.params)

    # a rerun computes nothing
    def must_not_run(cell, *args, **kwargs):
        raise AssertionError(f"{cell.track} {cell.label} computed again")

    monkeypatch.setattr(flow_module, "run_cell", must_not_run)
    second = flow_module.run_benchmark(params_path=name, root=str(root))
    assert (second["cached"], second["failed"]) == (8, 0)
    monkeypatch.undo()

    # a changed expert file (lab-a's only): its hash alone is read again, and exactly lab-a's cells recompute
    # (its zeroshot row too: it is normalized by the experts' scores)
    shard = sorted((root / "ckpt" / "sent").glob("model-*.safetensors"))[0]
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(shard))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key] + 0.5
    save_file(tensors, str(shard), metadata={"format": "pt"})
    reads = []
    real = hashing._sha256_file
    monkeypatch.setattr(hashing, "_sha256_file", lambda path: reads.append(Path(path)) or real(path))
    hashing.file_digest_at.cache_clear()
    _stages(root, name)
    assert [p.name for p in reads if "ckpt" in p.parts] == [shard.name]
    third = flow_module.run_benchmark(params_path=name, root=str(root))
    computed = {(r["track"], r["label"]) for r in third["rows"] if "avg_acc" in r}
    assert third["failed"] == 0 and third["cached"] == 4
    with sqlite3.connect(root / "mlruns" / "mlruns.db") as con:
        new = con.execute("select t.value, r.value from tags t join tags r on r.run_uuid = t.run_uuid and "
                          "r.key = 'mergecal.recipe' join tags s on s.run_uuid = t.run_uuid and "
                          "s.key = 'mergecal.status' and s.value = 'ok' where t.key = 'mergecal.track'").fetchall()
    assert sorted(new) == sorted([(t, label) for t, label in computed] + [
        ("local_llm:lab-a", label) for label in ("zeroshot", "finetuned", "task_arithmetic", "task_arithmetic>svc")])
    assert not marker.exists()

    # the leaderboard has a section per family, with the lm-eval scores and the skipped chain's reason
    from mergecal.pipeline.tracking import tracking_uri
    from mergecal.reports.write import write_reports

    write_reports(tracking_uri(root, "mlruns"), "mergecal", root / "reports", third["invocation_id"])
    board = (root / "reports" / "leaderboard.md").read_text()
    assert "lab-a · local · standard" in board and "lab-b · local · standard" in board
    assert "task_arithmetic>svc" in board and "needs models and data" in board


@pytest.mark.integration
def test_bad_models_fail_their_cells_with_one_line_and_other_tracks_go_on(checkpoints, prefect_server):
    from mergecal.pipeline.flow import run_benchmark

    root, marker = checkpoints
    bad = {"missing": ("ckpt/nowhere", "nowhere: model directory not found"),
           "config": ("ckpt/sent-config", "sent-config/config.json: rms_norm_eps is 0.5, the base model"),
           "shard": ("ckpt/sent-shard", "not found at"),
           "pickle": ("ckpt/sent-pickle", "pytorch_model.bin: pickled weights (pytorch_model*.bin) and no")}
    tracks = [_track("good", {"maximum": "ckpt/max", "sentiment": "ckpt/sent2"})]
    tracks += [_track(f"bad-{k}", {"maximum": "ckpt/max", "sentiment": path}) for k, (path, _) in bad.items()]
    name = _write_params(root, tracks, "params-bad.yaml", chains=("{merge}",), scaling=(0.5,))
    references = _stages(root, name)
    for key, (_, message) in bad.items():
        assert message in references[f"bad-{key}"]["tasks"]["sentiment"]["error"]
        assert "error" not in references[f"bad-{key}"]["tasks"]["maximum"]
    result = run_benchmark(params_path=name, root=str(root), output="results/bad.json")
    failed = {(r["track"], r["label"]): r["error"] for r in result["rows"] if "error" in r}
    ok = {(r["track"], r["label"]) for r in result["rows"] if "avg_acc" in r}
    for key, (_, message) in bad.items():  # the zeroshot row too: it is normalized by the experts' scores
        for label in ("zeroshot", "finetuned", "task_arithmetic"):
            assert message in failed.pop((f"local_llm:bad-{key}", label))
    assert not failed and ok == {("local_llm:good", label) for label in ("zeroshot", "finetuned", "task_arithmetic")}
    assert result["failed"] == 3 * len(bad)
    assert not marker.exists()  # the pickle was hashed as bytes, never loaded


@pytest.mark.integration
def test_unscored_experts_are_merged_and_hashed_but_never_scored(checkpoints, prefect_server):
    """The published WizardMath + chat pair's shape: one expert scored on its task, one merged without a task. With
    one scaling, its merge is the same model as the track scoring both experts, so the task both report scores the
    same."""
    from mergecal.pipeline.flow import run_benchmark
    from mergecal.pipeline.tracks.causal_lm.files import cells as local_cells

    root, _ = checkpoints
    tracks = [_track("pair", {"maximum": "ckpt/max"}, unscored={"chat": "ckpt/sent2"}),
              _track("both", {"maximum": "ckpt/max", "sentiment": "ckpt/sent2"})]
    name = _write_params(root, tracks, "params-unscored.yaml", chains=("{merge}",), scaling=(0.5,))
    if not (root / "params.yaml").exists():  # run alone: the flow's workers know a checkout by its params.yaml
        shutil.copy(root / name, root / "params.yaml")
    references = _stages(root, name)
    assert set(references["pair"]["tasks"]) == {"maximum"} and "error" not in references["pair"]["unscored"]["chat"]
    assert references["pair"]["unscored"]["chat"]["norm"] == references["both"]["tasks"]["sentiment"]["norm"]
    recorded = json.loads((root / "models/local/inputs.json").read_text())["pair"]["files"]
    assert any(role.startswith("unscored.chat/") for role in recorded)

    params = load_params(root / name)
    pair = params.local_llm[0]
    by_label = {c.merge: c for c in local_cells.cells(params) if c.track == "local_llm:pair"}
    assert set(by_label) == {"zeroshot", "finetuned", "task_arithmetic"} and by_label["finetuned"].tasks == ("maximum",)
    merge_inputs = local_cells.inputs(by_label["task_arithmetic"], params, root)
    assert any(role.startswith("unscored.chat/") for role in merge_inputs)
    assert not any(role.startswith("unscored.") for role in local_cells.inputs(by_label["finetuned"], params, root))
    assert local_cells.models(by_label["task_arithmetic"], pair, root).experts == [root / "ckpt/max",
                                                                                    root / "ckpt/sent2"]

    from mergecal.pipeline.tracking import Tracker

    result = run_benchmark(params_path=name, root=str(root), output="results/unscored.json")
    assert result["failed"] == 0, [r.get("error") for r in result["rows"]]
    tracker = Tracker(root, "mergecal")
    metrics = {}
    for track in ("pair", "both"):
        for run in tracker.client.search_runs([tracker.experiment_id], f"tags.`mergecal.track` = 'local_llm:{track}' "
                                              "and tags.`mergecal.status` = 'ok'", max_results=100):
            metrics[track, run.data.tags["mergecal.merge"]] = run.data.metrics
    assert "acc.sentiment" not in metrics["pair", "task_arithmetic"]
    for label in ("task_arithmetic", "finetuned"):
        assert metrics["pair", label]["acc.maximum"] == metrics["both", label]["acc.maximum"], label


def test_a_users_task_directory_is_scored_with_its_metrics_and_hashed_with_its_data(checkpoints, tmp_path):
    """task_dir: the user's lm-eval YAMLs (here the suite's, written as a user would have them), the metric per
    task and the validation task by the ``<task>_validation`` convention; the YAMLs and the local data files they
    name are the cells' inputs."""
    from mergecal.data.llm import LlmSuiteConfig, build_llm_suite
    from mergecal.errors import MergecalError
    from mergecal.evaluation.lm_eval_tasks import write_task_yamls

    root, _ = checkpoints
    build_llm_suite(tmp_path / "data", LlmSuiteConfig(**DATA), tasks=("maximum", "sentiment"))
    write_task_yamls(tmp_path / "data", tmp_path / "yamls", ("maximum", "sentiment"), splits=("validation", "test"))
    track = {"name": "lab-yaml", "base": "ckpt/base", "experts": {"maximum": "ckpt/max", "sentiment": "ckpt/sent"},
             "task_dir": str(tmp_path / "yamls"), "evaluation": EVALUATION,
             "tasks": {"maximum": {"metric": "exact_match"}, "sentiment": {"metric": "acc"}}}
    config = parse_params({"local_llm": [track]}).local_llm[0]
    files = local_llm.task_files(config, root)
    assert {"task_dir/maximum.yaml", "task_dir/sentiment_validation.yaml"} <= set(files)
    assert str((tmp_path / "data" / "sentiment" / "test.jsonl").resolve()) in {str(p) for p in files.values()}
    scores = local_llm.scorer(config, root).score(root / "ckpt" / "base", ["maximum", "sentiment"], "validation")
    assert set(scores) == {"maximum", "sentiment"} and all(0 <= v <= 1 for v in scores.values())
    track["tasks"]["sentiment"]["metric"] = "f1"
    wrong = parse_params({"local_llm": [track]}).local_llm[0]
    with pytest.raises(MergecalError, match=r"lm-eval task 'sentiment' reports acc.*, not 'f1' \(the metric "
                                            r"configured for task 'sentiment'\)"):
        local_llm.scorer(wrong, root).score(root / "ckpt" / "base", ["sentiment"], "test")


def _task_dir_with_code(tmp_path: Path) -> tuple[Path, Path]:
    """The suite's YAMLs of maximum and sentiment as a user's task_dir, maximum's documents processed by a
    ``!function`` of the folder's utils.py, which creates a marker file when it is imported; (task_dir, marker)."""
    from mergecal.data.llm import LlmSuiteConfig, build_llm_suite
    from mergecal.evaluation.lm_eval_tasks import write_task_yamls

    build_llm_suite(tmp_path / "data", LlmSuiteConfig(**DATA), tasks=("maximum", "sentiment"))
    yamls = tmp_path / "yamls"
    write_task_yamls(tmp_path / "data", yamls, ("maximum", "sentiment"), splits=("validation", "test"))
    with (yamls / "maximum.yaml").open("a") as f:
        f.write("process_docs: !function utils.process_docs\n")
    marker = tmp_path / "IMPORTED"
    (yamls / "utils.py").write_text(f"open({str(marker)!r}, 'w').close()\n\n\ndef process_docs(dataset):\n"
                                    "    return dataset\n")
    return yamls, marker


def _yaml_track(task_dir: Path, **extra) -> dict:
    return {"name": "lab-yaml", "base": "ckpt/base", "experts": {"maximum": "ckpt/max", "sentiment": "ckpt/sent"},
            "task_dir": str(task_dir), "evaluation": EVALUATION, "min_test": DATA["n_test"],
            "tasks": {"maximum": {"metric": "exact_match"}, "sentiment": {"metric": "acc"}}, **extra}


def test_task_code_is_refused_before_it_is_imported_unless_the_track_trusts_it(checkpoints, tmp_path):
    """A task YAML with `process_docs: !function utils.process_docs`: without trust_task_code the track is
    refused with one line naming the YAML and the function, and utils.py is never imported (its marker is not
    created), neither by scoring nor by local_inputs (which records utils.py with the YAMLs); with it, lm-eval
    imports and runs it as for any lm-eval task folder."""
    from lm_eval.tasks import TaskManager

    root, _ = checkpoints
    yamls, marker = _task_dir_with_code(tmp_path)
    params = parse_params({"local_llm": [_yaml_track(yamls)]})
    message = (r"maximum.yaml: process_docs: !function utils.process_docs would import and run Python code of the "
               r"task folder; local_llm track 'lab-yaml' runs it only with trust_task_code: true")
    with pytest.raises(MergecalError, match=message) as info:
        local_llm.scorer(params.local_llm[0], root)
    assert "\n" not in str(info.value) and not marker.exists()
    report = local_llm.references(params.local_llm[0], root)
    assert "trust_task_code" in report["error"] and "base" not in report and not marker.exists()
    recorded = lab_files.record_inputs(params, tmp_path)["lab-yaml"]["files"]
    assert "task_dir/utils.py" in recorded and not marker.exists()

    trusted = parse_params({"local_llm": [_yaml_track(yamls, trust_task_code=True)]}).local_llm[0]
    score = local_llm.scorer(trusted, root)
    TaskManager(include_path=str(score.task_dir), include_defaults=False).load(["maximum"])
    assert marker.exists()


def test_task_code_of_an_included_yaml_is_found_without_importing_it(tmp_path):
    """`!function` entries are found through `include:` (as lm-eval merges it), in the YAML that holds them,
    with the Python file they name, by a safe YAML read: nothing is imported."""
    from mergecal.evaluation.lm_eval_tasks import task_sources

    (tmp_path / "common.yaml").write_text("doc_to_text: !function helpers.prompt\ndataset_path: json\n")
    (tmp_path / "helpers.py").write_text(f"open({str(tmp_path / 'IMPORTED')!r}, 'w').close()\n")
    (tmp_path / "README.txt").write_text("- notes, not a task\n")  # no YAML mapping: lm-eval refuses it too
    (tmp_path / "mine.yaml").write_text("include: [common.yaml, README.txt]\ntask: mine\n")
    found = task_sources(tmp_path, ["mine"])
    assert found.defined == ["mine"] and found.yamls == [tmp_path / "mine.yaml", tmp_path / "common.yaml"]
    assert found.functions == [(tmp_path / "common.yaml", "doc_to_text", "helpers.prompt")]
    assert found.modules == [tmp_path / "helpers.py"] and not (tmp_path / "IMPORTED").exists()


def test_a_task_yaml_a_safe_loader_cannot_read_is_refused_without_trust(tmp_path):
    """What a YAML that does not parse safely would run cannot be checked: refused in one line naming it."""
    (tmp_path / "maximum.yaml").write_text("task: maximum\nextra: !!python/tuple [1, 2]\n")
    track = parse_params({"local_llm": [_yaml_track(tmp_path)]}).local_llm[0]
    with pytest.raises(MergecalError, match=r"maximum.yaml: not readable as a safe YAML \(.*python/tuple.*\), so "
                                            r"whether it would run Python code cannot be checked; fix it, or: "
                                            r"local_llm track 'lab-yaml' runs it only with trust_task_code: true"
                       ) as info:
        local_llm.check_task_code(track, tmp_path)
    assert "\n" not in str(info.value)
    local_llm.check_task_code(parse_params({"local_llm": [_yaml_track(tmp_path, trust_task_code=True)]}
                                           ).local_llm[0], tmp_path)


def test_a_task_with_fewer_test_documents_than_min_test_is_refused(checkpoints, tmp_path):
    """The suite's 4 test documents per task are scored, then refused below min_test (default 50): the
    track's one-line error names the track, the task, the count and the minimum; no expert is scored."""
    from mergecal.data.llm import LlmSuiteConfig, build_llm_suite
    from mergecal.evaluation.lm_eval_tasks import write_task_yamls

    root, _ = checkpoints
    build_llm_suite(tmp_path / "data", LlmSuiteConfig(**DATA), tasks=("maximum", "sentiment"))
    write_task_yamls(tmp_path / "data", tmp_path / "yamls", ("maximum", "sentiment"), splits=("validation", "test"))
    track = _yaml_track(tmp_path / "yamls")
    del track["min_test"]
    report = local_llm.references(parse_params({"local_llm": [track]}).local_llm[0], root)
    assert report["error"] == ("ParameterError: local_llm track 'lab-yaml': task maximum has 4 test documents, fewer "
                               "than min_test 50 (a score on so few is mostly noise; lower min_test to accept it)")
    assert report["tasks"] == {} and "base" not in report


def test_the_manual_example_of_local_tracks_is_valid_params():
    text = (Path(__file__).resolve().parents[1] / "docs" / "own-models.md").read_text()
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    params = parse_params(yaml.safe_load(example))
    assert [t.name for t in params.local_llm] == ["lab-llama-1b", "lab-mistral-7b", "lab-llama-1b-registry",
                                                  "lab-llama2-math-chat"]
    assert params.local_llm[1].tasks["gsm8k_local"].validation == "gsm8k_local_validation"
    assert [t.source for t in params.local_llm] == ["suite", "task_dir", "registry", "registry"]
    assert params.local_llm[3].merged_names == ["gsm8k", "chat"] and params.local_llm[3].align_vocabulary


def test_the_new_options_at_their_defaults_leave_a_tracks_dump_and_so_its_cell_ids_unchanged():
    plain = parse_params({"local_llm": [_track("lab", {"maximum": "m", "sentiment": "s"})]}).local_llm[0]
    dump = plain.model_dump(mode="json")
    assert "unscored" not in dump and "align_vocabulary" not in dump and dump["experts"] == {"maximum": "m",
                                                                                            "sentiment": "s"}
    both = parse_params({"local_llm": [_track("lab", {"maximum": "m"}, unscored={"chat": "s"},
                                              align_vocabulary=True)]}).local_llm[0]
    assert both.model_dump(mode="json")["unscored"] == {"chat": "s"} and both.model_dump()["align_vocabulary"]
