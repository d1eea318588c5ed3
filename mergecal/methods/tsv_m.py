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
Solvers: ``"gram"`` (default) takes each task's top triplets from the eigendecomposition of its smaller
Gram matrix in float64 and the polar factors from r x r Gram matrices (mergecal.linalg: exact, no
randomized step, ~2-3x faster than full SVDs); ``"svd"`` is the original route (a full thin SVD per task
and per polar factor), in float32 or, with ``float64``, float64 (the most accurate option).
On tensors off the CPU (CUDA) the "gram" solver runs torch-only, in float64, with the K tasks' top triplets
from one batched eigh (mergecal.linalg's backends; ``tsv_merge_matrix(..., backend="torch")`` on the CPU).
"""

from __future__ import annotations

import torch

from typing import Literal

from ..linalg import polar_factor, polar_gram, stack64, svd, top_svd, torch_route
from .base import MatrixMergeMethod, MergeParams, register


class TsvMParams(MergeParams):
    scaling: float = 1.0  # alpha
    key_rule: str = "matrices_except_text_projection"
    float64: bool = False  # the "svd" solver's precision ("gram" always works in float64)
    solver: Literal["gram", "svd"] = "gram"


def tsv_merge_matrix(taus: list[torch.Tensor], float64: bool = False,
                     solver: str = "gram", backend: str = "auto") -> torch.Tensor | None:
    """TSV-M of K task matrices; None when floor(r/K) = 0. ``backend`` picks the Gram route's implementation
    (mergecal.linalg: numpy/scipy on the CPU by default, torch-only and batched off it)."""
    K = len(taus)
    rank = min(taus[0].shape) // K
    if rank == 0:
        return None
    if solver == "gram" and torch_route(backend, taus[0]):
        u, s, vh = top_svd(stack64(taus), rank, backend="torch")  # one batched eigh over the K tasks
        m, n = taus[0].shape
        U_orth = polar_gram(u.transpose(0, 1).reshape(m, K * rank), backend="torch")  # [U_1 ... U_K]
        Vh_orth = polar_gram(vh.reshape(K * rank, n), backend="torch")
        return ((U_orth * s.reshape(-1)) @ Vh_orth).float()
    if solver == "gram":
        triplets = [top_svd(tau, rank) for tau in taus]
        U_orth = polar_gram(torch.cat([u for u, _, _ in triplets], dim=1))
        Vh_orth = polar_gram(torch.cat([vh for _, _, vh in triplets], dim=0))
        S = torch.cat([s for _, s, _ in triplets])
        return ((U_orth * S) @ Vh_orth).float()
    if solver != "svd":
        raise ValueError(f"unknown solver {solver!r}")
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
        return tsv_merge_matrix(taus, self.params.float64, self.params.solver)
