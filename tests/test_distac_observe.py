"""DisTaC's ``observe`` argument (mergecal.calibrations.distac): the student measured along its trajectory without
changing a bit of the result."""

import pytest
import torch
from torch import nn

from mergecal.calibrations.distac import DistacParams, DistacStepParams, condition_models, distill_task_vector

D, C = 6, 4
OBSERVED = ("accuracy", "entropy", "training", "grad")


class Tiny(nn.Module):
    """A linear classifier with dropout (so a student left in train mode, or an extra draw, would change the bits),
    a frozen head and an integer buffer; it records the mode of every forward."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(D, D)
        self.drop = nn.Dropout(0.3)
        self.head = nn.Linear(D, C)
        self.head.requires_grad_(False)
        self.register_buffer("version", torch.tensor([2, 7]))
        self.modes: list[tuple[bool, bool]] = []

    def forward(self, x):
        self.modes.append((self.training, torch.is_grad_enabled()))
        return self.head(self.drop(torch.tanh(self.body(x))))


def build_model(state_dict):
    model = Tiny()
    model.load_state_dict(state_dict)
    return model


@pytest.fixture(scope="module")
def task():
    g = torch.Generator().manual_seed(0)
    pre = Tiny().state_dict()
    pre = {k: (torch.randn(v.shape, generator=g) if v.is_floating_point() else v.clone()) for k, v in pre.items()}
    ft = {k: (v + 0.3 * torch.randn(v.shape, generator=g) if v.is_floating_point() and not k.startswith("head")
              else v.clone()) for k, v in pre.items()}
    inputs = torch.randn(96, D, generator=g)
    test_x = torch.randn(40, D, generator=g)
    test_y = torch.randint(0, C, (40,), generator=g)
    return {"pre": pre, "ft": ft, "unlabeled": inputs, "test_x": test_x, "test_y": test_y}


def observer(task):
    calls = []

    def observe(student):
        logits = student(task["test_x"])
        p = logits.softmax(-1)
        calls.append(student)
        return {"accuracy": float((logits.argmax(-1) == task["test_y"]).double().mean()),
                "entropy": float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean()),
                "training": float(student.training), "grad": float(torch.is_grad_enabled())}

    return observe, calls


def params(**overrides):
    return DistacParams(**{"kappa": 0.6, "lr": 1e-2, "steps": 7, "batch_size": 16, "seed": 3, **overrides})


def test_observing_changes_no_bit_and_records_the_trajectory(task):
    pre, ft = task["pre"], task["ft"]
    plain, plain_history = distill_task_vector(build_model, pre, ft, task["unlabeled"], params(), progress=False,
                                               norm_every=3)
    observe, calls = observer(task)
    seen, history = distill_task_vector(build_model, pre, ft, task["unlabeled"], params(), progress=False,
                                        norm_every=3, observe=observe)
    assert seen.keys() == plain.keys() == ft.keys()
    for key in plain:
        assert torch.equal(seen[key], plain[key]), key
        assert seen[key].dtype == plain[key].dtype
    assert not torch.equal(seen["body.weight"], ft["body.weight"])  # it did train

    # no observer: no step 0, and the observer's keys nowhere
    assert [h["step"] for h in plain_history] == list(range(1, 8))
    assert not any(set(OBSERVED) & set(h) for h in plain_history)

    # step 0 first (the anchor), then the steps as without the observer, the same figures
    assert [h["step"] for h in history] == list(range(0, 8))
    first = history[0]
    assert set(first) == {"step", "tau_norm", *OBSERVED}
    for record, same in zip(history[1:], plain_history):
        for key, value in same.items():
            assert record[key] == value, (record["step"], key)
    with_norm = [h["step"] for h in history if "tau_norm" in h]
    assert with_norm == [0, 3, 6, 7]
    for record in history:
        assert (set(OBSERVED) <= set(record)) == ("tau_norm" in record), record
    assert len(calls) == 4

    # the anchor: theta_pre + kappa tau, so its tau_norm is kappa |tau| (float keys: the head's tau is 0)
    tau_norm = sum(float((ft[k].double() - pre[k].double()).pow(2).sum()) for k in ft if ft[k].is_floating_point())
    assert first["tau_norm"] == pytest.approx(0.6 * tau_norm ** 0.5, rel=1e-5)
    # the last record's tau_norm is the result's
    out_norm = sum(float((seen[k].double() - pre[k].double()).pow(2).sum()) for k in ft if ft[k].is_floating_point())
    assert history[-1]["tau_norm"] == pytest.approx(out_norm ** 0.5, rel=1e-5)

    # observed in eval mode without gradients; trained in train mode with them, before and after each observation
    for record in history:
        if "tau_norm" in record:
            assert record["training"] == 0.0 and record["grad"] == 0.0
            assert 0.0 <= record["accuracy"] <= 1.0 and 0.0 <= record["entropy"] <= torch.log(torch.tensor(C))
    student = calls[0]
    assert all(s is student for s in calls)
    training_forwards = [m for m in student.modes if m[1]]
    observe_forwards = [m for m in student.modes if not m[1]]
    assert len(training_forwards) == 7 and all(m == (True, True) for m in training_forwards)
    assert len(observe_forwards) == 4 and all(m == (False, False) for m in observe_forwards)
    # the order: observe (step 0), 3 steps, observe, 3 steps, observe, 1 step, observe
    grads = [g for _, g in student.modes]
    assert grads == [False, True, True, True, False, True, True, True, False, True, False]
    assert student.training  # back in train mode after the last observation


def test_the_observers_figures_follow_the_student(task):
    """The step-0 figures are the anchor's, measured on the student itself (not the teacher)."""
    pre, ft = task["pre"], task["ft"]
    observe, _ = observer(task)
    _, history = distill_task_vector(build_model, pre, ft, task["unlabeled"], params(steps=2), progress=False,
                                     observe=observe)
    anchor = build_model({k: (pre[k] + 0.6 * (ft[k] - pre[k]) if v.is_floating_point() else v)
                          for k, v in ft.items()}).eval()
    with torch.no_grad():
        logits = anchor(task["test_x"])
    accuracy = float((logits.argmax(-1) == task["test_y"]).double().mean())
    p = logits.softmax(-1)
    entropy = float(-(p * p.clamp_min(1e-12).log()).sum(-1).mean())
    assert history[0]["accuracy"] == pytest.approx(accuracy)
    assert history[0]["entropy"] == pytest.approx(entropy, rel=1e-5)
    assert [h["step"] for h in history if "entropy" in h] == [0, 2]  # norm_every 10 > steps: the last step only


def test_condition_models_passes_each_task_its_observer(task):
    pre, ft = task["pre"], task["ft"]
    g = torch.Generator().manual_seed(9)
    longer = {k: (v + 0.9 * torch.randn(v.shape, generator=g) if v.is_floating_point() and not k.startswith("head")
                  else v.clone()) for k, v in pre.items()}
    fts = [ft, longer]
    data = [task["unlabeled"], task["unlabeled"][:48]]
    step = DistacStepParams(**{"lr": 1e-2, "steps": 4, "batch_size": 16, "seed": 1, "apply_to": "all"})
    plain, plain_report = condition_models(step, pre, fts, lambda t, sd: build_model(sd), data, norm_every=2)

    seen_tasks = []

    def observe(t, student):
        seen_tasks.append(t)
        return {"task": float(t), "training": float(student.training)}

    models, report = condition_models(step, pre, fts, lambda t, sd: build_model(sd), data, norm_every=2,
                                      observe=observe)
    assert report["kappas"] == plain_report["kappas"]
    assert report["kappas"][0] == 1.0 and report["kappas"][1] < 1.0  # norm matching shrinks the longer one
    assert report["conditioned"] == [0, 1]
    for t in range(2):
        for key in plain[t]:
            assert torch.equal(models[t][key], plain[t][key]), (t, key)
        history = report["history"][t]
        assert history[0]["step"] == 0
        observed = [h for h in history if "task" in h]
        assert [h["step"] for h in observed] == [0, 2, 4]
        assert all(h["task"] == float(t) and h["training"] == 0.0 for h in observed)
        assert [h["step"] for h in history if "tau_norm" in h] == [0, 2, 4]
        assert not any("task" in h for h in plain_report["history"][t])
    assert seen_tasks == [0, 0, 0, 1, 1, 1]


def test_largest_norm_observes_only_the_model_it_conditions(task):
    pre, ft = task["pre"], task["ft"]
    g = torch.Generator().manual_seed(9)
    longer = {k: (v + 0.9 * torch.randn(v.shape, generator=g) if v.is_floating_point() and not k.startswith("head")
                  else v.clone()) for k, v in pre.items()}
    step = DistacStepParams(preset="norm_mismatch", lr=1e-2, steps=3, batch_size=16)
    seen_tasks = []
    models, report = condition_models(step, pre, [ft, longer], lambda t, sd: build_model(sd),
                                      [task["unlabeled"]] * 2, observe=lambda t, s: seen_tasks.append(t) or {"n": 1.0})
    assert report["conditioned"] == [1]
    assert set(seen_tasks) == {1} and len(seen_tasks) == 2  # step 0 and the last step
    assert models[0] is ft
    assert list(report["history"]) == [1]
