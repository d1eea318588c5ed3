"""DisTaC (mergecal.calibrations.distac) on a tiny classifier: an MLP "backbone" with a frozen linear head on
16-dim Gaussian-mixture inputs; the fine-tuned teachers are trained here with fixed seeds."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from mergecal.confidence import prediction_entropy
from mergecal.calibrations.distac import (
    PRESETS,
    DistacParams,
    DistacStepParams,
    distill_task_vector,
    learning_rate,
    norm_matching_kappas,
    task_vector_norm,
)
from mergecal.errors import MergecalError, ParameterError, UnknownNameError
from mergecal.recipe import Recipe

D, H, C = 16, 32, 8
HEAD_KEYS = ("head.weight", "head.bias")


class Classifier(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Sequential(nn.Linear(D, H), nn.Tanh(), nn.Linear(H, D))
        self.head = nn.Linear(D, C)  # the task's fixed head, as CLIP's zero-shot head
        self.head.requires_grad_(False)
        self.register_buffer("version", torch.tensor([3, 1]))  # an integer buffer

    def forward(self, x):
        return self.head(self.backbone(x))


def build_model(state_dict):
    model = Classifier()
    model.load_state_dict(state_dict)
    return model


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # tiny models: a second thread only adds synchronisation cost, and a lot of it on a busy 2-core machine
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def clone(state_dict):
    return {k: v.clone() for k, v in state_dict.items()}


@pytest.fixture(scope="module")
def task():
    """Pretrained weights, a hard-label teacher, a label-smoothed (low-confidence) teacher and data."""
    means = torch.randn(C, D, generator=torch.Generator().manual_seed(0))

    def sample(n, seed):
        g = torch.Generator().manual_seed(seed)
        labels = torch.randint(0, C, (n,), generator=g)
        return means[labels] + torch.randn(n, D, generator=g), labels

    torch.manual_seed(0)
    # a "pretrained" backbone with large weights, so that shrinking the task vector visibly changes predictions
    pretrained = {k: (3 * v if k.startswith("backbone") else v).clone() for k, v in Classifier().state_dict().items()}

    def finetune(label_smoothing):
        model = build_model(clone(pretrained))
        inputs, labels = sample(1024, 1)
        optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        for _ in range(300):
            optimizer.zero_grad()
            F.cross_entropy(model(inputs), labels, label_smoothing=label_smoothing).backward()
            optimizer.step()
        return clone(model.state_dict())

    test_inputs, test_labels = sample(2000, 2)
    unlabeled, _ = sample(1024, 3)
    return {"pretrained": pretrained, "finetuned": finetune(0.0), "smoothed": finetune(0.5),
            "unlabeled": unlabeled, "test_inputs": test_inputs, "test_labels": test_labels}


@torch.no_grad()
def logits_of(state_dict, inputs):
    return build_model(state_dict).eval()(inputs)


def agreement(a, b, inputs):
    return float((logits_of(a, inputs).argmax(-1) == logits_of(b, inputs).argmax(-1)).double().mean())


def tau_of(model, pretrained):
    return {k: model[k] - pretrained[k] for k in pretrained if pretrained[k].is_floating_point()}


def scaled(pretrained, finetuned, kappa):
    return {k: (pretrained[k] + kappa * (finetuned[k] - pretrained[k]) if v.is_floating_point() else v.clone())
            for k, v in finetuned.items()}


def quick(preset="norm_mismatch", **overrides):
    values = {"lr": 3e-3, "steps": 150, "batch_size": 128, **overrides}
    return DistacParams.preset(preset, **values)


# --- kappa ------------------------------------------------------------------------------------------------------------

def test_norm_matching_kappas_hand_computed():
    ints = torch.tensor([7, 7])  # integer keys are not part of the norm

    def make(w, b):  # float64, so that the decimals below are (nearly) exact
        return {"w": torch.tensor([w], dtype=torch.float64), "b": torch.tensor([b], dtype=torch.float64), "ids": ints}

    tvs = [make([0.6, 0.0], 0.8), make([1.2, 0.0], 1.6), make([2.0, 4.0], 4.0)]  # norms 1, 2, 6
    assert [task_vector_norm(tv) for tv in tvs] == pytest.approx([1.0, 2.0, 6.0], abs=1e-12)
    # the longest is shrunk to the mean norm of the others: (1 + 2) / 2 / 6
    assert norm_matching_kappas(tvs) == pytest.approx([1.0, 1.0, 0.25], abs=1e-12)
    assert norm_matching_kappas([tvs[2], tvs[0], tvs[1]]) == pytest.approx([0.25, 1.0, 1.0], abs=1e-12)
    assert norm_matching_kappas([tvs[2]]) == [1.0]


def test_norm_matching_kappas_errors():
    with pytest.raises(ParameterError, match="task_vectors"):
        norm_matching_kappas([])
    zero = {"w": torch.zeros(3)}
    with pytest.raises(ParameterError, match="task_vectors"):
        norm_matching_kappas([zero, zero])


# --- the paper's two settings -----------------------------------------------------------------------------------------

def test_shrunk_task_vector_recovers_teacher_agreement_and_keeps_its_norm(task):
    pre, ft, x_test = task["pretrained"], task["finetuned"], task["test_inputs"]
    kappa = 0.3
    tau_norm = task_vector_norm(tau_of(ft, pre))
    anchor = scaled(pre, ft, kappa)
    assert task_vector_norm(tau_of(anchor, pre)) == pytest.approx(kappa * tau_norm, rel=1e-5)
    start = agreement(anchor, ft, x_test)
    assert start < 0.9  # shrinking alone really loses the teacher's predictions here

    out, history = distill_task_vector(build_model, pre, ft, task["unlabeled"], quick(kappa=kappa, beta=1.5),
                                       progress=False)
    end = agreement(out, ft, x_test)
    norm = task_vector_norm(tau_of(out, pre))
    assert end >= start + 0.03, (start, end)
    assert 0.85 * kappa * tau_norm <= norm <= 1.15 * kappa * tau_norm, norm / (kappa * tau_norm)
    assert history[-1]["tau_norm"] == pytest.approx(norm, rel=1e-5)
    assert history[-1]["kl"] < history[0]["kl"]

    # the anchor regulariser is what keeps the norm: without it the task vector grows further back
    free, _ = distill_task_vector(build_model, pre, ft, task["unlabeled"], quick(kappa=kappa, beta=0.0), progress=False)
    assert task_vector_norm(tau_of(free, pre)) > norm * 1.05


def test_hotter_student_becomes_more_confident_than_low_confidence_teacher(task):
    pre, teacher, x_test = task["pretrained"], task["smoothed"], task["test_inputs"]
    teacher_entropy = prediction_entropy(logits_of(teacher, x_test))
    assert teacher_entropy > 1.0  # label smoothing 0.5 made a low-confidence teacher (log 8 = 2.08)
    assert PRESETS["low_confidence"] == {"kappa": 1.0, "t_teacher": 1.0, "t_student": 10.0}
    out, _ = distill_task_vector(build_model, pre, teacher, task["unlabeled"], quick("low_confidence", beta=0.1),
                                 progress=False)
    student_entropy = prediction_entropy(logits_of(out, x_test))
    assert student_entropy < 0.8 * teacher_entropy, (teacher_entropy, student_entropy)
    assert agreement(out, teacher, x_test) >= 0.9  # sharper, same predictions

    # a neutral pair keeps the confidence where it was (the effect comes from T_stu > T_tcr)
    neutral, _ = distill_task_vector(build_model, pre, teacher, task["unlabeled"],
                                     quick("low_confidence", beta=0.1, t_student=1.0), progress=False)
    assert prediction_entropy(logits_of(neutral, x_test)) == pytest.approx(teacher_entropy, rel=0.05)


# --- mechanics --------------------------------------------------------------------------------------------------------

def test_first_step_loss_matches_the_formula_and_labels_are_ignored(task):
    pre, ft = task["pretrained"], task["finetuned"]
    batches = [task["unlabeled"][i:i + 64] for i in range(0, 256, 64)]
    params = quick(kappa=0.5, t_teacher=2.0, t_student=5.0, steps=6)  # 6 steps over 4 batches: cycles
    _, history = distill_task_vector(build_model, pre, ft, batches, params, progress=False)
    assert [h["step"] for h in history] == list(range(1, 7))

    # step 1 sees the anchor: KL(softmax(z_t / 2) || softmax(z_s / 5)) * 2 * 5, mean over the batch, reg = 0
    z_t = logits_of(ft, batches[0]).double()
    z_s = logits_of(scaled(pre, ft, 0.5), batches[0]).double()
    p = torch.softmax(z_t / 2.0, dim=-1)
    q = torch.softmax(z_s / 5.0, dim=-1)
    expected = 10.0 * float((p * (p.log() - q.log())).sum(dim=-1).mean())
    assert history[0]["kl"] == pytest.approx(expected, rel=1e-4)
    assert history[0]["reg"] == 0.0
    assert history[0]["loss"] == pytest.approx(history[0]["kl"], rel=1e-6)
    later = history[1]
    assert later["loss"] == pytest.approx(later["kl"] + params.beta * later["reg"], rel=1e-5)
    assert later["reg"] > 0.0

    labelled = [(b, torch.randint(0, C, (len(b),))) for b in batches]
    _, history_labelled = distill_task_vector(build_model, pre, ft, labelled, params, progress=False)
    assert history_labelled == history


def test_history_records_the_task_vector_norm_every_n_steps(task):
    pre, ft = task["pretrained"], task["finetuned"]
    out, history = distill_task_vector(build_model, pre, ft, task["unlabeled"], quick(kappa=0.5, steps=25),
                                       progress=False, norm_every=10)
    assert len(history) == 25
    assert [h["step"] for h in history if "tau_norm" in h] == [10, 20, 25]
    assert all({"step", "loss", "kl", "reg"} <= set(h) for h in history)
    assert history[-1]["tau_norm"] == pytest.approx(task_vector_norm(tau_of(out, pre)), rel=1e-5)


def test_same_seed_is_bit_identical_and_inputs_are_untouched(task):
    pre, ft = task["pretrained"], task["finetuned"]
    pre_copy, ft_copy = clone(pre), clone(ft)
    unlabeled_copy = task["unlabeled"].clone()
    rng_state = torch.get_rng_state()
    params = quick(kappa=0.5, steps=40)

    first, h1 = distill_task_vector(build_model, pre, ft, task["unlabeled"], params, progress=False)
    second, h2 = distill_task_vector(build_model, pre, ft, task["unlabeled"], params, progress=False)
    assert first.keys() == second.keys() == ft.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert h1 == h2
    other, _ = distill_task_vector(build_model, pre, ft, task["unlabeled"], quick(kappa=0.5, steps=40, seed=1),
                                   progress=False)
    assert not torch.equal(other["backbone.0.weight"], first["backbone.0.weight"])  # the seed shuffles the data

    assert all(torch.equal(pre[k], pre_copy[k]) for k in pre)
    assert all(torch.equal(ft[k], ft_copy[k]) for k in ft)
    assert torch.equal(task["unlabeled"], unlabeled_copy)
    assert torch.equal(torch.get_rng_state(), rng_state)  # the global RNG is not consumed


def test_head_frozen_dtypes_kept_integer_buffers_copied(task):
    pre, ft = task["pretrained"], task["finetuned"]
    ft_changed = clone(ft)
    ft_changed["version"] = torch.tensor([4, 2])
    out, _ = distill_task_vector(build_model, pre, ft_changed, task["unlabeled"], quick(kappa=0.5, steps=30),
                                 progress=False)
    assert {k: (v.dtype, v.shape) for k, v in out.items()} == {k: (v.dtype, v.shape) for k, v in ft.items()}
    for key in HEAD_KEYS:  # same in pre and ft, so the anchor keeps it, and the student never trains it
        assert torch.equal(out[key], pre[key])
    assert torch.equal(out["version"], torch.tensor([4, 2]))
    assert not torch.allclose(out["backbone.0.weight"], scaled(pre, ft, 0.5)["backbone.0.weight"])


def test_trainable_predicate_limits_what_moves(task):
    pre, ft = task["pretrained"], task["finetuned"]
    anchor = scaled(pre, ft, 0.5)
    out, _ = distill_task_vector(build_model, pre, ft, task["unlabeled"], quick(kappa=0.5, steps=30),
                                 trainable=lambda name: name.startswith("backbone.0."), progress=False)
    for key in ("backbone.2.weight", "backbone.2.bias", *HEAD_KEYS):
        torch.testing.assert_close(out[key], anchor[key], rtol=0, atol=1e-6)
    assert (out["backbone.0.weight"] - anchor["backbone.0.weight"]).abs().max() > 1e-3


def test_low_precision_state_dicts_come_back_in_their_dtype(task):
    pre = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in task["pretrained"].items()}
    ft = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in task["finetuned"].items()}
    out, history = distill_task_vector(build_model, pre, ft, task["unlabeled"], quick(kappa=0.5, steps=5),
                                       progress=False)
    assert all(out[k].dtype == ft[k].dtype for k in ft)
    assert all(math.isfinite(h["loss"]) for h in history)


# --- learning-rate schedule ------------------------------------------------------------------------------------------

def test_constant_schedule_is_the_default_and_keeps_the_lr():
    params = DistacParams(lr=1e-5, steps=500)
    assert (params.schedule, params.warmup_fraction) == ("constant", 0.0)
    assert [learning_rate(params, s) for s in (0, 1, 250, 499)] == [1e-5] * 4


def test_cosine_schedule_warms_up_then_decays_as_the_formula():
    params = DistacParams(lr=2e-5, steps=500, schedule="cosine")
    assert params.warmup_fraction == 0.1  # the paper's 200 of 2000 fine-tuning steps, scaled to the run
    warmup = 50

    def expected(step):  # 0-based: linear to lr over 50 steps, then half a cosine over the remaining 450
        if step < warmup:
            return 2e-5 * (step + 1) / warmup
        return 2e-5 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (500 - warmup)))

    for step, value in [(0, 2e-5 / 50), (24, 1e-5), (49, 2e-5), (50, 2e-5), (275, 1e-5), (499, None)]:
        assert learning_rate(params, step) == pytest.approx(expected(step), rel=1e-12)
        if value is not None:
            assert learning_rate(params, step) == pytest.approx(value, rel=1e-12)
    assert 0 < learning_rate(params, 499) < 2e-5 * 1e-4  # near zero on the last step, not zero


def test_warmup_fraction_explicit_wins_and_applies_to_the_constant_schedule_too():
    assert DistacParams(schedule="cosine", warmup_fraction=0.0, steps=10).warmup_steps() == 0
    params = DistacParams(lr=1.0, steps=10, warmup_fraction=0.2)  # int(0.2 * 10) = 2 warm-up steps
    assert [learning_rate(params, s) for s in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_the_optimizer_steps_with_the_scheduled_lr_and_the_history_records_it(task, monkeypatch):
    seen = []
    original = torch.optim.Adam.step

    def step(self, *args, **kwargs):
        seen.append(self.param_groups[0]["lr"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    params = quick(kappa=0.5, steps=10, lr=1e-3, schedule="cosine", warmup_fraction=0.3)
    constant, _ = distill_task_vector(build_model, task["pretrained"], task["finetuned"], task["unlabeled"],
                                      quick(kappa=0.5, steps=10, lr=1e-3), progress=False)
    seen.clear()
    cosine, history = distill_task_vector(build_model, task["pretrained"], task["finetuned"], task["unlabeled"],
                                          params, progress=False)
    expected = [1e-3 * (s + 1) / 3 if s < 3 else 1e-3 * 0.5 * (1 + math.cos(math.pi * (s - 3) / 7))
                for s in range(10)]
    assert seen == pytest.approx(expected, rel=1e-12)
    assert [h["lr"] for h in history] == pytest.approx(expected, rel=1e-12)
    assert not torch.equal(constant["backbone.0.weight"], cosine["backbone.0.weight"])


def test_the_recipe_id_shows_the_schedule_and_its_warmup():
    step = DistacStepParams(preset="low_confidence", schedule="cosine", steps=150)
    recipe_id = Recipe([("distac", step.model_dump()), ("task_arithmetic", {})]).id
    assert "schedule='cosine'" in recipe_id and "warmup_fraction=0.1" in recipe_id, recipe_id
    default_id = Recipe([("distac", DistacStepParams(preset="norm_mismatch").model_dump()),
                         ("task_arithmetic", {})]).id
    assert "schedule='constant'" in default_id and "warmup_fraction=0.0" in default_id, default_id
    assert step.distillation_params().warmup_steps() == 15


# --- parameters and errors --------------------------------------------------------------------------------------------

def test_presets_and_defaults():
    assert DistacParams.preset("norm_mismatch") == DistacParams(t_teacher=10.0, t_student=10.0)
    defaults = DistacParams()
    assert (defaults.kappa, defaults.beta, defaults.lr, defaults.steps, defaults.batch_size, defaults.grad_clip) == (
        None, 0.5, 1e-5, 500, 128, 1.0)
    low = DistacParams.preset("low_confidence", steps=100)
    assert (low.kappa, low.t_teacher, low.t_student, low.steps) == (1.0, 1.0, 10.0, 100)
    with pytest.raises(UnknownNameError, match="low_confidence, norm_mismatch"):
        DistacParams.preset("sharpen")
    with pytest.raises(ParameterError, match="'t_student'"):
        DistacParams.preset("low_confidence", t_student=0)


@pytest.mark.parametrize("values, name", [
    ({"steps": 0}, "'steps'"),
    ({"t_teacher": 0.0}, "'t_teacher'"),
    ({"t_student": -1.0}, "'t_student'"),
    ({"kappa": 0.0}, "'kappa'"),
    ({"beta": -0.1}, "'beta'"),
    ({"lr": 0.0}, "'lr'"),
    ({"batch_size": 0}, "'batch_size'"),
    ({"grad_clip": 0.0}, "'grad_clip'"),
    ({"optimizer": "sgd"}, "'optimizer'"),
    ({"schedule": "linear"}, "'schedule': Input should be 'constant' or 'cosine'"),
    ({"warmup_fraction": 1.0}, "'warmup_fraction': Input should be less than 1"),
    ({"temperature": 2.0}, "unknown parameter 'temperature'"),
])
def test_bad_parameters_name_the_parameter(task, values, name):
    with pytest.raises(ParameterError, match=name) as info:
        distill_task_vector(build_model, task["pretrained"], task["finetuned"], task["unlabeled"],
                            {"kappa": 0.5, **values}, progress=False)
    assert "\n" not in str(info.value)


def test_missing_kappa_and_bad_data_raise(task):
    pre, ft, x = task["pretrained"], task["finetuned"], task["unlabeled"]
    with pytest.raises(ParameterError, match="'kappa'"):
        distill_task_vector(build_model, pre, ft, x, DistacParams.preset("norm_mismatch"), progress=False)
    with pytest.raises(ParameterError, match="'unlabeled'"):
        distill_task_vector(build_model, pre, ft, [], quick(kappa=0.5, steps=2), progress=False)
    with pytest.raises(ParameterError, match="'unlabeled'"):
        distill_task_vector(build_model, pre, ft, x[:0], quick(kappa=0.5, steps=2), progress=False)
    one_shot = (x[i:i + 32] for i in range(0, 64, 32))  # two batches, then exhausted
    with pytest.raises(ParameterError, match="one-shot"):
        distill_task_vector(build_model, pre, ft, one_shot, quick(kappa=0.5, steps=3), progress=False)
    with pytest.raises(ParameterError, match="'unlabeled'"):
        distill_task_vector(build_model, pre, ft, [{"pixel_values": x}], quick(kappa=0.5, steps=1), progress=False)


def test_model_and_state_dict_mismatches_raise(task):
    pre, ft, x = task["pretrained"], task["finetuned"], task["unlabeled"]
    params = quick(kappa=0.5, steps=1)
    extra_pre, extra_ft = dict(pre), dict(ft)
    extra_pre["adapter.weight"] = torch.zeros(2)
    extra_ft["adapter.weight"] = torch.ones(2)
    with pytest.raises(ParameterError, match="adapter.weight"):
        distill_task_vector(lambda sd: build_model({k: v for k, v in sd.items() if k != "adapter.weight"}),
                            extra_pre, extra_ft, x, params, progress=False)
    with pytest.raises(ParameterError, match="'trainable'"):
        distill_task_vector(build_model, pre, ft, x, params, trainable=lambda name: False, progress=False)
    without_head = {k: v for k, v in ft.items() if k not in HEAD_KEYS}

    def build_with_fixed_head(sd):
        return build_model({**sd, **{k: pre[k] for k in HEAD_KEYS}})

    with pytest.raises(ParameterError, match="head.weight"):  # trained but would not be returned
        distill_task_vector(build_with_fixed_head, {k: pre[k] for k in without_head}, without_head, x, params,
                            trainable=lambda name: True, progress=False)
    bad = dict(ft)
    bad["backbone.0.bias"] = torch.full_like(ft["backbone.0.bias"], float("nan"))
    with pytest.raises(MergecalError, match="backbone.0.bias"):
        distill_task_vector(build_model, pre, bad, x, params, progress=False)
    with pytest.raises(MergecalError, match="backbone.0.weight"):
        distill_task_vector(build_model, pre, {**ft, "backbone.0.weight": ft["backbone.0.weight"][:1]}, x, params,
                            progress=False)
