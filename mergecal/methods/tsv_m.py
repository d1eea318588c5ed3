"""TSV-M, Task Singular Vectors merging (Gargiulo et al., 2025).

Per 2-D key (rule ``matrices_except_text_projection``): keep each task's top floor(r/K) singular
triplets (r = min(m, n)), concatenate the K blocks of U, S and V, replace the concatenated U and V by
their orthogonal polar factors (SVD(U_cat) = P Sigma Q^T -> P Q^T, likewise for V), and rebuild
U_orth diag(S_cat) V_orth^T. Every other float key is averaged (mean of tau_t). A 2-D key with
r < K (floor(r/K) = 0, which never happens in real ViTs) is averaged too rather than zeroed.
theta = theta_0 + alpha * merged, alpha = 1 by default (chosen on validation up to 3).
K = 1: every triplet is kept and U, V are already orthonormal, so alpha * tau (up to round-off).
Degenerate input: a task of rank below floor(r/K) contributes null-space singular vectors that LAPACK
completes arbitrarily (deterministically for a given input and library); they carry sigma = 0 but enter
the polar factor, exactly as in the original algorithm. Real task vectors are full-rank.
"""

from __future__ import annotations

import torch

from ..linalg import polar_factor, svd
from .base import MatrixMergeMethod, MergeParams, register


class TsvMParams(MergeParams):
    scaling: float = 1.0  # alpha
    key_rule: str = "matrices_except_text_projection"
    float64: bool = False


def tsv_merge_matrix(taus: list[torch.Tensor], float64: bool = False) -> torch.Tensor | None:
    """TSV-M of K task matrices; None when floor(r/K) = 0."""
    K = len(taus)
    rank = min(taus[0].shape) // K
    if rank == 0:
        return None
    us, ss, vhs = [], [], []
    for tau in taus:
        U, S, Vh = svd(tau, float64=float64)
        us.append(U[:, :rank])
        ss.append(S[:rank])
        vhs.append(Vh[:rank, :])
    U_orth = polar_factor(torch.cat(us, dim=1), float64=float64)
    Vh_orth = polar_factor(torch.cat(vhs, dim=0), float64=float64)
    return (U_orth * torch.cat(ss)) @ Vh_orth


@register
class TsvM(MatrixMergeMethod):
    name = "tsv_m"
    Params = TsvMParams
    key_rule = "matrices_except_text_projection"
    summary = "per-task top floor(r/K) singular triplets, polar-orthogonalised"

    def merge_matrix(self, taus):
        return tsv_merge_matrix(taus, self.params.float64)
