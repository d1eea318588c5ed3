"""AdaMerging's settings (Yang et al., "AdaMerging: Adaptive Model Merging for Multi-Task Learning", ICLR 2024,
arXiv:2310.02575), the one home of their defaults: the merge methods' parameters (``mergecal.methods.adamerging``)
and the library function's config (``mergecal.adamerging.AdaMergingConfig``) both extend them. A module of its own
so that the library function reads them without importing the merge methods, which import it."""

from __future__ import annotations

from pydantic import Field

from ..config_types import Count, Flag, NonNegativeInt, Steps
from .base import HyperParams


class AdaMergingSettings(HyperParams):
    """The learning's settings, the one home of their defaults (the authors' code's, the paper's runs): every
    coefficient's ``init``, Adam's ``lr``, ``steps``, ``batch_size`` inputs per task and step, ``clamp`` to [0, 1]
    where used, the draws' ``seed``. The merge methods' parameters and ``mergecal.adamerging.AdaMergingConfig``
    both extend it."""

    init: float = 0.3
    lr: float = Field(1e-3, gt=0.0)
    steps: Steps = 500
    batch_size: Count = 16
    clamp: Flag = True
    seed: NonNegativeInt = 0
