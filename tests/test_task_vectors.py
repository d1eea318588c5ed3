import copy

import pytest
import torch

from mergecal import TaskVectorSet, apply_task_vector, merge_models, task_vector
from mergecal.errors import IncompatibleModelsError, NonFiniteError, ParameterError


def test_task_vector_round_trip(pretrained, finetuned):
    tau = task_vector(finetuned[0], pretrained)
    assert set(tau) == {k for k, v in pretrained.items() if v.is_floating_point()}
    rebuilt = apply_task_vector(pretrained, tau)
    for key, value in finetuned[0].items():
        torch.testing.assert_close(rebuilt[key], value, rtol=0, atol=1e-6)
    assert torch.equal(rebuilt["position_ids"], pretrained["position_ids"])


def test_missing_key_error_names_key_and_models(pretrained, finetuned):
    broken = dict(finetuned[1])
    del broken["visual.blocks.0.mlp.c_fc.weight"]
    with pytest.raises(IncompatibleModelsError,
                       match=r"'visual\.blocks\.0\.mlp\.c_fc\.weight' is in pretrained "
                             r"but missing from finetuned\[1\]"):
        TaskVectorSet.from_models(pretrained, [finetuned[0], broken])
    extra = dict(finetuned[0], surplus=torch.ones(1))
    with pytest.raises(IncompatibleModelsError, match=r"'surplus' is in finetuned\[0\] but missing from pretrained"):
        TaskVectorSet.from_models(pretrained, [extra])


def test_shape_and_dtype_mismatch_errors_name_key_and_models(pretrained, finetuned):
    wrong_shape = dict(finetuned[0], text_projection=torch.zeros(6, 8))
    with pytest.raises(IncompatibleModelsError,
                       match=r"'text_projection': shape \(8, 6\) in pretrained but \(6, 8\) in finetuned\[0\]"):
        TaskVectorSet.from_models(pretrained, [wrong_shape])
    wrong_dtype = dict(finetuned[0], text_projection=finetuned[0]["text_projection"].half())
    with pytest.raises(IncompatibleModelsError,
                       match=r"'text_projection': dtype torch.float32 in pretrained "
                             r"but torch.float16 in finetuned\[0\]"):
        TaskVectorSet.from_models(pretrained, [wrong_dtype])


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_input_is_reported_with_key_and_model(pretrained, finetuned, bad):
    poisoned = copy.deepcopy(finetuned[2])
    poisoned["visual.class_embedding"][3] = bad
    with pytest.raises(NonFiniteError, match=r"'visual\.class_embedding' in finetuned\[1\] contains (NaN|Inf)"):
        merge_models(pretrained, [finetuned[0], poisoned], "task_arithmetic")


def test_cuda_request_without_cuda_is_a_clear_error(pretrained, finetuned):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    with pytest.raises(ParameterError, match="CUDA was requested"):
        merge_models(pretrained, finetuned, "weight_averaging", device="cuda")


def test_low_precision_inputs_are_upcast_and_cast_back(pretrained, finetuned):
    pre16 = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in pretrained.items()}
    ft16 = [{k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in ft.items()} for ft in finetuned]
    merged = merge_models(pre16, ft16, "weight_averaging")
    merged32 = merge_models(pre16, ft16, "weight_averaging", out_dtype=torch.float32)
    assert merged["text_projection"].dtype == torch.bfloat16
    assert merged32["text_projection"].dtype == torch.float32
    # the mean is computed in float32: exact mean of the bf16 values, before the final rounding
    expected = pre16["text_projection"].float() + torch.stack(
        [ft["text_projection"].float() - pre16["text_projection"].float() for ft in ft16]).mean(0)
    torch.testing.assert_close(merged32["text_projection"], expected, rtol=0, atol=1e-6)
    assert merged["position_ids"].dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.float8_e4m3fn])
def test_all_finite_agrees_with_isfinite_for_every_position_and_value(dtype):
    """The one-pass aminmax check finds a NaN or an Inf wherever it sits (vectorised body or tail of the kernel),
    as isfinite does; float8 (no aminmax or isfinite kernel on CPU) is checked in float32 (its NaN stays NaN)."""
    from mergecal.task_vectors import all_finite

    clean = torch.linspace(-3, 3, 37).to(dtype)
    assert all_finite(clean) and all_finite(clean[:0])
    for bad in (float("nan"), float("inf"), float("-inf")):
        for position in range(clean.numel()):
            tensor = clean.clone()
            tensor[position] = bad
            expected = bool(torch.isfinite(tensor.float()).all())  # float8 e4m3fn stores an Inf as 448
            assert all_finite(tensor) == expected and (expected is False or dtype == torch.float8_e4m3fn)
    big = torch.randn(513, 1031).to(dtype)
    big[400, 1030] = float("nan")
    assert not all_finite(big) and all_finite(big[:400])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
def test_add_pretrained_is_load_pretrained_plus_the_update_bit_for_bit(dtype):
    """The merged model's theta_0 + tau without a float32 copy of theta_0 gives the same bits and dtype as the
    float32 copy plus tau, for narrower, equal and wider stored dtypes."""
    g = torch.Generator().manual_seed(1)
    pre = {"w": (torch.randn(301, 67, generator=g) * 3).to(dtype)}
    tvs = TaskVectorSet.from_models(pre, [{"w": (pre["w"].double() + 0.01).to(dtype)}])
    update = torch.randn(301, 67, generator=g) * 1e-2
    expected = tvs.load_pretrained("w") + update
    got = tvs.add_pretrained("w", update)
    assert got.dtype == expected.dtype == torch.float32 and torch.equal(got, expected)
