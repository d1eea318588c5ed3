"""DisTaC's rescaling alone (mergecal.calibrations.rescale): theta_pre + kappa tau, kappa from norm matching."""

import math

import pytest
import torch

from mergecal.calibrations.registry import get_calibration
from mergecal.calibrations.rescale import RescaleParams, rescaled
from mergecal.errors import MergecalError, ParameterError
from mergecal.merge import require_data_free
from mergecal.recipe import Recipe
from mergecal.run_recipe import run_recipe


def pretrained_model():
    return {
        "w": torch.tensor([[1.0, -2.0], [0.5, 3.0]]),
        "b": torch.tensor([0.25, -0.75]),
        "ids": torch.tensor([4, 5, 6]),  # an integer buffer
    }


def with_task_vector(pre, w, b, ids=None):
    """pre + tau, tau given key by key; ``ids`` replaces the integer buffer."""
    out = {"w": pre["w"] + torch.tensor(w), "b": pre["b"] + torch.tensor(b), "ids": pre["ids"].clone()}
    if ids is not None:
        out["ids"] = torch.tensor(ids)
    return out


@pytest.fixture
def models():
    """Three fine-tuned models whose task vectors have norms 1, 4 and 2 (all exact in float32)."""
    pre = pretrained_model()
    fts = [
        with_task_vector(pre, [[0.6, 0.0], [0.0, 0.0]], [0.8, 0.0]),             # |tau| = 1
        with_task_vector(pre, [[2.0, 2.0], [2.0, 0.0]], [0.0, 2.0], [7, 8, 9]),  # |tau| = 4
        with_task_vector(pre, [[0.0, 0.0], [1.2, 0.0]], [0.0, 1.6]),             # |tau| = 2
    ]
    return pre, fts


def tau(model, pre):
    return {k: model[k].double() - pre[k].double() for k in ("w", "b")}


def norm(model, pre):
    return math.sqrt(sum(float(v.pow(2).sum()) for v in tau(model, pre).values()))


def test_fixture_norms(models):
    pre, fts = models
    assert [norm(m, pre) for m in fts] == pytest.approx([1.0, 4.0, 2.0], rel=1e-6)


# --- rescaled ---------------------------------------------------------------------------------------------------------

def test_kappa_one_returns_the_fine_tuned_tensors_themselves(models):
    pre, fts = models
    out = rescaled(pre, fts[0], 1.0)
    assert out.keys() == fts[0].keys()
    for key in fts[0]:
        assert out[key] is fts[0][key]
    assert out is not fts[0]  # a new dict: the caller's is not shared


def test_rescaled_is_pre_plus_kappa_tau_integer_buffers_untouched(models):
    pre, fts = models
    ft = fts[1]
    before = {k: v.clone() for k, v in ft.items()}
    out = rescaled(pre, ft, 0.25)
    assert torch.equal(out["w"], pre["w"] + 0.25 * (ft["w"] - pre["w"]))
    assert torch.equal(out["b"], pre["b"] + torch.tensor([0.0, 0.5]))
    assert out["ids"] is ft["ids"]  # the fine-tuned buffer, not the pretrained one
    assert torch.equal(out["ids"], torch.tensor([7, 8, 9]))
    assert norm(out, pre) == pytest.approx(1.0, rel=1e-6)
    for key in ft:  # the input is not modified
        assert torch.equal(ft[key], before[key])


def test_rescaled_keeps_the_fine_tuned_dtype_and_computes_in_float32():
    pre = {"w": torch.tensor([1.0, 2.0, 3.0], dtype=torch.float32), "n": torch.tensor([1, 2], dtype=torch.int64)}
    ft = {"w": torch.tensor([1.5, 1.0, 3.25], dtype=torch.float16), "n": torch.tensor([3, 4], dtype=torch.int64)}
    out = rescaled(pre, ft, 0.5)
    assert out["w"].dtype == torch.float16
    expected = (pre["w"] + 0.5 * (ft["w"].float() - pre["w"])).to(torch.float16)
    assert torch.equal(out["w"], expected)
    assert torch.equal(out["w"], torch.tensor([1.25, 1.5, 3.125], dtype=torch.float16))
    assert out["n"] is ft["n"]

    bf_pre = {"w": torch.tensor([1.0, 1.0], dtype=torch.bfloat16)}
    bf_ft = {"w": torch.tensor([3.0, -1.0], dtype=torch.bfloat16)}
    bf = rescaled(bf_pre, bf_ft, 2.0)
    assert bf["w"].dtype == torch.bfloat16
    assert torch.equal(bf["w"], torch.tensor([5.0, -3.0], dtype=torch.bfloat16))


# --- the recipe step --------------------------------------------------------------------------------------------------

def test_norm_matching_shrinks_the_longest_to_the_mean_of_the_others(models):
    pre, fts = models
    out, report = RescaleParams.run_step(RescaleParams(), pre, fts)
    assert report["kappas"] == pytest.approx([1.0, 0.375, 1.0], rel=1e-6)
    assert report["rescaled"] == [1]
    assert len(out) == 3
    for t in (0, 2):  # kappa 1: the fine-tuned tensors themselves
        for key in fts[t]:
            assert out[t][key] is fts[t][key]
    assert norm(out[1], pre) == pytest.approx((1.0 + 2.0) / 2, rel=1e-6)
    assert torch.allclose(out[1]["w"], pre["w"] + 0.375 * (fts[1]["w"] - pre["w"]), rtol=0, atol=1e-6)
    assert torch.equal(out[1]["ids"], fts[1]["ids"])


def test_a_fixed_kappa_scales_every_model(models):
    pre, fts = models
    params = RescaleParams(kappa=0.5)
    out, report = RescaleParams.run_step(params, pre, fts)
    assert report == {"kappas": [0.5, 0.5, 0.5], "rescaled": [0, 1, 2]}
    for t, expected in enumerate([0.5, 2.0, 1.0]):
        assert norm(out[t], pre) == pytest.approx(expected, rel=1e-6)
        assert torch.equal(out[t]["w"], pre["w"] + 0.5 * (fts[t]["w"] - pre["w"]))
        assert torch.equal(out[t]["ids"], fts[t]["ids"])

    _, report = RescaleParams.run_step(RescaleParams(kappa=1.0), pre, fts)
    assert report == {"kappas": [1.0, 1.0, 1.0], "rescaled": []}


@pytest.mark.parametrize("kappa", [0.0, -1.0])
def test_kappa_must_be_positive(kappa):
    with pytest.raises(Exception) as info:
        RescaleParams(kappa=kappa)
    assert isinstance(info.value, (ValueError, MergecalError))


def test_registered_as_a_pre_merge_step_without_data():
    spec = get_calibration("rescale")
    assert spec is not None
    assert spec.phase == "pre"
    assert spec.needs_data is False
    assert spec.Params is RescaleParams
    assert spec.run.__wrapped__ is RescaleParams.run_step  # its cost recorded around it (mergecal.cost)


def test_run_recipe_merges_the_rescaled_models(models):
    pre, fts = models
    result = run_recipe("rescale>task_arithmetic(scaling=1.0)", pre, fts)
    kappas = [1.0, 0.375, 1.0]
    for key in ("w", "b"):
        expected = pre[key] + sum(k * (m[key] - pre[key]) for k, m in zip(kappas, fts))
        assert torch.allclose(result.state_dict[key], expected, rtol=0, atol=1e-6), key
    assert torch.equal(result.state_dict["ids"], pre["ids"])
    assert result.diagnostics["rescale"]["rescaled"] == [1]
    assert result.diagnostics["rescale"]["kappas"] == pytest.approx(kappas, rel=1e-6)

    # without the rescale, the longest task vector enters whole
    plain = run_recipe("task_arithmetic(scaling=1.0)", pre, fts)
    assert not torch.allclose(plain.state_dict["w"], result.state_dict["w"])


def test_run_recipe_with_a_fixed_kappa(models):
    pre, fts = models
    result = run_recipe("rescale(kappa=0.5)>task_arithmetic(scaling=1.0)", pre, fts)
    expected = pre["w"] + 0.5 * sum(m["w"] - pre["w"] for m in fts)
    assert torch.allclose(result.state_dict["w"], expected, rtol=0, atol=1e-6)


def test_checkpoints_on_disk_refuse_rescale():
    with pytest.raises(ParameterError) as info:
        require_data_free(Recipe.parse("rescale>ties"))
    message = str(info.value)
    assert "'rescale'" in message
    assert "conditions the fine-tuned models before the merge" in message
    assert "\n" not in message


def test_distac_then_rescale_parses_as_two_pre_steps():
    recipe = Recipe.parse("distac>rescale>ties")
    assert [(s.name, s.phase) for s in recipe.steps] == [("distac", "pre"), ("rescale", "pre"), ("ties", "merge")]
    assert [s.name for s in recipe.phase("pre")] == ["distac", "rescale"]
