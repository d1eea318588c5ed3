"""Hardening, issue item 2: non-finite or ill-typed hyperparameters are rejected where they are parsed, and no merge
writes a checkpoint holding NaN or Inf."""

import pytest
import torch

from mergecal import merge_checkpoints, merge_models, save_state_dict
from mergecal.cli import main
from mergecal.errors import NonFiniteError, ParameterError
from mergecal.recipe import Recipe


def _models():
    g = torch.Generator().manual_seed(0)
    pre = {"w": torch.randn(6, 4, generator=g), "b": torch.randn(6, generator=g)}
    fts = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in pre.items()} for _ in range(2)]
    return pre, fts


@pytest.mark.parametrize("method, values, message", [
    ("task_arithmetic", {"scaling": float("nan")}, r"task_arithmetic: parameter 'scaling'"),
    ("task_arithmetic", {"scaling": float("inf")}, r"parameter 'scaling'"),
    ("task_arithmetic", {"scaling": 1e39}, r"parameter 'scaling': .*float32"),
    ("ties", {"top_k": True}, r"ties: parameter 'top_k': .*not a boolean"),
    ("consensus", {"mask_lambda": [0.4, True]}, r"parameter 'mask_lambda': .*not a boolean"),
])
def test_method_parameters_must_be_finite_numbers(method, values, message):
    pre, fts = _models()
    with pytest.raises(ParameterError, match=message) as info:
        merge_models(pre, fts, method, **values)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("text, message", [
    ("ties(scaling=nan)>svc", r"ties: parameter 'scaling'"),
    ("ties(scaling=.inf)>svc", r"ties: parameter 'scaling'"),
    ("tsv_m>svc(alpha=1e39)", r"svc: parameter 'alpha': .*float32"),
    ("tsv_m>svc(alpha=inf)", r"svc: parameter 'alpha'"),
    ("ties(top_k=0.2,top_k=0.5)", r"parameter 'top_k' is given twice"),
    ("ties(top_k=True)", r"ties: parameter 'top_k': .*not a boolean"),
    ("ties>fsc(task_feature=paper)", r"fsc: parameter 'task_feature': Input should be 'module_replay' or 'network'"),
])
def test_recipes_reject_bad_values_at_parse_time(text, message):
    with pytest.raises(ParameterError, match=message):
        Recipe.parse(text)


def test_flags_still_take_booleans():
    recipe = Recipe.parse("tsv_m(float64=True)>svc(float64=True)")
    assert recipe.steps[0].params.float64 is True


def test_a_merge_that_overflows_its_output_dtype_writes_nothing(tmp_path):
    pre, fts = _models()
    paths = [save_state_dict(sd, tmp_path / f"m{i}.safetensors") for i, sd in enumerate([pre, *fts])]
    with pytest.raises(NonFiniteError, match=r"key '(w|b)' in the merged model \(torch.float16\) contains Inf"):
        merge_checkpoints(paths[0], paths[1:], "task_arithmetic", tmp_path / "out", out_dtype=torch.float16,
                          scaling=1e6)
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m0.safetensors", "m1.safetensors", "m2.safetensors"]


def test_cli_refuses_nan_scaling_with_one_line(tmp_path, capsys):
    pre, fts = _models()
    paths = [str(save_state_dict(sd, tmp_path / f"m{i}.safetensors")) for i, sd in enumerate([pre, *fts])]
    code = main(["merge", "--pretrained", paths[0], "--finetuned", *paths[1:], "--method", "ties",
                 "--set", "scaling=.nan", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("mergecal: error: ties: parameter 'scaling'") and "\n" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("value, message", [
    ("[]", r"seeds: expected at least one fine-tuning seed, e.g. \[0\]$"),
    ("[0, 1, 0]", r"seeds: seeds must be distinct; 0 is listed twice$"),
    ("[-1]", r"seeds\.0: Input should be greater than or equal to 0$"),
    ("[1.5]", r"seeds\.0: Input should be a valid integer"),
    ("[true]", r"seeds\.0: Input should be a valid integer"),
    ("3", r"seeds: Input should be a valid list"),
])
def test_params_seeds_must_be_distinct_non_negative_integers(tmp_path, value, message):
    from pathlib import Path

    from mergecal.pipeline.config import load_params

    text = (Path(__file__).resolve().parents[1] / "params.yaml").read_text()
    assert "\nseeds: [0]\n" in text
    path = tmp_path / "params.yaml"
    path.write_text(text.replace("\nseeds: [0]\n", f"\nseeds: {value}\n"))
    with pytest.raises(ParameterError, match=message) as info:
        load_params(path)
    assert str(info.value).startswith(f"{path}: seeds") and "\n" not in str(info.value)
