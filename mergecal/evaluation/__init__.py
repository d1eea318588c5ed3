"""Evaluation of CLIP models with zero-shot heads: accuracy, entropy, ECE."""

from ..device import resolve_device
from .zeroshot import evaluate, predict_logits

__all__ = ["evaluate", "predict_logits", "resolve_device"]
