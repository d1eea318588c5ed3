"""Confidence measures (mergecal.confidence)."""

import math

import numpy as np
import pytest
import torch

from mergecal.confidence import (
    expected_calibration_error,
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


# --- errors -----------------------------------------------------------------------------------------------------------

def test_bad_inputs_name_the_parameter():
    logits, labels = torch.zeros(4, 3), torch.tensor([0, 1, 2, 0])
    with pytest.raises(ParameterError, match="'n_bins'"):
        expected_calibration_error(logits, labels, n_bins=0)
    with pytest.raises(ParameterError, match="'labels'"):
        expected_calibration_error(logits, labels[:3])
    with pytest.raises(ParameterError, match="'labels'"):
        expected_calibration_error(logits, torch.tensor([0, 1, 3, 0]))
    with pytest.raises(ParameterError, match="'logits'"):
        prediction_entropy(torch.zeros(5))
    with pytest.raises(ParameterError, match="'logits'"):
        prediction_entropy(torch.tensor([[0.0, float("nan")]]))
