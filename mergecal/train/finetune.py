"""Fine-tuning a CLIP image encoder on one task, following Ilharco et al. (task_vectors, ICLR 2023).

Only the image encoder (``visual.*``) is trained; the classifier is the task's zero-shot head, frozen, so the
logits are logit_scale * normalize(encode_image(x)) @ W (docs/references.md, "Evaluation protocol").
Cross-entropy, AdamW with weight decay 0.1, linear warmup then cosine decay, seeded batches.

Objectives (``regime``; the benchmark's regimes are built from them, ``mergecal.regimes``):

* ``standard``: plain cross-entropy;
* ``low_confidence``: an under-confident source model (higher prediction entropy), made by the loss named in
  ``low_confidence_loss``: ``label_smoothing`` (0.1, the paper's main setting), ``mixup`` (one mixing coefficient
  per step drawn from U(0, 1), the paper's appendix) or ``focal`` (focal loss, gamma 10 in the appendix).

DisTaC's norm-mismatch condition is a ``standard`` fine-tune at a multiple of the learning rate: the caller sets
``lr`` (the pipeline from ``vision.norm_mismatch_lr_multiplier``); the trainer has no multiplier of its own.

Splits are the caller's: every image given is trained on, and the accuracy reported at the end is measured on the
``validation`` images given (the pipeline passes its held-out validation split,
``pipeline.tracks.clip.built.stages.task_split``).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch
import torch.nn.functional as F

from ..config_types import Count, NonNegativeInt, NonNegativeReal, PositiveReal, Probability, Steps
from ..errors import ParameterError, UnknownNameError
from ..regimes import OBJECTIVES, Objective
from .lr_schedule import cosine_lr, set_lr

LowConfidenceLoss = Literal["label_smoothing", "mixup", "focal"]
LOW_CONFIDENCE_LOSSES: tuple[str, ...] = get_args(LowConfidenceLoss)


@dataclass
class FinetuneConfig:
    """Library defaults for the tiny ViT on 2 CPU cores (the pipeline's default benchmark sets its own, shorter
    fine-tunes in params.yaml, ``vision.finetune``). lr 1e-3 because the tiny model starts from a weak
    pretraining (the real CLIP's 1e-5 would barely move it)."""

    steps: Steps = 200
    batch_size: Count = 64
    lr: PositiveReal = 1e-3
    weight_decay: NonNegativeReal = 0.1
    warmup_steps: NonNegativeInt = 20
    regime: Objective = "standard"  # the training objective (mergecal.regimes.OBJECTIVES)
    low_confidence_loss: LowConfidenceLoss = "label_smoothing"  # used by the low_confidence objective only
    label_smoothing: Probability = 0.1
    focal_gamma: NonNegativeReal = 10.0
    shift_pixels: NonNegativeInt = 2  # train augmentation: random translation by up to this many pixels
    seed: NonNegativeInt = 0


def random_shift(x: torch.Tensor, pixels: int, generator: torch.Generator) -> torch.Tensor:
    """Translate each image of [N, C, H, W] by a seeded random offset in [-pixels, pixels]^2, replicating the
    edges (labels of every task are translation-invariant: shapes, counts, digits, fonts, colours)."""
    if pixels <= 0:
        return x
    h, w = x.shape[-2:]
    padded = F.pad(x, (pixels, pixels, pixels, pixels), mode="replicate")
    offsets = torch.randint(0, 2 * pixels + 1, (len(x), 2), generator=generator).tolist()
    return torch.stack([padded[i, :, dy:dy + h, dx:dx + w] for i, (dy, dx) in enumerate(offsets)])


# CI size (with SMOKE_PRETRAIN's micro architecture): a few steps.
SMOKE_FINETUNE = FinetuneConfig(steps=4, batch_size=16, lr=1e-3, warmup_steps=1)


def focal_loss(logits_: torch.Tensor, target: torch.Tensor, gamma: float) -> torch.Tensor:
    """Batch mean of -(1 - p_t)^gamma log p_t (Lin et al., 2017); gamma = 0 is cross-entropy."""
    log_p = F.log_softmax(logits_, dim=-1).gather(1, target[:, None]).squeeze(1)
    return (-(1.0 - log_p.exp()).pow(gamma) * log_p).mean()


def mixup(x: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Mix each image with a seeded partner: returns (mixed images, partner indices, lam), lam ~ U(0, 1)."""
    lam = float(torch.rand((), generator=generator))
    partner = torch.randperm(len(x), generator=generator)
    return lam * x + (1.0 - lam) * x[partner], partner, lam


def _check_config(config: FinetuneConfig) -> None:
    if config.regime not in OBJECTIVES:
        raise UnknownNameError(f"regime={config.regime!r}: choose one of {', '.join(OBJECTIVES)} (norm mismatch is "
                               "a standard fine-tune at a multiple of lr)")
    if config.low_confidence_loss not in LOW_CONFIDENCE_LOSSES:
        raise UnknownNameError(f"low_confidence_loss={config.low_confidence_loss!r}: choose one of "
                               f"{', '.join(LOW_CONFIDENCE_LOSSES)}")
    if config.steps < 1 or config.batch_size < 1:
        raise ParameterError(f"finetune: steps and batch_size must be >= 1, got {config.steps}, {config.batch_size}")


def _step_loss(model, head, x, y, config: FinetuneConfig, generator: torch.Generator) -> torch.Tensor:
    """The training loss of one batch under the config's regime (plain cross-entropy unless low_confidence)."""
    from ..backbones.open_clip_vit import logits

    kind = config.low_confidence_loss if config.regime == "low_confidence" else "cross_entropy"
    if kind == "mixup":
        mixed, partner, lam = mixup(x, generator)
        out = logits(model, head, mixed)
        return lam * F.cross_entropy(out, y) + (1.0 - lam) * F.cross_entropy(out, y[partner])
    out = logits(model, head, x)
    if kind == "focal":
        return focal_loss(out, y, config.focal_gamma)
    return F.cross_entropy(out, y, label_smoothing=config.label_smoothing if kind == "label_smoothing" else 0.0)


def _accuracy(model: torch.nn.Module, head: torch.Tensor, x: torch.Tensor, y: torch.Tensor, device: str) -> float:
    from ..backbones.open_clip_vit import logits

    if len(y) == 0:
        return float("nan")
    model.eval()
    with torch.no_grad():
        pred = torch.cat([logits(model, head, x[i:i + 512].to(device)).argmax(-1).cpu() for i in range(0, len(x), 512)])
    return float((pred == y).float().mean())


def finetune(model: torch.nn.Module, head: torch.Tensor, images: np.ndarray, labels: np.ndarray,
             config: FinetuneConfig | None = None, *, validation: tuple[np.ndarray, np.ndarray] | None = None,
             device: str = "cpu", progress: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    """Fine-tune a COPY of ``model``'s image encoder on all of ``images`` (uint8) / ``labels`` (int) with the
    frozen zero-shot ``head`` [embed_dim, C].

    Returns the fine-tuned model's full state dict (text tower and logit scale unchanged, on CPU) and the
    history ``{"loss", "lr"}`` per step, plus ``"val_accuracy"`` (one value, at the end) when ``validation``
    (images, labels) is given.
    """
    from tqdm.auto import tqdm

    from ..backbones.open_clip_vit import image_size, preprocess

    config = config or FinetuneConfig()
    _check_config(config)
    if len(images) != len(labels):
        raise ParameterError(f"finetune: {len(images)} images but {len(labels)} labels")

    model = copy.deepcopy(model).to(device)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("visual."))
    head = head.detach().to(device)

    x_all = preprocess(images, image_size(model))
    y_all = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    train_idx = torch.arange(len(y_all))

    params = [p for n, p in model.named_parameters() if n.startswith("visual.")]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    mix_generator = torch.Generator().manual_seed(config.seed + 1)  # mixup draws apart from the batch order
    shift_generator = torch.Generator().manual_seed(config.seed + 2)
    batch = min(config.batch_size, len(train_idx))
    order, cursor = train_idx[torch.randperm(len(train_idx), generator=generator)], 0
    history: dict[str, list[float]] = {"loss": [], "lr": []}
    model.train()
    for step in tqdm(range(config.steps), desc=f"finetune ({config.regime})", disable=not progress):
        if cursor + batch > len(order):
            order, cursor = train_idx[torch.randperm(len(train_idx), generator=generator)], 0
        idx = order[cursor:cursor + batch]
        cursor += batch
        lr = cosine_lr(step, config.steps, config.warmup_steps, config.lr)
        set_lr(optimizer, lr)
        x = random_shift(x_all[idx], config.shift_pixels, shift_generator)
        loss = _step_loss(model, head, x.to(device), y_all[idx].to(device), config, mix_generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        history["loss"].append(float(loss.detach()))
        history["lr"].append(lr)
    if validation is not None:
        x_val = preprocess(validation[0], image_size(model))
        y_val = torch.as_tensor(np.asarray(validation[1]), dtype=torch.long)
        history["val_accuracy"] = [_accuracy(model, head, x_val, y_val, device)]
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return state, history
