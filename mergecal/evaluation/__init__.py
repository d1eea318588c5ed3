"""Evaluation of CLIP models with zero-shot heads: accuracy, entropy, ECE (``zeroshot``); of causal LMs with
lm-eval (``lm_eval_tasks``, ``lm_eval_registry``).

``evaluate`` and ``predict_logits`` are imported on first use: ``zeroshot`` imports open_clip (and torchvision),
about 5-10 s on the 2-core machine, which the LLM stages and cells that import ``lm_eval_tasks`` never need."""

from ..device import resolve_device

__all__ = ["evaluate", "predict_logits", "resolve_device"]


def __getattr__(name: str):
    if name in ("evaluate", "predict_logits"):
        from . import zeroshot

        return getattr(zeroshot, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
