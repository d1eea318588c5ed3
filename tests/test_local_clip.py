"""CLIP tracks from local files (``local_clip:``): params, the checkpoint layouts and their checks, the stages and
the Prefect flow end to end on a micro open_clip ViT and a micro Hugging Face CLIP (random weights, the real key
layouts) with three fine-tuned checkpoints each and three small datasets (ImageFolder and HF parquet), written to
disk; nothing is downloaded."""

import contextlib
import io
import json
import shutil
import sqlite3
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from local_models import (CLIP_ARCH, CLIP_TASKS, CreatesAFile, micro_hf_clip, perturbed, write_image_datasets,
                          write_unrelated_files)
from mergecal.errors import CheckpointError, ParameterError
from mergecal.pipeline import cells as cells_mod
from mergecal.pipeline import hashing
from mergecal.backbones import clip_checkpoints
from mergecal.pipeline.tracks.clip.files import stages as local_clip
from mergecal.pipeline import own_models
from mergecal.pipeline.tracks import lab_files
from mergecal.pipeline.config import load_params, parse_params

ARCH, TASKS = CLIP_ARCH, CLIP_TASKS
EVALUATION = {"batch_size": 16, "max_validation": 12}
MIN_TEST = 20  # write_image_datasets' test images per task


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """A lab's files: an open_clip pretrained CLIP with fine-tuned checkpoints as an open_clip safetensors state
    dict, task_vectors' pickled ImageEncoder and a transformers-4 CLIPVisionModel directory; an HF CLIP with
    CLIPVisionModel directories (transformers 5's bare keys, sharded); the datasets; and the bad inputs."""
    from safetensors.torch import save_file

    from mergecal.backbones.clip_layouts import open_clip_to_hf_clip
    from mergecal.backbones.open_clip_vit import create_clip, save_clip
    from mergecal.checkpoint import save_checkpoint, save_state_dict

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("local_clip")
    ckpt = root / "ckpt"
    write_image_datasets(root / "data")

    # open_clip: pretrained as one safetensors file, fine-tuned in the three layouts
    model = create_clip(ARCH, seed=1)
    save_clip(model, ckpt / "oc" / "pretrained.safetensors")
    state = model.state_dict()
    save_state_dict(perturbed(state, 2, "visual."), ckpt / "oc" / "MNIST.safetensors")
    encoder = create_clip(ARCH, seed=1)
    encoder.load_state_dict({**state, **perturbed(state, 3, "visual.")})
    (ckpt / "oc" / "EuroSAT").mkdir(parents=True)
    torch.save(torch.nn.ModuleDict({"model": encoder}), ckpt / "oc" / "EuroSAT" / "finetuned.pt")  # model.visual.*
    hf_visual = {k: v for k, v in open_clip_to_hf_clip(perturbed(state, 4, "visual.")).items()
                 if k != "visual_projection.weight"}  # a CLIPVisionModel has no projection
    (ckpt / "oc" / "SVHN").mkdir()
    save_file(hf_visual, str(ckpt / "oc" / "SVHN" / "model.safetensors"))

    # HF CLIP: pretrained directory, CLIPVisionModel directories with transformers 5's bare key names
    hf = micro_hf_clip()
    hf.save_pretrained(ckpt / "hf" / "pretrained")
    hf_state = hf.state_dict()
    for i, task in enumerate(TASKS):
        vision = {k.removeprefix("vision_model."): v for k, v in perturbed(hf_state, 10 + i, "vision_model.").items()}
        save_checkpoint(vision, ckpt / "hf" / task, max_shard_bytes=40_000)  # sharded, with an index
    # bad inputs
    other = create_clip("mergecal-vit-tiny", seed=1)
    save_state_dict(perturbed(other.state_dict(), 5, "visual."), ckpt / "bad" / "other-arch.safetensors")
    shutil.copytree(ckpt / "hf" / "SVHN", ckpt / "bad" / "missing-shard")
    sorted((ckpt / "bad" / "missing-shard").glob("model-*.safetensors"))[-1].unlink()
    marker = root / "unpickled.txt"
    torch.save({"weights": CreatesAFile(marker)}, ckpt / "bad" / "evil.pt")
    return root, marker


def _oc_track(name="oc", **extra):
    return {"name": name, "model": {"arch": ARCH, "pretrained": "ckpt/oc/pretrained.safetensors"},
            "finetuned": {"MNIST": "ckpt/oc/MNIST.safetensors", "EuroSAT": "ckpt/oc/EuroSAT/finetuned.pt",
                          "SVHN": "ckpt/oc/SVHN"},
            "datasets": {t: "data" for t in TASKS}, "allow_unsafe_pickle": True, "evaluation": EVALUATION,
            "min_test": MIN_TEST, **extra}


def _hf_track(name="hf", **extra):
    return {"name": name, "model": {"pretrained": "ckpt/hf/pretrained"},
            "finetuned": {t: f"ckpt/hf/{t}" for t in TASKS}, "datasets": {t: "data" for t in TASKS},
            "evaluation": EVALUATION, "min_test": MIN_TEST, **extra}


# ------------------------------------------------------------------------------------------------ params

@pytest.mark.parametrize("change, message", [
    ({"finetuned": {"mnist": "a"}}, r"local_clip.0.finetuned: expected at least 2 fine-tuned checkpoints"),
    ({"finetuned": {"mnist": "a", "imagenet": "b"}}, r"local_clip.0.finetuned.imagenet: not one of the vision tasks"),
    ({"datasets": {"MNIST": "data"}}, r"local_clip.0.datasets.EuroSAT: missing: the data location"),
    ({"class_names": {"MNIST": ["zero", "one"]}}, r"local_clip.0.class_names.MNIST: 2 names, but MNIST has 10"),
    ({"templates": {"SVHN": ["a photo"]}}, r"local_clip.0.templates.SVHN: each template needs one '\{\}'"),
    ({"model": {"pretrained": "x.safetensors"}}, r"local_clip.0.model.arch: required with a weights file"),
    ({"model": {"pretrained": "hf-dir", "arch": "ViT-B-32"}}, r"local_clip.0.model.arch: only with a weights file"),
    ({"allow_unsafe_pickle": "yes"}, r"local_clip.0.allow_unsafe_pickle: Input should be a valid boolean"),
    ({"name": "tiny-llama"}, r"local_clip.0.name: 'tiny-llama' is already the name"),
    ({"min_test": 30, "evaluation": {"max_test": 20}}, r"local_clip.0.evaluation.max_test: 20 images, fewer than "
                                                       r"min_test 30"),
    ({"min_test": 0}, r"local_clip.0.min_test: "),
])
def test_local_clip_params_errors_are_one_clear_line(change, message):
    with pytest.raises(ParameterError, match=message) as info:
        parse_params({"local_clip": [{**_oc_track(), **change}]})
    assert "\n" not in str(info.value)


def test_default_params_have_no_local_clip_track():
    params = load_params(Path(__file__).resolve().parents[1] / "params.yaml")
    assert params.local_clip == [] and not [c for c in cells_mod.enumerate_cells(params)
                                            if c.track.startswith("local_clip")]


# ------------------------------------------------------------------------------------------ checkpoints

def test_every_layout_reads_as_the_same_open_clip_image_encoder(lab):
    """open_clip safetensors, task_vectors' pickled ImageEncoder (opt-in), HF CLIPVisionModel with and without
    the vision_model. prefix, sharded: the same keys as the pretrained image encoder, in open_clip's layout."""
    root, _ = lab
    oc = clip_checkpoints.open_checkpoint(root / "ckpt/oc/pretrained.safetensors")
    for name in ("MNIST.safetensors", "EuroSAT/finetuned.pt", "SVHN"):
        with pytest.warns(UserWarning, match="finetuned.pt: unpickling") if name.endswith(".pt") else _nothing():
            view = clip_checkpoints.finetuned_visual(oc, root / "ckpt/oc" / name, allow_unsafe_pickle=True)
        assert view.keys() == clip_checkpoints.visual_keys(oc)
        deltas = [float((view.get(k) - oc.get(k).float()).abs().max()) for k in view.keys()]
        assert max(deltas) > 0 and (name != "SVHN" or float((view.get("visual.proj") - oc.get("visual.proj")).abs()
                                                            .max()) == 0)  # no projection: the pretrained one
    hf = clip_checkpoints.open_checkpoint(root / "ckpt/hf/pretrained")
    arch = clip_checkpoints.register_hf_arch(root / "ckpt/hf/pretrained")
    model = clip_checkpoints.build_model(arch, hf)  # every key of the HF CLIP maps onto open_clip's architecture
    assert set(model.state_dict()) == set(hf.keys())
    # and the architecture read from config.json computes what the HF model computes, image and text
    from transformers import CLIPModel

    from mergecal.backbones.open_clip_vit import get_tokenizer

    reference = CLIPModel.from_pretrained(str(root / "ckpt/hf/pretrained"), local_files_only=True).eval()
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    text = get_tokenizer(arch)(["a photo of a 3.", "a blurry photo of the number 7."])
    with torch.no_grad():
        hf_image = reference.get_image_features(pixel_values=images)
        hf_text = reference.get_text_features(input_ids=text)
        torch.testing.assert_close(model.encode_image(images), getattr(hf_image, "pooler_output", hf_image),
                                   rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.encode_text(text), getattr(hf_text, "pooler_output", hf_text),
                                   rtol=1e-4, atol=1e-5)
    view = clip_checkpoints.finetuned_visual(hf, root / "ckpt/hf/MNIST")
    assert view.keys() == clip_checkpoints.visual_keys(hf)


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_bad_checkpoints_are_one_line_and_a_pickle_is_never_unpickled_without_the_opt_in(lab):
    root, marker = lab
    oc = clip_checkpoints.open_checkpoint(root / "ckpt/oc/pretrained.safetensors")
    cases = [("bad/other-arch.safetensors", False,
              r"other-arch.safetensors: architecture differs from the pretrained model: key 'visual\..*' is not in "
              r".*pretrained.safetensors"),
             ("bad/missing-shard", False, r"model.safetensors.index.json: shard 'model-\d+-of-\d+.safetensors'"),
             ("bad/evil.pt", False, r"evil.pt: a pickled checkpoint; unpickling can run arbitrary code, so it is not "
                                    r"read"),
             ("oc/EuroSAT/finetuned.pt", False, r"finetuned.pt: a pickled checkpoint"),
             ("bad/nowhere.safetensors", False, r"nowhere.safetensors: checkpoint not found")]
    for name, opt_in, message in cases:
        with pytest.raises(CheckpointError, match=message) as err:
            clip_checkpoints.finetuned_visual(oc, root / "ckpt" / name, allow_unsafe_pickle=opt_in)
        assert "\n" not in str(err.value)
    assert not marker.exists()  # refused from its name: not a byte was read


# --------------------------------------------------------------------------- what local_inputs reads and records

def test_local_inputs_record_only_the_checkpoint_and_dataset_files_the_loaders_read(lab, tmp_path):
    """An HF CLIP directory and a data location beside unrelated files (a `shadow`, notes, also inside the
    task's own folders): inputs.json names the config, weights and each split's images and shards, none of
    the others; a checkpoint or dataset path that holds none of what its loader reads is refused with one line
    naming its key, the path and what was expected."""
    root, _ = lab
    shutil.copytree(root / "ckpt" / "hf" / "pretrained", tmp_path / "pretrained")
    shutil.copytree(root / "data", tmp_path / "data")
    unrelated = write_unrelated_files(tmp_path / "pretrained") + write_unrelated_files(tmp_path / "data")
    for folder in ("mnist", "mnist/test", "EuroSAT", "EuroSAT/data"):
        write_unrelated_files(tmp_path / "data" / folder)
    track = _hf_track(model={"pretrained": str(tmp_path / "pretrained")},
                      datasets={t: str(tmp_path / "data") for t in TASKS})
    files = lab_files.record_inputs(parse_params({"local_clip": [track]}), tmp_path)["hf"]["files"]
    assert not [name for name in files if name.rsplit("/", 1)[-1] in unrelated], sorted(files)
    written = own_models.inputs_path(tmp_path).read_text()
    assert "shadow" not in written and "notes.txt" not in written
    assert {"pretrained/config.json", "pretrained/model.safetensors", "dataset.MNIST/mnist/test/0/0.png",
            "dataset.EuroSAT/EuroSAT/data/test-00000-of-00001.parquet"} <= set(files)
    assert len([n for n in files if n.startswith("dataset.MNIST/")]) == 3 * 20  # train, val, test: 20 images each

    cases = [("finetuned", {**track["finetuned"], "SVHN": str(tmp_path / "etc")},
              r"local_clip.0.finetuned.SVHN: .*/etc holds no checkpoint files \(expected a .safetensors file or "
              r"index, a pickled"),
             ("finetuned", {**track["finetuned"], "SVHN": str(tmp_path / "etc" / "shadow")},
              r"local_clip.0.finetuned.SVHN: .*/etc/shadow holds no checkpoint files"),
             ("datasets", {**track["datasets"], "MNIST": str(tmp_path / "etc")},
              r"local_clip.0.datasets.MNIST: .*/etc holds no MNIST dataset \(expected imagefolder .*/etc/"
              r"\{mnist,MNIST\}/\{train,val,test\}/<class>/<image>; torchvision")]
    write_unrelated_files(tmp_path / "etc")
    for key, value, message in cases:
        bad = parse_params({"local_clip": [{**track, key: value}]})
        with pytest.raises(ParameterError, match="^params.yaml: " + message) as info:
            lab_files.record_inputs(bad, tmp_path)
        assert "\n" not in str(info.value) and own_models.inputs_path(tmp_path).read_text() == written


def test_a_task_with_fewer_test_images_than_min_test_is_refused(lab):
    """20 test images per task, min_test 50 (the default): each task's one-line error names the track, the task,
    the count and the minimum; no score is recorded (the leaderboard has no row for it)."""
    root, _ = lab
    track = _hf_track("small")
    del track["min_test"]
    report = local_clip.references(parse_params({"local_clip": [track]}).local_clip[0], root)
    assert set(report["tasks"]) == set(TASKS) and "error" not in report
    for task, entry in report["tasks"].items():
        assert entry == {"error": f"ParameterError: local_clip track 'small': task {task} has 20 test images, fewer "
                                  "than min_test 50 (a score on so few is mostly noise; lower min_test to accept it)"}


# ---------------------------------------------------------------------------------------------- the flow

@pytest.fixture(scope="module")
def prefect_server():
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def _write_params(root: Path, tracks: list[dict], name: str,
                  chains=("{merge}", "{merge}>svc", "{merge}>wsc", "{merge}>dsc"), scaling=(0.3, 1.0)) -> str:
    data = {"vision": {"enabled": False}, "text": {"enabled": False}, "llm": {"enabled": False},
            "benchmark": {"merges": {"task_arithmetic": {"scaling": list(scaling)}}, "chains": list(chains),
                          "evaluation": {"distac_samples": 16}},
            "probing": {"max_samples": 30, "top": 3},  # 20 train images a task
            "local_clip": [{"distac": {"steps": 2, "batch_size": 8}, **t} for t in tracks]}
    (root / name).write_text(yaml.safe_dump(data))
    return name


def _stages(root: Path, params_name: str) -> dict:
    """The DVC stages `local_inputs`, `local_tracks`, `local_sensitivity` and `local_distac` (their scripts, in
    process); the references written."""
    from stages import local_distac, local_inputs, local_sensitivity, local_tracks

    for stage in (local_inputs, local_tracks, local_sensitivity, local_distac):
        assert stage.run(stage.stage, ["--root", str(root), "--params", params_name]) == 0
    params = load_params(root / params_name)
    return {t.name: json.loads(local_clip.references_path(t, root).read_text()) for t in params.local_clip}


@pytest.mark.slow
@pytest.mark.integration
def test_local_clip_tracks_run_through_the_flow_cache_and_recompute_exactly_what_changed(lab, prefect_server,
                                                                                         monkeypatch):
    import mergecal.pipeline.flow as flow_module
    from mergecal.pipeline.tracking import Tracker

    root, marker = lab
    name = _write_params(root, [_oc_track(), _hf_track()], "params.yaml")
    out = io.StringIO()  # not capsys: Prefect's console handler would keep its stream after the test
    with pytest.warns(UserWarning, match="finetuned.pt: unpickling"), contextlib.redirect_stdout(out):
        references = _stages(root, name)
    assert set(references) == {"oc", "hf"}
    printed = out.getvalue()
    assert "hf/SVHN: fine-tuned " in printed and "(test, 20 images); |tau| " in printed, printed
    for report in references.values():
        assert "error" not in report and set(report["tasks"]) == set(TASKS), report
        for entry in report["tasks"].values():
            assert "error" not in entry, entry
            assert entry["n"] == {"validation": 12, "test": 20} and entry["norm"] > 0
            assert 0 <= entry["zeroshot"]["test"]["accuracy"] <= 1 and 0 <= entry["test_accuracy"] <= 1
    recorded = json.loads((root / "models/local/inputs.json").read_text())
    assert recorded["hf"]["files"]["finetuned.SVHN/model.safetensors.index.json"]["size"] > 0
    assert len([r for r in recorded["oc"]["files"] if r.startswith("dataset.EuroSAT/")]) == 3
    assert not [p for p in (root / "models").rglob("*.safetensors")  # no checkpoint copied (DisTaC's are new models)
                if p.name != "heads.safetensors" and "distac" not in p.parts]

    first = flow_module.run_benchmark(params_path=name, root=str(root))
    assert (first["cells"], first["failed"], first["cached"]) == (12, 0, 0), [r.get("error") for r in first["rows"]]
    assert not [r for r in first["rows"] if "skipped" in r]  # the data chain (dsc) runs on local CLIP tracks
    tracker = Tracker(root, "mergecal")
    runs = tracker.client.search_runs([tracker.experiment_id], "tags.`mergecal.track` = 'local_clip:hf' and "
                                      "tags.`mergecal.status` = 'ok'", max_results=100)
    assert len(runs) == 6 and {r.data.tags["mergecal.backbone"] for r in runs} == {"hf"}
    for run in runs:
        assert {"acc.MNIST", "acc.EuroSAT", "acc.SVHN", "avg_norm_acc", "ece.SVHN"} <= set(run.data.metrics)
        assert {"arch", "data.MNIST", "open_clip_version"} <= set(run.data.params)
    finetuned = next(r for r in first["rows"] if r["track"] == "local_clip:oc" and r["label"] == "finetuned")
    assert finetuned["avg_acc"] == pytest.approx(np.mean([references["oc"]["tasks"][t]["test_accuracy"]
                                                          for t in TASKS]))

    def must_not_run(cell, *args, **kwargs):
        raise AssertionError(f"{cell.track} {cell.label} computed again")

    monkeypatch.setattr(flow_module, "run_cell", must_not_run)
    second = flow_module.run_benchmark(params_path=name, root=str(root))
    assert (second["cached"], second["failed"]) == (12, 0)
    monkeypatch.undo()

    # a changed fine-tuned checkpoint of the HF track: its hash alone is read again, and exactly hf's cells rerun
    from safetensors.torch import load_file, save_file

    shard = sorted((root / "ckpt/hf/MNIST").glob("model-*.safetensors"))[0]
    tensors = load_file(str(shard))
    key = sorted(tensors)[0]
    tensors[key] = tensors[key] + 0.5
    save_file(tensors, str(shard), metadata={"format": "pt"})
    reads = []
    real = hashing._sha256_file
    monkeypatch.setattr(hashing, "_sha256_file", lambda path: reads.append(Path(path)) or real(path))
    hashing.file_digest_at.cache_clear()
    with pytest.warns(UserWarning):
        _stages(root, name)
    assert [p.name for p in reads if "ckpt" in p.parts] == [shard.name]
    third = flow_module.run_benchmark(params_path=name, root=str(root))
    assert third["failed"] == 0 and third["cached"] == 6
    with sqlite3.connect(root / "mlruns" / "mlruns.db") as con:
        ok = con.execute("select t.value from tags t join tags s on s.run_uuid = t.run_uuid and s.key = "
                         "'mergecal.status' and s.value = 'ok' where t.key = 'mergecal.track'").fetchall()
    assert sorted(v for (v,) in ok) == ["local_clip:hf"] * 12 + ["local_clip:oc"] * 6
    assert not marker.exists()

    from mergecal.pipeline.tracking import tracking_uri
    from mergecal.reports.write import write_reports

    write_reports(tracking_uri(root, "mlruns"), "mergecal", root / "reports", third["invocation_id"])
    board = (root / "reports" / "leaderboard.md").read_text()
    assert "oc · local · standard" in board and "hf · local · standard" in board
    assert "task_arithmetic>wsc" in board and "task_arithmetic>dsc" in board


@pytest.mark.slow
@pytest.mark.integration
def test_bad_inputs_fail_their_tracks_cells_with_one_line_and_other_tracks_go_on(lab, prefect_server):
    from mergecal.pipeline.flow import run_benchmark

    root, marker = lab
    bad = {"arch": ({"finetuned": {**_hf_track()["finetuned"], "SVHN": "ckpt/bad/other-arch.safetensors"}},
                    "SVHN", "architecture differs from the pretrained model"),
           "shard": ({"finetuned": {**_hf_track()["finetuned"], "SVHN": "ckpt/bad/missing-shard"}},
                     "SVHN", "not found at"),
           "pickle": ({"finetuned": {**_hf_track()["finetuned"], "SVHN": "ckpt/bad/evil.pt"}},
                      "SVHN", "evil.pt: a pickled checkpoint; unpickling can run arbitrary code"),
           "dataset": ({"datasets": {**_hf_track()["datasets"], "SVHN": "nowhere"}},
                       "SVHN", "SVHN: data root"),
           "classes": ({"datasets": {**_hf_track()["datasets"], "EuroSAT": "data-12"}},
                       "EuroSAT", "match neither the 10 EuroSAT classes nor their number")}
    # a EuroSAT copy whose parquet labels name 12 classes: the dataset does not fit the 10-class head
    import datasets

    src = root / "data" / "EuroSAT" / "data"
    out = root / "data-12" / "EuroSAT" / "data"
    out.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=[f"c{i}" for i in
                                                                                                  range(12)])})
    for shard in src.glob("*.parquet"):
        ds = datasets.Dataset.from_parquet(str(shard)).cast(features)
        ds.to_parquet(str(out / shard.name))
    tracks = [_hf_track("good")] + [_hf_track(f"bad-{k}", **change) for k, (change, _, _) in bad.items()]
    name = _write_params(root, tracks, "params-bad.yaml", chains=("{merge}",), scaling=(0.5,))
    references = _stages(root, name)
    for key, (_, task, message) in bad.items():
        assert message in references[f"bad-{key}"]["tasks"][task]["error"], references[f"bad-{key}"]
        assert "error" not in references[f"bad-{key}"]["tasks"]["MNIST"]
    result = run_benchmark(params_path=name, root=str(root), output="results/bad.json")
    failed = {(r["track"], r["label"]): r["error"] for r in result["rows"] if "error" in r}
    ok = {(r["track"], r["label"]) for r in result["rows"] if "avg_acc" in r}
    for key, (_, _, message) in bad.items():
        for label in ("zeroshot", "finetuned", "task_arithmetic"):
            assert message in failed.pop((f"local_clip:bad-{key}", label))
    assert not failed and ok == {("local_clip:good", label) for label in ("zeroshot", "finetuned", "task_arithmetic")}
    assert not marker.exists()


def test_the_manual_example_of_local_clip_tracks_is_valid_params():
    text = (Path(__file__).resolve().parents[1] / "docs" / "own-models.md").read_text()
    blocks = [block.split("```", 1)[0] for block in text.split("```yaml\n")[1:]]
    example = next(block for block in blocks if block.startswith("local_clip:"))
    params = parse_params(yaml.safe_load(example))
    assert [t.name for t in params.local_clip] == ["vitb32-fusionbench", "vitb32-task-vectors"]
    assert [len(t.finetuned) for t in params.local_clip] == [8, 8]
    assert params.local_clip[1].model.arch == "ViT-B-32-quickgelu" and params.local_clip[0].model.arch is None


def test_an_unusable_pretrained_model_is_the_tracks_one_line_error(lab):
    root, _ = lab
    for change, message in [({"model": {"pretrained": "ckpt/hf/nowhere"}}, "ckpt/hf/nowhere: checkpoint not found"),
                            ({"model": {"arch": "mergecal-vit-tiny", "pretrained": "ckpt/oc/pretrained.safetensors"}},
                             "pretrained.safetensors: not a mergecal-vit-tiny checkpoint: key 'visual.")]:
        track = parse_params({"local_clip": [_hf_track("broken", **change)]}).local_clip[0]
        report = local_clip.references(track, root)
        assert message in report["error"] and "\n" not in report["error"] and report["tasks"] == {}
        assert not local_clip.heads_path(track, root).exists()
        assert json.loads(local_clip.references_path(track, root).read_text()) == report


def test_a_data_free_pre_step_is_skipped_on_local_clip_with_its_reason():
    """The track reads a chain's pre-merge step from its DisTaC stage: a `rescale>{merge}` chain (the vision
    track's, run in the cell) is listed as skipped with why, not run into DisTaC's files."""
    from mergecal.pipeline.tracks.clip.files import cells as local_cells

    params = parse_params({"local_clip": [_oc_track()],
                           "benchmark": {"chains": ["{merge}", "distac>{merge}", "rescale>{merge}",
                                                    "distac>rescale>{merge}"]}})
    recipes = [c.recipe for c in local_cells.cells(params)]
    assert any(r.startswith("distac(") for r in recipes) and not any("rescale" in r for r in recipes)
    skipped = local_cells.skipped(params)
    assert skipped and all("rescale" in c.recipe for c, _ in skipped)
    assert {reason for _, reason in skipped} == {"a pre-merge step other than a first distac runs on the vision "
                                                 "track only"}
