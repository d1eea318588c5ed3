"""Confidence of a classifier's predictions: entropy and expected calibration error.

DisTaC (Yoshida et al., arXiv:2508.01148, Sec. 3.2, 4.2 and 6.2) makes low-confidence
source models over-confident before merging, measured by the mean prediction entropy.
All functions take logits [N, C] (and integer labels [N]) and compute in float64.
"""

from __future__ import annotations

import math

import torch

from .errors import ParameterError


def _logits(logits: torch.Tensor, name: str = "logits") -> torch.Tensor:
    if not isinstance(logits, torch.Tensor) or logits.dim() != 2 or logits.shape[0] == 0 or logits.shape[1] == 0:
        shape = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
        raise ParameterError(f"confidence: parameter {name!r} must be a non-empty [N, C] tensor, got {shape}")
    z = logits.detach().to(torch.float64)
    if bool(torch.isnan(z).any()) or bool((z == math.inf).any()):
        raise ParameterError(f"confidence: parameter {name!r} contains NaN or +Inf")
    return z


def _labels(labels: torch.Tensor, n: int, c: int) -> torch.Tensor:
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.shape[0] != n:
        shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ParameterError(f"confidence: parameter 'labels' must be a [N] tensor with N = {n}, got {shape}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise ParameterError(f"confidence: parameter 'labels' must hold integer class indices, got {labels.dtype}")
    if bool((labels < 0).any()) or bool((labels >= c).any()):
        raise ParameterError(f"confidence: parameter 'labels' must lie in [0, {c}), got values in "
                             f"[{int(labels.min())}, {int(labels.max())}]")
    return labels.long()


def prediction_entropy(logits: torch.Tensor) -> float:
    """Mean entropy of softmax(logits) in nats, H = logsumexp(z) - sum_c p_c z_c per row.

    That form is exact for uniform rows (H = log C) and tolerates -inf logits (masked classes).
    """
    z = _logits(logits)
    p = torch.softmax(z, dim=-1)
    pz = torch.where(p > 0, p * z, torch.zeros_like(z))  # 0 * -inf would be NaN
    entropy = torch.logsumexp(z, dim=-1) - pz.sum(dim=-1)
    return float(entropy.mean())


def expected_calibration_error(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> float:
    """ECE with ``n_bins`` equal-width confidence bins (Guo et al., 2017, Sec. 2).

    Confidence = max softmax probability, prediction = its argmax (first index on ties). Bin m holds the
    confidences in ((m-1)/M, m/M]; ECE = sum_m |B_m| / N * |accuracy(B_m) - mean confidence(B_m)|.
    """
    if not isinstance(n_bins, int) or isinstance(n_bins, bool) or n_bins < 1:
        raise ParameterError(f"confidence: parameter 'n_bins' must be an integer >= 1, got {n_bins!r}")
    z = _logits(logits)
    y = _labels(labels, z.shape[0], z.shape[1]).to(z.device)
    confidence, prediction = torch.softmax(z, dim=-1).max(dim=-1)
    correct = (prediction == y).to(torch.float64)
    # right-closed bins: ceil(conf * M) - 1; conf >= 1/C > 0, so the clamp only guards round-off at 1.0
    bins = (torch.ceil(confidence * n_bins).long() - 1).clamp_(0, n_bins - 1)
    count = torch.zeros(n_bins, dtype=torch.float64, device=z.device).index_add_(0, bins, torch.ones_like(confidence))
    conf_sum = torch.zeros_like(count).index_add_(0, bins, confidence)
    correct_sum = torch.zeros_like(count).index_add_(0, bins, correct)
    # |B_m|/N * |acc - conf| = |sum(correct) - sum(conf)| / N
    return float((correct_sum - conf_sum).abs().sum() / z.shape[0])


