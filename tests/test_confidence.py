"""Confidence measures and temperature scaling (mergecal.calibrations.confidence)."""

import math

import numpy as np
import pytest
import torch

from mergecal.calibrations.confidence import (
    apply_temperature,
    expected_calibration_error,
    fit_temperature,
    negative_log_likelihood,
    prediction_entropy,
)
from mergecal.errors import ParameterError


def calibrated_sample(n, classes=5, spread=2.0, seed=0):
    """Logits of a perfectly calibrated model: each label is drawn from softmax(logits) itself."""
    g = torch.Generator().manual_seed(seed)
    logits = spread * torch.randn(n, classes, generator=g, dtype=torch.float64)
    labels = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g).squeeze(1)
    return logits, labels


def ece_reference(probs, labels, n_bins):
    """Guo et al.'s ECE written out with numpy: bins ((m-1)/M, m/M], weighted |accuracy - confidence|."""
    confidence, prediction = probs.max(axis=1), probs.argmax(axis=1)
    total = 0.0
    for m in range(1, n_bins + 1):
        lower, upper = (m - 1) / n_bins, m / n_bins
        members = (confidence > lower) & (confidence <= upper)
        if members.any():
            accuracy = (prediction[members] == labels[members]).mean()
            total += members.mean() * abs(accuracy - confidence[members].mean())
    return total


# --- entropy ----------------------------------------------------------------------------------------------------------

def test_entropy_of_uniform_logits_is_log_c():
    assert prediction_entropy(torch.zeros(4, 7)) == math.log(7)
    assert prediction_entropy(torch.full((3, 10), -2.5)) == pytest.approx(math.log(10), abs=1e-14)
    # masked classes (-inf) do not count: uniform over the 2 that remain
    assert prediction_entropy(torch.tensor([[0.0, 0.0, -math.inf]])) == pytest.approx(math.log(2), abs=1e-14)


def test_entropy_matches_direct_formula():
    logits = torch.randn(50, 6, generator=torch.Generator().manual_seed(1)) * 3
    p = np.exp(logits.double().numpy())
    p /= p.sum(axis=1, keepdims=True)
    expected = float(np.mean(-(p * np.log(p)).sum(axis=1)))
    assert prediction_entropy(logits) == pytest.approx(expected, rel=1e-10)
    assert prediction_entropy(torch.tensor([[50.0, 0.0, 0.0]])) < 1e-18
    # sharper logits, lower entropy
    assert prediction_entropy(logits * 3) < prediction_entropy(logits) < prediction_entropy(logits / 3)


# --- ECE --------------------------------------------------------------------------------------------------------------

def test_ece_hand_computed():
    # confidences 0.9, 0.9 (both right) and 0.6, 0.6 (one right): 0.5 * |1 - 0.9| + 0.5 * |0.5 - 0.6| = 0.1
    probs = torch.tensor([[0.9, 0.1], [0.1, 0.9], [0.6, 0.4], [0.4, 0.6]], dtype=torch.float64)
    labels = torch.tensor([0, 1, 0, 0])
    assert expected_calibration_error(probs.log(), labels) == pytest.approx(0.1, abs=1e-12)
    # with one bin it is |accuracy - mean confidence| = |0.75 - 0.75| = 0
    assert expected_calibration_error(probs.log(), labels, n_bins=1) == pytest.approx(0.0, abs=1e-12)


def test_ece_matches_reference_implementation():
    g = torch.Generator().manual_seed(3)
    logits = 2 * torch.randn(3000, 4, generator=g, dtype=torch.float64)
    labels = torch.randint(0, 4, (3000,), generator=g)
    probs = torch.softmax(logits, dim=-1).numpy()
    for n_bins in (1, 10, 15):
        assert expected_calibration_error(logits, labels, n_bins=n_bins) == pytest.approx(
            ece_reference(probs, labels.numpy(), n_bins), abs=1e-12)


def test_ece_near_zero_for_calibrated_and_large_for_overconfident():
    logits, labels = calibrated_sample(50_000)
    assert expected_calibration_error(logits, labels) < 0.01
    assert expected_calibration_error(5 * logits, labels) > 0.1


# --- temperature scaling ----------------------------------------------------------------------------------------------

def test_fit_temperature_recovers_the_scale():
    logits, labels = calibrated_sample(20_000, seed=1)
    assert fit_temperature(logits, labels) == pytest.approx(1.0, rel=0.05)
    assert fit_temperature(5 * logits, labels) == pytest.approx(5.0, rel=0.05)
    assert fit_temperature(logits / 4, labels) == pytest.approx(0.25, rel=0.05)
    assert fit_temperature(5 * logits, labels) == fit_temperature(5 * logits, labels)  # deterministic


def test_fitted_temperature_minimises_nll():
    logits, labels = calibrated_sample(5000, seed=2)
    noise = torch.randn(logits.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64)
    logits = 3 * logits + 0.5 * noise  # not a pure rescaling of a calibrated model
    t = fit_temperature(logits, labels)
    best = negative_log_likelihood(apply_temperature(logits, t), labels)
    for factor in (0.98, 1.02, 0.8, 1.25):
        assert best < negative_log_likelihood(apply_temperature(logits, t * factor), labels)
    grid = np.exp(np.linspace(math.log(0.1), math.log(10), 2001))
    nll = [negative_log_likelihood(logits / float(s), labels) for s in grid[::50]]
    assert best <= min(nll) + 1e-12


def test_temperature_scaling_lowers_ece_on_held_out_data():
    logits, labels = calibrated_sample(20_000, seed=4)
    overconfident = 5 * logits.float()  # float32, as a model would produce
    val, test = slice(0, 10_000), slice(10_000, None)
    t = fit_temperature(overconfident[val], labels[val])
    before = expected_calibration_error(overconfident[test], labels[test])
    after = expected_calibration_error(apply_temperature(overconfident[test], t), labels[test])
    assert before > 0.1
    assert after < 0.02
    assert after < before / 5


def test_temperature_at_the_bounds():
    labels = torch.tensor([0, 1, 2, 0])
    # the true class always has the lowest logit: NLL falls as T grows, the upper bound is returned
    anti = torch.full((4, 3), 1.0)
    anti[torch.arange(4), labels] = -1.0
    assert fit_temperature(anti, labels, t_max=50.0) == 50.0
    # separable with margin: NLL falls as T shrinks, the lower bound is returned
    assert fit_temperature(-anti, labels, t_min=0.05) == 0.05
    assert fit_temperature(torch.zeros(4, 3), labels) == 1.0  # no information about T


def test_apply_temperature():
    logits = torch.tensor([[1.0, -2.0, 4.0]])
    copy = logits.clone()
    torch.testing.assert_close(apply_temperature(logits, 2.0), torch.tensor([[0.5, -1.0, 2.0]]))
    assert torch.equal(logits, copy)
    assert apply_temperature(logits, 2.0).dtype == torch.float32


# --- errors -----------------------------------------------------------------------------------------------------------

def test_bad_inputs_name_the_parameter():
    logits, labels = torch.zeros(4, 3), torch.tensor([0, 1, 2, 0])
    with pytest.raises(ParameterError, match="'temperature'"):
        apply_temperature(logits, 0.0)
    with pytest.raises(ParameterError, match="'temperature'"):
        apply_temperature(logits, -1.0)
    with pytest.raises(ParameterError, match="'n_bins'"):
        expected_calibration_error(logits, labels, n_bins=0)
    with pytest.raises(ParameterError, match="'labels'"):
        expected_calibration_error(logits, labels[:3])
    with pytest.raises(ParameterError, match="'labels'"):
        expected_calibration_error(logits, torch.tensor([0, 1, 3, 0]))
    with pytest.raises(ParameterError, match="'labels'"):
        fit_temperature(logits, labels.float())
    with pytest.raises(ParameterError, match="'logits'"):
        prediction_entropy(torch.zeros(5))
    with pytest.raises(ParameterError, match="'logits'"):
        prediction_entropy(torch.tensor([[0.0, float("nan")]]))
    with pytest.raises(ParameterError, match="'t_min'"):
        fit_temperature(logits, labels, t_min=2.0, t_max=1.0)
