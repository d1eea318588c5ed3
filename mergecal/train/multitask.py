"""The multi-task reference ("traditional MTL"): one CLIP image encoder fine-tuned on all K tasks jointly, the
ceiling row of the merging papers' tables.

The recipe is the single-task fine-tunes' (``mergecal.train.finetune``): image encoder only, each task's frozen
zero-shot head, the same loss, AdamW, warmup then cosine decay over the joint run's steps, batch size, random
shifts. Each step's batch comes from one task, the tasks taken in round-robin order (step s trains task s mod K),
so that every task's head sees whole batches of its own classes.

Budget (``budget``), in steps of ``config.steps`` per single-task fine-tune:

* ``sum`` (default): the K fine-tunes' steps added up, so each task gets as many steps as its own fine-tune did
  and the reference costs what the K fine-tunes cost together;
* ``per_task_mean``: one fine-tune's steps (their mean), shared by the K tasks.

Task arithmetic ("Editing Models with Task Arithmetic", arXiv:2212.04089) trains its multi-task model on the union of
the tasks' training sets; the round-robin schedule with the ``sum`` budget is that run with every task's share of the
steps equal to its own fine-tune's, whatever the tasks' sizes.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Literal, get_args

import numpy as np
import torch

from ..errors import ParameterError, UnknownNameError
from .finetune import FinetuneConfig, _accuracy, _check_config, _step_loss, random_shift
from .lr_schedule import cosine_lr, set_lr

MultitaskBudget = Literal["sum", "per_task_mean"]
MULTITASK_BUDGETS: tuple[str, ...] = get_args(MultitaskBudget)


def multitask_steps(task_steps: Sequence[int], budget: str = "sum") -> int:
    """The joint run's steps from the single-task fine-tunes' ``task_steps`` (one per task) under ``budget``."""
    if budget not in MULTITASK_BUDGETS:
        raise UnknownNameError(f"budget={budget!r}: choose one of {', '.join(MULTITASK_BUDGETS)}")
    if not task_steps or any(s < 1 for s in task_steps):
        raise ParameterError(f"task_steps: one count >= 1 per task expected, got {list(task_steps)}")
    if budget == "sum":
        return int(sum(task_steps))
    return max(1, round(sum(task_steps) / len(task_steps)))


def round_robin(num_tasks: int, steps: int) -> list[int]:
    """The task whose batch each step trains on: 0, 1, ..., K-1, 0, 1, ..."""
    if num_tasks < 1 or steps < 1:
        raise ParameterError(f"round_robin: num_tasks and steps must be >= 1, got {num_tasks}, {steps}")
    return [step % num_tasks for step in range(steps)]


def finetune_multitask(model: torch.nn.Module, heads: Sequence[torch.Tensor],
                       datasets: Sequence[tuple[np.ndarray, np.ndarray]], config: FinetuneConfig | None = None, *,
                       budget: str = "sum", validation: Sequence[tuple[np.ndarray, np.ndarray]] | None = None,
                       device: str = "cpu", progress: bool = True) -> tuple[dict[str, torch.Tensor], dict]:
    """Fine-tune a COPY of ``model``'s image encoder on the K tasks of ``datasets`` ((uint8 images, int labels)
    each) jointly, task k scored by its frozen zero-shot head ``heads[k]`` [embed_dim, C_k]. ``config`` is the
    single-task recipe (its ``steps``: one task's fine-tune); the joint run takes ``multitask_steps`` steps.

    Returns the model's full state dict (on CPU) and the history ``{"loss", "lr", "task"}`` per step, plus
    ``"val_accuracy"`` (one value per task, at the end) when ``validation`` (one split per task) is given.
    """
    from tqdm.auto import tqdm

    from ..backbones.open_clip_vit import image_size, preprocess

    config = config or FinetuneConfig()
    _check_config(config)
    if len(heads) != len(datasets) or not datasets:
        raise ParameterError(f"finetune_multitask: one head per task expected, got {len(heads)} heads and "
                             f"{len(datasets)} datasets")
    if validation is not None and len(validation) != len(datasets):
        raise ParameterError(f"validation: one split per task expected, got {len(validation)} for {len(datasets)}")
    for k, (images, labels) in enumerate(datasets):
        if len(images) != len(labels) or len(labels) == 0:
            raise ParameterError(f"datasets[{k}]: as many images as labels (>= 1) expected, got {len(images)} "
                                 f"images and {len(labels)} labels")
    steps = multitask_steps([config.steps] * len(datasets), budget)
    schedule = round_robin(len(datasets), steps)

    model = copy.deepcopy(model).to(device)
    for name, param in model.named_parameters():
        param.requires_grad_(name.startswith("visual."))
    heads = [h.detach().to(device) for h in heads]
    size = image_size(model)
    xs = [preprocess(images, size) for images, _ in datasets]
    ys = [torch.as_tensor(np.asarray(labels), dtype=torch.long) for _, labels in datasets]

    params = [p for n, p in model.named_parameters() if n.startswith("visual.")]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay)
    generator = torch.Generator().manual_seed(config.seed)
    mix_generator = torch.Generator().manual_seed(config.seed + 1)
    shift_generator = torch.Generator().manual_seed(config.seed + 2)
    batches = [min(config.batch_size, len(y)) for y in ys]
    orders = [torch.randperm(len(y), generator=generator) for y in ys]  # each task's own epochs
    cursors = [0] * len(ys)
    history: dict[str, list] = {"loss": [], "lr": [], "task": []}
    model.train()
    for step, k in enumerate(tqdm(schedule, desc="finetune (multitask)", disable=not progress)):
        if cursors[k] + batches[k] > len(orders[k]):
            orders[k], cursors[k] = torch.randperm(len(ys[k]), generator=generator), 0
        idx = orders[k][cursors[k]:cursors[k] + batches[k]]
        cursors[k] += batches[k]
        lr = cosine_lr(step, steps, config.warmup_steps, config.lr)
        set_lr(optimizer, lr)
        x = random_shift(xs[k][idx], config.shift_pixels, shift_generator)
        loss = _step_loss(model, heads[k], x.to(device), ys[k][idx].to(device), config, mix_generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        history["loss"].append(float(loss.detach()))
        history["lr"].append(lr)
        history["task"].append(k)
    if validation is not None:
        history["val_accuracy"] = [
            _accuracy(model, head, preprocess(images, size), torch.as_tensor(np.asarray(labels), dtype=torch.long),
                      device) for head, (images, labels) in zip(heads, validation)]
    state = {key: v.detach().cpu().clone() for key, v in model.state_dict().items()}
    return state, history
