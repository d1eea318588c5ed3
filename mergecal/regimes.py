"""The benchmark's regimes, defined once: the conditions of the fine-tuned models that a merge starts from
(DisTaC's failure modes, Yoshida et al., "DisTaC: Conditioning Task Vectors via Distillation for Robust Model
Merging", arXiv:2508.01148).

The default run's three:

* ``standard``: every task fine-tuned with the base learning rate and plain cross-entropy;
* ``norm_mismatch``: as standard, except one task fine-tuned at a multiple of the learning rate, so that its task
  vector's norm is several times the others' (the pipeline's ``vision.norm_mismatch_lr_multiplier``, one multiple
  or one per task: the one home of that multiple);
* ``low_confidence``: every task fine-tuned with a loss that leaves the model under-confident (the trainer's
  ``low_confidence`` objective, with the track's ``low_confidence_loss``).

The papers' variants of them (the paper's Table 2, Figs. 1a, 4 and 8), named by what they change:

* ``norm_mismatch_<task>``: the norm mismatch with ``<task>`` lengthened (the paper lengthens each task in turn);
* ``mixup``, ``focal``: every task fine-tuned with that low-confidence loss (Appendix C.2);
* ``label_smoothing_<alpha>``: every task fine-tuned with label smoothing ``alpha`` (Fig. 4: 0, 0.01, 0.1).

A regime maps each task to a fine-tuning *variant* (``variants``), the name of one fine-tuning configuration
(``finetune_overrides``); a variant two regimes share is one fine-tune.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Literal, get_args

from .errors import ParameterError

Regime = Literal["standard", "norm_mismatch", "low_confidence"]
REGIMES: tuple[str, ...] = get_args(Regime)

#: the training objectives of ``mergecal.train.finetune`` (a regime is built from these plus the lr multiple)
Objective = Literal["standard", "low_confidence"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)

#: the objective every task of a default regime is fine-tuned with (norm_mismatch: standard, one task at a higher lr)
OBJECTIVE_OF_REGIME: dict[str, str] = {"standard": "standard", "norm_mismatch": "standard",
                                       "low_confidence": "low_confidence"}

#: DisTaC's preset for the models of each default regime (the standard regime has no failure mode of its own; norm
#: matching is the milder): the vision track's DisTaC step, and the own-model CLIP tracks' (as standard)
DISTAC_PRESETS = {"standard": "norm_mismatch", "norm_mismatch": "norm_mismatch", "low_confidence": "low_confidence"}

#: the low-confidence losses a variant can name alone (``mergecal.train.finetune.LOW_CONFIDENCE_LOSSES``)
LOSS_VARIANTS = ("mixup", "focal")
NORM_MISMATCH_PREFIX = "norm_mismatch_"
_SMOOTHING = re.compile(r"^label_smoothing_(0|0?\.\d+|1(\.0*)?)$")


def label_smoothing_of(name: str) -> float | None:
    """``alpha`` of a ``label_smoothing_<alpha>`` name, else None."""
    found = _SMOOTHING.match(name)
    return float(found.group(1)) if found else None


def check_regime(name: str, tasks: Sequence[str], norm_mismatch_task: str) -> str:
    """``name`` if it names a regime of these tasks, else a one-line error saying which names exist."""
    if name in REGIMES or name in LOSS_VARIANTS or label_smoothing_of(name) is not None:
        return name
    if name.startswith(NORM_MISMATCH_PREFIX):
        task = name[len(NORM_MISMATCH_PREFIX):]
        if task == norm_mismatch_task:
            raise ParameterError(f"regime {name!r}: {task!r} is norm_mismatch_task, whose regime is 'norm_mismatch'")
        if task in tasks:
            return name
        raise ParameterError(f"regime {name!r}: {task!r} is not one of the tasks ({', '.join(tasks)})")
    raise ParameterError(f"unknown regime {name!r}; choose {', '.join(REGIMES)}, norm_mismatch_<task>, "
                         f"{', '.join(LOSS_VARIANTS)} or label_smoothing_<alpha> (alpha in [0, 1])")


def lengthened_task(name: str, norm_mismatch_task: str) -> str | None:
    """The task a norm-mismatch regime fine-tunes at the lr multiple; None for the other regimes."""
    if name == "norm_mismatch":
        return norm_mismatch_task
    return name[len(NORM_MISMATCH_PREFIX):] if name.startswith(NORM_MISMATCH_PREFIX) else None


def variants(name: str, tasks: Sequence[str], norm_mismatch_task: str) -> dict[str, str]:
    """Which fine-tuning variant each task contributes to regime ``name`` (task order kept)."""
    check_regime(name, tasks, norm_mismatch_task)
    longer = lengthened_task(name, norm_mismatch_task)
    if longer is not None:
        return {t: ("norm_mismatch" if t == longer else "standard") for t in tasks}
    return {t: name for t in tasks}


def distac_preset(name: str) -> str:
    """DisTaC's preset for a regime's models: norm matching for the standard and norm-mismatch regimes, the
    low-confidence setting for every low-confidence one."""
    if name in DISTAC_PRESETS:
        return DISTAC_PRESETS[name]
    return "norm_mismatch" if name.startswith(NORM_MISMATCH_PREFIX) else "low_confidence"


def finetune_overrides(variant: str, lr: float, lr_multiplier: float) -> dict[str, Any]:
    """The fine-tuning settings a variant changes (``mergecal.train.finetune.FinetuneConfig`` fields) on top of the
    track's ``finetune``: its objective, loss and smoothing, or the lr multiple of the norm mismatch."""
    if variant == "norm_mismatch":
        return {"regime": "standard", "lr": lr * lr_multiplier}
    if variant in OBJECTIVES:
        return {"regime": variant}
    if variant in LOSS_VARIANTS:
        return {"regime": "low_confidence", "low_confidence_loss": variant}
    alpha = label_smoothing_of(variant)
    if alpha is None:
        raise ParameterError(f"unknown fine-tuning variant {variant!r}")
    return {"regime": "low_confidence", "low_confidence_loss": "label_smoothing", "label_smoothing": alpha}
