"""Iso-CTS, isotropic merging in common and task-specific subspaces (Marczak et al., 2025).

Per 2-D key (rule ``matrices_except_text_projection``), with r = min(m, n):
  * the common space keeps k_c = r - r_ts directions and each task r_ts / K, where the task-specific
    total r_ts = round((r - int(f r)) / K) * K, as in the authors' code (f = common_space_fraction = 0.8);
  * common space: the top k_c singular triplets of sum_t tau_t;
  * task t contributes the top r_ts/K triplets of its residual tau_t - U_c U_c^T tau_t;
  * concatenate U's and V's, replace each by its orthogonal polar factor, set every singular value to
    the mean of the concatenated ones, rebuild.
Every other float key is averaged. theta = theta_0 + alpha * merged, alpha = 1 by default (validation).
No common direction (k_c = 0: f = 0 where K divides r, f = 0.001 on a small key, K = 1 on an r = 1 key): the
authors' code slices an empty common space (u[:, :0]) and goes on, so every task keeps the top r/K triplets of
tau_t itself; both solvers do the same (the "gram" one asks mergecal.linalg for zero eigenpairs).
K = 1: the common and the task-specific triplets together span tau's SVD, so the result equals Iso-C's,
alpha * U mean(S) V^T (up to round-off).
Degenerate input: rank-deficient residuals contribute LAPACK's arbitrary null-space vectors, which the
flat spectrum then weights like any other direction, as in the original algorithm.
Solvers: ``"gram"`` (default) takes the sum's and the residuals' top triplets from float64
eigendecompositions of their smaller Gram matrices and the polar factors from r x r Gram matrices
(mergecal.linalg: exact, no randomized step); ``"svd"`` is the original route of full thin SVDs, in float32
or, with ``float64``, float64.
On tensors off the CPU (CUDA) the "gram" solver runs torch-only, in float64, the K residuals' Gram matrices
through one batched eigh (mergecal.linalg's backends; ``iso_cts_matrix(..., backend="torch")`` on the CPU).
"""

from __future__ import annotations

import torch
from pydantic import Field

from typing import Literal

from ..linalg import (
    _eigh_desc,
    _gram_eigh,
    _orthonormal_columns,
    gram_matrix,
    polar_factor,
    polar_gram,
    stack64,
    svd,
    top_svd,
    torch_route,
)
from .base import MatrixMergeMethod, MergeParams, register, sum_of


class IsoCtsParams(MergeParams):
    scaling: float = 1.0  # alpha
    common_space_fraction: float = Field(0.8, ge=0.0, le=1.0)
    key_rule: str = "matrices_except_text_projection"
    float64: bool = False  # the "svd" solver's precision ("gram" always works in float64)
    solver: Literal["gram", "svd"] = "gram"


def iso_cts_ranks(r: int, K: int, common_space_fraction: float) -> tuple[int, int]:
    """(common rank k_c, per-task rank) with k_c + K * per_task = r, by the authors' rule:
    k_c0 = int(f r); task total = round((r - k_c0) / K) * K; k_c = r - task total.
    (When rounding up would exceed r, which the original does not guard, one K is taken off.)"""
    common = int(r * common_space_fraction)
    task_total = round((r - common) / K) * K
    if task_total > r:
        task_total -= K
    return r - task_total, task_total // K


def iso_cts_matrix(taus: list[torch.Tensor], common_space_fraction: float, float64: bool = False,
                   solver: str = "gram", backend: str = "auto") -> torch.Tensor:
    """``backend``: the Gram route's implementation (mergecal.linalg: numpy/scipy on the CPU by default,
    torch-only and batched over the K residuals off it)."""
    K = len(taus)
    common_rank, task_rank = iso_cts_ranks(min(taus[0].shape), K, common_space_fraction)
    if solver == "gram":
        return _iso_cts_gram(taus, common_rank, task_rank, torch_route(backend, taus[0]))
    if solver != "svd":
        raise ValueError(f"unknown solver {solver!r}")
    U, S, Vh = svd(sum_of(taus, torch.float64 if float64 else None), float64=float64)
    us, ss, vhs = [U[:, :common_rank]], [S[:common_rank]], [Vh[:common_rank, :]]
    if task_rank > 0:
        U_c = us[0]
        for tau in taus:
            residual = tau - U_c @ (U_c.T @ tau)
            U_t, S_t, Vh_t = svd(residual, float64=float64)
            us.append(U_t[:, :task_rank])
            ss.append(S_t[:task_rank])
            vhs.append(Vh_t[:task_rank, :])
    U_orth = polar_factor(torch.cat(us, dim=1), float64=float64)
    Vh_orth = polar_factor(torch.cat(vhs, dim=0), float64=float64)
    return (U_orth * torch.cat(ss).mean()) @ Vh_orth


def _iso_cts_gram(taus: list[torch.Tensor], common_rank: int, task_rank: int, use_torch: bool) -> torch.Tensor:
    """The Gram route (mergecal.linalg), in float64. The residuals' Gram matrices are formed without the
    residuals: tall keys (m >= n) as tau^T tau - C^T C with C = U_c^T tau; wide keys (m < n, where the sum's
    m x m Gram gives all m left singular vectors) through the complement N of U_c, R R^T = N (N^T tau)(N^T
    tau)^T N^T, an (r - k_c)-sized eigenproblem. ``use_torch``: the torch route, the K residuals as one batch."""
    total = sum_of(taus, torch.float64)
    m, n = total.shape
    wide = m < n
    if wide:
        _, w = _gram_eigh(total, transpose=True, use_torch=use_torch)
        U_c, N = w[:, :common_rank], w[:, common_rank:]
        V_c, S_c = _orthonormal_columns(total.T @ U_c)
        Vh_c = V_c.T
    else:
        U_c, S_c, Vh_c = top_svd(total, common_rank, backend="torch" if use_torch else "numpy")
    del total
    us, ss, vhs = [U_c], [S_c], [Vh_c]
    if task_rank > 0:
        # batched: tau [K, m, n]; unbatched: one tau [m, n] at a time (the same expressions)
        for tau in [stack64(taus)] if use_torch else [t.to(torch.float64) for t in taus]:
            if wide:
                T = N.T @ tau
                _, z = _eigh_desc(gram_matrix(T, transpose=True, use_torch=use_torch), task_rank,
                                  use_torch=use_torch)
                U_t = N @ z
                V_t, S_t = _orthonormal_columns(T.mT @ z)
            else:
                C = U_c.T @ tau
                gram = gram_matrix(tau, use_torch=use_torch) - gram_matrix(C, use_torch=use_torch)
                _, V_t = _eigh_desc(gram, task_rank, use_torch=use_torch)
                U_t, S_t = _orthonormal_columns(tau @ V_t - U_c @ (C @ V_t))
            if use_torch:
                us += U_t.unbind(0)
                ss += S_t.unbind(0)
                vhs += V_t.mT.unbind(0)
            else:
                us.append(U_t)
                ss.append(S_t)
                vhs.append(V_t.T)
    backend = "torch" if use_torch else "numpy"
    U_orth = polar_gram(torch.cat(us, dim=1), backend=backend)
    Vh_orth = polar_gram(torch.cat(vhs, dim=0), backend=backend)
    return ((U_orth * torch.cat(ss).mean()) @ Vh_orth).float()


@register
class IsoCts(MatrixMergeMethod):
    name = "iso_cts"
    Params = IsoCtsParams
    key_rule = "matrices_except_text_projection"
    summary = "flat spectrum over a common subspace plus per-task residual subspaces"

    def merge_matrix(self, taus):
        return iso_cts_matrix(taus, self.params.common_space_fraction, self.params.float64,
                              self.params.solver)
