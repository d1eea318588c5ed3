"""Task Arithmetic (Ilharco et al., 2023): theta = theta_0 + lambda * sum_t tau_t.

lambda is chosen on validation (grid 0..1); 0.3 is the customary default for 8 ViT tasks.
K = 1: lambda * tau, the fine-tuned model's task vector scaled.
"""

from __future__ import annotations

import torch

from .base import MergeMethod, MergeParams, register, sum_of


class TaskArithmeticParams(MergeParams):
    scaling: float = 0.3  # lambda


@register
class TaskArithmetic(MergeMethod):
    name = "task_arithmetic"
    Params = TaskArithmeticParams
    key_rule = "all_float"
    blockwise = True
    summary = "lambda * sum of the task vectors"

    def combine(self, key: str, taus: list[torch.Tensor]) -> torch.Tensor:
        return sum_of(taus)
