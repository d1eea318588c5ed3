"""DisTaC's rescaling alone: each task vector scaled by its kappa, no distillation (Yoshida et al., "DisTaC:
Conditioning Task Vectors via Distillation for Robust Model Merging", arXiv:2508.01148, Appendix C.4 and Fig. 8:
"Norm Mismatch (only scaling)").

theta_t <- theta_pre + kappa_t tau_t, with kappa from norm matching (``mergecal.calibrations.distac
.kappas_from_norms``: the longest task vector shrunk to the mean norm of the others, every other kappa 1) unless
``kappa`` fixes one for every model. It is DisTaC's anchor (Algorithm 1, line 3) merged as it is, the ablation that
shows what the distillation adds; it needs no data and runs in the cell.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch
from pydantic import Field

from ..methods.base import HyperParams
from ..task_vectors import task_vector
from .distac import kappas_from_norms, task_vector_norm
from .registry import register_calibration

StateDict = Mapping[str, torch.Tensor]


def rescaled(pretrained: StateDict, finetuned: StateDict, kappa: float) -> dict[str, torch.Tensor]:
    """theta_pre + kappa (theta_t - theta_pre) on the floating keys (computed in float32, stored in the fine-tuned
    dtype); kappa = 1 returns the fine-tuned tensors themselves, as DisTaC's anchor does."""
    if kappa == 1.0:
        return dict(finetuned)
    out = {}
    for key, value in finetuned.items():
        if value.is_floating_point():
            base = pretrained[key].float()
            out[key] = (base + kappa * (value.float() - base)).to(value.dtype)
        else:
            out[key] = value
    return out


@register_calibration("rescale", phase="pre", needs_data=False)
class RescaleParams(HyperParams):
    """``kappa``: one scale for every task vector; None (the default) is norm matching, as DisTaC's
    norm-mismatch preset."""

    OWNER: ClassVar[str] = "rescale"

    kappa: float | None = Field(None, gt=0.0)

    @staticmethod
    def run_step(params: "RescaleParams", pretrained: StateDict, finetuned: Sequence[StateDict], *args: Any,
                 previous: dict | None = None, **options: Any) -> tuple[list[StateDict], dict]:
        """The registry's ``run`` (``mergecal.run_recipe.run_pre_steps``): the models rescaled and a report
        ``{"kappas", "rescaled": [t]}`` (the tasks whose kappa is not 1)."""
        norms = [task_vector_norm(task_vector(m, pretrained)) for m in finetuned]
        kappas = kappas_from_norms(norms) if params.kappa is None else [params.kappa] * len(finetuned)
        models = [rescaled(pretrained, m, k) for m, k in zip(finetuned, kappas)]
        return models, {"kappas": kappas, "rescaled": [t for t, k in enumerate(kappas) if k != 1.0]}
