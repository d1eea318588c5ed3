"""mergecal.cost: each step's own seconds, passes and peak memory, recorded while a recipe runs; nothing recorded
and the same result when nobody records."""

import time

import pytest
import torch

from mergecal import cost
from mergecal.merge import weight_space_trials
from mergecal.recipe import Recipe
from mergecal.run_recipe import RecipeInputs, run_recipe
from mergecal.task_vectors import TaskVectorSet
from test_run_recipe import setup  # noqa: F401  (the module-scoped fixture: a tiny CLIP, K = 3)


def test_a_recipe_records_its_merge_and_each_calibration(setup):  # noqa: F811
    pre_sd, ft_sds, images, build_model, build_task_model = setup
    recipe = Recipe.parse("distac(preset=norm_mismatch, steps=2, lr=1e-4, batch_size=4)->ties->svc(alpha=1.0)->dsc")
    inputs = RecipeInputs(build_model=build_model, build_task_model=build_task_model, distac_data=images,
                          fsc_data=[x[:1] for x in images],
                          sensitive=["visual.transformer.resblocks.0.mlp.c_fc.weight"],
                          progress=False, trainable=lambda n: n.startswith("visual."))
    with cost.recording() as costs:
        start = time.perf_counter()
        recorded = run_recipe(recipe, pre_sd, ft_sds, inputs)
        wall = time.perf_counter() - start
    assert cost.current() is None  # closed with the block
    metrics = costs.metrics()
    for name in ("distac", "merge", "svc", "wsc", "fsc"):
        assert metrics[f"cost.seconds.{name}"] > 0 and metrics[f"cost.calls.{name}"] == 1, name
    for name in ("distac", "fsc", cost.WEIGHT_SPACE):
        assert metrics[f"cost.peak_mib.{name}"] >= 0, name
    assert not any(k.startswith("cost.peak_mib.") for k in metrics if k.endswith((".merge", ".svc", ".wsc")))
    assert sum(costs.seconds.values()) <= wall  # each step's own time: disjoint parts of the recipe's
    unrecorded = run_recipe(recipe, pre_sd, ft_sds, inputs)
    for key, value in recorded.state_dict.items():
        assert torch.equal(value, unrecorded.state_dict[key]), key


def test_a_searched_scaling_that_merges_again_counts_each_pass(setup):  # noqa: F811
    pre_sd, ft_sds, *_ = setup
    tvs = TaskVectorSet.from_models(pre_sd, ft_sds)
    grid = (0.2, 0.5, 1.0)
    # SVC reads the merge at scaling 1: merged once, then rescaled; WSC the scaled merge: merged at each value
    for recipe, passes in (("task_arithmetic->svc(alpha=1.0)", 1), ("task_arithmetic->wsc", 3)):
        with cost.recording() as costs:
            trials = weight_space_trials(Recipe.parse(recipe), tvs, grid)
            for value in grid:
                updates, _ = trials(value)
                dict(updates)
        calibration = "svc" if passes == 1 else "wsc"
        assert costs.calls == {"merge": passes, calibration: passes}
        metrics = costs.metrics()
        assert metrics["cost.seconds.merge"] == pytest.approx(costs.seconds["merge"] / passes)


def test_nothing_is_recorded_outside_a_recording():
    with cost.step("merge"):
        pass
    assert list(cost.timed("merge", [1, 2])) == [1, 2] and list(cost.peak_of("x", iter([3]))) == [3]
    assert cost.current() is None


def test_a_failing_step_still_counts_its_time_and_recordings_nest():
    with cost.recording() as outer:
        with cost.recording() as inner:
            with pytest.raises(ValueError), cost.step("fsc", memory=False):
                raise ValueError("boom")
        assert cost.current() is outer
    assert "fsc" in inner.seconds and inner.calls == {"fsc": 1} and not outer.seconds
