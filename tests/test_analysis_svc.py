"""The SVC paper's analysis figures (arXiv:2602.05536, Figs. 2-4): hand-built spectra whose sigma*, s and cross terms
follow from the definitions, agreement with the library's SVC, and the driver's JSON on an open_clip-style model."""

import json
import math

import pytest
import torch

from mergecal import TaskVectorSet, merge_task_vectors
from mergecal.analysis.svc_spectrum import (OPEN_CLIP_CLASSES, cross_terms, figure_data, figure_data_from_models,
                                            normalize_cross_terms, singular_value_gap)
from mergecal.calibrations.svc import Svc, svc_coefficients
from mergecal.errors import ParameterError
from mergecal.merge import iter_merge
from mergecal.methods import get_merge_method


def orthogonal(n, seed):
    return torch.linalg.qr(torch.randn(n, n, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))[0]


def random_taus(K=4, m=14, n=10, seed=0, shared=3.0, noise=0.3):
    """K task matrices: one rank-1 direction every task shares, plus task-specific noise."""
    g = torch.Generator().manual_seed(seed)
    common = shared * torch.randn(m, 1, generator=g) @ torch.randn(1, n, generator=g) / math.sqrt(m * n) * 4
    return [common + noise * torch.randn(m, n, generator=g) for _ in range(K)]


# ------------------------------------------------------------------------------------------------------------------
# one key: sigma, sigma*, gamma sigma
# ------------------------------------------------------------------------------------------------------------------


def test_a_direction_every_task_shares_is_over_counted_K_times_and_owned_directions_are_not():
    """dW_i = c q0 p0^T + d_i q_{i+1} p_{i+1}^T: sigma_1 = K c, s_i^1 = K, sigma*_1 = c (Eqs. 12-13); subspace i+1 is
    task i's alone (s = 1, sigma* = sigma); beyond rank K + 1 no task responds (sigma* undefined: None)."""
    Q, P = orthogonal(12, 1), orthogonal(10, 2)
    K, c = 4, 3.0
    d = [1.0 + 0.25 * i for i in range(K)]
    taus = [(c * Q[:, :1] @ P[:, :1].T + d[i] * Q[:, i + 1:i + 2] @ P[:, i + 1:i + 2].T).float() for i in range(K)]
    out = singular_value_gap(sum(taus), taus)
    assert out["sigma"][0] == pytest.approx(K * c, rel=1e-6)
    assert out["sigma_star"][0] == pytest.approx(c, rel=1e-5)
    assert out["gap"][0] == pytest.approx((K - 1) * c, rel=1e-5)
    assert [row[0] for row in out["s"]] == pytest.approx([K] * K, rel=1e-5)
    assert out["responding"][:K + 1] == [K] + [1] * K
    assert out["sigma_star"][1:K + 1] == pytest.approx(out["sigma"][1:K + 1], rel=1e-5)
    assert out["sigma"][1:K + 1] == pytest.approx(sorted(d, reverse=True), rel=1e-5)
    assert out["sigma_star"][K + 1:] == [None] * (10 - K - 1) and out["responding"][K + 1:] == [0] * (10 - K - 1)
    C = cross_terms(sum(taus), taus, 2)
    torch.testing.assert_close(C[0], torch.full((K, K), c * c, dtype=torch.float64), rtol=1e-5, atol=1e-5)
    off_diagonal = C[1] - torch.diag(torch.diagonal(C[1]))
    assert off_diagonal.abs().max() < 1e-5 and int((torch.diagonal(C[1]) > 1e-3).sum()) == 1


def test_a_shared_direction_under_noise_inflates_the_top_singular_value_through_positive_cross_terms():
    taus = random_taus()
    merged = sum(taus)
    out = singular_value_gap(merged, taus)
    assert out["sigma_star"][0] < 0.5 * out["sigma"][0]  # K = 4 tasks share it: close to sigma / K
    assert out["gamma_star"][0] == pytest.approx(out["sigma_star"][0] / out["sigma"][0], rel=1e-9)
    C = cross_terms(merged, taus, 3)
    K = len(taus)
    off = ~torch.eye(K, dtype=torch.bool)
    assert bool((C[0][off] > 0).all())
    # the top subspace's cross terms are the largest in size: they concentrate at small r (Fig. 3)
    assert C[0][off].abs().mean() > C[1][off].abs().mean() and C[0][off].abs().mean() > C[2][off].abs().mean()


def test_orthogonal_row_spaces_have_no_cross_terms_and_sigma_star_equals_sigma():
    """dW_i dW_j^T = 0 gives C^r_ij = u_r^T dW_i dW_j^T u_r = 0 in every subspace, so s_i^r = 1 (Eq. 9) and sigma* =
    sigma, with the column spaces overlapping (each A_i random) and several tasks responding in most subspaces."""
    K, m, k = 3, 16, 4
    P = orthogonal(K * k, 3)
    g = torch.Generator().manual_seed(4)
    taus = [(torch.randn(m, k, generator=g, dtype=torch.float64) @ P[:, i * k:(i + 1) * k].T).float()
            for i in range(K)]
    merged = sum(taus)
    out = singular_value_gap(merged, taus)
    R = K * k
    C = cross_terms(merged, taus, R)
    off = ~torch.eye(K, dtype=torch.bool)
    assert C[:, off].abs().max() < 1e-5 * C.diagonal(dim1=1, dim2=2).max()
    assert out["sigma_star"] == pytest.approx(out["sigma"], rel=1e-4)
    assert max(out["responding"]) == K  # not one task per subspace: the average is over several
    for r in range(R):
        responding = [row[r] for row in out["s"] if abs(row[r]) > 1e-3]
        assert responding == pytest.approx([1.0] * len(responding), rel=1e-4)


def test_orthogonal_column_spaces_with_a_shared_input_direction_do_have_cross_terms():
    """The converse of the row-space case: dW_i = q_i x^T (disjoint outputs, one input direction) merge to rank 1 with
    u_1 = sum_i q_i / sqrt(K), a_i^1 = x^T / sqrt(K): every cross term is ||x||^2 / K and sigma* = sigma / K."""
    K = 4
    Q = orthogonal(8, 5)
    x = torch.randn(6, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    taus = [torch.outer(Q[:, i], x).float() for i in range(K)]
    C = cross_terms(sum(taus), taus, 1)
    torch.testing.assert_close(C[0], torch.full((K, K), float(x @ x) / K, dtype=torch.float64), rtol=1e-5, atol=1e-6)
    out = singular_value_gap(sum(taus), taus)
    assert out["sigma_star"][0] == pytest.approx(out["sigma"][0] / K, rel=1e-5)


def test_a_task_without_response_is_left_out_of_the_average():
    """Block-diagonal tasks (disjoint rows and columns): every subspace is one task's; the others have a_i^r = 0 and no
    optimal scaling (Theorem 3.3 assumes ||a_i^r|| > 0). Averaged in as 0 they would give sigma* = sigma / K."""
    K, b = 3, 4
    g = torch.Generator().manual_seed(7)
    taus = []
    for i in range(K):
        tau = torch.zeros(K * b, K * b)
        tau[i * b:(i + 1) * b, i * b:(i + 1) * b] = torch.randn(b, b, generator=g) * (1.0 + i)
        taus.append(tau)
    out = singular_value_gap(sum(taus), taus)
    assert out["responding"] == [1] * (K * b)
    assert out["sigma_star"] == pytest.approx(out["sigma"], rel=1e-5)


def test_a_conflicting_task_has_optimal_scaling_zero():
    """s_i^r <= 0 puts Eq. (11)'s optimum on the boundary, (gamma_i^r)* = 0 (Theorem 3.3): dW_1 = 3 u v^T and
    dW_2 = -u v^T merge to 2 u v^T; s = (2/3, -2), (gamma_i)* = (3/2, 0) and sigma* = 2 (3/2 + 0) / 2 = 3/2."""
    u, v = orthogonal(6, 12)[:, :1], orthogonal(5, 13)[:, :1]
    taus = [(3 * u @ v.T).float(), (-u @ v.T).float()]
    out = singular_value_gap(sum(taus), taus)
    assert [row[0] for row in out["s"]] == pytest.approx([2 / 3, -2], rel=1e-5)
    assert out["sigma"][0] == pytest.approx(2, rel=1e-6) and out["sigma_star"][0] == pytest.approx(1.5, rel=1e-5)
    assert cross_terms(sum(taus), taus, 1)[0, 0, 1] == pytest.approx(-3, rel=1e-5)


@pytest.mark.parametrize("alpha", [None, 1.0, 0.5])
@pytest.mark.parametrize("solver", ["gram", "svd"])
def test_gamma_sigma_is_the_svc_calibrations_own_bit_for_bit(alpha, solver):
    taus = random_taus(seed=8)
    merged = sum(taus)
    out = singular_value_gap(merged, taus, alpha, solver=solver)
    _, info = Svc(alpha=alpha, solver=solver).calibrate("w", merged, taus)
    assert out["gamma_sigma"] == info["sigma_calibrated"].tolist()
    assert out["gamma"] == info["gamma"].tolist()
    assert out["s"] == info["s"].tolist()
    assert out["alpha"] == info["alpha"]


def test_lemma_3_2_under_weight_addition_ties_s_to_the_cross_terms():
    """s_i^r = sum_j C_ij / C_ii (Eq. 9) from the cross terms against SVC's s, and sum_ij C^r_ij = sigma_r^2 (Eqs. 6,
    10); the top-r basis of ``cross_terms`` and SVC's full basis give the same cross terms."""
    taus = random_taus(seed=9)
    merged = sum(taus)
    c = svc_coefficients(merged, taus, 0.25)
    R = min(merged.shape)
    C = cross_terms(merged, taus, R, basis=c["U"])
    s_from_cross = C.sum(-1) / C.diagonal(dim1=1, dim2=2)  # [R, K]
    torch.testing.assert_close(s_from_cross.T.float(), c["s"], rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(C.sum((1, 2)), c["sigma"].double().square(), rtol=1e-5, atol=1e-8)
    torch.testing.assert_close(cross_terms(merged, taus, 3), C[:3], rtol=1e-5, atol=1e-8)


def test_sigma_star_does_not_scale_with_the_merge_but_sigma_does():
    taus = random_taus(seed=10)
    unit, scaled = singular_value_gap(sum(taus), taus), singular_value_gap(0.3 * sum(taus), taus)
    assert scaled["sigma"] == pytest.approx([0.3 * v for v in unit["sigma"]], rel=1e-5)
    # (1 / (lambda s)) (lambda sigma) where s > 0, and 0 where s <= 0, for lambda > 0
    assert scaled["sigma_star"] == pytest.approx(unit["sigma_star"], rel=1e-4)
    assert min(min(row) for row in unit["s"]) < 0 < unit["gap"][0]  # both cases occur


def test_normalisations():
    taus = random_taus(seed=11)
    merged = sum(taus)
    C = cross_terms(merged, taus, 2)
    sigma = svc_coefficients(merged, taus, 0.25)["sigma"]
    torch.testing.assert_close(normalize_cross_terms(C, sigma).sum((1, 2)), torch.ones(2, dtype=torch.float64))
    cosine = normalize_cross_terms(C, sigma, "cosine")
    torch.testing.assert_close(cosine.diagonal(dim1=1, dim2=2), torch.ones(2, len(taus), dtype=torch.float64))
    assert torch.equal(normalize_cross_terms(C, sigma, "none"), C)
    assert torch.isnan(normalize_cross_terms(C, torch.zeros(2))).all()
    with pytest.raises(ParameterError):
        normalize_cross_terms(C, sigma, "l2")


def test_bad_inputs():
    taus = random_taus()
    with pytest.raises(ParameterError):
        cross_terms(sum(taus), taus, 0)
    with pytest.raises(ParameterError):
        singular_value_gap(sum(taus), [t[:3] for t in taus])
    with pytest.raises(ParameterError):
        singular_value_gap(sum(taus).reshape(-1), taus)
    with pytest.raises(ParameterError):
        cross_terms(sum(taus), taus, 2, basis=torch.eye(3))


# ------------------------------------------------------------------------------------------------------------------
# the driver
# ------------------------------------------------------------------------------------------------------------------

D, LAYERS, K_TASKS = 8, 2, 3


def fake_clip(seed, scale=1.0):
    """An open_clip-style CLIP state dict: a two-block visual tower of width D, a narrower text block, embeddings."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return scale * torch.randn(*shape, generator=g)

    sd = {"visual.conv1.weight": r(D, 3, 2, 2), "visual.class_embedding": r(D), "visual.positional_embedding": r(5, D),
          "visual.ln_pre.weight": 1 + r(D), "visual.proj": r(D, 4), "logit_scale": r(())}
    for layer in range(LAYERS):
        p = f"visual.transformer.resblocks.{layer}."
        sd.update({p + "attn.in_proj_weight": r(3 * D, D), p + "attn.in_proj_bias": r(3 * D),
                   p + "attn.out_proj.weight": r(D, D), p + "attn.out_proj.bias": r(D), p + "ln_1.weight": 1 + r(D),
                   p + "mlp.c_fc.weight": r(4 * D, D), p + "mlp.c_fc.bias": r(4 * D),
                   p + "mlp.c_proj.weight": r(D, 4 * D)})
    sd["transformer.resblocks.0.attn.in_proj_weight"] = r(18, 6) if scale == 1.0 else torch.zeros(18, 6)  # unmoved
    sd["token_embedding.weight"] = r(10, 6) if scale == 1.0 else torch.zeros(10, 6)
    return sd


@pytest.fixture
def clip_models():
    pre = fake_clip(0)
    shared = fake_clip(50, scale=0.05)  # a direction every task moves along: over-counted by TA
    fts = []
    for t in range(K_TASKS):
        own = fake_clip(100 + t, scale=0.03)
        fts.append({k: v + shared[k] + own[k] for k, v in pre.items()})
    return pre, fts


@pytest.fixture
def clip_tvs(clip_models):
    pre, fts = clip_models
    return TaskVectorSet.from_models(pre, fts, names=[f"task{t}" for t in range(K_TASKS)])


def visual_keys(kind):
    return [f"visual.transformer.resblocks.{layer}.{kind}" for layer in range(LAYERS)]


def test_driver_returns_the_declared_json_shape(clip_tvs):
    top = 2
    out = figure_data(clip_tvs, "task_arithmetic", top=top, per_key=visual_keys("mlp.c_fc.weight")[:1])
    json.dumps(out, allow_nan=False)
    assert set(out) == {"paper", "method", "method_id", "merge_scaling", "alpha", "K", "tasks", "top",
                        "cross_normalize", "classes", "keys", "skipped"}
    assert out["method"] == "task_arithmetic" and out["merge_scaling"] == 1.0 and out["alpha"] == 1 / K_TASKS
    assert out["K"] == K_TASKS and out["tasks"] == ["task0", "task1", "task2"] and out["top"] == top
    assert set(out["classes"]) == set(OPEN_CLIP_CLASSES)
    assert out["skipped"] == ["transformer.resblocks.0.attn.in_proj_weight"]  # the text tower no task moved
    shapes = {"attn_in_proj": [3 * D, D], "attn_out_proj": [D, D], "mlp_fc": [4 * D, D], "mlp_proj": [D, 4 * D]}
    suffix = {"attn_in_proj": "attn.in_proj_weight", "attn_out_proj": "attn.out_proj.weight",
              "mlp_fc": "mlp.c_fc.weight", "mlp_proj": "mlp.c_proj.weight"}
    for name, entry in out["classes"].items():
        assert set(entry) == {"keys", "layers", "shape", "spectrum", "cross_terms"}
        assert entry["keys"] == visual_keys(suffix[name]) and entry["layers"] == list(range(LAYERS))
        assert entry["shape"] == shapes[name]
        R = min(shapes[name])
        spectrum = entry["spectrum"]
        assert set(spectrum) == {"r", "sigma", "sigma_star", "gamma_sigma", "gap", "gamma", "gamma_star"}
        assert spectrum["r"] == list(range(1, R + 1))
        assert all(len(values) == R for values in spectrum.values())
        cross = torch.tensor(entry["cross_terms"])
        assert cross.shape == (top, K_TASKS, K_TASKS)
        # weight addition, normalised by sigma_r^2: each key's matrix sums to 1, so does their mean
        torch.testing.assert_close(cross.sum((1, 2)), torch.ones(top, dtype=cross.dtype), rtol=1e-6, atol=1e-6)
        # the shared direction: sigma* below sigma at r = 1, cross terms positive there
        assert spectrum["sigma_star"][0] < spectrum["sigma"][0]
        assert bool((cross[0][~torch.eye(K_TASKS, dtype=torch.bool)] > 0).all())
    (key,) = out["keys"]
    entry = out["keys"][key]
    assert set(entry) == {"class", "layer", "shape", "sigma", "sigma_star", "gamma_sigma", "gap", "gamma",
                          "gamma_star", "s", "responding", "cross_terms"}
    assert entry["class"] == "mlp_fc" and entry["layer"] == 0 and entry["shape"] == [4 * D, D]
    assert len(entry["s"]) == K_TASKS and len(entry["s"][0]) == D
    assert torch.tensor(entry["cross_terms"]).shape == (top, K_TASKS, K_TASKS)


def test_class_means_are_the_means_of_the_per_key_values(clip_tvs):
    out = figure_data(clip_tvs, per_key="all", top=2)
    assert set(out["keys"]) == {k for entry in out["classes"].values() for k in entry["keys"]}
    for entry in out["classes"].values():
        for name in ("sigma", "sigma_star", "gamma_sigma", "gap", "gamma", "gamma_star"):
            per_key = torch.tensor([out["keys"][k][name] for k in entry["keys"]], dtype=torch.float64)
            assert entry["spectrum"][name] == pytest.approx(per_key.mean(0).tolist(), rel=1e-12)
        raw = torch.tensor([out["keys"][k]["cross_terms"] for k in entry["keys"]], dtype=torch.float64)
        sigma = torch.tensor([out["keys"][k]["sigma"][:2] for k in entry["keys"]], dtype=torch.float64)
        expected = (raw / sigma.square()[:, :, None, None]).mean(0)
        torch.testing.assert_close(torch.tensor(entry["cross_terms"], dtype=torch.float64), expected)


@pytest.mark.parametrize("method, params", [("task_arithmetic", {}), ("tsv_m", {}), ("iso_c", {}),
                                            ("ties", {"top_k": 0.3})])
def test_driver_reads_the_librarys_merge_at_scaling_one_and_svcs_gamma(clip_tvs, method, params):
    """Per key, gamma sigma is what the svc calibration computes on the library's merge at scaling 1 (the method's own
    scaling, 0.3 for TA, not applied) with the authors' alpha (1 after TSV-M, else 1/K)."""
    out = figure_data(clip_tvs, method, method_params={**params, "scaling": 0.3}, per_key="all", top=1)
    alpha = 1.0 if method == "tsv_m" else 1 / K_TASKS
    assert out["alpha"] == alpha
    merged = merge_task_vectors(clip_tvs, method, **params, scaling=1.0)  # the whole model
    for key, entry in out["keys"].items():
        _, info = Svc(alpha=alpha).calibrate(key, merged[key], clip_tvs.load(key))
        assert entry["sigma"] == info["sigma"].tolist(), key
        assert entry["gamma_sigma"] == info["sigma_calibrated"].tolist(), key
        alone = singular_value_gap(merged[key], clip_tvs.load(key), alpha)
        assert all(entry[name] == alone[name] for name in alone if name != "alpha"), key
        # Fig. 3's raw cross terms: the column-space responses (Eq. 4), here on SVC's basis, there on top_svd's
        torch.testing.assert_close(torch.tensor(entry["cross_terms"], dtype=torch.float64),
                                   cross_terms(merged[key], clip_tvs.load(key), 1), rtol=1e-4, atol=1e-9)


def test_ties_global_threshold_is_fitted_on_the_whole_model(clip_tvs):
    """TIES trims against a top-k threshold over every key: fitted on the analysed keys alone it would differ."""
    key = visual_keys("mlp.c_fc.weight")[0]
    whole = merge_task_vectors(clip_tvs, "ties", top_k=0.3, scaling=1.0)[key]
    alone = dict(iter_merge(clip_tvs, get_merge_method("ties", top_k=0.3), keys=[key]))[key]
    assert not torch.equal(whole, alone)  # the test can tell the two apart
    out = figure_data(clip_tvs, "ties", method_params={"top_k": 0.3}, keys=[key], per_key=[key], top=1)
    assert out["keys"][key]["sigma"] == svc_coefficients(whole, clip_tvs.load(key), 1 / K_TASKS)["sigma"].tolist()


def test_driver_from_models_and_from_task_vectors_agree(clip_models, clip_tvs):
    pre, fts = clip_models
    a = figure_data_from_models(pre, fts, "task_arithmetic", names=[f"task{t}" for t in range(K_TASKS)], top=2)
    b = figure_data(clip_tvs, "task_arithmetic", top=2)
    assert a == b
    instance = get_merge_method("ties", top_k=0.3)
    c = figure_data(clip_tvs, instance, top=1)
    assert c == figure_data(clip_tvs, "ties", method_params={"top_k": 0.3}, top=1)


def test_driver_key_selection_and_errors(clip_models, clip_tvs):
    cls = {"fc": r"mlp\.c_fc\.weight$"}
    out = figure_data(clip_tvs, key_classes=cls, top=1)
    assert list(out["classes"]) == ["fc"] and out["classes"]["fc"]["keys"] == visual_keys("mlp.c_fc.weight")
    out = figure_data(clip_tvs, keys=["visual.proj"], top=1)
    assert list(out["classes"]) == ["visual.proj"]  # a key no class matches is a class of its own
    with pytest.raises(ParameterError, match="2-D"):
        figure_data(clip_tvs, keys=["visual.class_embedding"])
    with pytest.raises(ParameterError, match="per_key"):
        figure_data(clip_tvs, per_key=["visual.proj"])
    with pytest.raises(ParameterError, match="no 2-D key"):
        figure_data(clip_tvs, key_classes={"none": "nothing_matches"})
    with pytest.raises(ParameterError, match="cross_normalize"):
        figure_data(clip_tvs, cross_normalize="l1")
    with pytest.raises(ParameterError, match="top"):
        figure_data(clip_tvs, top=0)
    # a fine-tuned text tower of another width in the same class: refused rather than averaged across shapes
    pre, fts = clip_models
    moved = [{**ft, "transformer.resblocks.0.attn.in_proj_weight": ft["transformer.resblocks.0.attn.in_proj_weight"]
              + 0.01 * (t + 1)} for t, ft in enumerate(fts)]
    with pytest.raises(ParameterError, match="attn_in_proj"):
        figure_data_from_models(pre, moved)
