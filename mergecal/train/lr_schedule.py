"""The learning-rate schedule shared by the three trainers (CLIP pretraining, vision and text fine-tuning).

Linear warmup then cosine decay to zero, as in task_vectors (Ilharco et al.): one definition, so that the
vision and text tracks and the pretraining cannot drift apart.
"""

from __future__ import annotations

import math

import torch

from ..errors import ParameterError


def warmup_cosine(step: int, total: int, warmup: int) -> float:
    """The multiplier of the base learning rate at 0-based ``step``: (step+1)/warmup during the warmup, then
    0.5 (1 + cos(pi * progress)), reaching 0 at ``total`` and staying there."""
    if step < 0 or total < 1:
        raise ParameterError(f"warmup_cosine: need step >= 0 and total >= 1, got {step}, {total}")
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def cosine_lr(step: int, total: int, warmup: int, base_lr: float) -> float:
    """``base_lr * warmup_cosine(step, total, warmup)``."""
    return base_lr * warmup_cosine(step, total, warmup)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set every parameter group's learning rate (the trainers call this once per step, before ``step()``)."""
    for group in optimizer.param_groups:
        group["lr"] = lr
