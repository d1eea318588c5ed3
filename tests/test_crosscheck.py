"""Cross-check mergecal's merge methods against independent float64 numpy references.

The references (tests/crosscheck/reference_merging.py) follow the authors' public code: flattened
vectors for TA / TIES / DARE / Consensus, the zero-padded slot layout for TSV-M / Iso-CTS. Where the
library deliberately departs from the original code (TIES' kept count, TSV-M with r < K, Iso-CTS rank
rounding), the reference implements both behaviours behind a flag, the cross-check uses the library's
documented one, and a separate test pins down the original's behaviour.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from crosscheck import reference_merging as ref
from mergecal import merge_task_vectors
from mergecal.errors import ParameterError
from mergecal.methods import get_merge_method
from mergecal.methods.dare import drop_and_rescale, key_seed
from mergecal.methods.iso_cts import iso_cts_ranks as lib_iso_cts_ranks

# ---------------------------------------------------------------------------------------------------
# test data: a tiny ViT-like state dict; matrices are low rank plus noise with distinct spectra
# ---------------------------------------------------------------------------------------------------
SHAPES = {
    "blocks.0.attn.in_proj_weight": (24, 8),
    "blocks.0.attn.out_proj.weight": (16, 16),
    "blocks.0.mlp.c_fc.weight": (32, 8),
    "blocks.0.mlp.c_fc.bias": (32,),
    "blocks.0.mlp.c_proj.weight": (8, 32),
    "text_projection": (8, 6),
    "visual.positional_embedding": (5, 8),
    "visual.conv1.weight": (8, 3, 2, 2),
    "visual.class_embedding": (8,),
}
# different magnitudes per key, so a global and a per-tensor top-k trim differ
KEY_SCALE = dict(zip(SHAPES, [1.0, 0.6, 2.0, 0.3, 1.5, 0.8, 0.4, 1.2, 0.2]))
TASK_COUNTS = [2, 3, 5]
DATA_SEED = 320  # chosen so every SVD truncation below has a relative spectral gap >= 1e-2

SVD_TOL = dict(rtol=1e-4, atol=1e-5)  # float32 SVD in the library vs float64 here, after normalising
EXACT_TOL = dict(rtol=1e-6, atol=1e-6)  # methods without SVD: only float32 summation error


def _low_rank_plus_noise(rng: np.random.Generator, m: int, n: int, scale: float) -> np.ndarray:
    rank = max(2, (min(m, n) + 1) // 2)
    u = np.linalg.qr(rng.standard_normal((m, rank)))[0]
    v = np.linalg.qr(rng.standard_normal((n, rank)))[0]
    spectrum = 0.7 ** np.arange(rank) * rng.uniform(0.9, 1.1, rank)
    return scale * ((u * spectrum) @ v.T + 0.03 * rng.standard_normal((m, n)) / np.sqrt(max(m, n)))


def make_task_vectors(K: int, seed: int = DATA_SEED) -> list[dict[str, np.ndarray]]:
    """K float32 task vectors (numpy), identical input for the library and the reference."""
    rng = np.random.default_rng(seed + K)
    out = []
    for _ in range(K):
        tv = {}
        for key, shape in SHAPES.items():
            if len(shape) == 2:
                value = _low_rank_plus_noise(rng, *shape, KEY_SCALE[key])
            else:
                value = KEY_SCALE[key] * rng.standard_normal(shape)
            tv[key] = value.astype(np.float32)
        out.append(tv)
    return out


def to_torch(models):
    return [{k: torch.from_numpy(v.copy()) for k, v in m.items()} for m in models]


def run_library(models, method, **params) -> dict[str, np.ndarray]:
    merged = merge_task_vectors(to_torch(models), method, **params)
    for value in merged.values():
        assert value.dtype == torch.float32
    return {k: v.double().numpy() for k, v in merged.items()}


def assert_models_close(actual: dict, expected: dict, rtol: float, atol: float, keys=None):
    """Per key, compare after dividing both by the reference tensor's Frobenius norm."""
    assert set(actual) == set(expected)
    for key in keys if keys is not None else expected:
        exp = np.asarray(expected[key], dtype=np.float64)
        act = np.asarray(actual[key], dtype=np.float64)
        assert act.shape == exp.shape, key
        norm = max(np.linalg.norm(exp), 1e-30)
        np.testing.assert_allclose(act / norm, exp / norm, rtol=rtol, atol=atol, err_msg=key)


def rel_diff(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module", params=TASK_COUNTS, ids=lambda K: f"K{K}")
def tvs(request):
    return make_task_vectors(request.param)


def svd_matrices(models):
    for key, shape in SHAPES.items():
        if ref.svd_key(key, shape):
            yield key, [m[key].astype(np.float64) for m in models]


# ---------------------------------------------------------------------------------------------------
# WA / TA
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", [1.0, 0.5])
def test_weight_averaging(tvs, scaling):
    assert_models_close(run_library(tvs, "weight_averaging", scaling=scaling),
                        ref.weight_averaging(tvs, scaling), **EXACT_TOL)


@pytest.mark.parametrize("scaling", [0.3, 1.0])
def test_task_arithmetic(tvs, scaling):
    assert_models_close(run_library(tvs, "task_arithmetic", scaling=scaling),
                        ref.task_arithmetic(tvs, scaling), **EXACT_TOL)


def test_task_arithmetic_default_scaling_is_0_3(tvs):
    assert_models_close(run_library(tvs, "task_arithmetic"), ref.task_arithmetic(tvs, 0.3), **EXACT_TOL)


# ---------------------------------------------------------------------------------------------------
# TIES
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("trim_scope", ["global", "per_tensor"])
@pytest.mark.parametrize("sign_vote", ["mass", "count"])
@pytest.mark.parametrize("disjoint", ["mean", "sum", "max"])
def test_ties_matches_reference(tvs, trim_scope, sign_vote, disjoint):
    params = dict(scaling=0.7, top_k=0.2, trim_scope=trim_scope, sign_vote=sign_vote, disjoint=disjoint)
    expected = ref.ties(tvs, trim_rule="exact", unsigned="none", **params)
    assert_models_close(run_library(tvs, "ties", **params), expected, **EXACT_TOL)


@pytest.mark.parametrize("top_k", [0.05, 0.5, 1.0])
def test_ties_other_densities(tvs, top_k):
    expected = ref.ties(tvs, top_k=top_k, trim_rule="exact", unsigned="none")
    assert_models_close(run_library(tvs, "ties", top_k=top_k), expected, **EXACT_TOL)


def test_ties_defaults_are_the_papers():
    """Default parameters against the original's rules (apart from the kept count), original's
    unsigned-coordinate selection included: on real-sized data it never comes into play."""
    models = make_task_vectors(3)
    expected = ref.ties(models, scaling=1.0, top_k=0.2, trim_scope="global", sign_vote="mass", disjoint="mean",
                        trim_rule="exact", unsigned="negative")
    assert_models_close(run_library(models, "ties"), expected, **EXACT_TOL)


def test_ties_trim_scope_matters():
    """Guard that the scope option is honoured: a global and a per-tensor trim give different merges here."""
    models = make_task_vectors(3)
    glob, per = run_library(models, "ties", trim_scope="global"), run_library(models, "ties", trim_scope="per_tensor")
    # keys with large entries keep more than 20% of them under a global trim, small-entry keys fewer
    differing = [k for k in SHAPES if np.count_nonzero(glob[k]) != np.count_nonzero(per[k])]
    assert len(differing) >= 3
    assert rel_diff(glob["blocks.0.mlp.c_fc.weight"], per["blocks.0.mlp.c_fc.weight"]) > 1e-3


def test_ties_original_trim_keeps_one_entry_more():
    """Known, deliberate difference: the original topk_values_mask (kthvalue(d - int(d*K)) with >=) keeps
    int(d*K) + 1 entries per task vector; mergecal keeps int(d*K). With one task vector TIES returns the
    trimmed vector itself, so the counts can be read off the merge."""
    model = make_task_vectors(2)[:1]
    D = sum(int(np.prod(s)) for s in SHAPES.values())
    for top_k in (0.1, 0.2, 0.35):
        lib = run_library(model, "ties", top_k=top_k)
        lib_count = sum(np.count_nonzero(v) for v in lib.values())
        exact = ref.ties(model, top_k=top_k, trim_rule="exact")
        original = ref.ties(model, top_k=top_k, trim_rule="original")
        assert lib_count == int(D * top_k) == sum(np.count_nonzero(v) for v in exact.values())
        assert sum(np.count_nonzero(v) for v in original.values()) == int(D * top_k) + 1
        # the extra entry is the (int(D*K)+1)-th largest magnitude; everything else agrees
        flat = ref.Flattener(model[0])
        extra = np.flatnonzero(flat.flatten(original) != flat.flatten(lib))
        assert extra.size == 1
        mags = np.sort(np.abs(flat.flatten(model[0])))[::-1]
        assert np.abs(flat.flatten(model[0])[extra[0]]) == mags[int(D * top_k)]


def test_ties_zero_votes_take_the_majority_elected_sign():
    """Coordinates whose vote is exactly zero take the sign of the sum of elected signs over the whole
    flattened model (resolve_zero_signs 'majority'), in the library as in the reference."""
    a = np.array([1.0, 2.0, -0.5, 3.0, 0.25], dtype=np.float32)
    b = np.array([-1.0, 0.5, -0.25, 1.0, 0.125], dtype=np.float32)  # coordinate 0 cancels exactly
    models = [{"w": a}, {"w": b}]
    lib = run_library(models, "ties", top_k=1.0, disjoint="mean")["w"]
    expected = ref.ties(models, top_k=1.0, trim_rule="exact")["w"]
    np.testing.assert_allclose(lib, expected, rtol=0, atol=0)
    assert lib[0] == 1.0  # majority of (0, +, -, +, +) is +: the positive entry survives alone


def test_ties_zero_vote_with_zero_majority_documented_difference():
    """Documented difference: if the majority of elected signs is itself 0, the original's
    ``torch.where(sign > 0, T > 0, T < 0)`` keeps the *negative* entries of zero-vote coordinates, while
    mergecal keeps nothing there. Practically impossible for the original (global scope, mass vote, millions
    of coordinates) but common with per-tensor scope + count vote + K = 2 on a small tensor."""
    a = np.array([1.0, 2.0, -3.0, -0.5, 0.7], dtype=np.float32)
    b = np.array([-1.0, 0.5, -0.25, -0.1, 0.2], dtype=np.float32)  # elected: 0, +, -, -, + -> majority 0
    models = [{"w": a}, {"w": b}]
    original = ref.ties(models, top_k=1.0, trim_rule="exact", unsigned="negative")["w"]
    lib = run_library(models, "ties", top_k=1.0)["w"]
    np.testing.assert_allclose(lib, ref.ties(models, top_k=1.0, unsigned="none")["w"], rtol=1e-7)
    np.testing.assert_allclose(lib[1:], original[1:], rtol=1e-7)
    assert original[0] == -1.0 and lib[0] == 0.0

    models = make_task_vectors(2)
    params = dict(trim_scope="per_tensor", sign_vote="count")
    key = "blocks.0.attn.in_proj_weight"  # its per-tensor majority of count votes is exactly 0 here
    assert rel_diff(run_library(models, "ties", **params)[key],
                    ref.ties(models, unsigned="negative", **params)[key]) > 1e-2


# ---------------------------------------------------------------------------------------------------
# DARE
# ---------------------------------------------------------------------------------------------------
def test_dare_without_drop_is_task_arithmetic(tvs):
    for rescale in ("inverse_keep", "l1"):
        lib = run_library(tvs, "dare", drop_rate=0.0, scaling=0.3, rescale=rescale, seed=3)
        assert_models_close(lib, ref.task_arithmetic(tvs, 0.3), **EXACT_TOL)


@pytest.mark.parametrize("trim_scope", ["global", "per_tensor"])
def test_dare_without_drop_is_ties(tvs, trim_scope):
    params = dict(top_k=0.2, trim_scope=trim_scope, sign_vote="mass", disjoint="sum")
    lib = run_library(tvs, "dare", drop_rate=0.0, scaling=0.5, base="ties", **params)
    assert_models_close(lib, ref.ties(tvs, scaling=0.5, unsigned="none", **params), **EXACT_TOL)
    assert_models_close(lib, run_library(tvs, "ties", scaling=0.5, **params), rtol=0, atol=0)


def _library_dropped(models, **params):
    """The library's own DARE draws (Dare.drop), as numpy."""
    method = get_merge_method("dare", **params)
    taus = to_torch(models)
    return [{k: v.double().numpy() for k, v in zip(SHAPES, vals)} for vals in
            zip(*[method.drop(key, [t[key] for t in taus]) for key in SHAPES])]


@pytest.mark.parametrize("rescale", ["inverse_keep", "l1"])
def test_dare_rescale_and_merge_given_the_librarys_draw(tvs, rescale):
    """The random mask cannot match another RNG; given the library's surviving entries, the rescaled
    values and the TA merge must match the reference exactly."""
    p = 0.6
    dropped = _library_dropped(tvs, drop_rate=p, rescale=rescale, seed=11)
    for tau, drop in zip(tvs, dropped):
        for key in SHAPES:
            keep = drop[key] != 0
            np.testing.assert_allclose(drop[key], ref.dare_rescale(tau[key], keep, p, rescale), rtol=1e-6, atol=0)
    lib = run_library(tvs, "dare", drop_rate=p, rescale=rescale, seed=11, scaling=0.3)
    assert_models_close(lib, ref.dare(dropped, scaling=0.3), **EXACT_TOL)


def test_dare_ties_given_the_librarys_draw(tvs):
    """DARE + TIES: the global trim is computed over the *dropped* task vectors."""
    params = dict(drop_rate=0.5, seed=5, rescale="inverse_keep", base="ties", top_k=0.3, disjoint="mean")
    dropped = _library_dropped(tvs, **params)
    lib = run_library(tvs, "dare", scaling=0.4, **params)
    expected = ref.dare(dropped, scaling=0.4, base="ties", top_k=0.3, disjoint="mean", unsigned="none")
    assert_models_close(lib, expected, **EXACT_TOL)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dare_drop_statistics(p):
    rng = np.random.default_rng(0)
    tau_np = rng.standard_normal(200_000).astype(np.float32)
    tau = torch.from_numpy(tau_np)
    out = drop_and_rescale(tau, p, seed=1234, rescale="inverse_keep").double().numpy()
    keep = out != 0
    n = tau_np.size
    assert abs(keep.mean() - (1 - p)) < 5 * np.sqrt(p * (1 - p) / n)
    np.testing.assert_allclose(out[keep], tau_np[keep].astype(np.float64) / (1 - p), rtol=1e-6)
    # survivors are unbiased: the rescaled sum estimates the original sum
    assert abs(out.sum() - tau_np.sum()) < 6 * np.sqrt(p / (1 - p) * (tau_np.astype(np.float64) ** 2).sum())

    l1 = drop_and_rescale(tau, p, seed=1234, rescale="l1").double().numpy()
    assert np.array_equal(l1 != 0, keep)  # same seed, same mask
    np.testing.assert_allclose(np.abs(l1).sum(), np.abs(tau_np.astype(np.float64)).sum(), rtol=1e-5)
    factor = l1[keep] / tau_np[keep]
    np.testing.assert_allclose(factor, np.abs(tau_np).sum() / np.abs(tau_np[keep]).sum(), rtol=1e-5)

    # reproducible per seed, different across seeds (overlap of two masks ~ (1-p)^2)
    again = drop_and_rescale(tau, p, seed=1234, rescale="inverse_keep").numpy()
    assert np.array_equal(again, out.astype(np.float32))
    other = drop_and_rescale(tau, p, seed=4321, rescale="inverse_keep").numpy() != 0
    assert abs((keep & other).mean() - (1 - p) ** 2) < 5 * np.sqrt((1 - p) ** 2 / n) + 1e-3


def test_dare_masks_differ_across_tasks_and_keys():
    assert len({key_seed(0, t, k) for t in range(5) for k in SHAPES}) == 5 * len(SHAPES)
    models = make_task_vectors(2)
    same = [{k: models[0][k].copy() for k in SHAPES} for _ in range(2)]
    dropped = _library_dropped(same, drop_rate=0.5, seed=0)
    key = "blocks.0.mlp.c_fc.weight"
    assert not np.array_equal(dropped[0][key] != 0, dropped[1][key] != 0)


def test_dare_full_merge_keeps_about_one_minus_p():
    big = [{"w": np.random.default_rng(t).standard_normal(50_000).astype(np.float32)} for t in range(2)]
    merged = run_library(big, "dare", drop_rate=0.9, scaling=1.0, seed=7)["w"]
    expected_nonzero = 1 - 0.9 ** 2  # kept by at least one of the two tasks
    assert abs(np.count_nonzero(merged) / merged.size - expected_nonzero) < 0.01


# ---------------------------------------------------------------------------------------------------
# Consensus (TALL masks)
# ---------------------------------------------------------------------------------------------------
def _assert_consensus_close(models, lib, expected, mask_lambda):
    """Exact compare except where a TALL mask sits within float32 rounding of flipping."""
    margin = ref.consensus_margin(models, mask_lambda)
    borderline = 0
    for key in expected:
        clear = margin[key] > 1e-5
        borderline += int((~clear).sum())
        scale = max(np.abs(expected[key]).max(), 1e-30)
        np.testing.assert_allclose(lib[key][clear], expected[key][clear], rtol=1e-6, atol=1e-7 * scale, err_msg=key)
    assert borderline <= 2


@pytest.mark.parametrize("min_agreement", [0, 1, 2, 6])
@pytest.mark.parametrize("lambda_kind", ["scalar", "per_task"])
def test_consensus_matches_reference(tvs, min_agreement, lambda_kind):
    K = len(tvs)
    mask_lambda = 0.4 if lambda_kind == "scalar" else [0.2 + 0.1 * (t % 5) for t in range(K)]
    params = dict(scaling=0.3, mask_lambda=mask_lambda, min_agreement=min_agreement)
    expected = ref.consensus(tvs, **params)
    if min_agreement > K:  # the reference keeps nothing: the library rejects it rather than return theta_0
        assert not any(np.any(v) for v in expected.values())
        with pytest.raises(ParameterError, match="exceeds the number of models"):
            run_library(tvs, "consensus", **params)
        return
    lib = run_library(tvs, "consensus", **params)
    _assert_consensus_close(tvs, lib, expected, mask_lambda)
    kept = sum(np.count_nonzero(v) for v in expected.values())
    total = sum(v.size for v in expected.values())
    if min_agreement == 0:
        assert_models_close(lib, ref.task_arithmetic(tvs, 0.3), **EXACT_TOL)
    elif min_agreement == 2:
        assert 0 < kept < total  # the mask is not trivial on this data


def test_consensus_masks_are_strict():
    """|tau_t| == lambda |tau_MTL - tau_t| is not in the mask (strict >, as in generate_task_masks)."""
    a = np.array([1.0, 1.0, 2.0], dtype=np.float32)
    b = np.array([2.0, 4.0, 8.0], dtype=np.float32)  # task a: 1 vs 0.5*2 = 1 (tie); task b: 2 vs 0.5*1
    models = [{"w": a}, {"w": b}]
    lib = run_library(models, "consensus", mask_lambda=0.5, min_agreement=2, scaling=1.0)["w"]
    expected = ref.consensus(models, scaling=1.0, mask_lambda=0.5, min_agreement=2)["w"]
    np.testing.assert_array_equal(lib, expected)
    assert lib[0] == 0.0 and lib[1] == 0.0


# ---------------------------------------------------------------------------------------------------
# TSV-M
# ---------------------------------------------------------------------------------------------------
def test_data_is_well_conditioned_for_svd_truncations(tvs):
    """Precondition for the SVD cross-checks: a small spectral gap at a truncation point would make
    float32 and float64 pick different subspaces, a data problem rather than a bug."""
    for _, mats in svd_matrices(tvs):
        assert ref.tsv_m_min_gap(mats) >= 1e-2
        for f in (0.8, 0.5, 0.3):
            for rule in ("original", "floor_multiple"):
                assert ref.iso_cts_min_gap(mats, f, rule) >= 1e-2


@pytest.mark.parametrize("scaling", [1.0, 2.5])
def test_tsv_m_matches_reference(tvs, scaling):
    lib = run_library(tvs, "tsv_m", scaling=scaling)
    expected = ref.tsv_m(tvs, scaling=scaling)
    assert_models_close(lib, expected, **SVD_TOL)
    # keys that are not decomposed are the plain mean (text_projection, vectors, conv)
    for key in ("text_projection", "blocks.0.mlp.c_fc.bias", "visual.conv1.weight", "visual.class_embedding"):
        np.testing.assert_allclose(lib[key], scaling * np.mean([m[key] for m in tvs], axis=0), rtol=1e-6, atol=1e-7)
    # and the decomposed ones are not (the method really did something)
    for key, mats in svd_matrices(tvs):
        assert rel_diff(lib[key], scaling * np.mean(mats, axis=0)) > 1e-2


def test_tsv_m_rank_below_task_count_is_averaged_not_zeroed():
    """Documented difference: with int(r/K) == 0 the original keeps no triplet and returns zeros for the
    key; mergecal averages the key (never happens for ViT matrices)."""
    rng = np.random.default_rng(3)
    models = [{"thin": rng.standard_normal((6, 2)).astype(np.float32)} for _ in range(3)]
    lib = run_library(models, "tsv_m")["thin"]
    np.testing.assert_allclose(lib, np.mean([m["thin"] for m in models], axis=0), rtol=1e-6)
    np.testing.assert_allclose(lib, ref.tsv_m(models, zero_rank="average")["thin"], rtol=1e-6)
    assert not np.any(ref.tsv_m(models, zero_rank="zeros")["thin"])


# ---------------------------------------------------------------------------------------------------
# Iso-C
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("scaling", [1.0, 0.7])
def test_iso_c_matches_reference(tvs, scaling):
    lib = run_library(tvs, "iso_c", scaling=scaling)
    assert_models_close(lib, ref.iso_c(tvs, scaling=scaling), **SVD_TOL)
    for key, mats in svd_matrices(tvs):  # a flat spectrum equal to the mean of the sum's spectrum
        s = np.linalg.svd(lib[key], compute_uv=False)
        mean_sigma = np.linalg.svd(np.sum(mats, axis=0), compute_uv=False).mean()
        np.testing.assert_allclose(s, scaling * mean_sigma, rtol=1e-4)
    np.testing.assert_allclose(lib["text_projection"], scaling * np.mean([m["text_projection"] for m in tvs], axis=0),
                               rtol=1e-6, atol=1e-7)


def test_iso_c_decomposes_the_sum_not_the_mean():
    """iso-merging / FusionBench and docs/references.md decompose sum_t tau_t; task_singular_vectors'
    src/utils/iso.py decomposes the mean (1/K the scale). The library follows the sum."""
    models = make_task_vectors(3)
    lib = run_library(models, "iso_c")
    by_mean = ref.iso_c(models, center="mean")
    key = "blocks.0.attn.in_proj_weight"
    np.testing.assert_allclose(lib[key], 3 * by_mean[key], rtol=1e-4, atol=1e-5 * np.abs(lib[key]).max())


# ---------------------------------------------------------------------------------------------------
# Iso-CTS
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fraction", [0.8, 0.5, 0.3])
def test_iso_cts_matches_reference_with_the_original_rank_rule(tvs, fraction):
    lib = run_library(tvs, "iso_cts", common_space_fraction=fraction)
    assert_models_close(lib, ref.iso_cts(tvs, common_space_fraction=fraction, rank_rule="original"), **SVD_TOL)


def test_iso_cts_with_full_common_space_is_iso_c(tvs):
    lib = run_library(tvs, "iso_cts", common_space_fraction=1.0)
    assert_models_close(lib, ref.iso_c(tvs), **SVD_TOL)


def test_iso_cts_uses_task_specific_directions(tvs):
    """With a task-specific space the result differs from Iso-C and its spectrum is flat."""
    lib = run_library(tvs, "iso_cts", common_space_fraction=0.5)
    iso = ref.iso_c(tvs)
    key = "blocks.0.attn.out_proj.weight"  # r = 16
    assert lib_iso_cts_ranks(16, len(tvs), 0.5)[1] > 0
    assert rel_diff(lib[key], iso[key]) > 1e-2
    s = np.linalg.svd(lib[key], compute_uv=False)
    np.testing.assert_allclose(s, s.mean(), rtol=1e-4)


def test_iso_cts_residual_is_against_common_left_space_only():
    """docs/references.md: each task contributes the top triplets of tau_t - U_c U_c^T tau_t. A two-sided
    projection (also removing V_c) would give a different merge; the library must match the one-sided one."""
    models = make_task_vectors(3)
    key = "blocks.0.attn.out_proj.weight"
    mats = [m[key].astype(np.float64) for m in models]
    lib = run_library(models, "iso_cts", common_space_fraction=0.5)[key]
    one_sided = ref.iso_cts_matrix(mats, 0.5, rank_rule="original")
    np.testing.assert_allclose(lib / np.linalg.norm(one_sided), one_sided / np.linalg.norm(one_sided), **SVD_TOL)

    # the alternative, written out: residual with both singular spaces of the common block removed
    common, per_task = ref.iso_cts_ranks(16, 3, 0.5, "original")
    u, s, vt = np.linalg.svd(np.sum(mats, axis=0))
    uc, vc = u[:, :common], vt[:common].T
    blocks_u, blocks_v, sig = [uc], [vt[:common]], [s[:common]]
    for a in mats:
        res = a - uc @ (uc.T @ a) - (a @ vc) @ vc.T + uc @ (uc.T @ a @ vc) @ vc.T
        ut, st, vtt = np.linalg.svd(res)
        blocks_u.append(ut[:, :per_task])
        blocks_v.append(vtt[:per_task])
        sig.append(st[:per_task])
    two_sided = (ref.orthogonal_polar(np.hstack(blocks_u)) * np.concatenate(sig).mean()
                 @ ref.orthogonal_polar(np.vstack(blocks_v)))
    assert rel_diff(lib, two_sided) > 1e-2


@pytest.mark.parametrize("r", [5, 8, 16, 64, 512, 768, 1024, 1280])
@pytest.mark.parametrize("K", [2, 3, 5, 8, 14, 20])
@pytest.mark.parametrize("fraction", [0.8, 0.5])
def test_iso_cts_rank_split_follows_spec(r, K, fraction):
    """docs/references.md: k_c from the fraction, rounded so that the rest divides by K; the library uses the
    original's rounding (iso-merging / FusionBench): common = int(r f), task total = round((r - common)/K)*K."""
    common, per_task = lib_iso_cts_ranks(r, K, fraction)
    assert (common, per_task) == ref.iso_cts_ranks(r, K, fraction, "original")
    assert common + K * per_task == r and per_task >= 0 and common >= 0
    assert abs(K * per_task - (r - int(r * fraction))) <= K / 2


def test_iso_cts_rank_rounding_is_the_originals_for_real_shapes():
    """An earlier library rule (task total = round((1 - f) r) lowered to a multiple of K) agreed with the
    original for ViT-B with 8 or 14 tasks only; the library now follows the original everywhere."""
    for (r, K), expected in {(768, 8): (616, 19), (768, 14): (614, 11), (768, 20): (608, 8),
                             (1024, 8): (816, 26), (1024, 14): (814, 15), (8, 3): (5, 1)}.items():
        assert lib_iso_cts_ranks(r, K, 0.8) == ref.iso_cts_ranks(r, K, 0.8, "original") == expected
    assert ref.iso_cts_ranks(768, 20, 0.8, "floor_multiple") == (628, 7)  # the rule no longer used
