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


# --------------------------------------------------------------------------------------------------
# Gram-matrix route (the default for TSV-M, Iso-C and Iso-CTS): exact, no truncated or randomized step.
#
# For A [m, n] the smaller Gram matrix (A^T A or A A^T, at most r x r with r = min(m, n)) is formed and
# eigendecomposed in float64. Its eigenvalues are the squared singular values, its eigenvectors one side's
# singular vectors; the other side comes from A V (or A^T U), orthonormalised by Householder QR. The QR
# removes the only error that squaring brings to a kept direction (a component of size eps64 * sigma_1 /
# sigma_i along the larger directions) and completes null-space columns with orthonormal vectors, as
# LAPACK's SVD does (arbitrarily: a rank-deficient input has no unique completion in either route).
# Float64 Gram entries carry an absolute error ~1e-16 sigma_1^2, so a kept singular vector is exact to
# ~1e-16 (sigma_1 / sigma_i)^2 / relative gap -- below float32 SVD's own ~6e-8 sigma_1 / gap for any
# sigma_1 / sigma_i < 1e4; float64 SVD (``solver="svd", float64=True``) remains the most accurate option.
#
# Two backends run the same route (``backend=``):
#   "numpy": CPU tensors only; Gram products through numpy (BLAS syrk), eigenpairs from scipy's LAPACK drivers
#            (dsyevr for a top-k range, dsyevd for all). The default on the CPU, bit for bit the earlier results.
#   "torch": torch only (matmul, torch.linalg.eigh -- every eigenpair, then the top k --, torch.linalg.qr), and
#            batched over leading dimensions, so the K task matrices of one key go through one batched eigh and
#            one batched QR. It runs where the tensors live; the default off the CPU (CUDA), selectable on the
#            CPU, where the tests compare it with the numpy route. Still float64: the squared condition number
#            of a Gram matrix is what float64 absorbs (float32 Gram entries would carry ~6e-8 sigma_1^2, i.e.
#            ~6e-8 (sigma_1 / sigma_i)^2 on a kept direction); data-centre GPUs (H100/H200) run float64 at
#            half their float32 rate, consumer GPUs at 1/32-1/64.
#   "auto":  "torch" for tensors off the CPU (``on_accelerator``), else "numpy".
# --------------------------------------------------------------------------------------------------
BACKENDS = ("auto", "numpy", "torch")


def on_accelerator(tensor: torch.Tensor) -> bool:
    """The device predicate of ``backend="auto"``: True for a tensor off the CPU (CUDA)."""
    return tensor.device.type != "cpu"


def torch_route(backend: str, tensor: torch.Tensor) -> bool:
    """Whether ``backend`` (auto | numpy | torch) runs the torch-only route for ``tensor``."""
    if backend == "auto":
        return on_accelerator(tensor)
    if backend == "torch":
        return True
    if backend == "numpy":
        if on_accelerator(tensor):
            raise ValueError(f"backend='numpy' computes on the CPU; got a tensor on {tensor.device} "
                             "(use backend='torch' or 'auto')")
        return False
    raise ValueError(f"backend={backend!r}: expected one of {', '.join(BACKENDS)}")


def _gram_eigh(a64: torch.Tensor, transpose: bool, k: int | None = None, *,
               use_torch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues (descending, clamped at 0) and eigenvectors of a^T a (or a a^T if ``transpose``); only
    the top ``k`` if given. LAPACK drivers chosen by measurement (768 x 768, one thread): a top-k index range
    by dsyevr (MRRR: only k eigenvectors computed and back-transformed, ~0.09 s at k = 96 against ~0.15 s for
    torch's full eigh); the full decomposition by dsyevd (divide and conquer, ~0.09-0.10 s; dsyevr takes
    ~0.45 s on the large eigenvalue clusters of a concatenated basis's Gram matrix), also for a top k above
    ``EVR_MAX_SHARE`` of a large matrix (``eigh_driver``). ``use_torch``: the torch route (batched over leading
    dimensions)."""
    return _eigh_desc(gram_matrix(a64, transpose, use_torch=use_torch), k, use_torch=use_torch)


def gram_matrix(a64: torch.Tensor, transpose: bool = False, *, use_torch: bool = False) -> torch.Tensor:
    """a^T a (or a a^T) of a float64 CPU tensor through numpy, which recognises the product of a matrix with
    its own transpose and calls BLAS syrk (half the flops of a general product; ~2x faster than torch's
    matmul here, measured). With ``use_torch`` or off the CPU, torch's (batched) matmul."""
    if use_torch or on_accelerator(a64):
        return a64 @ a64.mT if transpose else a64.mT @ a64
    a = a64.numpy()
    return torch.from_numpy(a @ a.T if transpose else a.T @ a)


#: dsyevr's cost grows with the pairs it computes, dsyevd's does not: above this share of the n pairs one
#: decomposition of all of them is cheaper (one thread, Gram matrices of low-rank-plus-noise task matrices, whose
#: tail eigenvalues cluster: at n = 4096 evr takes 6.9 s for n/8 pairs, 12.5 s for n/3, 22.9 s for n/2 (TSV-M's
#: k at K = 2) and 47.1 s for 0.8 n (Iso-CTS's common space), evd 12.4 s for all; docs/performance.md)
EVR_MAX_SHARE = 0.4
#: below this size both drivers take milliseconds; the route is the one every earlier result was computed with
EVD_FOR_MANY_PAIRS_FROM = 1024


def eigh_driver(n: int, k: int | None) -> str:
    """The LAPACK driver of the top ``k`` of ``n`` eigenpairs: "evr" (only the k pairs) or "evd" (all, then the
    top k), by ``EVR_MAX_SHARE`` from ``EVD_FOR_MANY_PAIRS_FROM`` on."""
    if k is None or k >= n:
        return "evd"
    if n >= EVD_FOR_MANY_PAIRS_FROM and k > EVR_MAX_SHARE * n:
        return "evd"
    return "evr"


def _eigh_desc(gram: torch.Tensor, k: int | None = None, *,
               use_torch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    import scipy.linalg

    n = gram.shape[-1]
    if k == 0:  # no pair asked for (Iso-CTS without a common direction): scipy refuses an empty index range
        return gram.new_zeros((*gram.shape[:-2], 0)), gram.new_zeros((*gram.shape[:-1], 0))
    keep = n if k is None else min(k, n)
    if use_torch or on_accelerator(gram):  # torch's (batched) eigh: every eigenpair, then the top k
        evals, evecs = torch.linalg.eigh(gram)
        return evals.flip(-1)[..., :keep].clamp_min(0.0), evecs.flip(-1)[..., :keep]
    driver = eigh_driver(n, k)
    subset = [n - keep, n - 1] if driver == "evr" else None
    evals, evecs = scipy.linalg.eigh(gram.numpy(), driver=driver, subset_by_index=subset, check_finite=False,
                                     overwrite_a=True)
    evals, evecs = torch.from_numpy(evals).flip(0), torch.from_numpy(evecs).flip(1)
    if driver == "evd" and keep < n:
        evals, evecs = evals[:keep], evecs[:, :keep]
    return evals.clamp_min(0.0), evecs.contiguous()


def _orthonormal_columns(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q with orthonormal columns, signed so that Q[:, i] . b[:, i] >= 0, and |diag(R)|, from b = QR (batched
    over leading dimensions)."""
    q, r = torch.linalg.qr(b)
    d = r.diagonal(dim1=-2, dim2=-1)
    sign = torch.where(d < 0, -1.0, 1.0).to(b.dtype)
    return q * sign.unsqueeze(-2), d.abs()


def _matrix_route(backend: str, a: torch.Tensor) -> bool:
    """``torch_route`` for a matrix, or a batch of them [..., m, n], which only the torch route takes."""
    use_torch = torch_route(backend, a)
    if a.dim() != 2 and not use_torch:
        raise ValueError(f"a batch of matrices (shape {tuple(a.shape)}) needs backend='torch'")
    return use_torch


def top_svd(matrix: torch.Tensor, k: int, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The top-k singular triplets (U [m, k], S [k], Vh [k, n]) in float64 via the smaller Gram matrix
    (see the note above); exact up to round-off, same as ``svd(...)[:k]`` where the spectrum has a gap at k.
    With the torch route, ``matrix`` may be a batch [B, m, n] (U [B, m, k], S [B, k], Vh [B, k, n])."""
    a = matrix.to(torch.float64)
    use_torch = _matrix_route(backend, a)
    m, n = a.shape[-2:]
    wide = m < n
    _, w = _gram_eigh(a, transpose=wide, k=k, use_torch=use_torch)
    if wide:  # w = U_k; V_k from a^T U_k = V_k S_k
        v, s = _orthonormal_columns(a.mT @ w)
        return w, s, v.mT
    u, s = _orthonormal_columns(a @ w)  # w = V_k; a V_k = U_k S_k
    return u, s, w.mT


def svd_gram(matrix: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full thin SVD (U [m, r], S [r], Vh [r, n]) in float64 via the smaller Gram matrix, for SVC's merged update.

    V (or U if wide) = the Gram's eigenvectors; the other side = A V scaled to unit columns, S = those column
    norms (not sqrt(lambda), which loses the small sigmas' digits). Full rank up to a sigma ratio of 1e6:
    each u_r carries ~1e-16 (sigma_1 / sigma_r)^2 / gap, weighted by sigma_r wherever SVC uses it (sigma_r u_r
    v_r^T, a_m = sigma_r v_r), so ~1e-16 sigma_1 / gap in the output. Beyond, rank-deficient input included:
    Householder QR of A V, which completes null-space columns with orthonormal vectors as LAPACK's SVD does
    (arbitrarily in both). The singular values come in descending order of the Gram's eigenvalues."""
    a = matrix.to(torch.float64)
    use_torch = _matrix_route(backend, a)
    m, n = a.shape
    if m < n:
        u, s, vh = svd_gram(a.T, backend=backend)
        return vh.T, s, u.T
    evals, w = _gram_eigh(a, transpose=False, use_torch=use_torch)
    b = a @ w
    if float(evals[0]) > 0 and float(evals[-1]) >= 1e-12 * float(evals[0]):
        s = b.norm(dim=0)
        return b / s, s, w.T
    u, s = _orthonormal_columns(b)
    return u, s, w.T


def _syrk(c: torch.Tensor, use_torch: bool = False) -> torch.Tensor:
    """c c^T through numpy's syrk on the CPU (half a general product's flops), torch's matmul with ``use_torch``
    or off the CPU."""
    if use_torch or on_accelerator(c):
        return c @ c.T
    x = c.numpy()
    return torch.from_numpy(x @ x.T)


def _polar_from_eigh(a: torch.Tensor, evals: torch.Tensor, w: torch.Tensor, well_conditioned: float = 1e-6,
                     polishable: float = 1e-12, use_torch: bool = False) -> torch.Tensor:
    """P Q^T of a tall float64 ``a`` [m, n] from the eigendecomposition (evals descending, w) of a^T a.

    * lambda_min >= ``well_conditioned`` lambda_max (sigma_max / sigma_min <= 1e3): P Q^T = a (a^T a)^{-1/2}, the
      inverse square root formed as C C^T with C = W Lambda^{-1/4} (syrk); accurate to ~1e-16 (sigma_1 /
      sigma_n)^2 <= 1e-10.
    * down to ``polishable`` (sigma_max / sigma_min <= 1e6): the same product, then one Newton-Schulz step
      X <- X (3 I - X^T X) / 2. The product's error (~1e-16 (sigma_1 / sigma_n)^2 <= 1e-4) is mostly symmetric
      in the polar frame (wrong column norms, mixing of nearby small directions), which the step removes
      quadratically; what is left is the eigenvectors' own ~1e-16 (sigma_1 / sigma_n)^2 / relative gap, the same
      as in the QR branch (tests/test_gram_solver.py measures both: equal or smaller here), at two products'
      cost instead of a product, a Householder QR and a product (~40% less on a square 768 x 768 sum).
    * otherwise, rank-deficient input included: Q = eigenvectors, P = orthonormalised a Q by Householder QR
      (null-space columns completed arbitrarily, as LAPACK's SVD does)."""
    lam_max, lam_min = float(evals[0]), float(evals[-1])
    if lam_max > 0 and lam_min >= polishable * lam_max:
        x = a @ _syrk(w * evals.rsqrt().sqrt(), use_torch)
        if lam_min < well_conditioned * lam_max:
            x = x @ (1.5 * torch.eye(x.shape[1], dtype=x.dtype, device=x.device) - 0.5 * _syrk(x.T, use_torch))
        return x
    u, _ = _orthonormal_columns(a @ w)
    return u @ w.T


def polar_gram(matrix: torch.Tensor, *, well_conditioned: float = 1e-6, backend: str = "auto") -> torch.Tensor:
    """Orthogonal polar factor P Q^T of ``matrix`` = P Sigma Q^T, in float64, via the smaller Gram matrix
    (branches by the Gram's condition number: see ``_polar_from_eigh``)."""
    a = matrix.to(torch.float64)
    use_torch = _matrix_route(backend, a)
    m, n = a.shape
    if m < n:
        return polar_gram(a.T, well_conditioned=well_conditioned, backend=backend).T
    evals, w = _gram_eigh(a, transpose=False, use_torch=use_torch)
    return _polar_from_eigh(a, evals, w, well_conditioned, use_torch=use_torch)


def flat_polar_gram(matrix: torch.Tensor, *, backend: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(P Q^T, mean singular value) of ``matrix`` in float64 via the Gram route, for Iso-C."""
    a = matrix.to(torch.float64)
    use_torch = _matrix_route(backend, a)
    m, n = a.shape
    if m < n:
        p, mean = flat_polar_gram(a.T, backend=backend)
        return p.T, mean
    evals, w = _gram_eigh(a, transpose=False, use_torch=use_torch)
    lam_max, lam_min = float(evals[0]), float(evals[-1])
    if lam_max > 0 and lam_min >= 1e-12 * lam_max:  # full rank: sigma_i = sqrt(lambda_i)
        return _polar_from_eigh(a, evals, w, use_torch=use_torch), evals.sqrt().mean()
    u, s = _orthonormal_columns(a @ w)  # the null space's sigmas from the QR (exactly 0 there, not sqrt(round-off))
    return u @ w.T, s.mean()


def stack64(taus: list[torch.Tensor]) -> torch.Tensor:
    """The K matrices as one float64 batch [K, m, n], converted slice by slice (no float32 stack in between)."""
    out = torch.empty((len(taus), *taus[0].shape), dtype=torch.float64, device=taus[0].device)
    for i, tau in enumerate(taus):
        out[i].copy_(tau)
    return out
