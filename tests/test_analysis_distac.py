"""The data of DisTaC's analysis figures (mergecal.analysis.distac_figures) on small cases computed by hand."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from mergecal import intervals
from mergecal.analysis.distac_figures import (
    _scipy_interval,
    average_reliability,
    classify_key,
    confidence_gap_interval,
    kappa_sweep_summary,
    layer_norm_comparison,
    layer_norms,
    reliability,
    reliability_from_probabilities,
    trajectory_summary,
)
from mergecal.errors import ParameterError

BLOCK_KEYS = ["ln_1.weight", "ln_1.bias", "attn.in_proj_weight", "attn.in_proj_bias", "attn.out_proj.weight",
              "attn.out_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
              "mlp.c_proj.weight", "mlp.c_proj.bias"]
BLOCK_INFO = [("layernorm", "ln_1"), ("layernorm", "ln_1"), ("attention", "in_proj"), ("attention", "in_proj"),
              ("attention", "out_proj"), ("attention", "out_proj"), ("layernorm", "ln_2"), ("layernorm", "ln_2"),
              ("mlp", "c_fc"), ("mlp", "c_fc"), ("mlp", "c_proj"), ("mlp", "c_proj")]


def _strict_json(value):
    return json.loads(json.dumps(value, allow_nan=False))


def _vector(keys, norms=None):
    """A task vector whose key j has one non-zero entry (its norm): ``norms[j]`` or j + 1."""
    out = {}
    for j, key in enumerate(keys):
        t = torch.zeros(3, 2) if key.endswith("weight") else torch.zeros(3)
        t.view(-1)[1] = float(j + 1) if norms is None else norms[j]
        out[key] = t
    return out


# --- classification and Figs. 5/6 -------------------------------------------------------------------------------------


@pytest.mark.parametrize("suffix,panel,module", [(k, p, m) for k, (p, m) in zip(BLOCK_KEYS, BLOCK_INFO)])
def test_block_keys_are_classified(suffix, panel, module):
    info = classify_key(f"visual.transformer.resblocks.7.{suffix}")
    assert info == {"panel": panel, "kind": "bias" if suffix.endswith("bias") else "weight", "layer": 7,
                    "module": module}


@pytest.mark.parametrize("key,expected", [
    ("visual.conv1.weight", ("other", "weight", None, "conv1")),
    ("visual.class_embedding", ("other", "weight", None, "class_embedding")),
    ("visual.positional_embedding", ("other", "weight", None, "positional_embedding")),
    ("visual.ln_pre.weight", ("layernorm", "weight", "pre", "ln_pre")),
    ("visual.ln_pre.bias", ("layernorm", "bias", "pre", "ln_pre")),
    ("visual.ln_post.weight", ("layernorm", "weight", "post", "ln_post")),
    ("visual.ln_post.bias", ("layernorm", "bias", "post", "ln_post")),
    ("visual.proj", ("other", "weight", None, "proj")),
    # unrecognised: never an error, panel "other"
    ("visual.transformer.resblocks.3.ls_1.gamma", ("other", "weight", 3, "ls_1.gamma")),
    ("visual.transformer.resblocks.3.attn.k_proj.bias", ("other", "bias", 3, "attn.k_proj")),
    ("logit_scale", ("other", "weight", None, "logit_scale")),
    ("transformer.resblocks.0.attn.in_proj_weight", ("other", "weight", None, "transformer.resblocks.0.attn.in_proj")),
    ("visual.head.weight", ("other", "weight", None, "head")),
])
def test_other_keys_are_classified(key, expected):
    info = classify_key(key)
    assert (info["panel"], info["kind"], info["layer"], info["module"]) == expected


def test_prefix_selects_the_tower():
    assert classify_key("transformer.resblocks.2.mlp.c_fc.bias", prefix="")["layer"] == 2
    assert classify_key("ln_pre.weight", prefix="")["layer"] == "pre"
    assert classify_key("visual.ln_pre.weight", prefix="")["panel"] == "other"


def test_layer_norms_order_classification_and_values():
    blocks = [f"visual.transformer.resblocks.{i}.{k}" for i in (0, 1) for k in BLOCK_KEYS]
    expected = (["visual.conv1.weight", "visual.class_embedding", "visual.positional_embedding",
                 "visual.ln_pre.weight", "visual.ln_pre.bias"] + blocks[:12]
                + ["visual.transformer.resblocks.0.ls_1.gamma"] + blocks[12:]
                + ["visual.transformer.resblocks.2.mlp.c_fc.weight", "visual.transformer.resblocks.10.ln_1.weight",
                   "visual.transformer.resblocks.10.ln_1.bias"]
                + ["visual.ln_post.weight", "visual.ln_post.bias", "visual.proj", "logit_scale", "text.proj"])
    # shuffled input: alphabetical would put resblocks.10 before resblocks.2 and ln_post before the blocks
    shuffled = list(reversed(expected))
    shuffled.remove("logit_scale")
    shuffled.remove("text.proj")
    shuffled = ["logit_scale"] + shuffled + ["text.proj"]  # unrecognised keys outside blocks keep their input order
    vector = _vector(shuffled)
    rows = layer_norms(vector)
    assert [r["key"] for r in rows] == expected
    assert [r["layer"] for r in rows[:6]] == [None, None, None, "pre", "pre", 0]
    layers = [r["layer"] for r in rows if isinstance(r["layer"], int)]
    assert layers == sorted(layers) and layers[-1] == 10
    for row in rows:
        assert row["norm"] == pytest.approx(shuffled.index(row["key"]) + 1)
        assert set(row) == {"key", "panel", "kind", "layer", "module", "norm"}
    assert _strict_json(rows) == rows


def test_layer_norm_accumulates_in_float64():
    rows = layer_norms({"visual.proj": torch.full((4,), 60000.0, dtype=torch.float16)})
    assert torch.linalg.vector_norm(torch.full((4,), 60000.0, dtype=torch.float16)).isinf()  # float16 overflows
    assert rows[0]["norm"] == pytest.approx(120000.0)
    nan = layer_norms({"visual.proj": torch.tensor([math.nan, 1.0])})
    assert nan[0]["norm"] is None


def test_lengthened_three_times_gives_ratio_three_and_cv_zero():
    keys = ["visual.transformer.resblocks.0.mlp.c_fc.weight", "visual.transformer.resblocks.0.mlp.c_fc.bias",
            "visual.transformer.resblocks.0.attn.in_proj_weight", "visual.ln_post.weight", "visual.conv1.weight"]
    standard = [_vector(keys, [1.0, 2.0, 3.0, 4.0, 5.0]), _vector(keys, [2.0, 0.5, 1.0, 1.0, 1.0])]
    lengthened = [{k: 3 * v for k, v in s.items()} for s in standard]
    out = layer_norm_comparison(standard, lengthened, ["a", "b"])
    assert out["tasks"] == ["a", "b"]
    assert [r["key"] for r in out["rows"]] == [keys[4], keys[2], keys[0], keys[1], keys[3]]
    for row in out["rows"]:
        assert row["ratio"] == pytest.approx(3.0)
    c_fc = next(r for r in out["rows"] if r["key"] == keys[0])
    assert (c_fc["standard"], c_fc["lengthened"]) == (pytest.approx(1.5), pytest.approx(4.5))
    assert [(s["panel"], s["kind"]) for s in out["summary"]] == [("mlp", "weight"), ("mlp", "bias"),
                                                                 ("attention", "weight"), ("layernorm", "weight"),
                                                                 ("other", "weight")]
    for s in out["summary"]:
        assert s["ratio_mean"] == s["ratio_min"] == s["ratio_max"] == pytest.approx(3.0)
        assert s["ratio_cv"] == pytest.approx(0.0, abs=1e-12)
    assert out["overall"]["weight"] == {"ratio_median": pytest.approx(3.0), "ratio_cv": pytest.approx(0, abs=1e-12),
                                        "rows_above_one": 4, "rows": 4, "rows_undefined": 0}
    assert out["overall"]["bias"]["rows"] == 1 and out["overall"]["bias"]["rows_above_one"] == 1
    assert _strict_json(out) == out


def test_ratio_of_task_means_and_spread_by_hand():
    keys = ["visual.transformer.resblocks.0.mlp.c_fc.weight", "visual.transformer.resblocks.1.mlp.c_fc.weight",
            "visual.transformer.resblocks.0.ln_1.bias"]
    standard = [_vector(keys, [1.0, 1.0, 0.0]), _vector(keys, [3.0, 1.0, 0.0])]
    lengthened = [_vector(keys, [2.0, 1.0, 5.0]), _vector(keys, [10.0, 3.0, 5.0])]
    out = layer_norm_comparison(standard, lengthened, ["a", "b"])
    rows = {r["key"]: r for r in out["rows"]}
    # ratio of the task means (6 / 2), not the mean of per-task ratios (2 and 10/3)
    assert rows[keys[0]]["ratio"] == pytest.approx(3.0)
    assert rows[keys[1]]["ratio"] == pytest.approx(2.0)
    assert rows[keys[2]]["ratio"] is None  # standard norm 0: undefined
    mlp = out["summary"][0]
    assert mlp == {"panel": "mlp", "kind": "weight", "ratio_mean": pytest.approx(2.5), "ratio_min": 2.0,
                   "ratio_max": 3.0, "ratio_cv": pytest.approx(0.5 / 2.5)}  # population sd of [2, 3] is 0.5
    assert out["overall"]["weight"]["ratio_median"] == pytest.approx(2.5)
    assert out["overall"]["bias"] == {"ratio_median": None, "ratio_cv": None, "rows_above_one": 0, "rows": 0,
                                      "rows_undefined": 1}


# --- reliability diagrams ---------------------------------------------------------------------------------------------


def test_reliability_of_six_examples_by_hand():
    conf = [0.0, 0.15, 0.5, 0.7, 0.9, 1.0]
    correct = [0, 1, 1, 0, 1, 1]
    out = reliability(conf, correct, bins=5)
    bins = out["bins"]
    assert [b["count"] for b in bins] == [2, 0, 1, 1, 2]  # 0.0 in the first bin, 1.0 in the last
    assert [b["lower"] for b in bins] == pytest.approx([0.0, 0.2, 0.4, 0.6, 0.8])
    assert [b["upper"] for b in bins] == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0])
    assert bins[0]["confidence"] == pytest.approx(0.075) and bins[0]["accuracy"] == pytest.approx(0.5)
    assert bins[1]["confidence"] is None and bins[1]["accuracy"] is None
    assert (bins[2]["confidence"], bins[2]["accuracy"]) == (pytest.approx(0.5), 1.0)
    assert (bins[3]["confidence"], bins[3]["accuracy"]) == (pytest.approx(0.7), 0.0)
    assert (bins[4]["confidence"], bins[4]["accuracy"]) == (pytest.approx(0.95), 1.0)
    # ECE = (2 * 0.425 + 0.5 + 0.7 + 2 * 0.05) / 6
    assert out["ece"] == pytest.approx(2.15 / 6)
    assert out["gap"] == pytest.approx(3.25 / 6 - 4 / 6)  # under-confident here
    assert out["count"] == 6 and out["accuracy"] == pytest.approx(4 / 6)
    assert _strict_json(out) == out


def test_decimal_boundaries_fall_in_the_bin_they_close():
    """Bin i is (i/B, (i+1)/B]: 0.3 belongs to (0.2, 0.3] although 0.3 * 10 = 3.0000000000000004 in floating point."""
    conf = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0]
    out = reliability(conf, [1] * 10, bins=10)
    assert [b["count"] for b in out["bins"]] == [1] * 10
    assert [b["confidence"] for b in out["bins"]] == conf
    assert reliability([0.0, 1.0], [True, False], bins=1)["bins"][0]["count"] == 2


def test_reliability_agrees_with_guo_binning_on_random_data():
    rng = np.random.default_rng(0)
    conf = rng.random(500)
    conf[:5] = [0.0, 1.0, 0.25, 0.5, 0.75]
    correct = rng.random(500) < conf
    out = reliability(torch.tensor(conf), torch.tensor(correct), bins=15)
    edges = np.linspace(0, 1, 16)
    ece = 0.0
    for i, b in enumerate(out["bins"]):
        members = (conf > edges[i]) & (conf <= edges[i + 1])
        if i == 0:
            members |= conf == 0
        assert b["count"] == members.sum()
        if members.any():
            assert b["accuracy"] == pytest.approx(correct[members].mean())
            ece += members.mean() * abs(correct[members].mean() - conf[members].mean())
    assert out["ece"] == pytest.approx(ece)
    assert sum(b["count"] for b in out["bins"]) == 500


def test_average_reliability_by_hand():
    a = reliability([0.3, 0.8], [1, 1], bins=2)  # ece 0.5*0.7 + 0.5*0.2 = 0.45, gap -0.45
    b = reliability([0.9, 0.7], [0, 1], bins=2)  # first bin empty; ece 0.3, gap 0.3
    assert (a["ece"], a["gap"], b["ece"], b["gap"]) == pytest.approx((0.45, -0.45, 0.3, 0.3))
    out = average_reliability([a, b])
    first, second = out["bins"]
    assert (first["tasks"], first["count"], first["confidence"], first["accuracy"]) == (1, 1, pytest.approx(0.3), 1.0)
    assert (second["tasks"], second["count"]) == (2, 3)
    assert (second["confidence"], second["accuracy"]) == (pytest.approx(0.8), pytest.approx(0.75))
    assert out["ece"] == pytest.approx(0.375) and out["gap"] == pytest.approx(-0.075) and out["tasks"] == 2
    assert _strict_json(out) == out


def test_reliability_from_probabilities():
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3], [0.5, 0.5, 0.0]])
    conf, correct = reliability_from_probabilities(probs, torch.tensor([0, 2, 1]))
    assert conf.tolist() == pytest.approx([0.7, 0.6, 0.5])
    assert correct.tolist() == [True, False, False]  # a tie goes to the first class
    assert reliability(conf, correct, bins=2)["bins"][0]["count"] == 1


def test_confidence_gap_interval():
    rng = np.random.default_rng(1)
    conf = [np.full(200, 0.9), rng.uniform(0.5, 1.0, 150)]
    correct = [np.arange(200) % 2 == 0, rng.random(150) < 0.5]  # accuracy about 0.5: over-confident
    out = confidence_gap_interval(conf, correct)
    expected = np.mean([0.9 - 0.5, conf[1].mean() - correct[1].mean()])
    assert out["gap"] == pytest.approx(expected)
    assert out["low"] < out["gap"] < out["high"] and out["low"] > 0
    assert (out["samples"], out["seed"], out["tasks"]) == (intervals.N_RESAMPLES, intervals.SEED, 2)
    assert confidence_gap_interval(conf, correct) == out  # same seed, same numbers
    other = confidence_gap_interval(conf, correct, samples=400, seed=5)
    assert other == confidence_gap_interval(conf, correct, samples=400, seed=5)
    assert other["gap"] == out["gap"] and (other["low"], other["high"]) != (out["low"], out["high"])
    assert other["low"] < other["gap"] < other["high"]
    # the scipy route is the library's interval at the library's settings
    diffs = [c - r for c, r in zip(conf, correct)]
    assert _scipy_interval(diffs, [0.5, 0.5], intervals.N_RESAMPLES, intervals.SEED) == pytest.approx(
        (out["low"], out["high"]), rel=1e-12)
    assert _strict_json(out) == out


def test_confidence_gap_without_spread_is_a_point():
    out = confidence_gap_interval([[1.0, 1.0], [0.5]], [[1, 1], [0]], samples=100, seed=3)
    assert (out["gap"], out["low"], out["high"]) == (0.25, 0.25, 0.25)


# --- Fig. 2 -----------------------------------------------------------------------------------------------------------


def _records(steps, acc, ent, norm):
    return [{"step": s, "accuracy": a, "entropy": e, "tau_norm": n} for s, a, e, n in zip(steps, acc, ent, norm)]


def test_trajectory_of_two_tasks_by_hand():
    histories = {"a": _records([0, 10], [0.4, 0.8], [1.0, 0.5], [2.0, 1.0]),
                 "b": _records([10, 0], [0.45, 0.5], [0.3, 2.0], [5.0, 4.0])}  # out of order: sorted by step
    out = trajectory_summary(histories, {"a": 0.8, "b": 0.5}, {"a": 2.0, "b": 4.0})
    assert out["steps"] == [0, 10] and out["tasks"] == ["a", "b"]
    assert out["per_task"]["a"] == {"relative_accuracy": [50.0, 100.0], "norm_change_percent": [0.0, -50.0],
                                    "entropy": [1.0, 0.5]}
    assert out["per_task"]["b"]["relative_accuracy"] == pytest.approx([100.0, 90.0])
    assert out["per_task"]["b"]["norm_change_percent"] == pytest.approx([0.0, 25.0])
    assert out["relative_accuracy"]["mean"] == pytest.approx([75.0, 95.0])
    assert out["relative_accuracy"]["sd"] == pytest.approx([50 / math.sqrt(2), 10 / math.sqrt(2)])  # ddof=1
    assert out["norm_change_percent"]["mean"] == pytest.approx([0.0, -12.5])
    assert out["norm_change_percent"]["sd"] == pytest.approx([0.0, 75 / math.sqrt(2)])
    assert out["entropy"]["mean"] == pytest.approx([1.5, 0.4])
    assert out["entropy"]["sd"] == pytest.approx([1 / math.sqrt(2), 0.2 / math.sqrt(2)])
    assert _strict_json(out) == out


def test_trajectory_of_one_task_has_no_sd():
    out = trajectory_summary({"a": _records([0, 5], [0.4, 0.8], [1.0, 0.5], [2.0, 3.0])}, {"a": 0.8}, {"a": 2.0})
    assert out["relative_accuracy"]["sd"] == [None, None]
    assert out["norm_change_percent"]["mean"] == pytest.approx([0.0, 50.0])


# --- Fig. 3 -----------------------------------------------------------------------------------------------------------


def test_kappa_sweep_by_hand():
    accuracy = {"a": {3.0: 0.4, 0.0: 0.5, 0.5: 0.7, 1.0: 0.9, 1.5: 0.85, 2.0: 0.6},
                "b": {"0": 0.3, "0.5": 0.8, "1": 0.9, "1.5": 0.7, "3": 0.5}}
    out = kappa_sweep_summary(accuracy)
    a, b = out["per_task"]["a"], out["per_task"]["b"]
    assert a["kappas"] == [0.0, 0.5, 1.0, 1.5, 2.0, 3.0] and a["accuracy"] == [0.5, 0.7, 0.9, 0.85, 0.6, 0.4]
    assert (a["zero_shot"], a["finetuned"], a["at_max"], a["shrunk"], a["stretched"]) == (0.5, 0.9, 0.4, 0.7, 0.85)
    assert a["below_zero_shot_at_max"] is True and a["shrink_better"] is False
    assert b["below_zero_shot_at_max"] is False and b["shrink_better"] is True
    assert out["counts"] == {"tasks": 2, "below_zero_shot_at_max": 1, "shrink_better": 1}
    assert _strict_json(out) == out


def test_kappa_sweep_matches_kappas_within_rounding():
    # 1 - 0.7 is 0.30000000000000004, the sweep's 0.3 is still found; equal accuracies count as shrink_better
    out = kappa_sweep_summary({"a": {0: 0.5, 0.3: 0.6, 1: 0.9, 1.7: 0.6}}, shrink_stretch=0.7)
    assert out["per_task"]["a"]["shrunk"] == 0.6 and out["per_task"]["a"]["shrink_better"] is True


# --- bad input --------------------------------------------------------------------------------------------------------


_KEYS = ["visual.proj", "visual.ln_post.bias"]
_HIST = {"a": _records([0, 5], [0.4, 0.8], [1.0, 0.5], [2.0, 3.0]),
         "b": _records([0, 6], [0.4, 0.8], [1.0, 0.5], [2.0, 3.0])}


@pytest.mark.parametrize("call,match", [
    (lambda: layer_norms({}), r"^task_vector: "),
    (lambda: layer_norms({"visual.proj": [1.0]}), r"^task_vector\['visual.proj'\]: expected a tensor"),
    (lambda: layer_norm_comparison([], [], []), r"^standard: "),
    (lambda: layer_norm_comparison([_vector(_KEYS)], [_vector(_KEYS)] * 2, ["a"]), r"^lengthened: expected 1"),
    (lambda: layer_norm_comparison([_vector(_KEYS)], [_vector(_KEYS)], ["a", "b"]), r"^task_names: expected 1"),
    (lambda: layer_norm_comparison([_vector(_KEYS)] * 2, [_vector(_KEYS)] * 2, ["a", "a"]), r"^task_names: .*distinct"),
    (lambda: layer_norm_comparison([_vector(_KEYS)], [_vector(_KEYS[:1])], ["a"]),
     r"^lengthened\[0\] \(a\): lacks 'visual.ln_post.bias'"),
    (lambda: layer_norm_comparison([_vector(_KEYS)] * 2, [_vector(_KEYS), _vector(_KEYS + ["x"])], ["a", "b"]),
     r"^lengthened\[1\] \(b\): has the extra key 'x'"),
    (lambda: layer_norm_comparison([_vector(_KEYS)], [{"visual.proj": torch.zeros(2), "visual.ln_post.bias":
                                                       torch.zeros(3)}], ["a"]), r"^lengthened\[0\]\['visual.proj'\]"),
    (lambda: reliability([0.5, 1.2], [1, 0]), r"^confidence: expected finite values in \[0, 1\], got 1.2"),
    (lambda: reliability([0.5, math.nan], [1, 0]), r"^confidence: expected finite"),
    (lambda: reliability([], []), r"^confidence: expected a non-empty"),
    (lambda: reliability([[0.5]], [1]), r"^confidence: expected a non-empty 1-d"),
    (lambda: reliability([0.5, 0.6], [1]), r"^correct: expected a 1-d array of 2"),
    (lambda: reliability([0.5, 0.6], [1, 2]), r"^correct: expected booleans or 0/1"),
    (lambda: reliability([0.5], [1], bins=0), r"^bins: "),
    (lambda: reliability([0.5], [1], bins=2.0), r"^bins: "),
    (lambda: average_reliability([]), r"^per_task: "),
    (lambda: average_reliability([{"bins": []}]), r"^per_task\[0\]: "),
    (lambda: average_reliability([reliability([0.5], [1], 2), reliability([0.5], [1], 3)]), r"^per_task\[1\]: "),
    (lambda: confidence_gap_interval([[0.5]], [[1], [0]]), r"^correct_per_task: expected 1"),
    (lambda: confidence_gap_interval([], []), r"^confidence_per_task: "),
    (lambda: confidence_gap_interval([[0.5], [2.0]], [[1], [0]]), r"^confidence_per_task\[1\]: "),
    (lambda: confidence_gap_interval([[0.5]], [[3]]), r"^correct_per_task\[0\]: "),
    (lambda: confidence_gap_interval([[0.5]], [[1]], samples=0), r"^samples: "),
    (lambda: confidence_gap_interval([[0.5]], [[1]], seed=-1), r"^seed: "),
    (lambda: reliability_from_probabilities(torch.tensor([[2.0, -1.0]]), torch.tensor([0])), r"^probabilities: "),
    (lambda: reliability_from_probabilities(torch.tensor([[0.2, 0.2]]), torch.tensor([0])), r"^probabilities: .*sum"),
    (lambda: reliability_from_probabilities(torch.tensor([0.5, 0.5]), torch.tensor([0])), r"^probabilities: "),
    (lambda: reliability_from_probabilities(torch.tensor([[0.5, 0.5]]), torch.tensor([2])), r"^labels: .*\[0, 2\)"),
    (lambda: reliability_from_probabilities(torch.tensor([[0.5, 0.5]]), torch.tensor([0, 1])), r"^labels: "),
    (lambda: reliability_from_probabilities(torch.tensor([[0.5, 0.5]]), torch.tensor([0.0])), r"^labels: .*integer"),
    (lambda: trajectory_summary({}, {}, {}), r"^histories: "),
    (lambda: trajectory_summary(_HIST, {"a": 0.8, "b": 0.8}, {"a": 1.0, "b": 1.0}),
     r"^histories\['b'\]: steps \[0, 6\] differ from task 'a'"),
    (lambda: trajectory_summary({"a": _HIST["a"]}, {"b": 0.8}, {"a": 1.0}),
     r"^teacher_accuracy: no value for task 'a'"),
    (lambda: trajectory_summary({"a": _HIST["a"]}, {"a": 0.8}, {}), r"^initial_norm: no value for task 'a'"),
    (lambda: trajectory_summary({"a": _HIST["a"]}, {"a": 0.0}, {"a": 1.0}), r"^teacher_accuracy\['a'\]: .*> 0"),
    (lambda: trajectory_summary({"a": _HIST["a"]}, {"a": 0.8}, {"a": -1.0}), r"^initial_norm\['a'\]: "),
    (lambda: trajectory_summary({"a": [{"step": 0, "accuracy": 1, "entropy": 1}]}, {"a": 1}, {"a": 1}),
     r"^histories\['a'\]\[0\]: missing 'tau_norm'"),
    (lambda: trajectory_summary({"a": _HIST["a"] + _HIST["a"][:1]}, {"a": 1}, {"a": 1}),
     r"^histories\['a'\]: step 0 is recorded twice"),
    (lambda: trajectory_summary({"a": [{"step": 0.5, "accuracy": 1, "entropy": 1, "tau_norm": 1}]}, {"a": 1},
                                {"a": 1}), r"^histories\['a'\]\[0\]\['step'\]: "),
    (lambda: kappa_sweep_summary({}), r"^accuracy: "),
    (lambda: kappa_sweep_summary({"a": {0.5: 0.6, 1: 0.9, 1.5: 0.6}}), r"^accuracy\['a'\]: no accuracy at kappa=0 "),
    (lambda: kappa_sweep_summary({"a": {0: 0.5, 0.5: 0.6, 1.5: 0.6}}), r"^accuracy\['a'\]: no accuracy at kappa=1 "),
    (lambda: kappa_sweep_summary({"a": {0: 0.5, 0.5: 0.6, 1: 0.9}}),
     r"^accuracy\['a'\]: no accuracy at kappa=1.5 \(shrink_stretch=0.5 needs it\)"),
    (lambda: kappa_sweep_summary({"a": {0: 0.5, 1: 0.9}}, shrink_stretch=0), r"^shrink_stretch: "),
    (lambda: kappa_sweep_summary({"a": {0: 0.5, "0": 0.5, 1: 0.9}}), r"^accuracy\['a'\]: kappa=0 given twice"),
    (lambda: kappa_sweep_summary({"a": {0: 0.5, "x": 0.5}}), r"^accuracy\['a'\]: kappa: expected a number"),
    (lambda: kappa_sweep_summary({"a": {0: 0.5, 0.5: math.nan, 1: 0.9, 1.5: 0.6}}), r"^accuracy\['a'\]\[0.5\]: "),
])
def test_bad_input_names_the_parameter(call, match):
    with pytest.raises(ParameterError, match=match) as raised:
        call()
    assert "\n" not in str(raised.value)
