"""Contrastive image-caption pretraining of a small open_clip model on the suite's ``pretrain`` data.

CLIP's objective (Radford et al., 2021): symmetric InfoNCE over a batch of (image, caption) pairs with a
learnable temperature, logits = exp(logit_scale) * normalize(f(x)) @ normalize(g(t)).T, the scale clamped at
100 as in CLIP. AdamW, linear warmup then cosine decay, everything seeded. The aim is a weak but real
zero-shot model: clearly above chance on the eight tasks, clearly below a fine-tuned one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..config_types import Count, NonNegativeInt, NonNegativeReal, PositiveReal, Steps
from ..errors import ParameterError
from .lr_schedule import cosine_lr, set_lr  # noqa: F401  (re-exported: mergecal.train.cosine_lr)

MAX_LOGIT_SCALE = math.log(100.0)


@dataclass
class PretrainConfig:
    arch: str = "mergecal-vit-tiny"
    steps: Steps = 600  # library default; the pipeline sets its own in params.yaml (vision.pretrain)
    batch_size: Count = 128
    lr: PositiveReal = 2e-3
    weight_decay: NonNegativeReal = 0.1
    warmup_steps: NonNegativeInt = 50
    seed: NonNegativeInt = 0


# CI size: the micro architecture, a few steps.
SMOKE_PRETRAIN = PretrainConfig(arch="mergecal-vit-micro", steps=8, batch_size=32, warmup_steps=2)


def clip_loss(image_features: torch.Tensor, text_features: torch.Tensor, logit_scale: torch.Tensor) -> torch.Tensor:
    """Symmetric InfoNCE on L2-normalised features; pair i is the positive of row i and of column i."""
    logits = logit_scale.exp() * F.normalize(image_features, dim=-1) @ F.normalize(text_features, dim=-1).T
    target = torch.arange(logits.shape[0], device=logits.device)
    return 0.5 * (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target))


def pretrain_clip(images: np.ndarray, captions: list[str], config: PretrainConfig | None = None, *,
                  model: torch.nn.Module | None = None, device: str = "cpu",
                  progress: bool = True) -> tuple[torch.nn.Module, dict[str, list[float]]]:
    """Pretrain ``config.arch`` (or continue ``model``) on uint8 ``images`` [N, H, W, 3] and their ``captions``.

    Batches are drawn by a seeded permutation per epoch. Returns the model (eval mode, on ``device``) and the
    history ``{"loss": [...], "lr": [...], "logit_scale": [...]}`` per step.
    """
    from tqdm.auto import tqdm

    from ..backbones.open_clip_vit import create_clip, get_tokenizer, image_size, preprocess

    config = config or PretrainConfig()
    if len(images) != len(captions) or len(images) < 2:
        raise ParameterError(f"pretrain_clip: need >= 2 images with one caption each, got {len(images)} images "
                             f"and {len(captions)} captions")
    if config.steps < 1 or config.batch_size < 2:
        raise ParameterError(f"pretrain_clip: steps must be >= 1 and batch_size >= 2, got {config.steps}, "
                             f"{config.batch_size}")
    model = (model or create_clip(config.arch, seed=config.seed)).to(device)
    tokenizer = get_tokenizer(config.arch)
    x_all = preprocess(images, image_size(model))
    t_all = tokenizer(list(captions))
    generator = torch.Generator().manual_seed(config.seed)
    # the fused kernel: the same AdamW update, about 1.3x faster per pretraining step on 2 CPU cores (most
    # parameters are the text tower's 49408-token embedding)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=config.weight_decay, fused=True)
    history: dict[str, list[float]] = {"loss": [], "lr": [], "logit_scale": []}
    batch = min(config.batch_size, len(images))
    order = torch.randperm(len(images), generator=generator)
    cursor = 0
    model.train()
    for step in tqdm(range(config.steps), desc="pretrain clip", disable=not progress):
        if cursor + batch > len(order):
            order, cursor = torch.randperm(len(images), generator=generator), 0
        idx = order[cursor:cursor + batch]
        cursor += batch
        lr = cosine_lr(step, config.steps, config.warmup_steps, config.lr)
        set_lr(optimizer, lr)
        loss = clip_loss(model.encode_image(x_all[idx].to(device)), model.encode_text(t_all[idx].to(device)),
                         model.logit_scale)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            model.logit_scale.clamp_(0.0, MAX_LOGIT_SCALE)
        history["loss"].append(float(loss.detach()))
        history["lr"].append(lr)
        history["logit_scale"].append(float(model.logit_scale.detach().exp()))
    return model.eval(), history
