"""The torch-only Gram route (mergecal.linalg ``backend="torch"``), which TSV-M, Iso-C, Iso-CTS and SVC run on
tensors off the CPU (CUDA), tested on the CPU: the same functions, against the float64 reference
(tests/crosscheck/reference_merging.py), the numpy/scipy route and the float64 SVD, on full-rank, near-degenerate
and rank-deficient inputs (the generators of tests/test_gram_solver.py), plus the dispatch that picks it.

The torch route runs the same float64 algorithm with torch's eigh (all eigenpairs, LAPACK dsyevd on the CPU)
instead of scipy's dsyevr/dsyevd, and batches the K task matrices of a key; outputs are float32, so the two
routes agree to float32 rounding (measured: <= 6.5e-9 relative on these inputs) where the result is unique.
"""

from __future__ import annotations

import numpy as np
import pytest
import scipy.linalg
import torch

from crosscheck import reference_merging as ref
from test_gram_solver import (
    SHAPES,
    TIGHT,
    as_float32_inputs,
    rank_deficient,
    rel,
    tasks,
    torch_list,
    with_spectrum,
)

import mergecal.linalg as linalg
from mergecal import TaskVectorSet, merge_task_vectors
from mergecal.calibrations.svc import svc_coefficients
from mergecal.linalg import flat_polar_gram, polar_gram, svd_gram, top_svd
from mergecal.methods.iso_c import iso_c_matrix
from mergecal.methods.iso_cts import iso_cts_matrix
from mergecal.methods.tsv_m import tsv_merge_matrix
from mergecal.merge import iter_weight_space
from mergecal.recipe import Recipe

ROUTES_AGREE = 2e-8  # float32 outputs of two float64 routes (measured <= 6.5e-9 on these inputs)
METHODS = {"tsv_m": tsv_merge_matrix, "iso_c": iso_c_matrix,
           "iso_cts": lambda t, **kw: iso_cts_matrix(t, 0.5, **kw)}


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["full_rank", "near_degenerate"])
@pytest.mark.parametrize("K", [1, 3, 4])
def test_tsv_m_torch_route_matches_reference_and_numpy_route(kind, shape, K):
    mats = tasks(kind, shape, K)
    f32 = as_float32_inputs(mats)
    if kind == "full_rank" and ref.tsv_m_min_gap(f32) < 1e-3:
        pytest.skip("no spectral gap at the truncation: the exact result is ill-posed")
    out = tsv_merge_matrix(torch_list(mats), backend="torch")
    assert out.dtype == torch.float32
    assert rel(out, ref.tsv_m_matrix(f32)) < TIGHT
    assert rel(out, tsv_merge_matrix(torch_list(mats), backend="numpy")) < ROUTES_AGREE


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("kind", ["full_rank", "near_degenerate"])
@pytest.mark.parametrize("K", [1, 3, 4])
def test_iso_c_torch_route_matches_reference_and_numpy_route(kind, shape, K):
    mats = tasks(kind, shape, K)
    out = iso_c_matrix(torch_list(mats), backend="torch")
    assert rel(out, ref.iso_c_matrix(as_float32_inputs(mats))) < TIGHT
    assert rel(out, iso_c_matrix(torch_list(mats), backend="numpy")) < ROUTES_AGREE


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("K", [1, 2, 3])
@pytest.mark.parametrize("fraction", [0.5, 0.8])
def test_iso_cts_torch_route_matches_reference_and_numpy_route(shape, K, fraction):
    mats = tasks("full_rank", shape, K, seed=K)
    f32 = as_float32_inputs(mats)
    if ref.iso_cts_min_gap(f32, fraction, "original") < 1e-3:
        pytest.skip("no spectral gap at a truncation: the exact result is ill-posed")
    out = iso_cts_matrix(torch_list(mats), fraction, backend="torch")
    assert rel(out, ref.iso_cts_matrix(f32, fraction)) < TIGHT
    assert rel(out, iso_cts_matrix(torch_list(mats), fraction, backend="numpy")) < ROUTES_AGREE


@pytest.mark.parametrize("method", sorted(METHODS))
def test_torch_route_agrees_with_float64_svd(method):
    mats = torch_list(tasks("full_rank", (30, 20), 3, seed=5))
    fn = METHODS[method]
    assert rel(fn(mats, backend="torch"), fn(mats, solver="svd", float64=True)) < TIGHT


@pytest.mark.parametrize("shape", [(24, 16), (16, 24)], ids=str)
def test_rank_deficient_inputs_keep_the_unique_parts_on_the_torch_route(shape):
    """As tests/test_gram_solver.py's rank-deficient tests: the null-space completion is arbitrary in every route,
    the output's spectrum (TSV-M: the kept sigmas; Iso-C / Iso-CTS: flat at the reference mean) is not."""
    mats = rank_deficient(shape, 3, 2)
    f32 = as_float32_inputs(mats)
    tsv = tsv_merge_matrix(torch_list(mats), backend="torch").double().numpy()
    s_ref = np.linalg.svd(ref.tsv_m_matrix(f32), compute_uv=False)
    np.testing.assert_allclose(np.linalg.svd(tsv, compute_uv=False) / s_ref[0], s_ref / s_ref[0], atol=1e-6)

    iso = iso_c_matrix(torch_list(mats), backend="torch").double().numpy()
    u, s, vt = np.linalg.svd(np.sum(f32, axis=0), full_matrices=False)
    u, vt = u[:, :6], vt[:6]
    expected = ref.iso_c_matrix(f32)
    np.testing.assert_allclose(u.T @ iso @ vt.T, u.T @ expected @ vt.T, atol=1e-6 * s.mean())
    np.testing.assert_allclose(np.linalg.svd(iso, compute_uv=False), s.mean(), rtol=1e-5)

    two = rank_deficient(shape, 2, 2)
    cts = iso_cts_matrix(torch_list(two), 0.5, backend="torch").double().numpy()
    s_cts = np.linalg.svd(ref.iso_cts_matrix(as_float32_inputs(two), 0.5), compute_uv=False)
    assert np.isfinite(cts).all()
    np.testing.assert_allclose(np.linalg.svd(cts, compute_uv=False), s_cts.mean(), rtol=1e-5)


@pytest.mark.parametrize("cond", [1e1, 1e5, 1e12, np.inf])
@pytest.mark.parametrize("shape", [(20, 12), (12, 20), (12, 12)], ids=str)
def test_polar_gram_torch_route_on_ill_conditioned_and_singular_input(cond, shape):
    rng = np.random.default_rng(1)
    r = min(shape)
    s = np.geomspace(1.0, 1.0 / cond, r) if np.isfinite(cond) else np.r_[np.ones(r - 3), np.zeros(3)]
    a = with_spectrum(rng, *shape, s)
    p = polar_gram(torch.from_numpy(a), backend="torch").numpy()
    gram = p.T @ p if shape[0] >= shape[1] else p @ p.T
    np.testing.assert_allclose(gram, np.eye(r), atol=1e-10)
    if cond <= 1e5:
        np.testing.assert_allclose(p, ref.orthogonal_polar(a), atol=1e-10 * cond)
        np.testing.assert_allclose(p, polar_gram(torch.from_numpy(a), backend="numpy").numpy(), atol=1e-11 * cond)


@pytest.mark.parametrize("cond", [1e2, 1e4, 1e5, 5e5, 1e7])
@pytest.mark.parametrize("shape", [(40, 24), (24, 24), (24, 40)], ids=str)
def test_flat_polar_gram_torch_route_across_its_branches(cond, shape):
    rng = np.random.default_rng(3)
    a = with_spectrum(rng, *shape, np.geomspace(1.0, 1.0 / cond, min(shape)))
    p, mean = flat_polar_gram(torch.from_numpy(a), backend="torch")
    np.testing.assert_allclose(p.numpy(), ref.orthogonal_polar(a), atol=2e-18 * cond**2 + 1e-12)
    assert float(mean) == pytest.approx(np.linalg.svd(a, compute_uv=False).mean(), rel=1e-12)


def test_batched_top_svd_equals_each_matrix_and_the_svd_top_block():
    """One batched eigh + QR over a [B, m, n] stack (what TSV-M and Iso-CTS run on a GPU) gives each matrix's
    top-k triplets, with eigenvalue clusters inside the kept set."""
    rng = np.random.default_rng(2)
    s = np.r_[np.full(4, 3.0), np.full(4, 2.0), np.geomspace(1.0, 1e-3, 12)]
    for shape in [(30, 20), (20, 30)]:
        mats = [with_spectrum(rng, *shape, s) for _ in range(3)]
        u, sig, vh = top_svd(torch.from_numpy(np.stack(mats)), 8, backend="torch")
        assert u.shape == (3, shape[0], 8) and sig.shape == (3, 8) and vh.shape == (3, 8, shape[1])
        for i, a in enumerate(mats):
            np.testing.assert_allclose(sig[i].numpy(), s[:8], rtol=1e-12)
            np.testing.assert_allclose(u[i].T @ u[i], np.eye(8), atol=1e-12)
            uu, _, vv = ref.thin_svd(a)
            top = uu[:, :8] * s[:8] @ vv[:8]
            np.testing.assert_allclose(((u[i] * sig[i]) @ vh[i]).numpy(), top, atol=1e-12)
            u1, s1, vh1 = top_svd(torch.from_numpy(a), 8, backend="numpy")
            np.testing.assert_allclose(((u1 * s1) @ vh1).numpy(), top, atol=1e-12)


@pytest.mark.parametrize("shape", [(48, 32), (32, 48)], ids=str)
@pytest.mark.parametrize("cond", [1e2, 1e8, np.inf])
def test_svd_gram_torch_route(shape, cond):
    rng = np.random.default_rng(4)
    r = min(shape)
    s = np.geomspace(1.0, 1.0 / cond, r) if np.isfinite(cond) else np.r_[np.geomspace(1.0, 0.1, r - 4), np.zeros(4)]
    a = with_spectrum(rng, *shape, s)
    # sigma ratio 1e8 is past the 1e6 that svd_gram's full-rank bound covers: its QR branch is ~1e-16 sigma_1 / gap
    # there, in both routes (measured 3e-9 numpy, 3e-9 torch); else ~1e-15
    atol = 1e-8 if cond == 1e8 else 1e-14
    u, sig, vh = (x.numpy() for x in svd_gram(torch.from_numpy(a), backend="torch"))
    np.testing.assert_allclose(sig, s, atol=atol)
    np.testing.assert_allclose(u.T @ u, np.eye(r), atol=1e-12)
    np.testing.assert_allclose((u * sig) @ vh, a, atol=atol)


@pytest.mark.parametrize("space", ["column", "row"])
def test_svc_coefficients_torch_route_matches_numpy_route(space):
    rng = np.random.default_rng(6)
    taus = torch_list([rng.standard_normal((40, 24)) / 10 for _ in range(3)])
    merged = torch.stack(taus).sum(0)
    numpy_route = svc_coefficients(merged, taus, 1 / 3, space=space, backend="numpy")
    torch_route = svc_coefficients(merged, taus, 1 / 3, space=space, backend="torch")
    for c in (numpy_route, torch_route):
        assert c["U"].dtype == torch.float32
    rebuilt = [(c["U"] * c["gamma"] * c["sigma"]) @ c["Vh"] for c in (numpy_route, torch_route)]
    assert rel(rebuilt[1], rebuilt[0]) < 1e-6
    np.testing.assert_allclose(torch_route["sigma"], numpy_route["sigma"], rtol=1e-6)
    np.testing.assert_allclose(torch_route["gamma"], numpy_route["gamma"], rtol=1e-5)


def test_backend_argument_is_checked():
    a = torch.randn(6, 4)
    with pytest.raises(ValueError, match="backend='cupy'"):
        polar_gram(a, backend="cupy")
    with pytest.raises(ValueError, match="needs backend='torch'"):
        top_svd(torch.randn(2, 6, 4), 2, backend="numpy")


@pytest.fixture
def accelerator(monkeypatch):
    """Every tensor reads as off the CPU (the device predicate ``backend="auto"`` asks), and the numpy/scipy
    route fails if it is entered: what a CUDA merge runs, on CPU tensors."""
    monkeypatch.setattr(linalg, "on_accelerator", lambda tensor: True)

    def no_host_route(*args, **kwargs):
        raise AssertionError("the numpy/scipy route ran for an accelerator tensor")

    monkeypatch.setattr(scipy.linalg, "eigh", no_host_route)
    monkeypatch.setattr(torch.Tensor, "numpy", no_host_route)


@pytest.mark.parametrize("method", sorted(METHODS))
def test_auto_dispatch_runs_the_torch_route_off_the_cpu(method, accelerator, monkeypatch):
    mats = torch_list(tasks("full_rank", (30, 20), 3, seed=5))
    fn = METHODS[method]
    eigh, batches = torch.linalg.eigh, []
    monkeypatch.setattr(torch.linalg, "eigh", lambda g: batches.append(g.dim()) or eigh(g))
    out = fn(mats)  # backend="auto", as the merge methods call it
    # TSV-M's K task matrices and Iso-CTS's K residuals go through one batched eigh
    assert (3 in batches) == (method in ("tsv_m", "iso_cts"))
    assert torch.equal(out, fn(mats, backend="torch"))
    with pytest.raises(ValueError, match="backend='numpy' computes on the CPU"):
        fn(mats, backend="numpy")


def test_streaming_merge_and_svc_of_accelerator_tensors_stay_on_the_torch_route(accelerator):
    """The merge pipeline's path (TaskVectorSet on the chosen device -> iter_merge -> method -> svc) key by key:
    with tensors read as off the CPU it never enters the host route, and equals the torch route called directly."""
    rng = np.random.default_rng(7)
    vectors = [{"w": torch.from_numpy(rng.standard_normal((30, 20)).astype(np.float32)),
                "b": torch.from_numpy(rng.standard_normal(20).astype(np.float32))} for _ in range(3)]
    taus = [v["w"] for v in vectors]
    for name, fn in METHODS.items():
        params = {"common_space_fraction": 0.5} if name == "iso_cts" else {}
        merged = merge_task_vectors(vectors, name, key_rule="matrices", **params)
        assert torch.equal(merged["w"], fn(taus, backend="torch"))
    tvs = TaskVectorSet.from_task_vectors(vectors)
    updates = dict(iter_weight_space(Recipe.parse("tsv_m(key_rule=matrices) > svc(alpha=1.0, key_rule=matrices)"),
                                     tvs))
    base = tsv_merge_matrix(taus, backend="torch")
    c = svc_coefficients(base, taus, 1.0, backend="torch")
    assert torch.equal(updates["w"], (c["U"] * (c["gamma"] * c["sigma"])) @ c["Vh"])
