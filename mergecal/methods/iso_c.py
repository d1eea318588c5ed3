"""Iso-C, isotropic merging in the common subspace (Marczak et al., 2025).

Per 2-D key (rule ``matrices_except_text_projection``): SVD of sum_t tau_t, every singular value
replaced by their mean (a flat spectrum with the same mean), directions kept. Every other float key
is averaged (mean of tau_t). theta = theta_0 + alpha * merged, alpha = 1 by default (validation).
K = 1: alpha * the flat-spectrum tau (U mean(S) V^T) on matrices, alpha * tau elsewhere; not tau itself.
Degenerate input: if the sum is rank-deficient, its null-space singular vectors (completed arbitrarily
by LAPACK) also receive the mean singular value, exactly as in the original algorithm. Real task-vector
sums are full-rank.
Solvers: ``"gram"`` (default) gets U V^T and the mean singular value from the eigendecomposition of the
sum's smaller Gram matrix in float64 (mergecal.linalg.flat_polar_gram: exact, no randomized step);
``"svd"`` is the original full thin SVD, in float32 or, with ``float64``, float64.
On tensors off the CPU (CUDA) the "gram" solver runs torch-only, in float64 (mergecal.linalg's backends).
"""

from __future__ import annotations

import torch

from typing import Literal

from ..linalg import flat_polar_gram, svd
from .base import MatrixMergeMethod, MergeParams, register, sum_of


class IsoCParams(MergeParams):
    scaling: float = 1.0  # alpha
    key_rule: str = "matrices_except_text_projection"
    float64: bool = False  # the "svd" solver's precision ("gram" always works in float64)
    solver: Literal["gram", "svd"] = "gram"


def iso_c_matrix(taus: list[torch.Tensor], float64: bool = False, solver: str = "gram",
                 backend: str = "auto") -> torch.Tensor:
    """``backend``: the Gram route's implementation (mergecal.linalg: numpy/scipy on the CPU by default,
    torch-only off it)."""
    if solver == "gram":
        # summed in float64: the flat spectrum weights the smallest directions like the largest, so float32
        # rounding of the sum would show (~eps32 sigma_1 / sigma_r)
        polar, mean = flat_polar_gram(sum_of(taus, torch.float64), backend=backend)
        return (polar * mean).float()
    if solver != "svd":
        raise ValueError(f"unknown solver {solver!r}")
    U, S, Vh = svd(sum_of(taus, torch.float64 if float64 else None), float64=float64)
    return (U * S.mean()) @ Vh


@register
class IsoC(MatrixMergeMethod):
    name = "iso_c"
    Params = IsoCParams
    key_rule = "matrices_except_text_projection"
    summary = "flat spectrum (mean singular value) of the task-vector sum"

    def merge_matrix(self, taus):
        return iso_c_matrix(taus, self.params.float64, self.params.solver)
