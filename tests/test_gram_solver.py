"""The Gram-matrix solver (default for TSV-M, Iso-C, Iso-CTS) against the float64 numpy reference
(tests/crosscheck/reference_merging.py, full SVDs) and against the library's own SVD solver, on full-rank,
near-degenerate and rank-deficient spectra (#17).

Where the exact result is unique (a spectral gap at every truncation point, and no null space entering a
polar factor) the outputs must agree to 1e-6 relative (float32 output rounding; the float64 Gram route's own
error is ~1e-16 (sigma_1 / sigma_k)^2 / gap). A rank-deficient input has no unique result in either route
(LAPACK completes null-space vectors arbitrarily, documented in each method): there the unique parts are
compared -- the output's singular values (TSV-M: the kept sigmas; Iso-C / Iso-CTS: flat at the mean) and the
output restricted to the input's row and column spaces.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from crosscheck import reference_merging as ref
from mergecal.linalg import flat_polar_gram, polar_gram, top_svd
from mergecal.methods.iso_c import iso_c_matrix
from mergecal.methods.base import sum_of
from mergecal.methods.iso_cts import iso_cts_matrix
from mergecal.methods.tsv_m import tsv_merge_matrix

TIGHT = 1e-6


def rel(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def with_spectrum(rng, m: int, n: int, s: np.ndarray) -> np.ndarray:
    u, _ = np.linalg.qr(rng.standard_normal((m, len(s))))
    v, _ = np.linalg.qr(rng.standard_normal((n, len(s))))
    return (u * s) @ v.T


def low_rank_plus_noise(rng, m, n, rank=6, noise=0.05):
    return rng.standard_normal((m, rank)) @ rng.standard_normal((rank, n)) / np.sqrt(rank * n) + \
        noise * rng.standard_normal((m, n)) / np.sqrt(n)


def near_degenerate(rng, m, n, K):
    """Clusters of equal (to 1e-9) singular values inside the kept set, a 1e-3 relative gap at every
    truncation point (floor(r/K) for TSV-M), a 1e-4 dynamic range."""
    r = min(m, n)
    k = r // K
    head = np.repeat(np.geomspace(1.0, 1e-2, (k + 2) // 3), 3)[:k] * (1 + 1e-9 * rng.standard_normal(k))
    tail = np.geomspace(head[-1] * (1 - 1e-3), 1e-4, r - k)
    return with_spectrum(rng, m, n, np.sort(np.concatenate([head, tail]))[::-1])


SHAPES = [(24, 16), (16, 40), (18, 18)]


def tasks(kind: str, shape, K: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    m, n = shape
    if kind == "full_rank":
        return [low_rank_plus_noise(rng, m, n) for _ in range(K)]
    if kind == "near_degenerate":
        return [near_degenerate(rng, m, n, K) for _ in range(K)]
    raise ValueError(kind)


def torch_list(mats):
    return [torch.from_numpy(np.asarray(a, dtype=np.float32)) for a in mats]


def as_float32_inputs(mats):  # the reference sees exactly the float32 tensors the library sees
    return [np.asarray(a, dtype=np.float32).astype(np.float64) for a in mats]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["full_rank", "near_degenerate"])
@pytest.mark.parametrize("K", [1, 3, 4])
def test_tsv_m_gram_matches_reference(kind, shape, K):
    mats = tasks(kind, shape, K)
    expected = ref.tsv_m_matrix(as_float32_inputs(mats))
    if kind == "full_rank" and ref.tsv_m_min_gap(as_float32_inputs(mats)) < 1e-3:
        pytest.skip("no spectral gap at the truncation: the exact result is ill-posed")
    assert rel(tsv_merge_matrix(torch_list(mats), solver="gram"), expected) < TIGHT


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["full_rank", "near_degenerate"])
@pytest.mark.parametrize("K", [1, 3, 4])
def test_iso_c_gram_matches_reference(kind, shape, K):
    mats = tasks(kind, shape, K)
    expected = ref.iso_c_matrix(as_float32_inputs(mats))
    assert rel(iso_c_matrix(torch_list(mats), solver="gram"), expected) < TIGHT


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_iso_cts_gram_matches_reference(shape, K, fraction):
    mats = tasks("full_rank", shape, K, seed=K)
    f32 = as_float32_inputs(mats)
    if ref.iso_cts_min_gap(f32, fraction, "original") < 1e-3:
        pytest.skip("no spectral gap at a truncation: the exact result is ill-posed")
    expected = ref.iso_cts_matrix(f32, fraction)
    assert rel(iso_cts_matrix(torch_list(mats), fraction, solver="gram"), expected) < TIGHT


@pytest.mark.parametrize("method", ["tsv_m", "iso_c", "iso_cts"])
def test_gram_and_svd_solvers_agree_float64(method):
    mats = torch_list(tasks("full_rank", (30, 20), 3, seed=5))
    fn = {"tsv_m": tsv_merge_matrix, "iso_c": iso_c_matrix,
          "iso_cts": lambda t, **kw: iso_cts_matrix(t, 0.5, **kw)}[method]
    assert rel(fn(mats, solver="gram"), fn(mats, solver="svd", float64=True)) < TIGHT
    with pytest.raises(ValueError):
        fn(mats, solver="nope")


def rank_deficient(shape, K, rank, seed=0):
    rng = np.random.default_rng(seed)
    m, n = shape
    return [rng.standard_normal((m, rank)) @ rng.standard_normal((rank, n)) for _ in range(K)]


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)], ids=str)
def test_tsv_m_rank_deficient_tasks_keep_the_unique_parts(shape):
    """Each task of rank 2 < floor(16/3) = 5: the kept sigmas are unique (the null ones are 0), so the output's
    spectrum is; the rest depends on LAPACK's arbitrary null-space completion in either route."""
    mats = rank_deficient(shape, 3, 2)
    lib = tsv_merge_matrix(torch_list(mats), solver="gram").double().numpy()
    expected = ref.tsv_m_matrix(as_float32_inputs(mats))
    assert np.isfinite(lib).all()
    s_lib, s_ref = np.linalg.svd(lib, compute_uv=False), np.linalg.svd(expected, compute_uv=False)
    np.testing.assert_allclose(s_lib / s_ref[0], s_ref / s_ref[0], atol=1e-6)


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)], ids=str)
def test_iso_c_rank_deficient_sum_keeps_the_unique_parts(shape):
    """A rank-6 sum: mean sigma (counting the zeros) and the output on the sum's row/column spaces are unique;
    the null-space block is an arbitrary isometry weighted by the mean sigma, as in LAPACK's SVD."""
    mats = rank_deficient(shape, 3, 2)
    f32 = as_float32_inputs(mats)
    lib = iso_c_matrix(torch_list(mats), solver="gram").double().numpy()
    expected = ref.iso_c_matrix(f32)
    u, s, vt = np.linalg.svd(np.sum(f32, axis=0), full_matrices=False)
    u, vt = u[:, :6], vt[:6]
    np.testing.assert_allclose(u.T @ lib @ vt.T, u.T @ expected @ vt.T, atol=1e-6 * s.mean())
    np.testing.assert_allclose(np.linalg.svd(lib, compute_uv=False), s.mean(), rtol=1e-5)


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)], ids=str)
def test_iso_cts_rank_deficient_keeps_a_flat_spectrum_at_the_reference_mean(shape):
    mats = rank_deficient(shape, 2, 2)
    lib = iso_cts_matrix(torch_list(mats), 0.5, solver="gram").double().numpy()
    expected = ref.iso_cts_matrix(as_float32_inputs(mats), 0.5)
    s_ref = np.linalg.svd(expected, compute_uv=False)
    assert np.isfinite(lib).all()
    np.testing.assert_allclose(np.linalg.svd(lib, compute_uv=False), s_ref.mean(), rtol=1e-5)


@pytest.mark.parametrize("cond", [1e1, 1e5, 1e12, np.inf])
@pytest.mark.parametrize("shape", [(20, 12), (12, 20), (12, 12)], ids=str)
def test_polar_gram_on_ill_conditioned_and_singular_input(cond, shape):
    """Both branches of polar_gram (direct (M^T M)^{-1/2} up to sigma ratio 1e3, QR beyond): orthonormal, and
    equal to the SVD polar factor where that is unique (full rank)."""
    rng = np.random.default_rng(1)
    r = min(shape)
    s = np.geomspace(1.0, 1.0 / cond, r) if np.isfinite(cond) else np.r_[np.ones(r - 3), np.zeros(3)]
    a = with_spectrum(rng, *shape, s)
    p = polar_gram(torch.from_numpy(a)).numpy()
    gram = p.T @ p if shape[0] >= shape[1] else p @ p.T
    np.testing.assert_allclose(gram, np.eye(r), atol=1e-10)
    if cond <= 1e5:
        np.testing.assert_allclose(p, ref.orthogonal_polar(a), atol=1e-10 * cond)


def test_top_svd_is_the_svd_top_block_with_clusters():
    rng = np.random.default_rng(2)
    s = np.r_[np.full(4, 3.0), np.full(4, 2.0), np.geomspace(1.0, 1e-3, 12)]
    a = with_spectrum(rng, 30, 20, s)
    u, sig, vh = (x.numpy() for x in top_svd(torch.from_numpy(a), 8))
    np.testing.assert_allclose(sig, s[:8], rtol=1e-12)
    np.testing.assert_allclose(u.T @ u, np.eye(8), atol=1e-12)
    np.testing.assert_allclose((u * sig) @ vh, ref.thin_svd(a)[0][:, :8] * s[:8] @ ref.thin_svd(a)[2][:8], atol=1e-12)


@pytest.mark.parametrize("cond", [1e2, 1e4, 1e5, 5e5, 1e7])
@pytest.mark.parametrize("shape", [(40, 24), (24, 24), (24, 40)], ids=str)
def test_flat_polar_gram_across_its_branches(cond, shape):
    """Direct (sigma ratio <= 1e3), Newton-Schulz-polished (<= 1e6) and QR (beyond) branches of the Iso-C
    solver against the float64 SVD: P Q^T (the Gram's eigenvectors bound every branch at ~1e-16 ratio^2 / gap;
    measured 2e-18 ratio^2 at most here, the replaced QR-only route alike) and the mean singular value."""
    rng = np.random.default_rng(3)
    a = with_spectrum(rng, *shape, np.geomspace(1.0, 1.0 / cond, min(shape)))
    p, mean = flat_polar_gram(torch.from_numpy(a))
    np.testing.assert_allclose(p.numpy(), ref.orthogonal_polar(a), atol=2e-18 * cond**2 + 1e-12)
    assert float(mean) == pytest.approx(np.linalg.svd(a, compute_uv=False).mean(), rel=1e-12)


@pytest.mark.parametrize("shape", [(3000, 7), (5,), (70000,), ()], ids=str)
def test_sum_of_in_a_wider_dtype_is_bitwise_the_plain_sum(shape):
    taus = [torch.randn(shape) for _ in range(5)]
    plain = taus[0].to(torch.float64, copy=True)
    for tau in taus[1:]:
        plain.add_(tau)
    assert torch.equal(sum_of(taus, torch.float64), plain)


def test_many_top_pairs_of_a_large_gram_come_from_one_full_decomposition_and_small_ones_as_before():
    """``eigh_driver``: the top k of n eigenpairs by dsyevr (only those k) unless the matrix is large and k a large
    share of n, where dsyevd's decomposition of all pairs is cheaper (performance.md); both give the same pairs
    where they are unique, and below ``EVD_FOR_MANY_PAIRS_FROM`` the pairs are dsyevr's bit for bit, the route
    every committed result was computed with."""
    import scipy.linalg

    from mergecal.linalg import EVD_FOR_MANY_PAIRS_FROM, _eigh_desc, eigh_driver

    assert [eigh_driver(n, k) for n, k in ((768, 700), (384, 307), (2048, 512), (2048, 1024), (4096, 3276),
                                           (4096, 4096), (4096, None))] == ["evr", "evr", "evr", "evd", "evd",
                                                                            "evd", "evd"]
    rng = np.random.default_rng(0)
    for n, k in ((EVD_FOR_MANY_PAIRS_FROM, 600), (300, 240)):
        q, _ = np.linalg.qr(rng.standard_normal((n, n)))
        gram = (q * np.geomspace(1.0, 1e-4, n)) @ q.T  # a gap at every eigenvalue: the pairs are unique
        evals, evecs = _eigh_desc(torch.from_numpy(gram.copy()), k)
        assert evals.shape == (k,) and evecs.shape == (n, k) and bool((evals[:-1] >= evals[1:]).all())
        w, v = scipy.linalg.eigh(gram, driver="evr", subset_by_index=[n - k, n - 1])
        w, v = torch.from_numpy(w).flip(0), torch.from_numpy(v).flip(1)
        if eigh_driver(n, k) == "evr":
            assert torch.equal(evals, w.clamp_min(0.0)) and torch.equal(evecs, v)
        else:
            assert float((evals - w).abs().max()) < 1e-12
            cosines = (evecs * v).sum(0).abs()  # each pair the same vector up to its sign
            assert float((1 - cosines).abs().max()) < 1e-8
