"""Iso-C, isotropic merging in the common subspace (Marczak et al., 2025).

Per 2-D key (rule ``matrices_except_text_projection``): SVD of sum_t tau_t, every singular value
replaced by their mean (a flat spectrum with the same mean), directions kept. Every other float key
is averaged (mean of tau_t). theta = theta_0 + alpha * merged, alpha = 1 by default (validation).
K = 1: alpha * the flat-spectrum tau (U mean(S) V^T) on matrices, alpha * tau elsewhere; not tau itself.
Degenerate input: if the sum is rank-deficient, its null-space singular vectors (completed arbitrarily
by LAPACK) also receive the mean singular value, exactly as in the original algorithm. Real task-vector
sums are full-rank.
"""

from __future__ import annotations

import torch

from ..linalg import svd
from .base import MatrixMergeMethod, MergeParams, register, sum_of


class IsoCParams(MergeParams):
    scaling: float = 1.0  # alpha
    key_rule: str = "matrices_except_text_projection"
    float64: bool = False


def iso_c_matrix(taus: list[torch.Tensor], float64: bool = False) -> torch.Tensor:
    U, S, Vh = svd(sum_of(taus), float64=float64)
    return (U * S.mean()) @ Vh


@register
class IsoC(MatrixMergeMethod):
    name = "iso_c"
    Params = IsoCParams
    key_rule = "matrices_except_text_projection"
    summary = "flat spectrum (mean singular value) of the task-vector sum"

    def merge_matrix(self, taus):
        return iso_c_matrix(taus, self.params.float64)
