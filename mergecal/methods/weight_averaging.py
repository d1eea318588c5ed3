"""Weight Averaging: theta = theta_0 + mean_t tau_t (task arithmetic with lambda = 1/K).

K = 1: scaling * tau (the fine-tuned model itself at the default scaling = 1).
"""

from __future__ import annotations

import torch

from .base import MergeMethod, MergeParams, mean_of, register


class WeightAveragingParams(MergeParams):
    scaling: float = 1.0


@register
class WeightAveraging(MergeMethod):
    name = "weight_averaging"
    Params = WeightAveragingParams
    key_rule = "all_float"
    blockwise = True
    summary = "mean of the task vectors"

    def combine(self, key: str, taus: list[torch.Tensor]) -> torch.Tensor:
        return mean_of(taus)
