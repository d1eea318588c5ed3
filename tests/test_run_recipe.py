"""A whole recipe on a tiny open_clip ViT: DisTaC -> TSV-M -> SVC -> DSC (WSC, then FSC)."""

import pytest
import torch
from torch import nn

from fsc_models import perturbed, tiny_open_clip
from mergecal import merge_models
from mergecal.calibrations.base import iter_calibrated
from mergecal.calibrations.fsc import calibrate_fsc
from mergecal.calibrations.svc import Svc
from mergecal.calibrations.wsc import Wsc
from mergecal.errors import ParameterError
from mergecal.recipe import Recipe
from mergecal.run_recipe import RecipeInputs, run_recipe
from mergecal.task_vectors import TaskVectorSet


def with_head(clip, head):
    """The CLIP model itself (same state-dict keys) classifying with a fixed linear head (a stand-in for a
    zero-shot head); the head adds its own 'task_head.*' keys."""
    clip.task_head = head
    clip.forward = lambda images: clip.task_head(clip.encode_image(images))
    return clip


@pytest.fixture(scope="module")
def setup():
    torch.set_num_threads(1)
    base = tiny_open_clip(0)
    K = 3
    fts = [perturbed(base, seed=10 + t, scale=0.05 * (1 + 2 * (t == 0)), prefix="visual.") for t in range(K)]
    heads = []
    for t in range(K):
        torch.manual_seed(100 + t)
        head = nn.Linear(16, 5)
        head.requires_grad_(False)
        heads.append(head)
    pre_sd = {k: v.clone() for k, v in base.state_dict().items()}
    ft_sds = [{k: v.clone() for k, v in m.state_dict().items()} for m in fts]
    g = torch.Generator().manual_seed(5)
    images = [torch.randn(8, 3, 32, 32, generator=g) for _ in range(K)]

    def build_model(sd):
        model = tiny_open_clip(0)
        model.load_state_dict(sd)
        return model

    def build_task_model(t, sd):
        return with_head(build_model(sd), heads[t])

    return pre_sd, ft_sds, images, build_model, build_task_model


def test_full_chain_equals_its_steps_run_by_hand(setup):
    pre_sd, ft_sds, images, build_model, build_task_model = setup
    recipe = Recipe.parse("distac(preset=norm_mismatch, steps=3, lr=1e-4, batch_size=4)->tsv_m->svc(alpha=1.0)->dsc")
    sensitive = ["visual.transformer.resblocks.0.mlp.c_fc.weight"]
    inputs = RecipeInputs(build_model=build_model, build_task_model=build_task_model, distac_data=images,
                          fsc_data=[x[:1] for x in images], sensitive=sensitive, progress=False,
                          trainable=lambda n: n.startswith("visual."))
    result = run_recipe(recipe, pre_sd, ft_sds, inputs)

    # 1. DisTaC conditioned only the largest task vector (task 0 was perturbed 3x more), with kappa < 1
    info = result.diagnostics["distac"]
    assert info["conditioned"] == [0] and info["kappas"][0] < 1.0 and info["kappas"][1:] == [1.0, 1.0]
    assert len(info["history"][0]) == 3

    # 2. by hand: the same conditioned model, then TSV-M, SVC, WSC in weight space ...
    from mergecal.calibrations.distac import distill_task_vector

    conditioned, _ = distill_task_vector(lambda sd: build_task_model(0, sd), pre_sd, ft_sds[0], images[0],
                                         recipe.steps[0].params.distillation_params().model_copy(
                                             update={"kappa": info["kappas"][0]}),
                                         trainable=lambda n: n.startswith("visual."), progress=False)
    models = [conditioned, ft_sds[1], ft_sds[2]]
    tvs = TaskVectorSet.from_models(pre_sd, models)
    from mergecal.merge import iter_merge
    from mergecal.methods import get_merge_method

    updates = dict(iter_calibrated(iter_merge(tvs, get_merge_method("tsv_m")), tvs,
                                   [Svc(alpha=1.0), Wsc(sensitive=sensitive)]))
    for key, value in pre_sd.items():
        expected = value + updates[key] if key in updates else value
        torch.testing.assert_close(result.state_dict[key], expected.to(value.dtype), msg=key)

    # 3. ... then FSC measured on the weight-calibrated model
    fsc = calibrate_fsc(build_model(result.state_dict), build_model(pre_sd), [build_model(m) for m in models],
                        [x[:1] for x in images],
                        params=recipe.steps[-1].params.model_copy(update={"sensitive": sensitive}),
                        progress=False)
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        torch.testing.assert_close(result.model.encode_image(x), fsc.encode_image(x))
        assert not torch.allclose(result.model.encode_image(x), build_model(result.state_dict).encode_image(x))
    assert result.diagnostics["fsc"]["hooked"] and "svc" in result.diagnostics and "wsc" in result.diagnostics


def test_data_free_recipe_equals_merge_models(setup):
    pre_sd, ft_sds, *_ = setup
    result = run_recipe("ties(scaling=0.7)", pre_sd, ft_sds)
    expected = merge_models(pre_sd, ft_sds, "ties", scaling=0.7)
    assert all(torch.equal(result.state_dict[k], expected[k]) for k in expected)
    assert result.model is None


def test_missing_inputs_are_named(setup):
    pre_sd, ft_sds, *_ = setup
    with pytest.raises(ParameterError, match="recipe step 'distac' needs RecipeInputs.build_task_model"):
        run_recipe("distac(preset=low_confidence)->ties", pre_sd, ft_sds)
    with pytest.raises(ParameterError, match="recipe step 'fsc' needs RecipeInputs.build_model"):
        run_recipe("ties->fsc", pre_sd, ft_sds)
