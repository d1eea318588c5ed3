"""The procedural vision suite: deterministic bytes, shared inputs across tasks, splits, the files on disk."""

import json
import subprocess
import sys

import numpy as np
import pytest

from mergecal.data.vision import (PROBE_TASK, TASKS, SuiteConfig, array_digest, build_vision_suite, generate,
                                  handwritten_splits, load_split, validation_indices)
from mergecal.errors import CheckpointError, ParameterError


def test_same_seed_same_bytes_in_another_process_and_other_seed_differs():
    here = array_digest(generate("scenes", "train", 24, seed=3))
    code = ("from mergecal.data.vision import generate, array_digest; "
            "print(array_digest(generate('scenes', 'train', 24, seed=3)))")
    there = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert here == there
    assert here != array_digest(generate("scenes", "train", 24, seed=4))
    assert here != array_digest(generate("scenes", "test", 24, seed=3))


def test_each_sample_depends_only_on_its_index():
    first = generate("glyphs", "train", 10, seed=0)
    longer = generate("glyphs", "train", 20, seed=0)
    assert np.array_equal(first["images"], longer["images"][:10])
    assert np.array_equal(first["digit"], longer["digit"][:10])


def test_scene_tasks_share_images_and_labels_cover_every_class():
    data = generate("scenes", "train", 400, seed=0)
    assert data["images"].shape == (400, 32, 32, 3) and data["images"].dtype == np.uint8
    for name in ("shapes", "colors", "counts", "textures"):
        spec = TASKS[name]
        assert spec.dataset == "scenes"
        labels = data[spec.label]
        assert set(labels.tolist()) == set(range(len(spec.classnames))), name
    # the captions name the attributes that the labels encode
    for caption, shape, color in zip(data["captions"][:20], data["shape"][:20], data["color"][:20]):
        assert TASKS["shapes"].classnames[shape] in caption and TASKS["colors"].classnames[color] in caption


def ink_colour(images):
    """Mean RGB of each image's darkest 4% of pixels (the ink of a glyph)."""
    x = images.reshape(len(images), -1, 3).astype(np.float64)
    luminance = x.mean(-1)
    cut = np.quantile(luminance, 0.04, axis=1, keepdims=True)
    mask = (luminance <= cut)[..., None]
    return (x * mask).sum(1) / mask.sum(1)


def nearest_mean_accuracy(features, labels, n_classes, n_fit):
    means = np.stack([features[:n_fit][labels[:n_fit] == c].mean(0) for c in range(n_classes)])
    pred = np.argmin(((features[n_fit:, None, :] - means[None]) ** 2).sum(-1), axis=1)
    return (pred == labels[n_fit:]).mean()


def test_images_carry_their_labels():
    """Simple fixed features separate the classes far above chance: the labels are really in the images
    (a renderer that ignored an attribute would sit at chance)."""
    scenes = generate("scenes", "train", 600, seed=1)
    pixels = scenes["images"].reshape(600, -1).astype(np.float64)
    assert nearest_mean_accuracy(pixels, scenes["color"], 8, 400) > 2.5 / 8
    glyphs = generate("glyphs", "train", 600, seed=1)
    assert nearest_mean_accuracy(ink_colour(glyphs["images"]), glyphs["ink"], 6, 400) > 0.8


def test_handwritten_digits_are_the_real_sklearn_digits():
    splits = handwritten_splits(seed=0)
    assert len(splits["train"]["digit"]) == 1200 and len(splits["test"]["digit"]) == 597
    from sklearn.datasets import load_digits

    assert sorted(np.concatenate([splits["train"]["digit"], splits["test"]["digit"]]).tolist()) == \
        sorted(load_digits().target.tolist())


def test_validation_split_is_ten_percent_fixed_and_capped():
    val = validation_indices(2000, seed=0)
    assert len(val) == 200 and np.array_equal(val, validation_indices(2000, seed=0))
    assert len(np.unique(val)) == 200 and val.max() < 2000
    assert len(validation_indices(80_000)) == 5000


def test_suite_on_disk(tmp_path):
    config = SuiteConfig(n_train=30, n_test=20, n_probe=10, n_agnostic=8, n_pretrain=12, image_size=16)
    manifest = build_vision_suite(tmp_path, config, progress=False)
    assert len(manifest["tasks"]) >= 8 and manifest["probe"]["name"] == PROBE_TASK.name
    assert PROBE_TASK.name not in manifest["tasks"]
    written = json.loads((tmp_path / "manifest.json").read_text())
    assert written["digests"] == manifest["digests"]
    scenes = load_split(tmp_path, "scenes", "train")
    assert scenes["images"].shape == (30, 16, 16, 3)
    assert array_digest({k: v for k, v in scenes.items() if k != "captions"}
                        | {"captions": scenes["captions"].tolist()}) \
        == manifest["digests"]["scenes/train"]
    pretrain = load_split(tmp_path, "pretrain", "train")
    assert len(pretrain["captions"]) == 12 and all(len(c) > 10 for c in pretrain["captions"])
    with pytest.raises(CheckpointError, match="split not found"):
        load_split(tmp_path, "scenes", "validation")


def test_bad_requests_are_named():
    with pytest.raises(ParameterError, match="unknown dataset 'scene'"):
        generate("scene", "train", 3)
    with pytest.raises(ParameterError, match="real images"):
        generate("handwritten", "train", 3)


def test_default_sizes_meet_the_issue_and_smoke_is_tiny():
    from mergecal.data.vision import SMOKE_SUITE

    default = SuiteConfig()
    assert default.n_train >= 1000 and default.n_test >= 500  # the issue's minimum per task
    assert len(handwritten_splits()["train"]["digit"]) >= 1000 and len(handwritten_splits()["test"]["digit"]) >= 500
    assert SMOKE_SUITE.n_train <= 100 and SMOKE_SUITE.n_pretrain <= 100


def test_typefaces_render_differently():
    """Every typeface class is its own font file (no two classes share glyph shapes, as DejaVu Sans and
    DejaVu Sans Mono nearly did)."""
    from mergecal.data.vision import TYPEFACES

    assert len(set(TYPEFACES.values())) == len(TYPEFACES) == len(TASKS["typefaces"].classnames)
    assert not any("Mono" in f for f in TYPEFACES.values())


# ------------------------------------------------------------------ disjoint8: one image distribution per task

@pytest.mark.parametrize("task_set, datasets", [
    ("disjoint8", ["objects", "glyphs", "symbols", "arrows", "dots", "swatches", "patterns"]),
    ("headroom8", ["objects", "glyphs", "numerals", "symbols", "arrows", "greek", "dots", "patterns"]),
])
def test_single_dataset_task_sets_are_seeded_and_label_within_their_classes(task_set, datasets):
    from mergecal.data.vision import TASK_SETS, TASKS, generate, task_set_datasets

    assert task_set_datasets(task_set) == datasets
    for task in TASK_SETS[task_set]:
        spec = TASKS[task]
        if spec.dataset == "handwritten":
            continue
        first = generate(spec.dataset, "train", 12, seed=0)
        again = generate(spec.dataset, "train", 12, seed=0)
        other = generate(spec.dataset, "train", 12, seed=1)
        assert first["images"].shape == (12, 32, 32, 3) and first["images"].dtype == np.uint8
        assert np.array_equal(first["images"], again["images"]) and not np.array_equal(first["images"], other["images"])
        labels = np.asarray(first[spec.label])
        assert labels.min() >= 0 and labels.max() < len(spec.classnames), task


def test_dots_images_show_as_many_dots_as_their_label_says():
    """An independent count: dark connected components on the plain background (3 of 200 dots touch after the
    downsampling, so the check allows a few)."""
    from scipy import ndimage

    from mergecal.data.vision import generate

    data = generate("dots", "train", 200, seed=0)
    counted = [ndimage.label(img.mean(-1) < np.median(img.mean(-1)) - 40)[1] for img in data["images"]]
    assert np.mean(np.asarray(counted) == np.asarray(data["count"]) + 1) > 0.95


def test_disjoint8_suite_and_its_pretraining_captions(tmp_path):
    from mergecal.data.vision import TASK_SETS, SuiteConfig, build_vision_suite, generate, load_split

    config = SuiteConfig(n_train=8, n_test=4, n_probe=4, n_agnostic=4, n_pretrain=16, task_set="disjoint8")
    manifest = build_vision_suite(tmp_path, config, progress=False)
    assert list(manifest["tasks"]) == TASK_SETS["disjoint8"]
    for dataset in ("objects", "glyphs", "symbols", "arrows", "dots", "swatches", "patterns", "handwritten"):
        assert load_split(tmp_path, dataset, "train")["images"].shape[1:] == (32, 32, 3)
    assert not (tmp_path / "scenes").exists()  # vision8's datasets are not generated
    captions = [str(c) for c in load_split(tmp_path, "pretrain", "train")["captions"]]
    assert any("letter" in c for c in captions)  # the probe set is seen in pretraining
    named = [str(c) for c in generate("pretrain", "train", 40, task_set="disjoint8", caption_rate=1.0)["captions"]]
    unnamed = [str(c) for c in generate("pretrain", "train", 40, task_set="disjoint8", caption_rate=0.0)["captions"]]
    assert len(set(unnamed)) <= 8 < len(set(named))  # one generic caption per source


def test_headroom8_pretraining_captions_every_task_and_the_probe_but_no_left_out_dataset():
    """headroom8 drops disjoint8's swatches (solved zero-shot) and handwritten (never in pretraining): every one of
    its tasks' datasets, and the probe's letters, is a pretraining source; swatches is not."""
    from mergecal.data.vision import PRETRAIN_SOURCES, TASK_SETS, TASKS, generate

    sources = PRETRAIN_SOURCES["headroom8"]
    assert {TASKS[t].dataset for t in TASK_SETS["headroom8"]} | {"letters"} == set(sources)
    assert "swatches" not in sources and "handwritten" not in sources
    captions = [str(c) for c in generate("pretrain", "train", 90, task_set="headroom8", caption_rate=1.0)["captions"]]
    assert any("greek" in c for c in captions) and not any("blob" in c for c in captions)
