"""Iso-CTS, isotropic merging in common and task-specific subspaces (Marczak et al., 2025).

Per 2-D key (rule ``matrices_except_text_projection``), with r = min(m, n):
  * the common space keeps k_c = r - r_ts directions and each task r_ts / K, where the task-specific
    total r_ts = round((r - int(f r)) / K) * K, as in the authors' code (f = common_space_fraction = 0.8);
  * common space: the top k_c singular triplets of sum_t tau_t;
  * task t contributes the top r_ts/K triplets of its residual tau_t - U_c U_c^T tau_t;
  * concatenate U's and V's, replace each by its orthogonal polar factor, set every singular value to
    the mean of the concatenated ones, rebuild.
Every other float key is averaged. theta = theta_0 + alpha * merged, alpha = 1 by default (validation).
K = 1: the common and the task-specific triplets together span tau's SVD, so the result equals Iso-C's,
alpha * U mean(S) V^T (up to round-off).
Degenerate input: rank-deficient residuals contribute LAPACK's arbitrary null-space vectors, which the
flat spectrum then weights like any other direction, as in the original algorithm.
"""

from __future__ import annotations

import torch
from pydantic import Field

from ..linalg import polar_factor, svd
from .base import MatrixMergeMethod, MergeParams, register, sum_of


class IsoCtsParams(MergeParams):
    scaling: float = 1.0  # alpha
    common_space_fraction: float = Field(0.8, ge=0.0, le=1.0)
    key_rule: str = "matrices_except_text_projection"
    float64: bool = False


def iso_cts_ranks(r: int, K: int, common_space_fraction: float) -> tuple[int, int]:
    """(common rank k_c, per-task rank) with k_c + K * per_task = r, by the authors' rule:
    k_c0 = int(f r); task total = round((r - k_c0) / K) * K; k_c = r - task total.
    (When rounding up would exceed r, which the original does not guard, one K is taken off.)"""
    common = int(r * common_space_fraction)
    task_total = round((r - common) / K) * K
    if task_total > r:
        task_total -= K
    return r - task_total, task_total // K


def iso_cts_matrix(taus: list[torch.Tensor], common_space_fraction: float, float64: bool = False) -> torch.Tensor:
    K = len(taus)
    common_rank, task_rank = iso_cts_ranks(min(taus[0].shape), K, common_space_fraction)
    U, S, Vh = svd(sum_of(taus), float64=float64)
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


@register
class IsoCts(MatrixMergeMethod):
    name = "iso_cts"
    Params = IsoCtsParams
    key_rule = "matrices_except_text_projection"
    summary = "flat spectrum over a common subspace plus per-task residual subspaces"

    def merge_matrix(self, taus):
        return iso_cts_matrix(taus, self.params.common_space_fraction, self.params.float64)
