"""Confidence of a classifier's predictions: entropy, expected calibration error and temperature scaling.

DisTaC (Yoshida et al., arXiv:2508.01148, Sec. 3.2, 4.2 and 6.2) makes low-confidence
source models over-confident before merging, measured by the mean prediction entropy, and advises restoring
reliable confidence afterwards with post-hoc temperature scaling of the merged model (Guo et al., 2017).
All functions take logits [N, C] (and integer labels [N]) and compute in float64.
"""

from __future__ import annotations

import math

import torch

from ..errors import ParameterError


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


def _check_temperature(temperature: float) -> float:
    temperature = float(temperature)
    if not (temperature > 0.0 and math.isfinite(temperature)):
        raise ParameterError(f"confidence: parameter 'temperature' must be a finite number > 0, got {temperature}")
    return temperature


def prediction_entropy(logits: torch.Tensor) -> float:
    """Mean entropy of softmax(logits) in nats, H = logsumexp(z) - sum_c p_c z_c per row.

    That form is exact for uniform rows (H = log C) and tolerates -inf logits (masked classes).
    """
    z = _logits(logits)
    p = torch.softmax(z, dim=-1)
    pz = torch.where(p > 0, p * z, torch.zeros_like(z))  # 0 * -inf would be NaN
    entropy = torch.logsumexp(z, dim=-1) - pz.sum(dim=-1)
    return float(entropy.mean())


def negative_log_likelihood(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """Mean cross-entropy of softmax(logits) against integer ``labels`` (nats)."""
    z = _logits(logits)
    y = _labels(labels, z.shape[0], z.shape[1]).to(z.device)
    return float(torch.nn.functional.cross_entropy(z, y))


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


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """logits / T (a new tensor with the dtype of ``logits``); T > 1 softens, T < 1 sharpens."""
    return logits / _check_temperature(temperature)


def fit_temperature(logits: torch.Tensor, labels: torch.Tensor, *, t_min: float = 1e-2, t_max: float = 1e2,
                    iterations: int = 100) -> float:
    """Post-hoc temperature scaling (Guo et al., 2017): the T > 0 minimising the NLL of softmax(logits / T).

    With b = 1/T the NLL, mean_i [logsumexp(b z_i) - b z_{i, y_i}], is convex in b, and its derivative
    mean_i [E_{softmax(b z_i)}[z_i] - z_{i, y_i}] is nondecreasing; the minimiser is found by bisection on
    that derivative over log b in [1/t_max, 1/t_min], which is deterministic and needs no step size. When
    the optimum lies outside [t_min, t_max] the nearer bound is returned; logits whose rows are all constant
    carry no information about T and give 1.0. Fit on held-out (validation) logits, not training ones.
    """
    if not (0.0 < t_min < t_max and math.isfinite(t_max)):
        raise ParameterError(f"confidence: parameters 't_min', 't_max' must satisfy 0 < t_min < t_max, "
                             f"got {t_min}, {t_max}")
    if iterations < 1:
        raise ParameterError(f"confidence: parameter 'iterations' must be >= 1, got {iterations}")
    z = _logits(logits)
    y = _labels(labels, z.shape[0], z.shape[1]).to(z.device)
    finite = torch.where(torch.isfinite(z), z, torch.zeros_like(z))
    if not bool((finite.amax(dim=-1) > finite.amin(dim=-1)).any()):
        return 1.0
    z_true = z.gather(1, y[:, None]).squeeze(1)
    if bool(torch.isinf(z_true).any()):
        raise ParameterError("confidence: parameter 'logits' gives -inf to a true label; "
                             "the NLL is infinite for every T")

    def slope(b: float) -> float:  # d NLL / d b
        p = torch.softmax(b * z, dim=-1)
        expected = torch.where(p > 0, p * z, torch.zeros_like(z)).sum(dim=-1)
        return float((expected - z_true).mean())

    lo, hi = math.log(1.0 / t_max), math.log(1.0 / t_min)  # log b
    if slope(math.exp(lo)) >= 0.0:
        return t_max
    if slope(math.exp(hi)) <= 0.0:
        return t_min
    for _ in range(iterations):
        mid = 0.5 * (lo + hi)
        if slope(math.exp(mid)) < 0.0:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return 1.0 / math.exp(0.5 * (lo + hi))
