"""MAGIC sensitivity probing: deterministic ranking, exact restoration, the sensitive set, the cache file."""

import copy

import numpy as np
import pytest
import torch
from torch import nn

from mergecal.calibrations.probing import (SensitivityRanking, drop_interval, make_accuracy_probe, make_probe,
                                           probe_sensitivity)
from mergecal.errors import CheckpointError, ParameterError


def toy_setup(seed=0):
    """A 3-layer MLP classifier, its 'pretrained' weights, and a fixed probe set labelled by the model itself
    (so the averaged model is at 100% and any perturbation can only lower accuracy)."""
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4))
    pretrained = {k: v - 0.3 * torch.randn_like(v) for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(400, 6, generator=g)
    with torch.no_grad():
        y = model(x).argmax(-1)
    batches = [(x[i:i + 100], y[i:i + 100]) for i in range(0, 400, 100)]
    return model, pretrained, batches


def test_probe_is_deterministic_and_restores_weights_bit_for_bit():
    model, pretrained, batches = toy_setup()
    before = copy.deepcopy(model.state_dict())
    evaluate = make_accuracy_probe(batches)
    first = probe_sensitivity(model, pretrained, evaluate, scale=3.0, top=2, progress=False)
    second = probe_sensitivity(model, pretrained, evaluate, scale=3.0, top=2, progress=False)
    assert first.scores == second.scores
    assert all(torch.equal(model.state_dict()[k], before[k]) for k in before)
    assert first.baseline == 1.0
    assert [s for _, s in first.scores] == sorted(s for _, s in first.scores)
    assert len(first.sensitive) == 2 and first.sensitive == [k for k, _ in first.scores[:2]]


def test_scores_equal_an_independent_evaluation_of_each_perturbed_model():
    model, pretrained, batches = toy_setup(1)
    evaluate = make_accuracy_probe(batches)
    ranking = probe_sensitivity(model, pretrained, evaluate, scale=2.0, progress=False)
    for key, score in ranking.scores:
        clone = copy.deepcopy(model)
        sd = clone.state_dict()
        sd[key] = pretrained[key] + 2.0 * (sd[key] - pretrained[key])
        clone.load_state_dict(sd)
        assert evaluate(clone) == score, key


def test_an_amplified_sensitive_key_is_ranked_first():
    model, pretrained, batches = toy_setup(2)
    # zero task vector everywhere but one key: amplifying any other key changes nothing
    pretrained = {k: v.clone() for k, v in model.state_dict().items()}
    pretrained["2.weight"] = pretrained["2.weight"] + torch.randn(16, 16, generator=torch.Generator().manual_seed(9))
    ranking = probe_sensitivity(model, pretrained, make_accuracy_probe(batches), scale=1.5, top=1, progress=False)
    assert ranking.sensitive == ["2.weight"]
    assert ranking.scores[0][1] < 1.0 and all(score == 1.0 for _, score in ranking.scores[1:])


def test_ties_are_broken_by_model_order():
    model, pretrained, batches = toy_setup(3)
    ranking = probe_sensitivity(model, pretrained, lambda m: 0.5, progress=False)  # every key ties
    assert [k for k, _ in ranking.scores] == list(model.state_dict())


def test_key_subset_pattern_and_budget():
    model, pretrained, batches = toy_setup(4)
    calls = []

    def evaluate(m):
        calls.append(1)
        return make_accuracy_probe(batches, max_samples=150)(m)

    ranking = probe_sensitivity(model, pretrained, evaluate, key_pattern=r"weight$", progress=False)
    assert [k for k, _ in ranking.scores] and all(k.endswith("weight") for k, _ in ranking.scores)
    assert len(calls) == 1 + 3  # baseline + three weight matrices
    ranking = probe_sensitivity(model, pretrained, evaluate, keys=["0.bias", "2.weight"], progress=False)
    assert sorted(k for k, _ in ranking.scores) == ["0.bias", "2.weight"]
    with pytest.raises(ParameterError, match="'keys' names 'nope'"):
        probe_sensitivity(model, pretrained, evaluate, keys=["nope"], progress=False)
    with pytest.raises(ParameterError, match="no parameter key matches"):
        probe_sensitivity(model, pretrained, evaluate, key_pattern="^zzz", progress=False)
    # the budget: 150 samples means the 4th batch is never touched and the 2nd is cut at 50
    seen = []
    probe = make_accuracy_probe([(x, y) for x, y in batches], max_samples=150)

    class Spy(nn.Module):
        def forward(self, x):
            seen.append(len(x))
            return torch.zeros(len(x), 4)

    probe(Spy())
    assert seen == [100, 50]


def test_ranking_file_round_trip_and_errors(tmp_path):
    ranking = SensitivityRanking(baseline=0.5, scores=[("a", 0.1), ("b", 0.2)], top=1, metadata={"backbone": "tiny"})
    path = ranking.save(tmp_path / "ranking.json")
    loaded = SensitivityRanking.load(path)
    assert loaded == ranking and loaded.sensitive == ["a"]
    with pytest.raises(CheckpointError, match="not found"):
        SensitivityRanking.load(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text("{}")
    with pytest.raises(CheckpointError, match="not a sensitivity ranking"):
        SensitivityRanking.load(tmp_path / "bad.json")


def test_load_or_compute_probes_once_per_cache_file(tmp_path):
    model, pretrained, batches = toy_setup(5)
    calls = []

    def compute():
        calls.append(1)
        return probe_sensitivity(model, pretrained, make_accuracy_probe(batches), progress=False,
                                 metadata={"backbone": "toy", "task_set": "t3"})

    first = SensitivityRanking.load_or_compute(tmp_path / "toy-t3.json", compute)
    second = SensitivityRanking.load_or_compute(tmp_path / "toy-t3.json", compute)
    assert len(calls) == 1 and first == second and second.metadata["task_set"] == "t3"


def test_drops_and_intervals_equal_an_independent_paired_bootstrap():
    from scipy import stats

    model, pretrained, batches = toy_setup(6)
    evaluate = make_probe(batches, "nll")
    ranking = probe_sensitivity(model, pretrained, evaluate, scale=2.0, top=3, progress=False, seed=7)
    base = evaluate(model).numpy()
    for key, score in ranking.scores:
        clone = copy.deepcopy(model)
        sd = clone.state_dict()
        sd[key] = pretrained[key] + 2.0 * (sd[key] - pretrained[key])
        clone.load_state_dict(sd)
        diff = base - evaluate(clone).numpy()
        ci = stats.bootstrap((diff,), np.mean, n_resamples=2000, method="percentile",
                             random_state=7).confidence_interval
        assert ranking.drops[key] == pytest.approx([diff.mean(), ci.low, ci.high], rel=1e-12, abs=1e-15), key
        assert score == pytest.approx(base.mean() - diff.mean(), abs=1e-12)
    separated = sum(1 for k in ranking.sensitive if ranking.drops[k][1] > 0 or ranking.drops[k][2] < 0)
    assert ranking.top_separated == separated and separated > 0


def test_nll_separates_where_accuracy_cannot():
    """A model far from its decision boundaries: amplifying a key lowers the true-class probability of every
    example but flips no prediction, so accuracy's drops are all exactly 0 and NLL's exclude 0."""
    model, pretrained, batches = toy_setup(8)
    with torch.no_grad():
        model[4].bias.zero_()
        model[4].weight.mul_(30.0)  # confident logits, labelled by the model itself
        batches = [(x, model(x).argmax(-1)) for x, _ in batches]
    pretrained = {k: v.clone() for k, v in model.state_dict().items()}
    pretrained["4.weight"] = model[4].weight * 1.5  # tau = -w/2: amplifying it scales the logits by 0.95
    accuracy = probe_sensitivity(model, pretrained, make_probe(batches, "accuracy"), top=1, progress=False)
    nll = probe_sensitivity(model, pretrained, make_probe(batches, "nll"), top=1, progress=False)
    assert accuracy.baseline == 1.0 and all(d == [0.0, 0.0, 0.0] for d in accuracy.drops.values())
    assert accuracy.top_separated == 0
    assert nll.sensitive == ["4.weight"] and nll.top_separated == 1 and nll.drops["4.weight"][1] > 0


def test_layers_are_the_weight_matrices_wsc_calibrates():
    model = nn.Module()
    model.token_embedding, model.fc, model.ln = nn.Embedding(5, 4), nn.Linear(4, 4), nn.LayerNorm(4)
    model.proj = nn.Parameter(torch.ones(4, 2))
    pretrained = {k: v - 0.1 for k, v in model.state_dict().items()}
    ranking = probe_sensitivity(model, pretrained, lambda m: 0.5, key_rule="wsc_weights", progress=False)
    assert [k for k, _ in ranking.scores] == ["fc.weight"]  # no embedding, bias, LayerNorm, final projection
    everything = probe_sensitivity(model, pretrained, lambda m: 0.5, progress=False)
    assert len(everything.scores) == 6
    assert ranking.drops == {} and ranking.top_separated is None  # a mean-only probe gives no intervals


def test_ranking_with_intervals_round_trips_and_a_bad_metric_is_one_line(tmp_path):
    ranking = SensitivityRanking(baseline=-0.5, scores=[("a", -0.7), ("b", -0.5)], top=1,
                                 drops={"a": [0.2, 0.1, 0.3], "b": [0.0, -0.1, 0.1]})
    loaded = SensitivityRanking.load(ranking.save(tmp_path / "ranking.json"))
    assert loaded == ranking and loaded.top_separated == 1
    with pytest.raises(ParameterError, match="^probing: parameter 'metric' must be one of accuracy, nll, got 'loss'$"):
        make_probe([], "loss")


def test_drop_interval_of_constant_differences_has_zero_width():
    assert drop_interval(np.ones(5), np.ones(5)) == [0.0, 0.0, 0.0]
    assert drop_interval(np.ones(4), np.zeros(4)) == [1.0, 1.0, 1.0]
