"""Evaluation of CLIP models with zero-shot heads: accuracy, entropy, ECE."""

from .zeroshot import evaluate, predict_logits, resolve_device

__all__ = ["evaluate", "predict_logits", "resolve_device"]
