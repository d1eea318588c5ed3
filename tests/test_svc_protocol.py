"""SVC's protocol (issue #29): SVC reads the merge at scaling 1 and the merge's scaling follows it, in the library,
the command line and the pipeline alike; the old order is a named option with an id of its own."""

from __future__ import annotations

import pytest
import torch

from mergecal.checkpoint import load_state_dict, save_checkpoint
from mergecal.cli import main
from mergecal.errors import ParameterError
from mergecal.pipeline import cells as cells_mod
from mergecal.pipeline.chains import calibration_name, scaling_source
from mergecal.pipeline.config import parse_params
from mergecal.recipe import Recipe
from mergecal.run_recipe import RecipeInputs, recipe_trials, run_recipe

SVC_KEYS = ("visual.blocks.0.attn.in_proj_weight", "visual.blocks.0.mlp.c_fc.weight",
            "visual.blocks.0.mlp.c_proj.weight")  # the 2-D keys of conftest's model that the authors' key rule takes


def independent_svc(merged: torch.Tensor, taus: list[torch.Tensor]) -> torch.Tensor:
    """SVC of the SVC paper's Algorithm 1 in float64 with a plain SVD: alpha = 1/K."""
    K = len(taus)
    U, S, Vh = torch.linalg.svd(merged.double(), full_matrices=False)
    a_m = U.T @ merged.double()
    gamma = torch.zeros_like(S)
    for r in range(len(S)):
        s = [float(a_m[r] @ (U[:, r] @ t.double())) / float((U[:, r] @ t.double()).pow(2).sum()) for t in taus]
        gamma[r] = K / sum(max(1.0 / K, x) for x in s)
    return (U * (gamma * S)) @ Vh


def test_svc_calibrates_the_merge_at_scaling_1_and_the_scaling_follows(pretrained, finetuned):
    taus = {k: [ft[k] - pretrained[k] for ft in finetuned] for k in SVC_KEYS}
    got = run_recipe("task_arithmetic(scaling=0.3)>svc", pretrained, finetuned, RecipeInputs(progress=False)).state_dict
    old = run_recipe("task_arithmetic(scaling=0.3)>svc(calibrate_at=chosen_scaling)", pretrained, finetuned,
                     RecipeInputs(progress=False)).state_dict
    for key in SVC_KEYS:
        unit = sum(taus[key])
        expected = pretrained[key].double() + 0.3 * independent_svc(unit, taus[key])
        assert torch.allclose(got[key].double(), expected, atol=2e-6), key
        # the order matters: SVC of 0.3 x the merge is another model (every s shrinks by 0.3, the 1/K floor binds)
        assert (old[key] - got[key]).abs().max() > 1e-3, key
        floored = pretrained[key].double() + independent_svc(0.3 * unit, taus[key])
        assert torch.allclose(old[key].double(), floored, atol=2e-6), key


def test_the_api_the_command_line_and_a_pipeline_trial_give_the_same_model(pretrained, finetuned, tmp_path):
    save_checkpoint(pretrained, tmp_path / "pre")
    for i, ft in enumerate(finetuned):
        save_checkpoint(ft, tmp_path / f"ft{i}")
    recipe = "task_arithmetic(scaling=0.3)>svc"
    assert main(["merge", "--pretrained", str(tmp_path / "pre"), "--finetuned",
                 *[str(tmp_path / f"ft{i}") for i in range(len(finetuned))], "--recipe", recipe,
                 "--out", str(tmp_path / "out")]) == 0
    cli = load_state_dict(tmp_path / "out")
    api = run_recipe(recipe, pretrained, finetuned, RecipeInputs(progress=False)).state_dict
    trial = recipe_trials(Recipe.parse(recipe), pretrained, finetuned, RecipeInputs(progress=False), (0.1, 0.3, 1.0))
    pipeline = trial(0.3)  # merged and calibrated once at scaling 1, then rescaled
    assert pipeline.diagnostics["svc"]  # the spectra of the unit merge reach the cell's artifacts
    for key in api:
        assert torch.equal(api[key], pipeline.state_dict[key]), key
        assert torch.equal(api[key], cli[key]), key


@pytest.mark.parametrize("recipe", ["task_arithmetic>svc", "ties", "tsv_m>svc", "task_arithmetic>wsc"])
def test_weight_space_trials_equal_the_recipe_run_at_each_scaling(pretrained, finetuned, recipe):
    """The session of a CLIP cell merges through ``weight_space_trials``: a rescalable recipe once at scaling 1,
    then rescaled; WSC (which calibrates the scaled merge) streamed per value; both equal to ``run_recipe`` at
    that value, bit for bit, and the SVC spectra reach the diagnostics."""
    from mergecal.merge import weight_space_trials
    from mergecal.task_vectors import TaskVectorSet

    parsed = Recipe.parse(recipe)
    tvs = TaskVectorSet.from_models(pretrained, finetuned)
    sensitive = [SVC_KEYS[0]]  # WSC's magnitude-sensitive keys
    trials = weight_space_trials(parsed, tvs, (0.1, 0.3, 1.0), sensitive=sensitive)
    for value in (0.3, 1.0, 0.1):
        updates, diagnostics = trials(value)
        got = {k: tvs.load_pretrained(k) + u for k, u in updates}
        expected = run_recipe(parsed.with_scaling(value), pretrained, finetuned,
                              RecipeInputs(progress=False, sensitive=sensitive))
        assert got.keys() and set(got) <= set(expected.state_dict)
        for key, tensor in got.items():
            assert torch.equal(tensor, expected.state_dict[key]), (recipe, value, key)
        assert ("svc" in diagnostics) == ("svc" in recipe)


def test_recipe_ids_and_chain_sources_differ_by_protocol():
    paper, old = Recipe.parse("ties>svc"), Recipe.parse("ties>svc(calibrate_at=chosen_scaling)")
    assert "calibrate_at='unit_scaling'" in paper.id and "calibrate_at='chosen_scaling'" in old.id
    assert paper.digest != old.digest
    chains = ["{merge}", "{merge}>svc", "{merge}>svc(calibrate_at=chosen_scaling)", "{merge}>wsc"]
    # SVC searches the grid with itself in place; the old order and WSC calibrate the merge's chosen scaling
    assert [scaling_source(c, chains) for c in chains] == ["", "", "{merge}", "{merge}"]
    with pytest.raises(ParameterError, match="cannot follow 'wsc'"):
        Recipe.parse("task_arithmetic>wsc>svc")


def test_fixed_scaling_protocols_add_rows_named_by_their_scaling():
    data = {"benchmark": {"merges": {"task_arithmetic": {"scaling": [0.1, 0.5]}, "ties": {"scaling": [0.2, 1.0]}},
                          "chains": ["{merge}", "{merge}>svc", "{merge}>wsc"],
                          "fixed_scaling": [{"scaling": 1.0, "chains": ["{merge}", "{merge}>svc"]},
                                            {"scaling": 0.3, "merges": ["ties"], "chains": ["{merge}>wsc"]}]}}
    cells = [c for c in cells_mod.enumerate_cells(parse_params(data)) if c.track == "vision" and c.regime == "standard"]
    rows = {(c.merge, c.calibration): c for c in cells if c.merge in ("task_arithmetic", "ties")}
    assert set(rows) == {(m, n) for m in ("task_arithmetic", "ties") for n in ("none", "svc", "wsc", "none@λ=1",
                                                                              "svc@λ=1")} | {("ties", "wsc@λ=0.3")}
    fixed = rows[("ties", "wsc@λ=0.3")]
    assert fixed.grid == () and fixed.scaling_from == "" and Recipe.parse(fixed.recipe).merge.params.scaling == 0.3
    assert rows[("task_arithmetic", "svc")].grid == (0.1, 0.5) and rows[("task_arithmetic", "svc")].scaling_from == ""
    assert rows[("task_arithmetic", "wsc")].scaling_from == "{merge}"
    assert calibration_name("{merge}(scaling=0.3)>dsc") == "dsc@λ=0.3"
    # a chain never carries the merge's parameters (the cells read them from benchmark.merges): refused, not ignored
    for where in ({"chains": ["{merge}", "{merge}(scaling=0.3)>wsc"]},
                  {"fixed_scaling": [{"scaling": 0.3, "chains": ["{merge}(top_k=0.1)"]}]}):
        with pytest.raises(ParameterError, match=r"give the merge's parameters under benchmark.merges"):
            parse_params({"benchmark": where})
    with pytest.raises(ParameterError, match=r"fixed_scaling\[0\]\.merges.*'dare' is not among benchmark.merges"):
        parse_params({"benchmark": {"fixed_scaling": [{"scaling": 1.0, "merges": ["dare"], "chains": ["{merge}"]}]}})
