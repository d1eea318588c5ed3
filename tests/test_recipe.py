"""Recipes: validated chains with a stable, parseable string form, executed streaming."""

import pytest
import torch

from mergecal import TaskVectorSet, merge_task_vectors
from mergecal.calibrations.svc import Svc
from mergecal.calibrations.wsc import Wsc
from mergecal.errors import ParameterError, UnknownNameError
from mergecal.merge import iter_weight_space
from mergecal.recipe import Recipe


def test_string_form_is_canonical_and_round_trips():
    short = Recipe.parse("tsv_m->svc(alpha=1.0)->wsc")
    assert short.label == "tsv_m→svc→wsc"
    assert short.id.startswith("tsv_m(float64=False,key_rule='matrices_except_text_projection',scaling=1.0,"
                               "solver='gram')→svc(alpha=1.0,")
    assert Recipe.parse(short.id) == short and Recipe.parse(short.id).id == short.id
    # defaults written out or left implicit give the same id; other spellings of the arrow too
    assert Recipe.parse("tsv_m(scaling=1.0) > svc(alpha=1.0, space='column') → wsc") == short
    assert Recipe.parse("tsv_m→svc(alpha=0.5)→wsc") != short
    assert len(short.digest) == 16 and short.digest == Recipe.parse(short.id).digest


def test_from_params_yaml_style_config():
    config = ["ties", {"name": "svc", "alpha": 0.25, "calibrate_vectors": True}, "wsc(projection=least_squares)"]
    recipe = Recipe.from_config(config)
    assert recipe.label == "ties→svc→wsc"
    assert recipe.steps[1].params.alpha == 0.25 and recipe.steps[1].params.calibrate_vectors is True
    assert recipe.steps[2].params.projection == "least_squares"
    assert Recipe.from_config("consensus(mask_lambda=[0.2, 0.3])").merge.params.mask_lambda == [0.2, 0.3]


@pytest.mark.parametrize("text,error,match", [
    ("ties->tsv_m", ParameterError, "exactly one merge method is required, found 2"),
    ("svc", ParameterError, "exactly one merge method is required, found 0"),
    ("svc->ties", ParameterError, "'ties' \\(merge\\) cannot follow 'svc' \\(weight\\)"),
    ("ties->svc(alpah=1)", ParameterError, "svc: unknown parameter 'alpah'; allowed: alpha"),
    ("ties->svc(space=diagonal)", ParameterError, "svc: parameter 'space'"),
    ("tie", UnknownNameError, "unknown recipe step 'tie'; choose one of: adamerging_lw, adamerging_tw, consensus"),
    ("ties->->svc", ParameterError, "empty step"),
    ("ties->svc(alpha)", ParameterError, "should be param=value"),
])
def test_bad_recipes_get_one_clear_message(text, error, match):
    with pytest.raises(error, match=match):
        Recipe.parse(text)


def test_weight_space_chain_equals_the_calibrations_applied_by_hand(task_vectors):
    recipe = Recipe.parse("task_arithmetic(scaling=1.0)->svc->wsc")
    tvs = TaskVectorSet.from_task_vectors(task_vectors)
    diagnostics = {}
    out = dict(iter_weight_space(recipe, tvs, sensitive=["visual.blocks.0.mlp.c_fc.weight"], diagnostics=diagnostics))
    merged = merge_task_vectors(task_vectors, "task_arithmetic", scaling=1.0)
    svc, wsc = Svc(), Wsc(sensitive=["visual.blocks.0.mlp.c_fc.weight"])
    for key, expected in merged.items():
        taus = [t[key] for t in task_vectors]
        shape, dtype = tuple(expected.shape), expected.dtype
        if svc.covers(key, shape, dtype):
            expected, _ = svc.calibrate(key, expected, taus)
        if wsc.covers(key, shape, dtype):
            expected, _ = wsc.calibrate(key, expected, taus)
        torch.testing.assert_close(out[key], expected, msg=key)
    assert diagnostics["wsc"]["visual.blocks.0.mlp.c_fc.weight"]["sensitive"] is True
    assert diagnostics["wsc"]["visual.blocks.0.attn.in_proj_weight"]["sensitive"] is False
    assert "visual.conv1.weight" in diagnostics["wsc"] and "visual.conv1.weight" not in diagnostics["svc"]


def test_distac_presets_resolve_to_explicit_values_in_the_id():
    recipe = Recipe.parse("distac(preset=norm_mismatch)->tsv_m->svc(alpha=1.0)->dsc")
    assert recipe.label == "distac→tsv_m→svc→dsc"
    distac = recipe.steps[0].params
    assert (distac.t_teacher, distac.t_student, distac.kappa, distac.apply_to) == (10.0, 10.0, None, "largest_norm")
    assert "preset" not in recipe.id and "apply_to='largest_norm'" in recipe.id
    assert Recipe.parse(recipe.id) == recipe
    low = Recipe.parse("distac(preset=low_confidence, steps=50)->ties").steps[0].params
    assert (low.kappa, low.t_teacher, low.t_student, low.steps, low.apply_to) == (1.0, 1.0, 10.0, 50, "all")
    # dsc expands to wsc then fsc; dsc_a runs fsc on task-agnostic data
    assert [s.name for s in recipe.steps] == ["distac", "tsv_m", "svc", "wsc", "fsc"]
    with pytest.raises(ParameterError,
                       match="distac: unknown preset 'nope'; choose one of: low_confidence, norm_mismatch"):
        Recipe.parse("distac(preset=nope)->ties")


def test_with_scaling_sets_only_the_merge_scaling_and_leaves_the_recipe_as_it_was():
    """#33: a recipe carries its scaling; the cells' search and the tracks build each trial's recipe with it."""
    recipe = Recipe.parse("distac>ties(scaling=0.3)>svc>dsc")
    scaled = recipe.with_scaling(0.7)
    assert scaled.id == Recipe.parse("distac>ties(scaling=0.7)>svc>dsc").id
    assert scaled.label == recipe.label and recipe.merge.params.scaling == 0.3
    assert recipe.without_pre_merge().id == Recipe.parse("ties(scaling=0.3)>svc>dsc").id
