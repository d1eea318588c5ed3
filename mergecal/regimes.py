"""The benchmark's regimes, defined once: the conditions of the fine-tuned models that a merge starts from
(DisTaC's failure modes, Yoshida et al., arXiv:2508.01148).

* ``standard``: every task fine-tuned with the base learning rate and plain cross-entropy;
* ``norm_mismatch``: as standard, except one task fine-tuned at a multiple of the learning rate, so that its task
  vector's norm is several times the others' (the pipeline's ``vision.norm_mismatch_lr_multiplier``: the one
  home of that multiple);
* ``low_confidence``: every task fine-tuned with a loss that leaves the model under-confident (the trainer's
  ``low_confidence`` objective).
"""

from __future__ import annotations

from typing import Literal, get_args

Regime = Literal["standard", "norm_mismatch", "low_confidence"]
REGIMES: tuple[str, ...] = get_args(Regime)

#: the training objectives of ``mergecal.train.finetune`` (a regime is built from these plus the lr multiple)
Objective = Literal["standard", "low_confidence"]
OBJECTIVES: tuple[str, ...] = get_args(Objective)

#: the objective every task of a regime is fine-tuned with (norm_mismatch: standard, one task at a higher lr)
OBJECTIVE_OF_REGIME: dict[str, str] = {"standard": "standard", "norm_mismatch": "standard",
                                       "low_confidence": "low_confidence"}

#: DisTaC's preset for the models of each regime (the standard regime has no failure mode of its own; norm matching
#: is the milder): the vision track's DisTaC step, and the own-model CLIP tracks' (as standard)
DISTAC_PRESETS = {"standard": "norm_mismatch", "norm_mismatch": "norm_mismatch", "low_confidence": "low_confidence"}
