"""Accuracy, mean prediction entropy and ECE of a CLIP model with a zero-shot (or any linear) head on a split.

Logits follow the evaluation protocol (docs/references.md): logit_scale * normalize(encode_image(x)) @ W, with
W from ``zero_shot_head``. Entropy and ECE are ``mergecal.confidence``'s (float64, 15 bins).
"""

from __future__ import annotations

import numpy as np
import torch

from ..backbones.open_clip_vit import image_size, logits, preprocess
from ..confidence import expected_calibration_error, prediction_entropy
from ..device import resolve_device
from ..errors import ParameterError


@torch.no_grad()
def predict_logits(model: torch.nn.Module, head: torch.Tensor, images: np.ndarray, *, batch_size: int = 256,
                   device: str | None = None) -> torch.Tensor:
    """Logits [N, C] (float32, CPU) of uint8 ``images`` [N, H, W, 3], computed in batches in eval mode."""
    if batch_size < 1:
        raise ParameterError(f"predict_logits: batch_size must be >= 1, got {batch_size}")
    device = resolve_device(device)
    was_training = model.training
    model.eval().to(device)
    size = image_size(model)
    # inference mode: no autograd bookkeeping at all (speed against no_grad is within run-to-run noise on 2 CPU
    # cores: 0.95-1.20x, evidence/scripts/perf_eval_speed.py). The model was moved before entering it, so its
    # parameters stay ordinary tensors
    with torch.inference_mode():
        out = [logits(model, head, preprocess(images[i:i + batch_size], size).to(device)).float().cpu()
               for i in range(0, len(images), batch_size)]
    model.train(was_training)
    return torch.cat(out) if out else torch.zeros(0, head.shape[1])


def evaluate(model: torch.nn.Module, head: torch.Tensor, images: np.ndarray, labels: np.ndarray, *,
             batch_size: int = 256, device: str | None = None, per_example: bool = False) -> dict[str, float]:
    """``{"accuracy", "entropy", "ece", "n"}`` of the model on (``images``, ``labels``); with ``per_example``
    also ``"correct"``: 1 or 0 per image, in the split's order."""
    if len(images) != len(labels) or len(images) == 0:
        raise ParameterError(f"evaluate: need a non-empty split with one label per image, got {len(images)} "
                             f"images and {len(labels)} labels")
    return logit_scores(predict_logits(model, head, images, batch_size=batch_size, device=device), labels,
                        per_example=per_example)


def logit_scores(z: torch.Tensor, labels: np.ndarray, *, per_example: bool = False) -> dict[str, float]:
    """``{"accuracy", "entropy", "ece", "n"}`` of logits [N, C] against their labels; with ``per_example`` also
    ``"correct"``, each example's 0/1 outcome (the leaderboard's confidence intervals resample them)."""
    y = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    hits = z.argmax(-1) == y
    scores = {"accuracy": float(hits.float().mean()), "entropy": prediction_entropy(z),
              "ece": expected_calibration_error(z, y), "n": int(len(y))}
    if per_example:
        scores["correct"] = hits.int().tolist()
    return scores
