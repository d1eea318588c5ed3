"""Numerically careful SVD helpers shared by the SVD-based methods (TSV-M, Iso-C, Iso-CTS, SVC)."""

from __future__ import annotations

import torch


def svd(matrix: torch.Tensor, *, float64: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Thin SVD ``matrix = U diag(S) Vh`` computed in float32 (or float64), returned in float32.

    LAPACK occasionally fails to converge on ill-conditioned input; then retry once with a tiny
    diagonal jitter (1e-7 of the largest magnitude), as the SVC authors do.
    """
    work = matrix.to(torch.float64 if float64 else torch.float32)
    try:
        U, S, Vh = torch.linalg.svd(work, full_matrices=False)
    except torch.linalg.LinAlgError:
        scale = float(work.abs().max()) or 1.0
        jitter = torch.zeros_like(work)
        jitter.diagonal().fill_(1e-7 * scale)
        U, S, Vh = torch.linalg.svd(work + jitter, full_matrices=False)
    return U.float(), S.float(), Vh.float()


def polar_factor(matrix: torch.Tensor, *, float64: bool = False) -> torch.Tensor:
    """The orthogonal polar factor P Q^T of ``matrix = P Sigma Q^T`` (the nearest matrix with orthonormal
    columns, or rows if wide, in Frobenius norm)."""
    U, _, Vh = svd(matrix, float64=float64)
    return U @ Vh


def is_matrix(shape: tuple[int, ...] | torch.Size) -> bool:
    return len(shape) == 2
