"""Consensus merging with TALL masks (Wang et al., 2024).

TALL mask of task t: m_t = |tau_t| > lambda_t * |tau_MTL - tau_t| with tau_MTL = sum_s tau_s (i.e.
|theta_0 - theta_t| > lambda_t |theta_MTL - theta_t|, strict, as in the authors' code). Consensus keeps
a coordinate where at least k = 2 task masks include it, zeroes it elsewhere, and then applies task
arithmetic: theta = theta_0 + lambda * (consensus_mask * sum_t tau_t).

lambda_t is searched per task on validation in {0.2, ..., 0.6} by the authors; ``mask_lambda`` takes
one value for all tasks or a list of K values. k = 0 reduces to TA. k > K would zero every coordinate
(the pretrained model, silently), so it is rejected. K = 1: the mask of the only task keeps every
coordinate it moved (|tau| > lambda * 0), so k = 1 gives lambda * tau; the default k = 2 is rejected.
"""

from __future__ import annotations

import torch

from ..config_types import NonNegativeInt
from ..errors import ParameterError
from .base import MergeMethod, MergeParams, register, sum_of


class ConsensusParams(MergeParams):
    scaling: float = 0.3  # lambda of the task-arithmetic prior
    mask_lambda: float | list[float] = 0.4
    min_agreement: NonNegativeInt = 2  # k


def _lambdas(mask_lambda: float | list[float], K: int) -> list[float]:
    lambdas = mask_lambda if isinstance(mask_lambda, list) else [mask_lambda] * K
    if len(lambdas) != K:
        raise ParameterError(f"consensus: parameter 'mask_lambda' has {len(lambdas)} values but there are {K} tasks")
    return lambdas


@register
class Consensus(MergeMethod):
    name = "consensus"
    Params = ConsensusParams
    key_rule = "all_float"
    summary = "TA restricted to coordinates that >= k TALL masks keep"

    def _check_agreement(self, K: int) -> None:
        if self.params.min_agreement > K:
            raise ParameterError(f"consensus: parameter 'min_agreement'={self.params.min_agreement} exceeds the number "
                                 f"of models K={K}; no coordinate could be kept (use min_agreement <= {K})")

    def fit(self, task_vectors, keys):
        self._check_agreement(task_vectors.K)  # before any key is merged

    def combine(self, key, taus):
        self._check_agreement(len(taus))
        total = sum_of(taus)
        votes = torch.zeros(total.shape, dtype=torch.int32, device=total.device)
        for tau, lam in zip(taus, _lambdas(self.params.mask_lambda, len(taus))):
            votes += tau.abs() > lam * (total - tau).abs()
        return total.mul_(votes >= self.params.min_agreement)
