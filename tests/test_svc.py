"""SVC: hand-checkable spectra and an independent float64 loop over ranks and tasks."""

import numpy as np
import pytest
import torch

from mergecal import TaskVectorSet, merge_task_vectors
from mergecal.calibrations.base import iter_calibrated
from mergecal.calibrations.svc import Svc, svc_coefficients
from mergecal.errors import ParameterError
from mergecal.merge import iter_merge
from mergecal.methods import get_merge_method


def reference_gamma(merged, taus, alpha, targeted=None):
    """Algorithm 1 of the SVC paper, written as loops in float64 numpy."""
    M = merged.double().numpy()
    U, S, Vt = np.linalg.svd(M, full_matrices=False)
    K, R = len(taus), len(S)
    s = np.zeros((K, R))
    for r in range(R):
        a_m = U[:, r] @ M
        for i, tau in enumerate(taus):
            a_i = U[:, r] @ tau.double().numpy()
            s[i, r] = a_m @ a_i / max(a_i @ a_i, 1e-12)
    if targeted is None:
        gamma = K / np.maximum(alpha, s).sum(0)
    else:
        gamma = np.where(s[targeted] > 0, 1.0 / np.maximum(alpha, s[targeted]), 1.0)
    return U, S, Vt, s, gamma


def random_taus(K=3, m=20, n=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    shared = torch.randn(m, 3, generator=g) @ torch.randn(3, n, generator=g)
    return [shared + 0.5 * torch.randn(m, n, generator=g) for _ in range(K)]


def test_identical_tasks_summed_are_undone_exactly():
    g = torch.Generator().manual_seed(1)
    tau = torch.randn(10, 6, generator=g)
    K = 4
    calibrated, info = Svc().calibrate("w", K * tau, [tau] * K)
    torch.testing.assert_close(info["gamma"], torch.full((6,), 1.0 / K), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(calibrated, tau, rtol=1e-4, atol=1e-5)


def test_orthogonal_supports_gamma_is_one_when_suppression_only_and_closed_form_otherwise():
    Q, _ = torch.linalg.qr(torch.randn(12, 12, generator=torch.Generator().manual_seed(2)))
    P, _ = torch.linalg.qr(torch.randn(9, 9, generator=torch.Generator().manual_seed(3)))
    K = 3
    taus = [Q[:, 3 * t:3 * t + 3] @ torch.diag(torch.tensor([3.0, 2.0, 1.0]) + 0.3 * t) @ P[:, 3 * t:3 * t + 3].T
            for t in range(K)]
    merged = sum(taus)
    calibrated, info = Svc(alpha=1.0).calibrate("w", merged, taus)
    torch.testing.assert_close(info["gamma"], torch.ones(9), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(calibrated, merged, rtol=1e-4, atol=1e-5)
    # with the default alpha = 1/K the absent tasks each contribute alpha: gamma = K / (1 + (K-1)/K)
    _, info = Svc().calibrate("w", merged, taus)
    torch.testing.assert_close(info["gamma"], torch.full((9,), K / (1 + (K - 1) / K)), rtol=1e-5, atol=1e-5)
    # without the round-off guard (the authors' code), float32 round-off in the absent tasks' responses
    # meets the 1e-12 floor and gives wild coefficients
    _, info = Svc(alpha=1.0, roundoff_guard=False).calibrate("w", merged, taus)
    assert float(info["s"].abs().max()) > 100


@pytest.mark.parametrize("alpha", [None, 0.5, 1.0])
def test_matches_an_independent_loop_implementation(alpha):
    taus = random_taus()
    merged = 0.7 * sum(taus)
    calibrated, info = Svc(alpha=alpha).calibrate("w", merged, taus)
    a = alpha if alpha is not None else 1 / 3
    U, S, Vt, s, gamma = reference_gamma(merged, taus, a)
    np.testing.assert_allclose(info["s"].numpy(), s, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(info["gamma"].numpy(), gamma, rtol=1e-3, atol=1e-4)
    np.testing.assert_allclose(calibrated.numpy(), (U * (gamma * S)) @ Vt, rtol=1e-3, atol=1e-4)
    # diagnostics are consistent with the output
    torch.testing.assert_close(info["sigma"], torch.linalg.svdvals(merged), rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(info["sigma_calibrated"], info["gamma"] * info["sigma"])
    torch.testing.assert_close(torch.linalg.svdvals(calibrated), info["sigma_calibrated"].sort(descending=True).values,
                               rtol=1e-3, atol=1e-4)


def test_alpha_one_only_suppresses_and_the_floor_bounds_gamma():
    taus = random_taus(K=4, seed=5)
    merged = sum(taus) - 2.5 * taus[0]  # some s_i^r negative or small
    _, info = Svc(alpha=1.0).calibrate("w", merged, taus)
    assert bool((info["gamma"] <= 1 + 1e-6).all())
    _, info = Svc(alpha=0.25).calibrate("w", merged, taus)
    assert bool((info["gamma"] <= 4 / (4 * 0.25) + 1e-6).all()) and bool((info["gamma"] > 0).all())
    assert bool((info["s"] < 0.25).any())  # the floor was exercised


def test_targeted_calibration_for_one_task():
    taus = random_taus(K=3, seed=7)
    merged = sum(taus)
    _, info = Svc(targeted_task=1, alpha=0.2).calibrate("w", merged, taus)
    _, _, _, _, gamma = reference_gamma(merged, taus, 0.2, targeted=1)
    np.testing.assert_allclose(info["gamma"].numpy(), gamma, rtol=1e-3, atol=1e-4)
    with pytest.raises(ParameterError, match="'targeted_task'=5 but there are only 3 tasks"):
        Svc(targeted_task=5).calibrate("w", merged, taus)


def test_row_space_ablation_uses_right_singular_vectors():
    taus = random_taus(K=2, seed=9)
    merged = sum(taus)
    _, info = Svc(space="row").calibrate("w", merged, taus)
    _, S, Vt = np.linalg.svd(merged.double().numpy(), full_matrices=False)
    s = np.array([[(merged.double().numpy() @ Vt[r]) @ (t.double().numpy() @ Vt[r])
                   / np.sum((t.double().numpy() @ Vt[r]) ** 2)
                   for r in range(len(S))] for t in taus])
    np.testing.assert_allclose(info["s"].numpy(), s, rtol=1e-3, atol=1e-4)


def test_vector_form_for_one_dimensional_updates():
    svc = Svc(calibrate_vectors=True, alpha=0.5)
    out, info = svc.calibrate("bias", torch.tensor([2.0, 4.0]), [torch.tensor([1.0, 2.0])] * 2)  # s = 2, 2
    torch.testing.assert_close(out, torch.tensor([1.0, 2.0]))
    out, _ = svc.calibrate("bias", torch.tensor([1.0, 1.0]), [torch.tensor([1.0, 0.0]), torch.tensor([0.0, 1.0])])
    torch.testing.assert_close(out, torch.tensor([1.0, 1.0]))  # s = 1, 1 -> gamma = 1
    t1, t2, m = torch.tensor([1.0, 2.0, 0.0]), torch.tensor([0.0, 1.0, 3.0]), torch.tensor([0.5, 2.0, 2.0])
    s = [float(m @ t1 / (t1 @ t1)), float(m @ t2 / (t2 @ t2))]
    out, _ = svc.calibrate("bias", m, [t1, t2])
    torch.testing.assert_close(out, m * 2 / sum(max(0.5, v) for v in s))
    assert not Svc().covers("bias", (3,), torch.float32) and svc.covers("bias", (3,), torch.float32)


def test_key_rules_authors_versus_every_matrix(task_vectors):
    authors, every = Svc(), Svc(key_rule="matrices")
    assert authors.covers("visual.blocks.0.attn.in_proj_weight", (24, 8), torch.float32)
    assert not authors.covers("visual.positional_embedding", (5, 8), torch.float32)
    assert not authors.covers("text_projection", (8, 6), torch.float32)
    assert not authors.covers("visual.conv1.weight", (8, 3, 2, 2), torch.float32)
    assert every.covers("visual.positional_embedding", (5, 8), torch.float32)
    # as a stream after TA: uncovered keys pass through unchanged, diagnostics recorded per covered key
    tvs = TaskVectorSet.from_task_vectors(task_vectors)
    diagnostics = {}
    out = dict(iter_calibrated(iter_merge(tvs, get_merge_method("task_arithmetic")), tvs, [authors], diagnostics))
    plain = merge_task_vectors(task_vectors, "task_arithmetic")
    assert torch.equal(out["visual.positional_embedding"], plain["visual.positional_embedding"])
    assert not torch.allclose(out["visual.blocks.0.mlp.c_fc.weight"], plain["visual.blocks.0.mlp.c_fc.weight"])
    assert set(diagnostics["svc"]) == {"visual.blocks.0.attn.in_proj_weight", "visual.blocks.0.mlp.c_fc.weight",
                                       "visual.blocks.0.mlp.c_proj.weight"}


def test_float64_option_agrees_with_float32():
    taus = random_taus(seed=11)
    a, _ = Svc().calibrate("w", sum(taus), taus)
    b, _ = Svc(float64=True).calibrate("w", sum(taus), taus)
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("shape", [(40, 24), (24, 24), (24, 40)], ids=str)
@pytest.mark.parametrize("space", ["column", "row"])
def test_gram_solver_matches_the_float64_reference_and_the_svd_solver(shape, space):
    """solver='gram' (default, #17) against Algorithm 1 on a float64 SVD: the calibrated update to 1e-6 relative
    (float32 output), and the svd solver in float64 alike."""
    m, n = shape
    taus = random_taus(K=4, m=m, n=n, seed=3)
    merged = 0.5 * sum(taus)
    gram, info = Svc(space=space).calibrate("w", merged, taus)
    svd64, _ = Svc(space=space, solver="svd", float64=True).calibrate("w", merged, taus)
    if space == "column":
        U, S, Vt, _, gamma = reference_gamma(merged, taus, 1 / 4)
        expected = (U * (gamma * S)) @ Vt
    else:
        expected = svd64.double().numpy()
    rel = np.linalg.norm(gram.double().numpy() - expected) / np.linalg.norm(expected)
    assert rel < 1e-6
    torch.testing.assert_close(info["sigma"], torch.linalg.svdvals(merged.double()).float(), rtol=1e-6, atol=0)
    with pytest.raises(ValueError, match="unknown solver"):
        svc_coefficients(merged, taus, 0.5, solver="nope")


@pytest.mark.parametrize("space", ["column", "row"])
@pytest.mark.parametrize("solver", ["gram", "svd"])
def test_the_merged_responses_read_off_the_decomposition_match_the_product_against_the_reference(
        space, solver, monkeypatch):
    """From rank MERGED_RESPONSE_FROM on, a_m is sigma_r v_r^T (sigma_r u_r in the row space), not the product
    u_r^T dW_m: the same Algorithm 1 (against the float64 loop) to float32 round-off; below it, the product route,
    bit for bit what it computed before (the committed results). Forced both ways on a small key, and at the rank
    itself (1024) on a thin one."""
    import mergecal.calibrations.svc as svc_module

    taus = random_taus(K=3, m=48, n=32, seed=5)
    merged = 0.7 * sum(taus)
    product, _ = Svc(space=space, solver=solver).calibrate("w", merged, taus)
    monkeypatch.setattr(svc_module, "MERGED_RESPONSE_FROM", 1)
    read_off, _ = Svc(space=space, solver=solver).calibrate("w", merged, taus)
    if space == "column":
        U, S, Vt, _, gamma = reference_gamma(merged, taus, 1 / 3)
        expected = (U * (gamma * S)) @ Vt
        bound = 1e-6 if solver == "gram" else 2e-5  # the float32 SVD's own error (module docstring)
        for out in (product, read_off):
            assert np.linalg.norm(out.double().numpy() - expected) / np.linalg.norm(expected) < bound
    assert (read_off - product).norm() / product.norm() < 1e-5
    assert not torch.equal(read_off, product)  # another rounding: the two routes are both taken
    monkeypatch.undo()
    assert svc_module.MERGED_RESPONSE_FROM == 1024
    wide = random_taus(K=2, m=1024, n=1030, seed=6)  # rank 1024: read off by default
    merged = sum(wide)
    c = svc_coefficients(merged, wide, 0.5, space=space, solver=solver)
    monkeypatch.setattr(svc_module, "MERGED_RESPONSE_FROM", 10**9)
    p = svc_coefficients(merged, wide, 0.5, space=space, solver=solver)
    torch.testing.assert_close(c["gamma"], p["gamma"], rtol=1e-4, atol=1e-5)
    assert not torch.equal(c["s"], p["s"])


def test_gram_solver_on_a_rank_deficient_update_stays_finite_and_guarded():
    """Tasks on disjoint rows, merged rank 4 < 12: the QR branch completes the null space (sigma = 0 there, so
    the output is unique) and the round-off guard zeroes the null directions' coefficients."""
    g = torch.Generator().manual_seed(4)
    taus = [torch.zeros(20, 12) for _ in range(2)]
    taus[0][:5] = torch.randn(5, 2, generator=g) @ torch.randn(2, 12, generator=g)
    taus[1][10:15] = torch.randn(5, 2, generator=g) @ torch.randn(2, 12, generator=g)
    merged = sum(taus)
    gram, info = Svc(alpha=1.0).calibrate("w", merged, taus)
    svd64, _ = Svc(alpha=1.0, solver="svd", float64=True).calibrate("w", merged, taus)
    assert torch.isfinite(gram).all() and torch.isfinite(info["s"]).all()
    torch.testing.assert_close(gram, svd64, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lam", [0.2, 1.0])
def test_orthogonal_task_vectors_are_enlarged_by_k_over_lambda_plus_the_floor(lam):
    """Task vectors with disjoint row and column blocks share no direction: each merged direction is owned by one
    task (s = λ for it, 0 → the floor α = 1/K for the K − 1 others), so γ = K / (λ + (K − 1)/K) on every direction
    (docs/calibration-evidence.md: why SVC enlarges the vision track's merges)."""
    torch.manual_seed(0)
    K, b = 8, 6
    taus = []
    for i in range(K):
        t = torch.zeros(K * b, K * b)
        t[i * b:(i + 1) * b, i * b:(i + 1) * b] = torch.randn(b, b)
        taus.append(t)
    gamma = svc_coefficients(lam * sum(taus), taus, 1 / K)["gamma"]
    assert torch.allclose(gamma, torch.full_like(gamma, K / (lam + (K - 1) / K)), rtol=1e-5)
