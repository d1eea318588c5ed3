"""The calibration registry: each calibration's phase and data needs, lazy imports, DSC/DSC-A as composites,
and recipe ids unchanged by the move from if-chains to the registry."""

import subprocess
import sys

import pytest

from mergecal.calibrations import registry
from mergecal.calibrations.registry import (
    CALIBRATIONS,
    MODULES,
    all_calibrations,
    calibration_names,
    get_calibration,
    register_calibration,
)
from mergecal.errors import ParameterError, UnknownNameError
from mergecal.merge import require_data_free
from mergecal.recipe import Recipe, step_phase

EXPECTED = {  # name: (phase, needs_data)
    "distac": ("pre", True),
    "rescale": ("pre", False),
    "svc": ("weight", False),
    "wsc": ("weight", False),
    "fsc": ("feature", True),
    "dsc": ("composite", True),
    "dsc_a": ("composite", True),
}


def test_each_calibration_has_its_phase_and_data_needs():
    specs = all_calibrations()
    assert sorted(specs) == sorted(EXPECTED) == calibration_names()
    for name, (phase, needs_data) in EXPECTED.items():
        spec = specs[name]
        assert (spec.name, spec.phase, spec.needs_data) == (name, phase, needs_data)
        assert step_phase(name) == phase
    assert {n for n, s in specs.items() if s.uses_sensitivity} == {"wsc", "fsc"}
    assert all(specs[n].build is not None for n in ("svc", "wsc")) and specs["fsc"].build is None
    assert all(specs[n].Params is None and specs[n].expand is not None for n in ("dsc", "dsc_a"))


def test_the_lazy_module_table_matches_what_the_modules_register():
    all_calibrations()
    assert set(CALIBRATIONS) == set(MODULES)
    for module in MODULES.values():
        assert sys.modules[f"mergecal.calibrations.{module}"]  # imported by the lookup above


def test_a_composite_needs_data_when_a_part_does():
    for name in ("dsc", "dsc_a"):
        parts = [part for part, _ in get_calibration(name).expand({})]
        assert parts == ["wsc", "fsc"]
        assert get_calibration(name).needs_data == any(get_calibration(p).needs_data for p in parts)


def test_registering_a_name_twice_fails_clearly(monkeypatch):
    monkeypatch.setattr(registry, "CALIBRATIONS", dict(all_calibrations()))
    with pytest.raises(ValueError, match="calibration 'svc' registered twice"):
        register_calibration("svc", phase="weight", needs_data=False)(type("Other", (), {"Params": None}))
    with pytest.raises(ValueError, match="phase 'post' is not one of"):
        register_calibration("new", phase="post", needs_data=False)


def test_importing_the_recipe_module_loads_no_calibration_module():
    code = ("import sys, mergecal.recipe; "
            "print(sorted(m for m in sys.modules if m.startswith('mergecal.calibrations.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['mergecal.calibrations.registry']"


#: computed with the code before the registry (commit b337f8e): recipe ids are cache keys and run names, so the
#: registry must not change them. The one later change is deliberate: the SVD methods' new `solver` parameter
#: (default 'gram', #17) is written into their ids, and
#: so is SVC's (default 'gram' too, #17, 2026-11-25); SVC's protocol `calibrate_at` (default 'unit_scaling': the merge
#: at scaling 1, #29, 2026-11-26) is written into every svc id, so cells of the two protocols never share a cache
#: entry; WSC's `granularity` (default 'row', the authors' code, #29) is written into every WSC/DSC id, and DisTaC's
#: `schedule` / `warmup_fraction` (default constant / 0, the authors' code, #29) into every DisTaC id.
#: (recipe text, label, id, digest)
RECIPE_IDS = [
    ('distac(preset=norm_mismatch)->tsv_m->svc(alpha=1.0)->dsc',
     'distac→tsv_m→svc→dsc',
     "distac(apply_to='largest_norm',batch_size=128,beta=0.5,grad_clip=1.0,kappa=None,lr=1e-05,optimizer='adam',schedule='constant',seed=0,steps=500,t_student=10.0,t_teacher=10.0,warmup_fraction=0.0)→tsv_m(float64=False,key_rule='matrices_except_text_projection',scaling=1.0,solver='gram')→svc(alpha=1.0,calibrate_at='unit_scaling',calibrate_vectors=False,float64=False,key_rule='svc_authors',roundoff_guard=True,solver='gram',space='column',targeted_task=None)→wsc(granularity='row',key_rule='wsc_weights',projection='authors',sensitive=None)→fsc(aggregate='mean',conservative='xor',data='task',n_samples_per_task=1,norm='l1',sensitive=None,token_ratios='per_token')",
     '0e10b24fbf231f18'),
    ('distac(preset=low_confidence, steps=50)->ties(top_k=0.3)->svc->wsc(projection=least_squares)->dsc_a',
     'distac→ties→svc→wsc→dsc_a',
     "distac(apply_to='all',batch_size=128,beta=0.5,grad_clip=1.0,kappa=1.0,lr=1e-05,optimizer='adam',schedule='constant',seed=0,steps=50,t_student=10.0,t_teacher=1.0,warmup_fraction=0.0)→ties(disjoint='mean',scaling=1.0,sign_vote='mass',top_k=0.3,trim_scope='global')→svc(alpha=None,calibrate_at='unit_scaling',calibrate_vectors=False,float64=False,key_rule='svc_authors',roundoff_guard=True,solver='gram',space='column',targeted_task=None)→wsc(granularity='row',key_rule='wsc_weights',projection='least_squares',sensitive=None)→wsc(granularity='row',key_rule='wsc_weights',projection='authors',sensitive=None)→fsc(aggregate='mean',conservative='xor',data='task_agnostic',n_samples_per_task=1,norm='l1',sensitive=None,token_ratios='per_token')",
     'f1ac1e0eb3e03b7c'),
    ('task_arithmetic(scaling=0.3)->svc(targeted_task=1, space=row)->dsc(wsc={projection: least_squares, '
     'sensitive: [a.weight]}, fsc={n_samples_per_task: 4, norm: l2})',
     'task_arithmetic→svc→dsc',
     "task_arithmetic(scaling=0.3)→svc(alpha=None,calibrate_at='unit_scaling',calibrate_vectors=False,float64=False,key_rule='svc_authors',roundoff_guard=True,solver='gram',space='row',targeted_task=1)→wsc(granularity='row',key_rule='wsc_weights',projection='least_squares',sensitive=['a.weight'])→fsc(aggregate='mean',conservative='xor',data='task',n_samples_per_task=4,norm='l2',sensitive=None,token_ratios='per_token')",
     'fad6832679abef5b'),
    ('consensus(mask_lambda=[0.2, 0.3])->wsc->svc(calibrate_at=chosen_scaling)'
     '->fsc(data=task_agnostic, token_ratios=mean)',
     'consensus→wsc→svc→fsc',
     "consensus(mask_lambda=[0.2,0.3],min_agreement=2,scaling=0.3)→wsc(granularity='row',key_rule='wsc_weights',projection='authors',sensitive=None)→svc(alpha=None,calibrate_at='chosen_scaling',calibrate_vectors=False,float64=False,key_rule='svc_authors',roundoff_guard=True,solver='gram',space='column',targeted_task=None)→fsc(aggregate='mean',conservative='xor',data='task_agnostic',n_samples_per_task=1,norm='l1',sensitive=None,token_ratios='mean')",
     'c88fc23b58cb3732'),
    ('tsv_m->dsc_a(fsc={n_samples_per_task: 2})',
     'tsv_m→dsc_a',
     "tsv_m(float64=False,key_rule='matrices_except_text_projection',scaling=1.0,solver='gram')→wsc(granularity='row',key_rule='wsc_weights',projection='authors',sensitive=None)→fsc(aggregate='mean',conservative='xor',data='task_agnostic',n_samples_per_task=2,norm='l1',sensitive=None,token_ratios='per_token')",
     '339f3ea10a88dfee'),
    ('iso_cts>svc(calibrate_vectors=true, float64=true)',
     'iso_cts→svc',
     "iso_cts(common_space_fraction=0.8,float64=False,key_rule='matrices_except_text_projection',scaling=1.0,solver='gram')→svc(alpha=None,calibrate_at='unit_scaling',calibrate_vectors=True,float64=True,key_rule='svc_authors',roundoff_guard=True,solver='gram',space='column',targeted_task=None)",
     'fc358dbb36fdd7a2'),
]

CONFIG = ('distac→dare→svc→dsc',
          "distac(apply_to='all',batch_size=128,beta=0.5,grad_clip=1.0,kappa=None,lr=1e-05,optimizer='adam',schedule='constant',seed=0,steps=500,t_student=10.0,t_teacher=10.0,warmup_fraction=0.0)→dare(base='task_arithmetic',disjoint='mean',drop_rate=0.5,rescale='inverse_keep',scaling=0.3,seed=0,sign_vote='mass',top_k=0.2,trim_scope='global')→svc(alpha=None,calibrate_at='unit_scaling',calibrate_vectors=False,float64=False,key_rule='svc_authors',roundoff_guard=True,solver='gram',space='column',targeted_task=None)→wsc(granularity='row',key_rule='wsc_weights',projection='authors',sensitive=None)→fsc(aggregate='mean',conservative='xor',data='task_agnostic',n_samples_per_task=1,norm='l1',sensitive=None,token_ratios='per_token')")


@pytest.mark.parametrize("text,label,recipe_id,digest", RECIPE_IDS)
def test_recipe_ids_are_unchanged(text, label, recipe_id, digest):
    recipe = Recipe.parse(text)
    assert (recipe.label, recipe.id, recipe.digest) == (label, recipe_id, digest)
    assert Recipe.parse(recipe.id).id == recipe_id


def test_recipe_ids_from_a_config_list_are_unchanged():
    recipe = Recipe.from_config(["distac", {"name": "dare", "drop_rate": 0.5}, "svc",
                                 {"name": "dsc", "fsc": {"data": "task_agnostic"}}])
    assert (recipe.label, recipe.id) == CONFIG


@pytest.mark.parametrize("text,error,message", [
    ("tie", UnknownNameError, ("unknown recipe step 'tie'; choose one of: adamerging_lw, adamerging_tw, consensus, "
                               "dare, distac, dsc, dsc_a, fsc, "
                               "iso_c, iso_cts, rescale, svc, task_arithmetic, ties, tsv_m, weight_averaging, wsc")),
    ("ties->dsc(wcs={})", ParameterError, "recipe: dsc takes 'wsc' and 'fsc' parameter groups, not 'wcs'"),
    ("ties->dsc(fsc=3)", ParameterError, "recipe: dsc: 'fsc' must be a mapping of parameters"),
    ("ties->dsc_a(wsc={alpha: 1})", ParameterError,
     "wsc: unknown parameter 'alpha'; allowed: sensitive, projection, key_rule, granularity"),
    ("ties->dsc->fsc", ParameterError, "recipe: at most one feature-space step (fsc / dsc) is allowed"),
])
def test_error_messages_are_unchanged(text, error, message):
    with pytest.raises(error) as info:
        Recipe.parse(text)
    assert str(info.value) == message and "\n" not in str(info.value)


def test_data_free_checks_use_the_registry():
    assert [s.needs_data for s in Recipe.parse("distac->ties->svc->wsc->dsc_a").steps] == [True, False, False,
                                                                                         False, False, True]
    require_data_free(Recipe.parse("ties->svc->wsc"))
    with pytest.raises(ParameterError, match="step 'fsc' needs models and data.*followed by svc and/or wsc$"):
        require_data_free(Recipe.parse("ties->dsc"))
