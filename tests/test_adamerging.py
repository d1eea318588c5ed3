"""mergecal.adamerging (AdaMerging, Yang et al. ICLR 2024) on a tiny MLP with K = 3 synthetic task vectors and
synthetic inputs; the FusionBench oracle is scripts/crosscheck_adamerging.py (run here without the wheel)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from torch import nn

from mergecal.adamerging import AdaMergingConfig, adamerging, entropy, merge_with_coefficients
from mergecal.errors import ParameterError
from mergecal.merge import merge_models

ROOT = Path(__file__).resolve().parents[1]
K, DIM, EMB, CLASSES = 3, 8, 6, 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 16), nn.LayerNorm(16), nn.Tanh(), nn.Linear(16, EMB))


@pytest.fixture(scope="module")
def pool():
    model = make_model()
    pretrained = {k: v.detach().clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(1)
    taus = [{k: 0.5 * torch.randn(v.shape, generator=g) for k, v in pretrained.items()} for _ in range(K)]
    heads = [torch.randn(CLASSES, EMB, generator=g) for _ in range(K)]
    inputs = [torch.randn(24, DIM, generator=g) + k for k in range(K)]  # each task its own input distribution
    return model, pretrained, taus, heads, inputs


def head_logits(heads):
    return lambda output, task: output @ heads[task].T


def run(pool, batches=None, **config):
    model, pretrained, taus, heads, inputs = pool
    return adamerging(model, pretrained, taus, inputs if batches is None else batches,
                      AdaMergingConfig(**{"steps": 5, **config}), logits=head_logits(heads))


def test_the_merge_at_init_is_task_arithmetic_at_lambda_init(pool):
    model, pretrained, taus, heads, inputs = pool
    keys = list(pretrained)
    for shape in [(K,), (K, len(keys))]:
        merged = merge_with_coefficients(pretrained, taus, torch.full(shape, 0.3), keys)
        for key in keys:  # theta_0 + 0.3 tau_1 + 0.3 tau_2 + 0.3 tau_3, tasks added in order (FusionBench's)
            assert torch.equal(merged[key], pretrained[key] + 0.3 * taus[0][key] + 0.3 * taus[1][key]
                               + 0.3 * taus[2][key]), key
    finetuned = [{k: pretrained[k] + tau[k] for k in keys} for tau in taus]
    ta = merge_models(pretrained, finetuned, "task_arithmetic", scaling=0.3)  # theta_0 + 0.3 * sum: other rounding
    assert all(torch.allclose(merged[k], ta[k], atol=1e-6, rtol=0) for k in keys)
    # the first step's loss is the entropy of that merge on each task's first batch
    first = [x[:8] for x in inputs]
    result = run(pool, batches=[[b] for b in first], steps=1)
    ta_model = make_model()
    ta_model.load_state_dict({k: merged[k] for k in keys})
    with torch.no_grad():
        expected = sum(float(entropy(ta_model(b) @ heads[k].T)) for k, b in enumerate(first))
    assert result.history[0]["loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("granularity", ["task", "layer"])
def test_the_loss_decreases_and_the_coefficients_have_their_shape(pool, granularity):
    _, pretrained, *_ = pool
    result = run(pool, granularity=granularity, steps=40, lr=0.02, batch_size=24)  # one batch a task: no noise
    losses = [r["loss"] for r in result.history]
    assert len(losses) == 40 and losses[-1] < losses[0] - 0.05, (losses[0], losses[-1])
    assert result.coefficients.shape == ((K,) if granularity == "task" else (K, len(pretrained)))
    assert result.keys == list(pretrained)  # every parameter: the model has no buffer
    assert [r["step"] for r in result.history if "entropy" in r] == [1, 10, 20, 30, 40]
    assert all(len(r["entropy"]) == K for r in result.history if "entropy" in r)


def test_clamping_keeps_the_coefficients_in_the_unit_interval(pool):
    clamped = run(pool, lr=0.3, steps=15)
    assert clamped.coefficients.min() >= 0 and clamped.coefficients.max() <= 1
    assert bool(((clamped.coefficients == 0) | (clamped.coefficients == 1)).any())  # the clamp was active
    free = run(pool, lr=0.3, steps=15, clamp=False)
    assert free.coefficients.min() < 0 or free.coefficients.max() > 1


def test_the_state_is_the_merge_with_the_final_coefficients_and_other_keys_stay_theta_0(pool):
    model, pretrained, taus, heads, inputs = pool
    keys = ["0.weight", "3.bias"]
    result = adamerging(model, pretrained, taus, inputs, {"steps": 3, "lr": 0.05}, logits=head_logits(heads),
                        keys=keys)
    assert result.coefficients.shape == (K, 2) and result.keys == keys
    merged = merge_with_coefficients(pretrained, taus, result.coefficients, keys, clamp=False)
    assert all(torch.equal(result.state[k], merged[k]) for k in keys)
    assert all(torch.equal(result.state[k], pretrained[k]) for k in pretrained if k not in keys)


def test_same_seed_same_result_and_inputs_untouched(pool):
    model, pretrained, taus, *_ = pool
    before = ({k: v.clone() for k, v in pretrained.items()}, [{k: v.clone() for k, v in t.items()} for t in taus],
              {k: v.clone() for k, v in model.state_dict().items()})
    model.train()
    a, b = run(pool, batch_size=5, seed=3), run(pool, batch_size=5, seed=3)
    assert torch.equal(a.coefficients, b.coefficients) and a.history == b.history
    assert all(torch.equal(a.state[k], b.state[k]) for k in a.state)
    assert not torch.equal(run(pool, batch_size=5, seed=4).coefficients, a.coefficients)  # another shuffle
    assert model.training  # the mode is restored
    model.eval()
    assert all(torch.equal(pretrained[k], before[0][k]) for k in pretrained)
    assert all(torch.equal(t[k], o[k]) for t, o in zip(taus, before[1]) for k in t)
    assert all(torch.equal(v, before[2][k]) for k, v in model.state_dict().items())


@pytest.mark.parametrize("values, field", [
    ({"lr": 0}, "lr"), ({"lr": -1e-3}, "lr"), ({"steps": 0}, "steps"), ({"steps": 2.5}, "steps"),
    ({"batch_size": 0}, "batch_size"), ({"granularity": "block"}, "granularity"), ({"clamp": 1}, "clamp"),
    ({"init": float("nan")}, "init"), ({"seed": -1}, "seed"), ({"log_every": True}, "log_every"),
    ({"momentum": 0.9}, "momentum"),
])
def test_bad_config_values_are_one_line_errors_naming_the_field(pool, values, field):
    with pytest.raises(ParameterError) as err:
        AdaMergingConfig(**values)
    message = str(err.value)
    assert "\n" not in message and repr(field) in message and message.startswith("adamerging: ")
    with pytest.raises(ParameterError):
        run(pool, **values)


def test_bad_inputs_are_one_line_errors(pool):
    model, pretrained, taus, heads, inputs = pool
    cases = [
        (dict(batches=inputs[:2]), "2 task(s) of inputs for 3"),
        (dict(keys=["0.weight", "nope"]), "'nope' is not a parameter"),
        (dict(batches=[inputs[0], inputs[1], iter([])]), "task 2 yielded no batch"),
        (dict(logits=lambda output, task: output.sum()), "expected (batch, classes)"),
    ]
    for overrides, needle in cases:
        kwargs = {"logits": head_logits(heads), **overrides}
        batches = kwargs.pop("batches", inputs)
        with pytest.raises(ParameterError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
            adamerging(model, pretrained, taus, batches, {"steps": 2}, **kwargs)
        assert "\n" not in str(err.value)


def test_the_crosscheck_script_runs_without_the_wheel(capsys):
    """scripts/crosscheck_adamerging.py without --fusion-bench: our side only, one line saying so."""
    path = ROOT / "scripts" / "crosscheck_adamerging.py"
    spec = importlib.util.spec_from_file_location("crosscheck_adamerging", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.main(["--steps", "2", "--model", "mlp"]) == 0
    out = capsys.readouterr().out
    assert sum("FusionBench side skipped" in line for line in out.splitlines()) == 1
