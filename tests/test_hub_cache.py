"""Hub ids read from a local Hugging Face cache (#42, step 1), on a cache fabricated in the hub's own layout
(``models--org--name/{blobs,refs,snapshots/<commit>}``, snapshot files as relative symlinks to blobs): found offline
by huggingface_hub's lookup at ``main``, a branch, a tag or a commit; a file inside a repository; a dataset
repository's snapshot read as the task's dataset; a `local_clip` track configured by hub ids reads exactly the
bytes and images of the same track configured by paths; an id the cache lacks is one line naming it."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from local_models import micro_hf_clip, write_clip_track
from mergecal.errors import CheckpointError
from mergecal.hub_cache import HubId, local_path, parse_hub_id, snapshot
from mergecal.pipeline.config import load_params
from mergecal.pipeline.hashing import file_digest
from mergecal.pipeline.own_models import resolve
from mergecal.pipeline.tracks.clip.files import stages as clip_files

COMMIT = "0123456789abcdef0123456789abcdef01234567"
OTHER = "fedcba9876543210fedcba9876543210fedcba98"


def cache_repo(cache: Path, repo_type: str, repo_id: str, files: dict[str, bytes | Path], commit: str = COMMIT,
               refs: tuple[str, ...] = ("main",)) -> Path:
    """One repository revision in the hub cache's layout: blobs named by content, the snapshot's files relative
    symlinks to them, ``refs/<ref>`` holding the commit. Returns the snapshot folder."""
    folder = cache / f"{repo_type}s--{repo_id.replace('/', '--')}"
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = folder / "blobs" / hashlib.sha256(data).hexdigest()
        blob.parent.mkdir(parents=True, exist_ok=True)
        blob.write_bytes(data)
        link = folder / "snapshots" / commit / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    (folder / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (folder / "refs" / ref).write_text(commit)
    return folder / "snapshots" / commit


@pytest.fixture
def cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    folder = tmp_path / "hf-cache"
    folder.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(folder))  # what HF_HUB_CACHE sets when the process starts
    return folder


def test_hub_ids_are_parsed_strictly_and_bare_ones_never_take_a_path():
    assert parse_hub_id("hf://org/name") == HubId("org/name")
    assert parse_hub_id("hf://org/name@v1.0") == HubId("org/name", "v1.0")
    assert parse_hub_id(f"hf://org/name@{COMMIT}/sub/model.safetensors") == HubId("org/name", COMMIT,
                                                                                   "sub/model.safetensors")
    assert parse_hub_id("org/name@main") == HubId("org/name", "main")
    for not_an_id in ("models/base/experts", "./org/name", "/abs/org", "name"):
        assert parse_hub_id(not_an_id) is None
    for bad in ("hf://name", "hf://org/name/../../etc/passwd", "hf://org/na me"):
        with pytest.raises(CheckpointError, match=r"not a hub id \(expected hf://org/name"):
            parse_hub_id(bad)


def test_a_cached_revision_is_found_offline_by_ref_tag_or_commit_and_a_missing_one_is_one_line(cache):
    main = cache_repo(cache, "model", "org/clip", {"config.json": b"{}", "sub/w.safetensors": b"w1"})
    tagged = cache_repo(cache, "model", "org/clip", {"config.json": b"{}"}, commit=OTHER, refs=("v2",))
    assert snapshot(HubId("org/clip")) == main and snapshot(HubId("org/clip", COMMIT)) == main
    assert snapshot(HubId("org/clip", "v2")) == tagged
    assert local_path(parse_hub_id("hf://org/clip/sub/w.safetensors")).read_bytes() == b"w1"
    with pytest.raises(CheckpointError) as err:
        local_path(parse_hub_id("hf://org/clip@v2/sub/w.safetensors"))
    assert str(err.value) == f"org/clip@v2 (model): the cached snapshot {tagged} holds no 'sub/w.safetensors'"
    for hub_id, repo_type, command in ((HubId("org/other"), "model", "hf download org/other"),
                                       (HubId("org/clip", "v9"), "model", "hf download org/clip --revision v9"),
                                       (HubId("org/clip"), "dataset", "hf download org/clip --repo-type dataset")):
        with pytest.raises(CheckpointError) as err:
            snapshot(hub_id, repo_type)
        assert str(err.value) == (
            f"{hub_id} ({repo_type}): not in the local Hugging Face cache ({cache}); nothing is downloaded here: fetch "
            f"it where a network exists ({command}) and copy the cache, or set HF_HUB_CACHE to where it is")
        assert "\n" not in str(err.value)


def test_a_configured_path_wins_over_a_bare_id_and_a_bare_id_the_cache_lacks_stays_a_path(cache, tmp_path):
    cached = cache_repo(cache, "model", "org/clip", {"config.json": b"{}"})
    assert resolve("org/clip", tmp_path) == cached  # no such path under the root: the cache's
    (tmp_path / "org" / "clip").mkdir(parents=True)
    assert resolve("org/clip", tmp_path) == tmp_path / "org" / "clip"  # the path, as before hub ids
    assert resolve("org/missing", tmp_path) == tmp_path / "org" / "missing"  # reported missing as any path
    with pytest.raises(CheckpointError, match=r"^org/missing \(dataset\): not in the local Hugging Face cache"):
        resolve("hf://org/missing", tmp_path, repo_type="dataset")


def test_a_local_clip_track_configured_by_hub_ids_reads_what_the_same_track_configured_by_paths_reads(
        cache, tmp_path):
    """Pretrained and fine-tuned checkpoints as files of model repositories (pinned at a commit, at a tag, at
    main), EuroSAT as a dataset repository's parquet snapshot (FusionBench's tanganke/<task> layout); MNIST and
    SVHN stay local folders. Every file the loaders read has the same bytes, and EuroSAT's test split the same
    images and labels."""
    torch.set_num_threads(1)
    plain = write_clip_track(tmp_path / "lab", "lab")
    hub = dict(plain)
    cache_repo(cache, "model", "lab-org/clip-micro",
               {"open_clip_model.safetensors": Path(plain["model"]["pretrained"])})
    hub["model"] = {**plain["model"], "pretrained": "hf://lab-org/clip-micro/open_clip_model.safetensors"}
    hub["finetuned"] = {}
    for task, path in plain["finetuned"].items():
        repo = f"lab-org/clip-micro_{task.lower()}"
        cache_repo(cache, "model", repo, {"model.safetensors": Path(path)}, refs=("main", "v1"))
        revision = {"MNIST": f"@{COMMIT}", "EuroSAT": "@v1"}.get(task, "")
        hub["finetuned"][task] = f"hf://{repo}{revision}/model.safetensors"
    parquet = tmp_path / "lab" / "data" / "EuroSAT"
    cache_repo(cache, "dataset", "lab-org/eurosat",
               {p.relative_to(parquet).as_posix(): p for p in sorted(parquet.rglob("*.parquet"))})
    hub["datasets"] = {**plain["datasets"], "EuroSAT": "hf://lab-org/eurosat"}
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"local_clip": [plain, {**hub, "name": "hub"}]}))
    by_path, by_id = load_params(tmp_path / "params.yaml").local_clip

    files = [clip_files.input_files(track, tmp_path) for track in (by_path, by_id)]
    assert all(isinstance(f, Path) for one in files for f in one.values())  # nothing missing, no error
    hashes = tmp_path / "hashes"

    def contents(found: dict) -> dict[str, list[str]]:
        out: dict[str, list[str]] = {}
        for role, file in found.items():
            out.setdefault(role.split("/")[0], []).append(file_digest(file, hashes))
        return {role: sorted(digests) for role, digests in out.items()}

    assert contents(files[0]) == contents(files[1])
    assert any(str(cache) in str(f) for f in files[1].values())
    assert clip_files.data_digest(by_path, "MNIST", tmp_path) == clip_files.data_digest(by_id, "MNIST", tmp_path)
    plain_test, hub_test = (clip_files.task_split(track, "EuroSAT", "test", tmp_path) for track in (by_path, by_id))
    assert np.array_equal(plain_test.labels, hub_test.labels) and len(hub_test.labels) == 20
    assert np.array_equal(plain_test.images(np.arange(20), 32), hub_test.images(np.arange(20), 32))

    shutil.rmtree(cache / "models--lab-org--clip-micro_svhn")  # one checkpoint gone from the cache: one line
    with pytest.raises(CheckpointError, match=r"^lab-org/clip-micro_svhn \(model\): not in the local Hugging Face "
                                              r"cache .*\(hf download lab-org/clip-micro_svhn\)"):
        clip_files.input_files(by_id, tmp_path)


# --- a preset resolved from the cache, end to end at smoke size -------------------------------------------------

def _parquet(folder: Path, names: list[str], splits: tuple[str, ...]) -> None:
    """A task's parquet shards as the hub holds them: ``<split>-00000-of-00001.parquet`` with an image and a
    ClassLabel label, two images per class and split that depend on the class."""
    import datasets
    from PIL import Image

    rng = np.random.default_rng(len(names))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=names)})
    folder.mkdir(parents=True, exist_ok=True)
    for split in splits:
        labels = [label for label in range(len(names)) for _ in range(2)]
        images = [Image.fromarray((np.full((32, 32, 3), 20 * y) + rng.integers(0, 40, (32, 32, 3))).astype(np.uint8))
                  for y in labels]
        datasets.Dataset.from_dict({"image": images, "label": labels}, features=features).to_parquet(
            str(folder / f"{split}-00000-of-00001.parquet"))


def _fusionbench_b32_models(cache: Path, staged: Path, tasks: tuple[str, ...], seed: int) -> None:
    """OpenAI's CLIP ViT-B/32 (a micro Hugging Face CLIP with the real parameter names) and FusionBench's
    fine-tuned image encoders for ``tasks`` (its repository suffixes), in the cache under their hub ids."""
    from mergecal.checkpoint import save_checkpoint

    clip = micro_hf_clip()
    clip.save_pretrained(staged / "pretrained")
    cache_repo(cache, "model", "openai/clip-vit-base-patch32", {p.name: p for p in (staged / "pretrained").iterdir()})
    generator = torch.Generator().manual_seed(seed)
    for task in tasks:
        vision = {k.removeprefix("vision_model."): v + 0.02 * torch.randn(v.shape, generator=generator)
                  for k, v in clip.state_dict().items() if k.startswith("vision_model.")}
        save_checkpoint(vision, staged / task)
        cache_repo(cache, "model", f"tanganke/clip-vit-base-patch32_{task}",
                   {p.name: p for p in (staged / task).iterdir()})


def _references_and_a_cell(root: Path, track: dict):
    """The track's stages (``local_inputs``, ``local_tracks``) and its task-arithmetic cell: (params, the
    references report, the cell's result)."""
    from mergecal.pipeline.cells import enumerate_cells, run_cell
    from stages import local_inputs, local_tracks

    _write_preset_params(root, track, ["{merge}"])
    for stage in (local_inputs, local_tracks):
        assert stage.run(stage.stage, ["--root", str(root)]) == 0
    params = load_params(root / "params.yaml")
    report = yaml.safe_load(clip_files.references_path(params.local_clip[0], root).read_text())
    cell = next(c for c in enumerate_cells(params) if c.track.startswith("local_clip") and c.merge == "task_arithmetic")
    return params, report, run_cell(cell, params, root)


def test_a_preset_resolves_offline_and_runs_end_to_end_at_smoke_size(cache, tmp_path):
    """FusionBench's ViT-B/32 pool by its preset, two of its tasks (``preset_tasks``), every id fabricated in the
    cache at micro size (a Hugging Face CLIP with the real parameter names, CLIPVisionModel experts, parquet test
    sets in the layout of ylecun/mnist and tanganke/eurosat): the references and a task-arithmetic cell run."""
    from mergecal.data.real_vision import task_metadata

    torch.set_num_threads(1)
    staged = tmp_path / "staged"
    _fusionbench_b32_models(cache, staged, ("mnist", "eurosat"), seed=1)
    _parquet(staged / "mnist" / "data" / "mnist", task_metadata("MNIST")[0], ("train", "test"))
    cache_repo(cache, "dataset", "ylecun/mnist",
               {f"mnist/{p.name}": p for p in (staged / "mnist/data/mnist").iterdir()})
    _parquet(staged / "eurosat" / "data" / "data", task_metadata("EuroSAT")[0], ("train", "validation", "test"))
    cache_repo(cache, "dataset", "tanganke/eurosat",
               {f"data/{p.name}": p for p in (staged / "eurosat/data/data").iterdir()})

    track = {"name": "fb", "preset": "fusionbench-clip-vit-b32-ta8", "preset_tasks": ["MNIST", "EuroSAT"],
             "evaluation": {"batch_size": 16, "max_validation": 8}, "min_test": 20}
    params, report, result = _references_and_a_cell(tmp_path / "repo", track)
    assert set(report["tasks"]) == {"MNIST", "EuroSAT"} and "error" not in report, report
    for entry in report["tasks"].values():
        assert "error" not in entry and entry["n"]["test"] == 20 and entry["norm"] > 0, entry
    assert 0 <= result.metrics["avg_acc"] <= 1 and result.metrics["selected_scaling"] in (0.3, 1.0)
    assert set(result.examples) == {"MNIST", "EuroSAT"} and all(len(v) == 20 for v in result.examples.values())


def test_a_twenty_task_preset_reads_its_webdataset_and_validation_test_splits_end_to_end(cache, tmp_path):
    """FusionBench's TALL20 pool by its preset, three of the tasks the TALL-mask paper adds, each stored as its hub
    repository holds it (micro size): FER2013 as CLIP_benchmark's webdataset shards (clip-benchmark/wds_fer2013),
    Food-101 with train and validation only (ethz/food101: FusionBench tests on validation), KMNIST's hiragana
    label names (tanganke/kmnist). The references and a task-arithmetic cell run; the SVC paper's 14-task table
    (another 14) is compared on Food-101, the one column the two share, and never on its average."""
    import io
    import tarfile

    from PIL import Image

    from mergecal.data.real_vision import task_metadata
    from mergecal.pipeline.track_registry import lab_tracks
    from mergecal.published import for_tracks

    torch.set_num_threads(1)
    staged = tmp_path / "staged"
    _fusionbench_b32_models(cache, staged, ("fer2013", "food101", "kmnist"), seed=2)
    shards = {}
    rng = np.random.default_rng(0)
    for split, n in (("train", 14), ("test", 21)):
        buffer = io.BytesIO()
        with tarfile.open(fileobj=buffer, mode="w") as tar:
            for i in range(n):
                image = io.BytesIO()
                Image.fromarray((np.full((24, 24, 3), 30 * (i % 7)) + rng.integers(0, 30, (24, 24, 3)))
                                .astype(np.uint8)).save(image, format="JPEG")
                for name, data in ((f"s{i:07d}.jpg", image.getvalue()), (f"s{i:07d}.cls", str(i % 7).encode())):
                    info = tarfile.TarInfo(name)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
        shards[f"{split}/0.tar"] = buffer.getvalue()
    cache_repo(cache, "dataset", "clip-benchmark/wds_fer2013", {**shards, "classnames.txt": b"angry\n"})
    food = task_metadata("Food101")[0][:10]  # a pool's first ten classes: labels 0-9 of the 101
    _parquet(staged / "food" / "data", food, ("train", "validation"))
    cache_repo(cache, "dataset", "ethz/food101", {f"data/{p.name}": p for p in (staged / "food/data").iterdir()})
    _parquet(staged / "kmnist" / "data", task_metadata("KMNIST")[0], ("train", "test"))
    cache_repo(cache, "dataset", "tanganke/kmnist", {f"data/{p.name}": p for p in (staged / "kmnist/data").iterdir()})

    track = {"name": "fb20", "preset": "fusionbench-clip-vit-b32-tall20", "preset_tasks": ["FER2013", "Food101",
                                                                                           "KMNIST"],
             "evaluation": {"batch_size": 16, "max_validation": 8}, "min_test": 20}
    params, report, result = _references_and_a_cell(tmp_path / "repo", track)
    assert "error" not in report and set(report["tasks"]) == {"FER2013", "Food101", "KMNIST"}, report
    # FER2013's 21 test images; Food-101's 20 validation images as its test split; KMNIST's 20 test images
    assert {t: e["n"]["test"] for t, e in report["tasks"].items()} == {"FER2013": 21, "Food101": 20, "KMNIST": 20}
    assert 0 <= result.metrics["avg_acc"] <= 1 and set(result.examples) == {"FER2013", "Food101", "KMNIST"}
    fusionbench, svc = for_tracks(lab_tracks(params))["fb20"]
    tasks = set(params.local_clip[0].finetuned)
    assert fusionbench[0].task_set == "tall20" and tasks <= set(fusionbench[0].tasks)  # every column of the three
    assert svc[0].task_set == "svc14" and set(svc[0].tasks) & tasks == {"Food101"}


def test_the_task_vectors_presets_name_their_pickled_checkpoints_under_the_labs_folders(tmp_path):
    """task_vectors' pools are not on the hub: the preset's paths sit under the folders the track names
    (``preset_roots``), each fine-tuned file is task_vectors' pickled finetuned.pt (refused without the opt-in),
    the pretrained model is OpenAI's weights as open_clip's hub copy; a folder missing or unknown is one line."""
    from mergecal.backbones.clip_checkpoints import open_checkpoint
    from mergecal.errors import ParameterError
    from mergecal.pipeline.config import parse_params

    roots = {"checkpoints": str(tmp_path / "tv"), "data": str(tmp_path / "data")}
    for size, arch, repo in (("b32", "ViT-B-32", "vit_base_patch32_clip_224"),
                             ("b16", "ViT-B-16", "vit_base_patch16_clip_224"),
                             ("l14", "ViT-L-14", "vit_large_patch14_clip_224")):
        name = f"task-vectors-clip-vit-{size}-ta8"
        track = parse_params({"local_clip": [{"name": "p", "preset": name, "preset_roots": roots}]}).local_clip[0]
        assert (track.model.pretrained, track.model.arch) == (
            f"hf://timm/{repo}.openai/open_clip_model.safetensors", f"{arch}-quickgelu")
        assert track.finetuned == {t: f"{tmp_path}/tv/{arch}/{t}/finetuned.pt" for t in
                                   ("SUN397", "Cars", "RESISC45", "EuroSAT", "SVHN", "GTSRB", "MNIST", "DTD")}
        assert set(track.datasets.values()) == {str(tmp_path / "data")} and not track.allow_unsafe_pickle
        assert "preset_roots" not in track.model_dump(mode="json")  # the filled-in paths are in the cell ids
    b32 = parse_params({"local_clip": [{"name": "p", "preset": "task-vectors-clip-vit-b32-ta8",
                                        "preset_roots": roots}]}).local_clip[0]
    dtd = Path(b32.finetuned["DTD"])
    dtd.parent.mkdir(parents=True)
    torch.save({"model.visual.proj": torch.zeros(2, 2)}, dtd)
    with pytest.raises(CheckpointError, match=r"finetuned.pt: a pickled checkpoint; unpickling can run arbitrary"):
        open_checkpoint(dtd)  # without allow_unsafe_pickle, refused before a byte is read
    for roots_given, message in (
            ({"data": "/d"}, r"local_clip.0.preset_roots.checkpoints: required by preset "
                             r"'task-vectors-clip-vit-b32-ta8': the folder of task_vectors' released checkpoints"),
            ({**roots, "cache": "/c"}, r"local_clip.0.preset_roots.cache: not a folder of preset "
                                       r"'task-vectors-clip-vit-b32-ta8' \(it names: checkpoints, data\)"),
            ({"checkpoints": "", "data": "/d"}, r"local_clip.0.preset_roots: expected \{name: folder\}")):
        with pytest.raises(ParameterError, match=message) as err:
            parse_params({"local_clip": [{"name": "p", "preset": "task-vectors-clip-vit-b32-ta8",
                                          "preset_roots": roots_given}]})
        assert "\n" not in str(err.value)
    for track, message in (({"preset": "fusionbench-clip-vit-b32-ta8", "preset_roots": roots},
                            r"local_clip.0.preset_roots.checkpoints: not a folder of preset "
                            r"'fusionbench-clip-vit-b32-ta8' \(it names: none\)"),
                           ({"preset_roots": roots}, r"local_clip.0.preset_roots: only with a preset")):
        with pytest.raises(ParameterError, match=message):
            parse_params({"local_clip": [{"name": "p", **track}]})


SEEDS = {"MNIST": 2, "EuroSAT": 3}  # the noise of each fine-tuned encoder of _task_vectors_pool


def _task_vectors_pool(cache: Path, tmp_path: Path) -> tuple[dict, dict]:
    """task_vectors' ViT-B/32 pool at micro size for two tasks: the pretrained open_clip weights in the hub cache under
    open_clip's id for OpenAI's ViT-B/32, the fine-tuned encoders as task_vectors saves them (pickled modules holding
    model.visual.*), the datasets in a data location. Returns the track (the preset, its roots, the opt-in, the
    micro architecture as the track's own ``model.arch``) and the pretrained state."""
    from local_models import CLIP_ARCH, perturbed, write_image_datasets
    from mergecal.backbones.open_clip_vit import create_clip, save_clip

    model = create_clip(CLIP_ARCH, seed=1)
    save_clip(model, tmp_path / "staged" / "open_clip_model.safetensors")
    cache_repo(cache, "model", "timm/vit_base_patch32_clip_224.openai",
               {"open_clip_model.safetensors": tmp_path / "staged" / "open_clip_model.safetensors"})
    state = model.state_dict()
    for task, seed in SEEDS.items():
        encoder = create_clip(CLIP_ARCH, seed=1)
        encoder.load_state_dict({**state, **perturbed(state, seed, "visual.")})
        folder = tmp_path / "tv" / "ViT-B-32" / task
        folder.mkdir(parents=True)
        torch.save(torch.nn.ModuleDict({"model": encoder}), folder / "finetuned.pt")  # keys model.visual.*
    write_image_datasets(tmp_path / "data")
    track = {"name": "tv", "preset": "task-vectors-clip-vit-b32-ta8", "preset_tasks": ["MNIST", "EuroSAT"],
             "preset_roots": {"checkpoints": str(tmp_path / "tv"), "data": str(tmp_path / "data")},
             "allow_unsafe_pickle": True, "model": {"arch": CLIP_ARCH},
             "evaluation": {"batch_size": 16, "max_validation": 8}, "min_test": 20}
    return track, state


def _write_preset_params(root: Path, track: dict, chains: list[str]) -> None:
    root.mkdir(exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump({
        "vision": {"enabled": False}, "text": {"enabled": False}, "llm": {"enabled": False},
        "benchmark": {"merges": {"task_arithmetic": {"scaling": [0.3, 1.0]}}, "chains": chains},
        "probing": {"max_samples": 20, "top": 3},  # micro data: 20 training images a task
        "local_clip": [track]}))


def test_a_task_vectors_preset_runs_end_to_end_from_pickled_checkpoints_at_micro_size(cache, tmp_path):
    """The task_vectors preset (``_task_vectors_pool``): the track's own ``model.arch`` wins over the preset's; the
    references and a task-arithmetic cell run, and the task vectors are the pickled encoders minus the pretrained
    weights."""
    from local_models import CLIP_ARCH, perturbed
    from mergecal.pipeline.cells import enumerate_cells, run_cell
    from stages import local_inputs, local_tracks

    torch.set_num_threads(1)
    track, state = _task_vectors_pool(cache, tmp_path)
    root = tmp_path / "repo"
    _write_preset_params(root, track, ["{merge}"])
    with pytest.warns(UserWarning, match="finetuned.pt: unpickling"):
        for stage in (local_inputs, local_tracks):
            assert stage.run(stage.stage, ["--root", str(root)]) == 0
    params = load_params(root / "params.yaml")
    assert params.local_clip[0].model.arch == CLIP_ARCH
    assert params.local_clip[0].model.pretrained.startswith("hf://timm/vit_base_patch32_clip_224.openai/")
    report = yaml.safe_load(clip_files.references_path(params.local_clip[0], root).read_text())
    assert set(report["tasks"]) == {"MNIST", "EuroSAT"} and "error" not in report, report
    for task, entry in report["tasks"].items():
        assert "error" not in entry and entry["n"]["test"] == 20, entry
        tau = perturbed(state, SEEDS[task], "visual.")
        expected = sum(float((tau[k] - state[k]).double().pow(2).sum()) for k in tau) ** 0.5
        assert entry["norm"] == pytest.approx(expected, rel=1e-4), (task, entry["norm"], expected)
    cell = next(c for c in enumerate_cells(params) if c.track.startswith("local_clip") and c.merge == "task_arithmetic")
    with pytest.warns(UserWarning, match="finetuned.pt: unpickling"):
        result = run_cell(cell, params, root)
    assert 0 <= result.metrics["avg_acc"] <= 1 and set(result.examples) == {"MNIST", "EuroSAT"}


@pytest.mark.slow
@pytest.mark.integration
def test_a_preset_track_runs_through_the_flow_to_the_boards_published_section(cache, tmp_path):
    """The whole path a lab takes: the task_vectors preset's track through its stages, the Prefect flow (tracked in
    MLflow) and the report stage: the leaderboard holds the track's table and a Published section per paper the
    preset names, each of its rows with this run's value and 95 % interval beside the printed number."""
    import contextlib
    import io
    import json

    from prefect.testing.utilities import prefect_test_harness

    import mergecal.pipeline.flow as flow_module
    from stages import local_inputs, local_sensitivity, local_tracks, report

    torch.set_num_threads(1)
    track, _ = _task_vectors_pool(cache, tmp_path)
    root = tmp_path / "repo"
    _write_preset_params(root, track, ["{merge}", "{merge}>svc"])
    out = io.StringIO()  # not capsys: Prefect's console handler would keep its stream after the test
    with pytest.warns(UserWarning, match="finetuned.pt: unpickling"), contextlib.redirect_stdout(out):
        # the probe too: the preset adds MAGIC's `task_arithmetic(scaling=0.3)>dsc` (its protocol, #56)
        for stage in (local_inputs, local_tracks, local_sensitivity):
            assert stage.run(stage.stage, ["--root", str(root)]) == 0
        with prefect_test_harness(server_startup_timeout=120):
            summary = flow_module.run_benchmark(params_path="params.yaml", root=str(root))
        assert report.run(report.stage, ["--root", str(root)]) == 0
    assert summary["failed"] == 0 and summary["cells"] >= 4, [r.get("error") for r in summary["rows"]]
    board = (root / "reports" / "leaderboard.md").read_text()
    assert board.count("## Published: tv · ta8 · standard") == 2, board
    assert "(arXiv:2602.05536), Table 5" in board and "(arXiv:2512.19320), Table" in board  # SVC's, MAGIC's
    sections = json.loads((root / "reports" / "leaderboard.json").read_text())["published"]
    assert [s["backbone"] for s in sections] == ["tv", "tv"]
    svc = next(s for s in sections if "2602.05536" in s["source"])
    # two of the eight tasks: their columns are compared, the paper's eight-task average is not
    assert {c["column"] for c in svc["comparisons"]} == {"MNIST", "EuroSAT"}
    compared = {(c["recipe"], c["column"]): c for c in svc["comparisons"] if c["interval"]}
    # SVC's TA row is the searched merge, its TA w/ SVC the merge at lambda 1 with SVC, no search (#56)
    assert {(r, t) for r in ("task_arithmetic", "task_arithmetic(scaling=1.0)>svc")
            for t in ("MNIST", "EuroSAT")} <= set(compared)
    magic = next(s for s in sections if "2512.19320" in s["source"])
    assert {"task_arithmetic(scaling=0.3)", "task_arithmetic(scaling=0.3)>dsc"} <= {c["recipe"] for c in
                                                                                   magic["comparisons"]}
    for c in compared.values():  # this run's value inside its own interval, in percent as the paper prints
        low, high = c["interval"]
        assert 0 <= low <= c["value"] <= high <= 100 and isinstance(c["inside"], bool), c
    assert svc["counts"]["inside"] + svc["counts"]["outside"] == len(compared)


def test_every_shipped_preset_is_a_valid_track_of_its_task_set_and_a_tracks_own_keys_win(tmp_path):
    from mergecal.data.real_vision_metadata import TASK_SETS
    from mergecal.errors import ParameterError
    from mergecal.pipeline.config import parse_params
    from mergecal.presets import PRESETS, published_of
    from mergecal.published import rows

    fusionbench = tuple(f"fusionbench-clip-vit-{size}-{task_set}" for size in ("b16", "b32", "l14")
                        for task_set in ("ta8", "tall14", "tall20"))
    task_vectors = tuple(f"task-vectors-clip-vit-{size}-ta8" for size in ("b16", "b32", "l14"))
    assert PRESETS == fusionbench + task_vectors + ("wizardmath-llama-2-chat-7b",)  # LLM: tests/test_llm_preset.py
    for name in fusionbench:
        track = parse_params({"local_clip": [{"name": "p", "preset": name}]}).local_clip[0]
        size, task_set = name.split("-")[3:5]  # b32, b16, l14; ta8, tall14, tall20
        base = {"b32": "clip-vit-base-patch32", "b16": "clip-vit-base-patch16", "l14": "clip-vit-large-patch14"}[size]
        assert track.model.pretrained == f"hf://openai/{base}" and track.task_set == task_set
        assert tuple(track.finetuned) == TASK_SETS[task_set]  # FusionBench's order (TALL20's: the eight first)
        assert all(v.startswith(f"hf://tanganke/{base}_") for v in track.finetuned.values())
        assert set(track.datasets) == set(track.finetuned) and all(parse_hub_id(v) for v in track.datasets.values())
        assert track.evaluation.center_crop == "floor"  # FusionBench's (Hugging Face's) crop
        # the same model ids for the eight in every task set of a backbone
        eight = parse_params({"local_clip": [{"name": "p", "preset": name.replace(task_set, "ta8")}]}).local_clip[0]
        assert {t: track.finetuned[t] for t in eight.finetuned} == eight.finetuned
        assert {t: track.datasets[t] for t in eight.datasets} == eight.datasets
        # each names published tables that exist, FusionBench's documentation first (its 20-task references for
        # both TALL sets); the TALL sets the SVC paper's 14 (another set: no average shared)
        entries = published_of(name)
        assert entries[0] == {"source": "fusionbench", "backbone": {"b32": "ViT-B/32", "b16": "ViT-B/16",
                                                                     "l14": "ViT-L/14"}[size],
                              "task_set": "ta8" if task_set == "ta8" else "tall20"}
        for entry in entries:
            found = rows(entry["source"], entry["backbone"], entry["task_set"])
            assert found and (entry["task_set"] == "ta8") == (task_set == "ta8")
            shared = set(found[0].tasks) & set(track.finetuned)
            expected = len(track.finetuned) if entry["source"] == "fusionbench" else \
                {"ta8": 8, "tall14": 11, "tall20": 12}[task_set]
            assert len(shared) == expected, (entry, shared)
    own = parse_params({"local_clip": [{"name": "p", "preset": "fusionbench-clip-vit-b32-ta8", "task_set": "mine",
                                        "finetuned": {"DTD": "/ckpt/dtd"}, "preset_tasks": ["DTD", "MNIST"],
                                        "evaluation": {"max_test": 500}}]})
    track = own.local_clip[0]
    assert (track.evaluation.max_test, track.evaluation.center_crop) == (500, "floor")  # merged key by key
    assert track.model_dump(mode="json")["evaluation"]["center_crop"] == "floor"  # in the cell ids
    plain = parse_params({"local_clip": [{"name": "q", "model": {"pretrained": "/c"}, "finetuned": {"MNIST": "/a",
                                          "DTD": "/b"}, "datasets": {"MNIST": "/d", "DTD": "/d"}}]}).local_clip[0]
    # the default crop is left out of the dump: ids of tracks written before the option are unchanged
    assert plain.model_dump(mode="json")["evaluation"] == {"batch_size": 128, "max_validation": 512, "max_test": None}
    assert track.task_set == "mine" and track.finetuned == {"MNIST": "hf://tanganke/clip-vit-base-patch32_mnist",
                                                            "DTD": "/ckpt/dtd"}
    assert track.datasets == {"MNIST": "hf://ylecun/mnist", "DTD": "hf://tanganke/dtd"}
    lab_preset = tmp_path / "lab.yaml"  # a lab's own preset, by its path
    lab_preset.write_text(yaml.safe_dump({"family": "local_llm", "track": {
        "base": "hf://org/base", "experts": {"maximum": "hf://org/a", "sentiment": "hf://org/b"}}}))
    llm = parse_params({"local_llm": [{"name": "l", "preset": str(lab_preset)}]}).local_llm[0]
    assert llm.base == "hf://org/base" and llm.experts == {"maximum": "hf://org/a", "sentiment": "hf://org/b"}
    for track, message in (
            ({"preset": "fusionbench-clip-vit-b64"}, r"local_clip.0.preset: 'fusionbench-clip-vit-b64': not a preset "
                                                     r"\(shipped: fusionbench-clip-vit-b16-ta8, "),
            ({"preset": str(lab_preset)}, r"local_clip.0.preset: '.*lab.yaml' is a preset for 'local_llm' tracks, "
                                          r"not 'local_clip'"),
            ({"preset": "fusionbench-clip-vit-b32-ta8", "preset_tasks": ["ImageNet"]},
             r"local_clip.0.preset_tasks: 'ImageNet' is not a task of preset 'fusionbench-clip-vit-b32-ta8'"),
            ({"preset_tasks": ["MNIST"]}, r"local_clip.0.preset_tasks: only with a preset")):
        with pytest.raises(ParameterError, match=message) as err:
            parse_params({"local_clip": [{"name": "p", **track}]})
        assert "\n" not in str(err.value)


def test_a_run_missing_hub_ids_names_every_one_at_once_with_one_command(cache, tmp_path):
    """A FusionBench preset's run on a cache that lacks its ids: `local_inputs` fails before reading anything, in
    one line naming all seventeen (the pretrained model, eight experts, eight datasets) and the command that fetches
    them; with some cached, only the others."""
    from mergecal.pipeline.config import parse_params
    from mergecal.pipeline.tracks.lab_files import record_inputs

    params = parse_params({"local_clip": [{"name": "fb", "preset": "fusionbench-clip-vit-b32-ta8"}]})
    with pytest.raises(CheckpointError) as err:
        record_inputs(params, tmp_path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"17 hub ids are not in the local Hugging Face cache ({cache}): ")
    assert "openai/clip-vit-base-patch32 (model), tanganke/clip-vit-base-patch32_sun397 (model)" in message
    assert "ylecun/mnist (dataset)" in message and message.count("(dataset)") == 8
    assert ("fetch them where a network exists (hf download openai/clip-vit-base-patch32 && hf download "
            "tanganke/clip-vit-base-patch32_sun397 && ") in message
    assert "hf download ylecun/mnist --repo-type dataset" in message and message.count("hf download") == 17
    assert not (tmp_path / "models").exists()  # nothing written
    cache_repo(cache, "model", "openai/clip-vit-base-patch32", {"config.json": b"{}"})
    cache_repo(cache, "dataset", "mnist", {"mnist/test.parquet": b"x"})  # FusionBench's name for ylecun/mnist
    with pytest.raises(CheckpointError, match=r"^15 hub ids are not in") as err:
        record_inputs(params, tmp_path)
    assert "openai/clip-vit-base-patch32 (model)" not in str(err.value) and "ylecun/mnist" not in str(err.value)


def test_fusionbenchs_old_dataset_ids_in_a_cache_stand_for_the_hubs_new_ones(cache):
    """A cache filled through FusionBench's configs holds `svhn` and `mnist`; the presets name the hub's current
    ids, ufldl-stanford/svhn and ylecun/mnist: each resolves to the old one's snapshot (datasets only)."""
    svhn = cache_repo(cache, "dataset", "svhn", {"cropped_digits/test.parquet": b"s"})
    mnist = cache_repo(cache, "dataset", "mnist", {"mnist/test.parquet": b"m"})
    assert snapshot(HubId("ufldl-stanford/svhn"), "dataset") == svhn
    assert snapshot(HubId("ylecun/mnist"), "dataset") == mnist
    own = cache_repo(cache, "dataset", "ylecun/mnist", {"mnist/test.parquet": b"new"})
    assert snapshot(HubId("ylecun/mnist"), "dataset") == own  # the id itself first
    with pytest.raises(CheckpointError, match="not in the local Hugging Face cache"):
        snapshot(HubId("ufldl-stanford/svhn"), "model")


def test_mergecal_presets_lists_every_shipped_preset_and_shows_one(capsys):
    from mergecal.cli import main
    from mergecal.presets import PRESETS

    assert main(["presets"]) == 0
    listing = capsys.readouterr().out
    assert [line for line in listing.splitlines() if line and not line.startswith(" ")][:-1] == list(PRESETS)
    assert ("fusionbench-clip-vit-b32-tall14\n    local_clip, pool fusionbench, tall14 (14 tasks); compared with "
            "fusionbench (ViT-B/32, tall20), svc (ViT-B/32, svc14)") in listing
    assert "wizardmath-llama-2-chat-7b\n    local_llm, pool wizardmath-llama-2-chat, wizardmath-chat (1 task);" \
        in listing
    assert main(["presets", "task-vectors-clip-vit-b32-ta8"]) == 0
    shown = capsys.readouterr().out
    assert shown.splitlines()[1] == ("family local_clip, pool task_vectors, task set ta8: SUN397, Cars, RESISC45, "
                                     "EuroSAT, SVHN, GTSRB, MNIST, DTD")
    assert "preset_roots" not in shown.splitlines()[0] and "\nroots:\n" in shown  # the file itself follows
    assert main(["presets", "no-such-preset"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("mergecal: error: presets: 'no-such-preset': not a preset (shipped: ")
    assert err.count("\n") == 1


def test_every_params_block_of_the_reproduce_a_paper_page_works_as_the_page_says(cache, tmp_path):
    """docs/reproduce-a-paper.md as a newcomer follows it: each of its YAML blocks replaces its section of the
    committed params.yaml (`local_clip: []`, `local_llm: []`) and loads; its track gets the matrix's cells and its
    preset's published tables; on an empty cache `local_inputs` names every hub id it needs in one line."""
    import re

    from mergecal.pipeline.cells import enumerate_cells
    from mergecal.pipeline.config import parse_params
    from mergecal.pipeline.tracks.lab_files import record_inputs
    from mergecal.pipeline.track_registry import lab_tracks
    from mergecal.published import for_tracks

    page = (Path(__file__).resolve().parents[1] / "docs" / "reproduce-a-paper.md").read_text()
    blocks = re.findall(r"^```yaml\n(.*?)^```", page, flags=re.M | re.S)
    committed = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    assert committed["local_clip"] == [] and committed["local_llm"] == [] and len(blocks) == 3
    for block in blocks:
        section = yaml.safe_load(block)
        params = parse_params({**committed, **section})
        (name,) = [t["name"] for tracks in section.values() for t in tracks]
        family = next(iter(section))
        assert [c for c in enumerate_cells(params) if c.track == f"{family}:{name}"], name
        assert for_tracks(lab_tracks(params))[name], name
        if "preset_roots" not in block:  # hub ids: all named at once (the task_vectors pool is a lab's folders)
            with pytest.raises(CheckpointError, match=r"^\d+ hub ids are not in the local Hugging Face cache"):
                record_inputs(params, tmp_path)
