"""Tiny open_clip backbone, CLIP pretraining, Ilharco-style fine-tuning and zero-shot evaluation (fast, CPU)."""

import math
import re

import numpy as np
import open_clip
import pytest
import torch
import torch.nn.functional as F

from mergecal.backbones import (create_clip, get_tokenizer, load_clip, load_pretrained_file, logits, preprocess,
                                save_clip, zero_shot_head)
from mergecal.checkpoint import SafetensorsSource
from mergecal.data.vision import TASKS, generate
from mergecal.errors import CheckpointError, UnknownNameError
from mergecal.evaluation import evaluate, predict_logits
from mergecal.train import FinetuneConfig, PretrainConfig, clip_loss, finetune, pretrain_clip
from mergecal.train.finetune import focal_loss, mixup, random_shift

ARCH = "mergecal-vit-micro"


@pytest.fixture(scope="module")
def scenes():
    return generate("scenes", "train", 80, seed=0)


@pytest.fixture(scope="module")
def model():
    return create_clip(ARCH, seed=0)


@pytest.fixture(scope="module")
def head(model):
    spec = TASKS["colors"]
    return zero_shot_head(model, get_tokenizer(ARCH), spec.classnames, spec.templates)


def _pattern(key: str) -> str:
    return re.sub(r"\.\d+\.", ".#.", key)


@pytest.mark.parametrize("arch", ["mergecal-vit-tiny", "mergecal-vit-tiny-p8", "mergecal-vit-micro"])
def test_custom_arch_has_vit_b32_parameter_names(arch):
    ours = {_pattern(k) for k in create_clip(arch).state_dict()}
    vit_b32 = {_pattern(k) for k in open_clip.create_model("ViT-B-32", pretrained=None).state_dict()}
    assert ours == vit_b32
    assert open_clip.get_model_config(arch)["text_cfg"]["vocab_size"] == 49408


def test_create_is_seeded():
    a, b, c = (create_clip(ARCH, seed=s).state_dict() for s in (1, 1, 2))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["visual.conv1.weight"], c["visual.conv1.weight"])


def test_save_load_round_trip_is_bit_identical(tmp_path, model):
    path = save_clip(model, tmp_path / "clip.safetensors", {"arch": ARCH})
    loaded = load_clip(ARCH, path).state_dict()
    original = model.state_dict()
    assert loaded.keys() == original.keys()
    assert all(torch.equal(loaded[k], original[k]) and loaded[k].dtype == original[k].dtype for k in original)
    assert SafetensorsSource(path).metadata()["arch"] == ARCH


def test_preprocess_normalises_with_openai_stats():
    images = np.full((2, 32, 32, 3), 255, dtype=np.uint8)
    x = preprocess(images)
    assert x.shape == (2, 3, 32, 32) and x.dtype == torch.float32
    expected = (1.0 - torch.tensor(open_clip.OPENAI_DATASET_MEAN)) / torch.tensor(open_clip.OPENAI_DATASET_STD)
    assert torch.allclose(x[0, :, 0, 0], expected)
    assert preprocess(images, 64).shape == (2, 3, 64, 64)


def test_zero_shot_head_shape_norm_and_hand_computation(model, head):
    spec = TASKS["colors"]
    embed_dim = open_clip.get_model_config(ARCH)["embed_dim"]
    assert head.shape == (embed_dim, len(spec.classnames))
    assert torch.allclose(head.norm(dim=0), torch.ones(len(spec.classnames)), atol=1e-5)
    tokenizer = get_tokenizer(ARCH)
    with torch.no_grad():
        e = F.normalize(model.encode_text(tokenizer([t.format(spec.classnames[3]) for t in spec.templates])), dim=-1)
    assert torch.allclose(head[:, 3], F.normalize(e.mean(0), dim=0), atol=1e-5)


def test_logits_and_evaluate(model, head, scenes):
    x = preprocess(scenes["images"][:5])
    with torch.no_grad():
        z = logits(model, head, x)
        f = F.normalize(model.encode_image(x), dim=-1)
    assert torch.allclose(z, model.logit_scale.exp() * f @ head, atol=1e-5)
    assert torch.allclose(predict_logits(model, head, scenes["images"][:5], batch_size=2), z, atol=1e-5)
    result = evaluate(model, head, scenes["images"], scenes["color"], batch_size=32)
    assert set(result) == {"accuracy", "entropy", "ece", "n"} and result["n"] == 80
    assert 0.0 <= result["accuracy"] <= 1.0 and 0.0 <= result["entropy"] <= np.log(8) + 1e-6


def test_evaluating_leaves_the_model_trainable(head, scenes):
    """predict_logits runs in inference mode; the model's own parameters must stay ordinary tensors."""
    model = create_clip(ARCH, seed=0)
    predict_logits(model, head, scenes["images"][:4], batch_size=2)
    assert not any(p.is_inference() for p in model.parameters())
    model.train()
    loss = F.cross_entropy(logits(model, head, preprocess(scenes["images"][:4])), torch.as_tensor(scenes["color"][:4]))
    loss.backward()
    assert model.visual.conv1.weight.grad is not None and torch.isfinite(model.visual.conv1.weight.grad).all()


def test_importing_backbones_or_validating_params_does_not_import_open_clip():
    """Every DVC stage validates params.yaml and the text stages import hf_text: neither may pay for open_clip
    (torchvision, transformers: seconds per stage). A fresh interpreter, so earlier imports do not count."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    code = ("import sys; from mergecal.pipeline.config import load_params; load_params('params.yaml'); "
            "import mergecal.backbones, mergecal.backbones.hf_text, mergecal.train.finetune_text; "
            "print('open_clip' in sys.modules); from mergecal.backbones import create_clip; "
            "print('open_clip' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "True"]


def _finetune(model, head, scenes, regime="standard", seed=0, steps=12):
    config = FinetuneConfig(steps=steps, batch_size=16, lr=3e-3, warmup_steps=2, regime=regime, seed=seed)
    return finetune(model, head, scenes["images"], scenes["color"], config, progress=False)


def test_finetune_changes_only_visual_keys_and_is_deterministic(model, head, scenes):
    sd1, hist = _finetune(model, head, scenes)
    sd2, _ = _finetune(model, head, scenes)
    sd3, _ = _finetune(model, head, scenes, seed=1)
    pre = model.state_dict()
    changed = {k for k in pre if not torch.equal(pre[k], sd1[k])}
    assert changed and all(k.startswith("visual.") for k in changed)
    assert all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert any(not torch.equal(sd1[k], sd3[k]) for k in sd1)
    assert len(hist["loss"]) == 12 and "val_accuracy" not in hist  # no validation data given


def test_finetune_trains_on_every_image_given_and_validates_on_the_given_split(model, head, scenes, monkeypatch):
    """Splits are the caller's (regression: finetune removed 10% of what it received again, as 'validation')."""
    import sys

    ft = sys.modules["mergecal.train.finetune"]  # the module (the package exports a function of the same name)
    seen = []
    real = ft._step_loss
    monkeypatch.setattr(ft, "_step_loss", lambda m, h, x, y, *a: (seen.append(len(y)), real(m, h, x, y, *a))[1])
    n = len(scenes["color"])
    config = FinetuneConfig(steps=1, batch_size=n, lr=1e-3, warmup_steps=0)
    x_val, y_val = scenes["images"][:7], scenes["color"][:7]
    state, hist = finetune(model, head, scenes["images"], scenes["color"], config, validation=(x_val, y_val),
                           progress=False)
    assert seen == [n]
    expected = evaluate(load_clip(ARCH, state), head, x_val, y_val)["accuracy"]
    assert hist["val_accuracy"] == [pytest.approx(expected)]


def _task_vector_norm(pre, ft):
    return float(torch.sqrt(sum(((ft[k].float() - pre[k].float()) ** 2).sum() for k in pre)))


def _finetune_at_lr(model, head, scenes, lr):
    config = FinetuneConfig(steps=12, batch_size=16, lr=lr, warmup_steps=2, seed=0)
    return finetune(model, head, scenes["images"], scenes["color"], config, progress=False)


def test_norm_mismatch_gives_a_larger_task_vector(model, head, scenes):
    """The norm-mismatch condition is a standard fine-tune at 10x the learning rate (the multiple is the
    pipeline's vision.norm_mismatch_lr_multiplier; the trainer has none of its own)."""
    standard, _ = _finetune_at_lr(model, head, scenes, 3e-3)
    mismatch, _ = _finetune_at_lr(model, head, scenes, 3e-2)
    pre = model.state_dict()
    assert _task_vector_norm(pre, mismatch) > 2.0 * _task_vector_norm(pre, standard)


def test_label_smoothing_lowers_confidence(model, head, scenes):
    ent = {}
    for regime in ("standard", "low_confidence"):
        sd, _ = _finetune(model, head, scenes, regime=regime, steps=40)
        ent[regime] = evaluate(load_clip(ARCH, sd), head, scenes["images"], scenes["color"])["entropy"]
    assert ent["low_confidence"] > ent["standard"]


def test_focal_loss_matches_a_hand_computation():
    z = torch.tensor([[2.0, 0.0, -1.0], [0.5, 0.5, 0.0]])
    y = torch.tensor([0, 2])
    p0 = math.exp(2) / (math.exp(2) + 1 + math.exp(-1))
    p1 = 1 / (2 * math.exp(0.5) + 1)
    expected = 0.5 * (-(1 - p0) ** 2 * math.log(p0) - (1 - p1) ** 2 * math.log(p1))
    assert float(focal_loss(z, y, 2.0)) == pytest.approx(expected, rel=1e-6)
    assert float(focal_loss(z, y, 0.0)) == pytest.approx(float(F.cross_entropy(z, y)), rel=1e-6)


def test_mixup_is_seeded_and_convex():
    x = torch.randn(6, 3, 4, 4)
    a = mixup(x, torch.Generator().manual_seed(5))
    b = mixup(x, torch.Generator().manual_seed(5))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2] == b[2] and 0 <= a[2] <= 1
    assert torch.allclose(a[0], a[2] * x + (1 - a[2]) * x[a[1]])
    assert sorted(a[1].tolist()) == list(range(6))


def test_random_shift_is_seeded_and_keeps_shapes():
    x = torch.arange(2 * 3 * 8 * 8, dtype=torch.float32).view(2, 3, 8, 8)
    a = random_shift(x, 2, torch.Generator().manual_seed(1))
    assert a.shape == x.shape and torch.equal(a, random_shift(x, 2, torch.Generator().manual_seed(1)))
    assert torch.equal(random_shift(x, 0, torch.Generator()), x)


@pytest.mark.parametrize("loss", ["label_smoothing", "mixup", "focal"])
def test_each_low_confidence_loss_is_deterministic_and_less_confident(model, head, scenes, loss):
    def run(regime, **extra):
        config = FinetuneConfig(steps=30, batch_size=16, lr=3e-3, warmup_steps=2, regime=regime, seed=0,
                                low_confidence_loss=loss, shift_pixels=1, **extra)
        return finetune(model, head, scenes["images"], scenes["color"], config, progress=False)[0]

    first, again = run("low_confidence"), run("low_confidence")
    assert all(torch.equal(first[k], again[k]) for k in first)  # bitwise, mixup and shifts included
    entropy = {name: evaluate(load_clip(ARCH, sd), head, scenes["images"], scenes["color"])["entropy"]
               for name, sd in (("standard", run("standard")), ("low", first))}
    assert entropy["low"] > entropy["standard"]


def test_unknown_low_confidence_loss_is_a_one_line_error(model, head, scenes):
    config = FinetuneConfig(steps=2, regime="low_confidence", low_confidence_loss="dropout")
    with pytest.raises(UnknownNameError, match="low_confidence_loss='dropout'") as info:
        finetune(model, head, scenes["images"], scenes["color"], config, progress=False)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("regime", ["hot", "norm_mismatch"])
def test_unknown_regime_is_a_one_line_error(model, head, scenes, regime):
    with pytest.raises(UnknownNameError, match=f"regime='{regime}': choose one of standard, low_confidence") as info:
        _finetune(model, head, scenes, regime=regime)
    assert "\n" not in str(info.value)


def test_missing_local_pretrained_file_is_a_one_line_error(tmp_path):
    missing = tmp_path / "ViT-B-32-openai.safetensors"
    with pytest.raises(CheckpointError, match="ViT-B-32-openai.safetensors") as info:
        load_pretrained_file("ViT-B-32", missing)
    assert "\n" not in str(info.value)


def test_load_pretrained_file_reads_safetensors_and_weights_only_pt(tmp_path, model):
    path = save_clip(model, tmp_path / "w.safetensors")
    pt = tmp_path / "w.pt"
    torch.save({"state_dict": {f"module.{k}": v for k, v in model.state_dict().items()}}, pt)
    for source in (path, pt):
        loaded = load_pretrained_file(ARCH, source).state_dict()
        assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")  # a pickled module: refused, not unpickled
    with pytest.raises(CheckpointError, match="not a weights-only state dict") as info:
        load_pretrained_file(ARCH, tmp_path / "module.pt")
    assert "\n" not in str(info.value)


def test_pretraining_lowers_the_contrastive_loss():
    data = generate("pretrain", "train", 32, seed=0)
    config = PretrainConfig(arch=ARCH, steps=25, batch_size=32, lr=2e-3, warmup_steps=3, seed=0)
    tokenizer = get_tokenizer(ARCH)
    x, t = preprocess(data["images"]), tokenizer(data["captions"])

    def loss(m):
        with torch.no_grad():
            return float(clip_loss(m.encode_image(x), m.encode_text(t), m.logit_scale))

    before = loss(create_clip(ARCH, seed=0))
    model, hist = pretrain_clip(data["images"], data["captions"], config, progress=False)
    assert loss(model) < before - 0.3
    assert len(hist["loss"]) == 25 and all(np.isfinite(hist["loss"]))
