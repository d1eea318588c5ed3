"""MAGIC's WSC, Weight Space Calibration (data-free), after MAGIC, Li et al., arXiv:2512.19320
(Algorithm 2, Eq. 20-22) and the authors' code (docs/references.md).

For every covered key (rule ``wsc_weights``: keys containing 'weight' with >= 2 dimensions, reshaped to
[out, -1], so conv1 is included; 1-D keys, LayerNorms, embeddings and final projections are left alone, in
open_clip, HF CLIP, BERT-family and Llama names alike: mergecal.keys.key_role), xi is computed PER OUTPUT ROW.
For merged row d and the K task rows a_k:
    alpha_k = <d, a_k> / (||a_k||^2 + 1e-8);   d_perp = d - sum_k alpha_k a_k;
    xi = 1 / sqrt( sum_k alpha_k^2 + ||d_perp||^2 / ((mean_k ||a_k||)^2 + 1e-8) + 1e-8 )
i.e. d is scaled onto the hyperellipsoid with semi-axes a_k inside their span and a sphere of radius
mean ||a_k|| outside it (xi * d does not depend on the scale of d). NaN -> 1.
Conservative (XOR) rule per row: in a magnitude-sensitive key apply xi only where xi < 1; in other keys
only where xi > 1; with no sensitive set (None) apply xi both ways. MAGIC applies WSC to the merged
update of the base method with lambda = 1.

``granularity="row"`` (default) is the authors' code: one xi per output row. ``"layer"`` is the paper's
Algorithm 2: one xi per layer (key), the same formula with d and a_k the whole flattened matrices, and the
conservative rule applied to that one xi.

``projection="authors"`` (default) uses the independent projections above, exact only for orthogonal
task rows; ``"least_squares"`` solves for the orthogonal projection onto span{a_k} instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch

from ..keys import get_key_rule
from .base import CalibrationParams, WeightCalibration
from .registry import register_calibration

EPS = 1e-8


class WscParams(CalibrationParams):
    sensitive: list[str] | None = None  # magnitude-sensitive keys (from probing); None: no conservative rule
    projection: Literal["authors", "least_squares"] = "authors"
    key_rule: str = "wsc_weights"
    granularity: Literal["row", "layer"] = "row"  # authors' code / the paper's Algorithm 2 (one xi per layer)


def wsc_row_coefficients(merged: torch.Tensor, taus: Sequence[torch.Tensor],
                         projection: str = "authors") -> torch.Tensor:
    """xi for each output row of ``merged`` (reshaped to [out, -1]); shape [out]."""
    d = merged.reshape(merged.shape[0], -1).double()
    A = torch.stack([t.reshape(t.shape[0], -1).double() for t in taus], dim=1)  # [out, K, in]
    sq_norms = (A * A).sum(-1)  # [out, K]
    inner = torch.einsum("oki,oi->ok", A, d)
    if projection == "authors":
        alpha = inner / (sq_norms + EPS)
    else:
        gram = torch.einsum("oki,oji->okj", A, A) + EPS * torch.eye(A.shape[1], dtype=A.dtype)
        alpha = torch.linalg.solve(gram, inner.unsqueeze(-1)).squeeze(-1)
    d_perp = d - torch.einsum("ok,oki->oi", alpha, A)
    mean_norm = sq_norms.sqrt().mean(dim=1)
    xi = 1.0 / torch.sqrt((alpha * alpha).sum(1) + (d_perp * d_perp).sum(1) / (mean_norm**2 + EPS) + EPS)
    return torch.nan_to_num(xi, nan=1.0).float()


def wsc_layer_coefficient(merged: torch.Tensor, taus: Sequence[torch.Tensor],
                          projection: str = "authors") -> torch.Tensor:
    """The paper's one xi for a whole layer: ``wsc_row_coefficients`` of the flattened matrices; shape [1]."""
    return wsc_row_coefficients(merged.reshape(1, -1), [t.reshape(1, -1) for t in taus], projection)


def conservative(xi: torch.Tensor, sensitive: bool | None) -> torch.Tensor:
    """MAGIC's XOR rule: apply xi where (xi > 1) XOR sensitive; everywhere when sensitivity is unknown."""
    if sensitive is None:
        return xi
    apply = (xi > 1) ^ sensitive
    return torch.where(apply, xi, torch.ones_like(xi))


@register_calibration("wsc", phase="weight", needs_data=False)
class Wsc(WeightCalibration):
    name = "wsc"
    Params = WscParams

    @classmethod
    def from_step(cls, params, sensitive=None):
        """A step without its own ``sensitive`` list takes the probed keys (None: no conservative rule)."""
        if params.sensitive is None and sensitive is not None:
            params = params.model_copy(update={"sensitive": list(sensitive)})
        return cls(params)

    def __init__(self, params=None, **values):
        super().__init__(params, **values)
        self._rule = get_key_rule(self.params.key_rule)
        self._sensitive = set(self.params.sensitive) if self.params.sensitive is not None else None

    def covers(self, key, shape, dtype):
        return self._rule.matches(key, shape, dtype)

    def calibrate(self, key, merged, taus):
        coefficients = wsc_layer_coefficient if self.params.granularity == "layer" else wsc_row_coefficients
        raw = coefficients(merged, taus, self.params.projection)
        is_sensitive = None if self._sensitive is None else key in self._sensitive
        xi = conservative(raw, is_sensitive)
        shape = (-1,) + (1,) * (merged.dim() - 1) if self.params.granularity == "row" else (1,) * merged.dim()
        return merged * xi.to(merged.dtype).view(shape), {"xi_raw": raw, "xi": xi, "sensitive": is_sensitive}
