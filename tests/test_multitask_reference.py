"""The multi-task reference ("traditional MTL"): its round-robin schedule and budget, the joint fine-tune, the vision
stage that writes it and the reference row that scores it (the clip track's alone)."""

import json

import numpy as np
import pytest
import torch
import yaml

from mergecal.backbones import create_clip, get_tokenizer, zero_shot_head
from mergecal.data.vision import TASKS, generate
from mergecal.errors import ParameterError, UnknownNameError
from mergecal.train import FinetuneConfig, cosine_lr
from mergecal.train.multitask import MULTITASK_BUDGETS, finetune_multitask, multitask_steps, round_robin

ARCH = "mergecal-vit-micro"


def test_round_robin_takes_each_task_in_turn():
    assert round_robin(3, 7) == [0, 1, 2, 0, 1, 2, 0]
    assert round_robin(1, 3) == [0, 0, 0]
    with pytest.raises(ParameterError, match="num_tasks and steps"):
        round_robin(0, 3)


def test_budget_sum_gives_each_task_its_own_fine_tunes_steps():
    assert MULTITASK_BUDGETS == ("sum", "per_task_mean")
    assert multitask_steps([250] * 8) == 2000
    steps = multitask_steps([250] * 8, "sum")
    assert [round_robin(8, steps).count(k) for k in range(8)] == [250] * 8
    assert multitask_steps([250] * 8, "per_task_mean") == 250
    assert multitask_steps([10, 20, 31], "per_task_mean") == 20  # the mean, rounded
    with pytest.raises(UnknownNameError, match="budget='union'"):
        multitask_steps([10], "union")
    with pytest.raises(ParameterError, match="task_steps"):
        multitask_steps([10, 0])


@pytest.fixture(scope="module")
def model():
    return create_clip(ARCH, seed=0)


@pytest.fixture(scope="module")
def tasks(model):
    """Two tasks on fabricated scenes: colour (3 classes) and the same images' colours relabelled at random."""
    scenes = generate("scenes", "train", 48, seed=0)
    spec = TASKS["colors"]
    head = zero_shot_head(model, get_tokenizer(ARCH), spec.classnames, spec.templates)
    shuffled = np.random.default_rng(0).permutation(scenes["color"])
    return [head, head.flip(1)], [(scenes["images"], scenes["color"]), (scenes["images"][:20], shuffled[:20])]


def _joint(model, tasks, seed=0, budget="sum", validation=None):
    heads, datasets = tasks
    config = FinetuneConfig(steps=3, batch_size=8, lr=3e-3, warmup_steps=1, seed=seed)
    return finetune_multitask(model, heads, datasets, config, budget=budget, validation=validation, progress=False)


def test_joint_fine_tune_changes_the_image_encoder_only_and_is_deterministic(model, tasks):
    state, history = _joint(model, tasks)
    again, _ = _joint(model, tasks)
    other, _ = _joint(model, tasks, seed=1)
    pre = model.state_dict()
    changed = {k for k in pre if not torch.equal(pre[k], state[k])}
    assert changed and all(k.startswith("visual.") for k in changed)
    assert all(torch.equal(state[k], again[k]) for k in state)
    assert any(not torch.equal(state[k], other[k]) for k in state)
    assert history["task"] == [0, 1, 0, 1, 0, 1]  # the sum budget: 3 steps per task, in turn
    assert len(history["loss"]) == 6
    assert history["lr"] == [cosine_lr(step, 6, 1, 3e-3) for step in range(6)]  # decays over the joint run's steps


def test_per_task_mean_budget_and_validation_per_task(model, tasks):
    _, history = _joint(model, tasks, budget="per_task_mean", validation=tasks[1])
    assert history["task"] == [0, 1, 0]
    assert len(history["val_accuracy"]) == 2 and all(0.0 <= a <= 1.0 for a in history["val_accuracy"])


def test_bad_inputs_are_refused_in_one_line(model, tasks):
    heads, datasets = tasks
    with pytest.raises(ParameterError, match="one head per task"):
        finetune_multitask(model, heads[:1], datasets, progress=False)
    images, labels = datasets[0]
    with pytest.raises(ParameterError, match=r"datasets\[1\]"):
        finetune_multitask(model, heads, [datasets[0], (images, labels[:3])], progress=False)


# ------------------------------------------------------------------------------- the stage and the reference row

@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The smoke parameters' vision data and pretrained CLIP (seconds), in a directory of its own."""
    from mergecal.pipeline.config import parse_params
    from mergecal.pipeline.tracks.clip.built import stages as vision
    from mergecal.pipeline.workspace import SMOKE_PARAMS

    torch.set_num_threads(1)
    params = parse_params(yaml.safe_load(SMOKE_PARAMS.read_text()))
    root = tmp_path_factory.mktemp("multitask")
    vision.build_data(params, root, progress=False)
    vision.pretrain(params, root, progress=False)
    return root, params


def test_finetune_stage_writes_the_multitask_model_after_the_fine_tunes(workspace):
    from mergecal.checkpoint import load_state_dict
    from mergecal.pipeline.tracks.clip.built import stages as vision

    root, params = workspace
    lines = []
    summary = vision.finetune_all(params, root, log=lines.append, progress=False)
    paths = vision.paths_for(params, root)
    meta = json.loads(paths.multitask.with_suffix(".json").read_text())
    track = params.vision
    assert meta["tasks"] == list(track.tasks) and meta["budget"] == "sum"
    assert meta["steps"] == len(track.tasks) * track.finetune["steps"]
    assert set(meta["val_accuracy"]) == set(track.tasks)
    assert summary["multitask"] == meta == json.loads((paths.seeded / "finetuned.json").read_text())["multitask"]
    assert len(lines) == len(vision.finetune_runs(track)) + 1
    state = load_state_dict(paths.multitask)
    assert state and all(vision.is_visual(k) for k in state)
    assert vision.multitask(params, root, progress=False) == meta  # the same run again: the same model
    assert load_state_dict(paths.multitask).keys() == state.keys()
    assert all(torch.equal(load_state_dict(paths.multitask)[k], v) for k, v in state.items())


def test_multitask_row_scores_the_joint_model_per_example(workspace):
    from mergecal.backbones import load_clip
    from mergecal.checkpoint import load_state_dict
    from mergecal.pipeline.tracks.clip.built import cells as vision_cells
    from mergecal.pipeline.tracks.clip.built import stages as vision

    root, params = workspace
    paths = vision.paths_for(params, root)
    if not paths.multitask.is_file():
        vision.multitask(params, root, progress=False)
    tasks = list(params.vision.tasks)
    fabricated = {t: {"test_accuracy": 0.5, "val_accuracy": 0.5, "entropy": 0.1, "ece": 0.0, "norm": 1.0}
                  for t in tasks}
    diagnostics = paths.task_vectors("standard") / "diagnostics.json"
    diagnostics.parent.mkdir(parents=True, exist_ok=True)
    diagnostics.write_text(json.dumps(fabricated))
    (cell,) = [c for c in vision_cells.cells(params) if c.merge == "multitask" and c.seed == params.seeds[0]]
    assert vision_cells.inputs(cell, params, root)["multitask"] == paths.multitask
    result = vision_cells.reference(cell, params, root)
    model = load_clip(params.vision.arch, {**load_state_dict(paths.pretrained), **load_state_dict(paths.multitask)})
    expected = vision.evaluate_tasks(model, load_state_dict(paths.heads), paths.data, tasks, "test", per_example=True)
    for task in tasks:
        assert result.examples[task] == expected[task]["correct"]
        assert result.metrics[f"acc.{task}"] == pytest.approx(expected[task]["accuracy"])
        assert result.metrics[f"norm_acc.{task}"] == pytest.approx(expected[task]["accuracy"] / 0.5)


# ------------------------------------------------------------------------------------------ which tracks list it

def test_only_the_clip_tracks_standard_regime_lists_the_multitask_row():
    from mergecal.pipeline.cells import COMMON_REFERENCES, REFERENCES
    from mergecal.pipeline.config import load_params
    from mergecal.pipeline.track_registry import get_track

    assert "multitask" in REFERENCES and "multitask" not in COMMON_REFERENCES
    params = load_params("params.yaml")
    vision = get_track("vision").cells(params)
    found = {(c.regime, c.seed) for c in vision if c.merge == "multitask"}
    assert found == {("standard", seed) for seed in params.seeds}
    for name in ("text", "llm"):
        assert [c.merge for c in get_track(name).cells(params) if c.merge in REFERENCES] == \
            ["zeroshot", "finetuned"] * len(params.seeds)


def test_the_clip_files_tracks_list_no_multitask_row():
    from mergecal.pipeline.cells import COMMON_REFERENCES
    from mergecal.pipeline.config import load_params
    from mergecal.pipeline.tracks.clip.session import recipe_cells

    params = load_params("params.yaml")
    out = recipe_cells(params, "clip_files", "ViT-B-32", "eight", ["a", "b"], "standard", {})
    assert [c.merge for c in out if not c.chain] == list(COMMON_REFERENCES)


def test_the_leaderboard_orders_multitask_as_a_reference_after_finetuned():
    from mergecal.reports.leaderboard import recipe_order

    rows = ["task_arithmetic", "multitask", "finetuned", "zeroshot"]
    ordered = sorted(rows, key=lambda m: recipe_order(m, "" if m != "task_arithmetic" else "none", m))
    assert ordered == ["zeroshot", "finetuned", "multitask", "task_arithmetic"]
