"""Fine-tuning a CLIP image encoder on one task, following Ilharco et al. (task_vectors, ICLR 2023).

Only the image encoder (``visual.*``) is trained; the classifier is the task's zero-shot head, frozen, so the
logits are logit_scale * normalize(encode_image(x)) @ W (reference-details.md, "Evaluation protocol").
Cross-entropy, AdamW with weight decay 0.1, linear warmup then cosine decay, seeded batches.

Regimes (the source-model conditions studied by DisTaC, ../shared/papers/distac-task-vector-conditioning.txt):

* ``standard``: the base learning rate;
* ``norm_mismatch``: this task fine-tuned at 10x the learning rate (a task vector with a much larger norm);
* ``low_confidence``: label smoothing 0.1 (an under-confident source model, higher prediction entropy).

The validation split is ``validation_indices(n_train)`` (10% of train, fixed seed); it is held out of training.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from ..backbones.open_clip_vit import image_size, logits, preprocess
from ..data.vision import validation_indices
from ..errors import ParameterError, UnknownNameError
from .pretrain_clip import cosine_lr, set_lr

REGIMES = {
    "standard": {"lr_multiplier": 1.0, "label_smoothing": 0.0},
    "norm_mismatch": {"lr_multiplier": 10.0, "label_smoothing": 0.0},
    "low_confidence": {"lr_multiplier": 1.0, "label_smoothing": 0.1},
}


@dataclass
class FinetuneConfig:
    steps: int = 200
    batch_size: int = 64
    lr: float = 1e-4
    weight_decay: float = 0.1
    warmup_steps: int = 20
    regime: str = "standard"
    seed: int = 0


def _accuracy(model: torch.nn.Module, head: torch.Tensor, x: torch.Tensor, y: torch.Tensor, device: str) -> float:
    if len(y) == 0:
        return float("nan")
    model.eval()
    with torch.no_grad():
        pred = torch.cat([logits(model, head, x[i:i + 512].to(device)).argmax(-1).cpu() for i in range(0, len(x), 512)])
    return float((pred == y).float().mean())


def finetune(model: torch.nn.Module, head: torch.Tensor, images: np.ndarray, labels: np.ndarray,
             config: FinetuneConfig | None = None, *, device: str = "cpu",
             progress: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, list[float]]]:
    """Fine-tune a COPY of ``model``'s image encoder on a task's train split (uint8 ``images``, int ``labels``)
    with the frozen zero-shot ``head`` [embed_dim, C].

    Returns the fine-tuned model's full state dict (text tower and logit scale unchanged, on CPU) and the
    history ``{"loss", "lr"}`` per step plus ``"val_accuracy"`` (one value, at the end, on the held-out split).
    """
    from tqdm.auto import tqdm

    config = config or FinetuneConfig()
    if config.regime not in REGIMES:
        raise UnknownNameError(f"regime={config.regime!r}: choose one of {', '.join(REGIMES)}")
    if len(images) != len(labels):
        raise ParameterError(f"finetune: {len(images)} images but {len(labels)} labels")
    if config.steps < 1 or config.batch_size < 1:
        raise ParameterError(f"finetune: steps and batch_size must be >= 1, got {config.steps}, {config.batch_size}")
    regime = REGIMES[config.regime]
    base_lr = config.lr * regime["lr_multiplier"]

    model = copy.deepcopy(model).to(device)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("visual."))
    head = head.detach().to(device)

    x_all = preprocess(images, image_size(model))
    y_all = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    val = torch.as_tensor(validation_indices(len(y_all)), dtype=torch.long)
    train_mask = torch.ones(len(y_all), dtype=torch.bool)
    train_mask[val] = False
    train_idx = torch.nonzero(train_mask).squeeze(1)

    params = [p for n, p in model.named_parameters() if n.startswith("visual.")]
    optimizer = torch.optim.AdamW(params, lr=base_lr, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    batch = min(config.batch_size, len(train_idx))
    order, cursor = train_idx[torch.randperm(len(train_idx), generator=generator)], 0
    history: dict[str, list[float]] = {"loss": [], "lr": []}
    model.train()
    for step in tqdm(range(config.steps), desc=f"finetune ({config.regime})", disable=not progress):
        if cursor + batch > len(order):
            order, cursor = train_idx[torch.randperm(len(train_idx), generator=generator)], 0
        idx = order[cursor:cursor + batch]
        cursor += batch
        lr = cosine_lr(step, config.steps, config.warmup_steps, base_lr)
        set_lr(optimizer, lr)
        out = logits(model, head, x_all[idx].to(device))
        loss = F.cross_entropy(out, y_all[idx].to(device), label_smoothing=regime["label_smoothing"])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        history["loss"].append(float(loss.detach()))
        history["lr"].append(lr)
    history["val_accuracy"] = [_accuracy(model, head, x_all[val], y_all[val], device)]
    state = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
    return state, history
