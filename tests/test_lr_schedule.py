"""The warmup + cosine schedule shared by CLIP pretraining, vision fine-tuning and text fine-tuning."""

import importlib
import math

import pytest
import torch

from mergecal.errors import ParameterError
from mergecal.train import cosine_lr
from mergecal.train.lr_schedule import set_lr, warmup_cosine


def test_warmup_is_linear_then_cosine_reaches_zero_and_stays():
    values = [warmup_cosine(s, 10, 4) for s in range(12)]
    assert values[:4] == [0.25, 0.5, 0.75, 1.0]
    assert values[4] == 1.0  # progress 0 after the warmup
    assert values[7] == pytest.approx(0.5 * (1 + math.cos(math.pi * 3 / 6)))  # = 0.5
    assert values[10] == pytest.approx(0.0, abs=1e-12) and values[11] == pytest.approx(0.0, abs=1e-12)
    assert all(a >= b for a, b in zip(values[3:], values[4:]))  # non-increasing after the warmup


def test_no_warmup_and_base_lr_scaling():
    assert warmup_cosine(0, 5, 0) == 1.0
    assert cosine_lr(2, 10, 4, 3e-4) == pytest.approx(3e-4 * 0.75)


def test_every_trainer_uses_this_schedule():
    vision, text, pretrain = (importlib.import_module(f"mergecal.train.{m}")
                              for m in ("finetune", "finetune_text", "pretrain_clip"))

    assert pretrain.cosine_lr is cosine_lr and vision.cosine_lr is cosine_lr
    assert text.warmup_cosine is warmup_cosine


def test_set_lr_and_bad_arguments():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=1.0)
    set_lr(optimizer, 0.125)
    assert optimizer.param_groups[0]["lr"] == 0.125
    with pytest.raises(ParameterError, match="total >= 1"):
        warmup_cosine(0, 0, 0)
