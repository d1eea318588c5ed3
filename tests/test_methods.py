"""Per-method properties and hand-computed cases. Expected values are computed here, independently."""

import copy

import pytest
import torch

from mergecal import MERGE_METHODS, get_merge_method, merge_models, merge_task_vectors
from mergecal.errors import ParameterError, UnknownNameError
from mergecal.magnitude import kth_largest_magnitudes
from mergecal.methods.dare import drop_and_rescale
from mergecal.methods.iso_cts import iso_cts_matrix, iso_cts_ranks

ALL_METHODS = sorted(n for n, cls in MERGE_METHODS.items() if not cls.needs_data)  # AdaMerging: its own tests
SVD_METHODS = ["tsv_m", "iso_c", "iso_cts"]


def tv(**tensors):
    return {k: torch.as_tensor(v, dtype=torch.float32) for k, v in tensors.items()}


# ----------------------------------------------------------------------------- every method


@pytest.mark.parametrize("method", ALL_METHODS)
def test_inputs_are_never_mutated(method, task_vectors, pretrained, finetuned):
    before_tv = copy.deepcopy(task_vectors)
    before_models = copy.deepcopy([pretrained, *finetuned])
    merge_task_vectors(task_vectors, method)
    merge_models(pretrained, finetuned, method)
    for a, b in zip(task_vectors, before_tv):
        assert all(torch.equal(a[k], b[k]) for k in a)
    for a, b in zip([pretrained, *finetuned], before_models):
        assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_single_task_and_zero_task_vectors_stay_finite(method, task_vectors):
    one_model = {"min_agreement": 1} if method == "consensus" else {}  # consensus rejects k > K (issue #13)
    single = merge_task_vectors(task_vectors[:1], method, **one_model)
    assert all(torch.isfinite(v).all() for v in single.values())
    zeros = [{k: torch.zeros_like(v) for k, v in task_vectors[0].items()} for _ in range(3)]
    merged = merge_task_vectors(zeros, method)
    assert all(torch.equal(v, torch.zeros_like(v)) for v in merged.values())
    with_zero = merge_task_vectors([task_vectors[0], zeros[0]], method)
    assert all(torch.isfinite(v).all() for v in with_zero.values())


@pytest.mark.parametrize("method", ALL_METHODS)
def test_skipping_keys_no_task_moved_is_exact(method, task_vectors):
    """iter_merge skips a key whose task vectors are all zero (a frozen embedding): the method's own combine
    must give exactly zero there, and every other key must be unchanged (fit still sees the frozen key)."""
    from mergecal import iter_merge
    from mergecal.task_vectors import TaskVectorSet

    frozen_key = next(k for k, v in task_vectors[0].items() if v.dim() == 2)
    frozen = [{**t, frozen_key: torch.zeros_like(t[frozen_key])} for t in task_vectors]
    tvs = TaskVectorSet.from_task_vectors(frozen)
    skipped = dict(iter_merge(tvs, get_merge_method(method)))
    computed = dict(iter_merge(tvs, get_merge_method(method), skip_zero_keys=False))
    assert list(skipped) == list(computed)
    for key in computed:
        assert torch.equal(skipped[key], computed[key]), key
    assert not computed[frozen_key].any()


@pytest.mark.parametrize("method", ALL_METHODS)
def test_merged_model_is_pretrained_plus_merged_task_vector(method, pretrained, finetuned, task_vectors):
    merged_tau = merge_task_vectors(task_vectors, method)
    merged = merge_models(pretrained, finetuned, method)
    assert list(merged) == list(pretrained)
    for key, value in pretrained.items():
        if value.is_floating_point():
            torch.testing.assert_close(merged[key], value + merged_tau[key], rtol=1e-5, atol=1e-6)
        else:
            assert torch.equal(merged[key], value)


@pytest.mark.parametrize("method", ALL_METHODS)
def test_scaling_is_applied_linearly_in_one_place(method, task_vectors):
    one = merge_task_vectors(task_vectors, method, scaling=1.0)
    half = merge_task_vectors(task_vectors, method, scaling=0.5)
    for key in one:
        torch.testing.assert_close(half[key], 0.5 * one[key])


def test_registry_errors_and_stable_ids():
    with pytest.raises(UnknownNameError, match=r"unknown merge method 'tie'; choose one of: adamerging_lw, "
                                               r"adamerging_tw, consensus, dare, "):
        get_merge_method("tie")
    with pytest.raises(ParameterError, match=r"ties: unknown parameter 'topk'; allowed: scaling, top_k"):
        get_merge_method("ties", topk=0.1)
    with pytest.raises(ParameterError, match=r"ties: parameter 'top_k': Input should be greater than 0"):
        get_merge_method("ties", top_k=0)
    with pytest.raises(ParameterError, match=r"dare: parameter 'rescale'"):
        get_merge_method("dare", rescale="l2")
    with pytest.raises(UnknownNameError, match=r"unknown key rule 'matrix'"):
        get_merge_method("tsv_m", key_rule="matrix")
    assert get_merge_method("ties").id == (
        "ties(disjoint='mean',scaling=1.0,sign_vote='mass',top_k=0.2,trim_scope='global')")
    assert get_merge_method("consensus", mask_lambda=[0.2, 0.3]).id == (
        "consensus(mask_lambda=[0.2,0.3],min_agreement=2,scaling=0.3)")


# ----------------------------------------------------------------------------- WA, TA


def test_weight_averaging_is_the_mean(task_vectors):
    merged = merge_task_vectors(task_vectors, "weight_averaging")
    for key in merged:
        expected = sum(t[key] for t in task_vectors) / len(task_vectors)
        torch.testing.assert_close(merged[key], expected)


def test_task_arithmetic_is_lambda_times_sum(task_vectors):
    for lam in (0.0, 0.3, 1.0):
        merged = merge_task_vectors(task_vectors, "task_arithmetic", scaling=lam)
        for key in merged:
            torch.testing.assert_close(merged[key], lam * sum(t[key] for t in task_vectors))


# ----------------------------------------------------------------------------- TIES


def test_kth_largest_magnitude_matches_sorting():
    g = torch.Generator().manual_seed(3)
    parts = [torch.randn(50, generator=g) * 10 ** float(torch.randint(-3, 3, (1,), generator=g)) for _ in range(7)]
    flat = torch.cat(parts).abs().sort(descending=True).values
    for k in (1, 2, 17, 200, 350):
        [value] = kth_largest_magnitudes(lambda: ([p] for p in parts), [k])
        assert value == flat[k - 1].item()
    assert kth_largest_magnitudes(lambda: ([p] for p in parts), [0]) == [float("inf")]
    assert kth_largest_magnitudes(lambda: ([p] for p in parts), [10_000]) == [0.0]


def test_ties_trims_to_exactly_top_k_globally_and_per_tensor():
    g = torch.Generator().manual_seed(0)
    a = tv(w=torch.randn(10, 10, generator=g), b=torch.randn(100, generator=g) * 0.1)  # b smaller: global trim skips it
    # K = 1: the merge is the trimmed task vector itself (the only entry always agrees with its sign)
    glob = merge_task_vectors([a], "ties", top_k=0.1)
    assert int((glob["w"] != 0).sum() + (glob["b"] != 0).sum()) == 20  # int(0.1 * 200)
    flat = torch.cat([a["w"].flatten(), a["b"]]).abs()
    threshold = flat.sort(descending=True).values[19]
    torch.testing.assert_close(glob["w"], a["w"] * (a["w"].abs() >= threshold))
    per = merge_task_vectors([a], "ties", top_k=0.1, trim_scope="per_tensor")
    assert int((per["w"] != 0).sum()) == 10 and int((per["b"] != 0).sum()) == 10


def test_ties_elects_sign_by_mass_and_takes_disjoint_mean():
    # one coordinate, three tasks: +1, +1, -3. Mass elects '-', count elects '+'.
    taus = [tv(x=[1.0]), tv(x=[1.0]), tv(x=[-3.0])]
    assert merge_task_vectors(taus, "ties", top_k=1.0)["x"].item() == -3.0
    assert merge_task_vectors(taus, "ties", top_k=1.0, sign_vote="count")["x"].item() == 1.0  # mean of +1, +1
    assert merge_task_vectors(taus, "ties", top_k=1.0, sign_vote="count", disjoint="sum")["x"].item() == 2.0
    # two agreeing entries 2 and 4 plus a dissenting -1: mean of agreeing = 3, sum = 6, max = 4
    taus = [tv(x=[2.0]), tv(x=[4.0]), tv(x=[-1.0])]
    for how, expected in [("mean", 3.0), ("sum", 6.0), ("max", 4.0)]:
        assert merge_task_vectors(taus, "ties", top_k=1.0, disjoint=how)["x"].item() == expected


def test_ties_zero_vote_takes_the_majority_elected_sign():
    # coordinate 0: +2 and -2 cancel; the other coordinates elect '+' (majority), so coordinate 0 keeps +2.
    taus = [tv(x=[2.0, 1.0, 1.0]), tv(x=[-2.0, 1.0, 1.0])]
    merged = merge_task_vectors(taus, "ties", top_k=1.0)
    assert merged["x"].tolist() == [2.0, 1.0, 1.0]


def test_ties_global_streaming_matches_whole_model_trim(task_vectors):
    merged = merge_task_vectors(task_vectors, "ties")
    keys = list(task_vectors[0])
    flats = [torch.cat([t[k].flatten() for k in keys]) for t in task_vectors]
    n_keep = int(0.2 * flats[0].numel())
    trimmed = torch.stack([f * (f.abs() >= f.abs().sort(descending=True).values[n_keep - 1]) for f in flats])
    sign = torch.sign(trimmed.sum(0))
    agree = (torch.sign(trimmed) == sign) & (trimmed != 0)
    expected = (trimmed * agree).sum(0) / agree.sum(0).clamp(min=1)
    got = torch.cat([merged[k].flatten() for k in keys])
    torch.testing.assert_close(got, expected)


# ----------------------------------------------------------------------------- DARE


def test_dare_is_deterministic_per_seed_and_independent_of_other_keys(task_vectors):
    a = merge_task_vectors(task_vectors, "dare", seed=7)
    b = merge_task_vectors(task_vectors, "dare", seed=7)
    c = merge_task_vectors(task_vectors, "dare", seed=8)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["visual.blocks.0.mlp.c_fc.weight"], c["visual.blocks.0.mlp.c_fc.weight"])
    only_one_key = [{"visual.blocks.0.mlp.c_fc.weight": t["visual.blocks.0.mlp.c_fc.weight"]} for t in task_vectors]
    alone = merge_task_vectors(only_one_key, "dare", seed=7)
    assert torch.equal(alone["visual.blocks.0.mlp.c_fc.weight"], a["visual.blocks.0.mlp.c_fc.weight"])


def test_dare_drop_is_unbiased_and_keeps_the_expected_fraction():
    tau = torch.linspace(-1.0, 1.0, 200_000)
    dropped = drop_and_rescale(tau, 0.9, seed=1, rescale="inverse_keep")
    kept = dropped != 0
    assert abs(kept.float().mean().item() - 0.1) < 0.005  # 0.1 +- ~7 standard errors
    torch.testing.assert_close(dropped[kept], tau[kept] / 0.1)
    # unbiased: the average over many draws converges to tau (std of the mean ~ |tau| * 3 / sqrt(400))
    small = torch.tensor([0.5, -2.0, 1.0])
    mean = torch.stack([drop_and_rescale(small, 0.9, seed=s, rescale="inverse_keep") for s in range(4000)]).mean(0)
    torch.testing.assert_close(mean, small, rtol=0.15, atol=0.0)
    l1 = drop_and_rescale(tau, 0.5, seed=2, rescale="l1")
    torch.testing.assert_close(l1.abs().sum(), tau.abs().sum())


def test_dare_with_no_drop_reduces_to_its_base(task_vectors):
    ta = merge_task_vectors(task_vectors, "task_arithmetic", scaling=0.3)
    dare_ta = merge_task_vectors(task_vectors, "dare", drop_rate=0.0, scaling=0.3)
    ties = merge_task_vectors(task_vectors, "ties", scaling=0.7)
    dare_ties = merge_task_vectors(task_vectors, "dare", drop_rate=0.0, base="ties", scaling=0.7)
    for key in ta:
        torch.testing.assert_close(dare_ta[key], ta[key])
        torch.testing.assert_close(dare_ties[key], ties[key])


# ----------------------------------------------------------------------------- Consensus


def test_consensus_keeps_coordinates_that_two_tall_masks_keep():
    # sum = [3, 0.5+0.5, 1.2]; task masks |tau_t| > 0.5 |sum - tau_t|:
    # coord 0: task1 |2| > .5|1| yes, task2 |1| > .5|2| no      -> 1 mask -> dropped
    # coord 1: |.5| > .5|.5| yes twice                          -> 2 masks -> kept
    # coord 2: |1| > .5|.2| yes, |.2| > .5|1| no                -> 1 mask -> dropped
    taus = [tv(x=[2.0, 0.5, 1.0]), tv(x=[1.0, 0.5, 0.2])]
    merged = merge_task_vectors(taus, "consensus", mask_lambda=0.5, scaling=1.0)
    torch.testing.assert_close(merged["x"], torch.tensor([0.0, 1.0, 0.0]))
    ta = merge_task_vectors(taus, "consensus", mask_lambda=0.5, scaling=1.0, min_agreement=0)
    torch.testing.assert_close(ta["x"], torch.tensor([3.0, 1.0, 1.2]))
    with pytest.raises(ParameterError, match="'min_agreement'=3 exceeds the number of models K=2"):
        merge_task_vectors(taus, "consensus", min_agreement=3)  # would keep nothing (issue #13)
    per_task = merge_task_vectors(taus, "consensus", mask_lambda=[0.5, 0.1], scaling=1.0)
    torch.testing.assert_close(per_task["x"], torch.tensor([3.0, 1.0, 1.2]))  # task 2 now keeps 0 and 2
    with pytest.raises(ParameterError, match="'mask_lambda' has 3 values but there are 2 tasks"):
        merge_task_vectors(taus, "consensus", mask_lambda=[0.1, 0.2, 0.3])


# ----------------------------------------------------------------------------- SVD methods


def orthogonal_support_task_vectors(K=3, m=12, n=9, rank=3, seed=0):
    """Task matrices whose row and column spaces are mutually orthogonal across tasks."""
    g = torch.Generator().manual_seed(seed)
    Q_left, _ = torch.linalg.qr(torch.randn(m, m, generator=g))
    Q_right, _ = torch.linalg.qr(torch.randn(n, n, generator=g))
    taus = []
    for t in range(K):
        cols = slice(t * rank, (t + 1) * rank)
        # rank = floor(r/K): TSV-M keeps exactly these triplets (a lower rank would bring LAPACK's
        # arbitrary null-space vectors into the polar factor, in the original algorithm as here)
        S = torch.diag(torch.tensor([3.0 + t, 1.0 + 0.5 * t, 0.7 + 0.1 * t]))
        taus.append({"w": Q_left[:, cols] @ S @ Q_right[:, cols].T, "bias": torch.randn(4, generator=g)})
    return taus


def test_tsv_m_with_one_task_is_the_identity_truncation(task_vectors):
    merged = merge_task_vectors(task_vectors[:1], "tsv_m")  # floor(r/1) = r: full rank kept
    for key, value in task_vectors[0].items():
        torch.testing.assert_close(merged[key], value, rtol=1e-4, atol=1e-5)


def test_tsv_m_truncates_each_task_to_floor_r_over_k():
    # two tasks, r = 9 -> 4 triplets each; with orthogonal supports the merge is the sum of the truncations
    g = torch.Generator().manual_seed(1)
    Q, _ = torch.linalg.qr(torch.randn(20, 20, generator=g))
    P, _ = torch.linalg.qr(torch.randn(9, 9, generator=g))
    spectra = [torch.tensor([5.0, 4, 3, 2, 1]), torch.tensor([6.0, 2, 1, 0.5])]
    taus = [{"w": Q[:, :5] @ torch.diag(spectra[0]) @ P[:, :5].T},
            {"w": Q[:, 5:9] @ torch.diag(spectra[1]) @ P[:, 5:9].T}]
    merged = merge_task_vectors(taus, "tsv_m")
    expected = Q[:, :4] @ torch.diag(spectra[0][:4]) @ P[:, :4].T + taus[1]["w"]
    torch.testing.assert_close(merged["w"], expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("method", ["task_arithmetic", "ties", "tsv_m"])
def test_orthogonal_supports_merge_without_interference(method):
    taus = orthogonal_support_task_vectors()
    params = {"scaling": 1.0, **({"top_k": 1.0} if method == "ties" else {})}
    merged = merge_task_vectors(taus, method, **params)
    expected = sum(t["w"] for t in taus)
    if method == "ties":  # disjoint mean: overlapping coordinates are averaged, not summed
        stacked = torch.stack([t["w"] for t in taus])
        sign = torch.sign(stacked.sum(0))
        agree = (torch.sign(stacked) == sign) & (stacked != 0)
        expected = (stacked * agree).sum(0) / agree.sum(0).clamp(min=1)
    torch.testing.assert_close(merged["w"], expected, rtol=1e-4, atol=1e-5)


def test_svd_methods_average_non_matrix_keys_and_text_projection(task_vectors):
    for method in SVD_METHODS:
        merged = merge_task_vectors(task_vectors, method)
        for key in ("visual.class_embedding", "visual.conv1.weight", "text_projection", "visual.blocks.0.ln_1.weight"):
            torch.testing.assert_close(merged[key], sum(t[key] for t in task_vectors) / 3)


def test_iso_c_spectrum_is_flat_with_the_sum_mean(task_vectors):
    merged = merge_task_vectors(task_vectors, "iso_c")
    for key in ("visual.blocks.0.attn.in_proj_weight", "visual.blocks.0.mlp.c_proj.weight",
                "visual.positional_embedding"):
        total = sum(t[key] for t in task_vectors)
        sv_sum = torch.linalg.svdvals(total.double())
        sv_out = torch.linalg.svdvals(merged[key].double())
        torch.testing.assert_close(sv_out, torch.full_like(sv_out, sv_sum.mean().item()), rtol=1e-4, atol=1e-6)
        # same singular directions: the output is mean(sigma) times the polar factor of the sum
        U, _, Vh = torch.linalg.svd(total.double(), full_matrices=False)
        torch.testing.assert_close(merged[key].double(), sv_sum.mean() * U @ Vh, rtol=1e-4, atol=1e-5)


def test_iso_cts_rank_bookkeeping():
    # the authors' rule: k0 = int(f r); task total = round((r - k0) / K) * K; common = r - task total
    assert iso_cts_ranks(768, 8, 0.8) == (616, 19)  # k0 = 614, round(154 / 8) = 19 -> 152
    assert iso_cts_ranks(768, 20, 0.8) == (608, 8)  # round(154 / 20) = 8 -> 160
    assert iso_cts_ranks(1024, 8, 0.8) == (816, 26)  # ViT-L: k0 = 819, round(205 / 8) = 26 -> 208
    assert iso_cts_ranks(8, 3, 0.8) == (5, 1)  # k0 = 6, round(2 / 3) = 1 -> 3
    assert iso_cts_ranks(8, 3, 0.0) == (2, 2)  # round(8 / 3) * 3 = 9 > 8: one K taken off
    assert iso_cts_ranks(20, 2, 0.5) == (10, 5)
    for r, K, f in [(768, 8, 0.8), (50, 7, 0.6), (10, 3, 0.0)]:
        common, per_task = iso_cts_ranks(r, K, f)
        assert common + K * per_task == r and per_task >= 0


def test_iso_cts_keeps_common_and_task_ranks_with_a_flat_spectrum():
    g = torch.Generator().manual_seed(4)
    K, m, n = 2, 30, 20
    taus = [{"w": torch.randn(m, n, generator=g)} for _ in range(K)]
    f = 0.5
    common, per_task = iso_cts_ranks(n, K, f)  # (10, 5)
    merged = merge_task_vectors(taus, "iso_cts", common_space_fraction=f)["w"].double()
    sv = torch.linalg.svdvals(merged)
    assert int((sv > 1e-6 * sv[0]).sum()) == common + K * per_task == n
    torch.testing.assert_close(sv, torch.full_like(sv, sv.mean().item()), rtol=1e-4, atol=1e-6)
    # the common space (top singular vectors of the sum) lies inside the merged column space
    U_sum = torch.linalg.svd(sum(t["w"] for t in taus).double(), full_matrices=False)[0][:, :common]
    U_out = torch.linalg.svd(merged, full_matrices=False)[0]
    residual = U_sum - U_out @ (U_out.T @ U_sum)
    assert residual.norm() < 1e-4
    # a smaller task share leaves a lower-rank merge: rank = common + K * per_task
    f2 = 0.8
    common2, per_task2 = iso_cts_ranks(n, K, f2)  # round(4)=4 -> (16, 2)
    merged2 = merge_task_vectors(taus, "iso_cts", common_space_fraction=f2)["w"].double()
    assert (common2, per_task2) == (16, 2)
    sv2 = torch.linalg.svdvals(merged2)
    assert int((sv2 > 1e-6 * sv2[0]).sum()) == 20


@pytest.mark.parametrize("shape,K,f", [((6, 4), 2, 0.0), ((4, 6), 2, 0.0), ((5, 3), 3, 0.001), ((1, 1), 1, 0.8),
                                       ((5, 1), 1, 0.8)])
def test_iso_cts_without_a_common_direction_is_the_authors_task_specific_merge(shape, K, f):
    """k_c = 0 (a fraction of 0, or a key so small that the rank rounding leaves none): the authors' code slices
    an empty common space (u[:, :0]) and goes on, so every task keeps the top r/K triplets of its own tau_t; the
    Gram solver used to fail in scipy there."""
    g = torch.Generator().manual_seed(6)
    taus = [torch.randn(*shape, generator=g) for _ in range(K)]
    r = min(shape)
    assert iso_cts_ranks(r, K, f) == (0, r // K)
    k = r // K
    parts = [torch.linalg.svd(t.double(), full_matrices=False) for t in taus]

    def polar(a):
        u, _, vh = torch.linalg.svd(a, full_matrices=False)
        return u @ vh

    U = polar(torch.cat([p[0][:, :k] for p in parts], dim=1))
    Vh = polar(torch.cat([p[2][:k] for p in parts], dim=0))
    expected = U * torch.cat([p[1][:k] for p in parts]).mean() @ Vh
    for solver in ("gram", "svd"):
        merged = merge_task_vectors([{"w": t} for t in taus], "iso_cts", common_space_fraction=f, solver=solver)
        torch.testing.assert_close(merged["w"].double(), expected, rtol=1e-5, atol=1e-5, msg=solver)
    on_cuda_route = iso_cts_matrix(taus, f, backend="torch")  # the Gram route as it runs off the CPU
    torch.testing.assert_close(on_cuda_route.double(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fraction", [-0.1, 1.5, float("nan")])
def test_iso_cts_common_space_fraction_outside_0_1_is_one_line(fraction):
    with pytest.raises(ParameterError, match="iso_cts: parameter 'common_space_fraction'"):
        get_merge_method("iso_cts", common_space_fraction=fraction)


def test_iso_cts_rank_deficient_merge_has_the_stated_rank():
    # tall-and-thin pieces make a sum of rank < r, so the stated ranks are visible in the output
    g = torch.Generator().manual_seed(5)
    K, m, n = 3, 40, 30
    taus = [{"w": torch.randn(m, n, generator=g)} for _ in range(K)]
    common, per_task = iso_cts_ranks(n, K, 0.6)  # round(12)=12 -> (18, 4)
    assert (common, per_task) == (18, 4)
    merged = merge_task_vectors(taus, "iso_cts", common_space_fraction=0.6)["w"].double()
    sv = torch.linalg.svdvals(merged)
    assert int((sv > 1e-6 * sv[0]).sum()) == common + K * per_task


@pytest.mark.parametrize("scope", ["global", "per_tensor"])
@pytest.mark.parametrize("sign_vote,disjoint", [("mass", "mean"), ("count", "sum"), ("mass", "max")])
def test_ties_in_blocks_equals_ties_in_one_block_bit_for_bit(monkeypatch, scope, sign_vote, disjoint):
    """TIES walks each key in blocks of elements (memory); its thresholds and zero-vote majority are sums over the
    whole key, so blocks of 7 elements must give the one-block merge exactly, zero votes and 0-d keys included."""
    from mergecal.methods import ties

    g = torch.Generator().manual_seed(5)
    taus = [tv(w=torch.randn(13, 11, generator=g), b=torch.randn(5, generator=g), s=torch.randn((), generator=g))
            for _ in range(3)]
    taus[1]["w"][:4] = -taus[0]["w"][:4]  # exactly balanced mass: zero votes resolved by the majority
    params = dict(top_k=0.5, trim_scope=scope, sign_vote=sign_vote, disjoint=disjoint)
    whole = merge_task_vectors(taus, "ties", **params)
    monkeypatch.setattr(ties, "BLOCK", 7)
    blocked = merge_task_vectors(taus, "ties", **params)
    assert all(torch.equal(blocked[k], whole[k]) and blocked[k].shape == whole[k].shape for k in whole)


@pytest.mark.parametrize("scope", ["global", "per_tensor"])
def test_ties_keeping_everything_skips_the_histograms_with_the_same_bits(monkeypatch, scope):
    """top_k = 1 (DARE over TIES as MergeKit's dare_ties): the thresholds are 0.0 without the two histogram passes,
    and the merge equals the one with kth_largest_magnitudes's thresholds (the smallest magnitudes) bit for bit,
    zeros of either sign included."""
    from mergecal.methods import ties

    g = torch.Generator().manual_seed(8)
    taus = [tv(w=torch.randn(9, 7, generator=g), b=torch.randn(5, generator=g)) for _ in range(3)]
    taus[0]["w"][0, :3] = torch.tensor([0.0, -0.0, 1e-30])
    taus[2]["w"][1] = -taus[1]["w"][1]  # zero votes
    for method, params in [("ties", {"top_k": 1.0, "trim_scope": scope}),
                           ("dare", {"base": "ties", "top_k": 1.0, "trim_scope": scope, "drop_rate": 0.5})]:
        fast = merge_task_vectors(taus, method, **params)
        calls = []
        monkeypatch.setattr(ties, "magnitude_thresholds",
                            lambda stream, counts, numel: calls.append(numel) or kth_largest_magnitudes(stream, counts))
        exact = merge_task_vectors(taus, method, **params)
        monkeypatch.undo()
        assert calls  # the exact thresholds were computed ...
        assert all(torch.equal(fast[k].view(torch.int32), exact[k].view(torch.int32)) for k in exact)  # ... same bits
    assert ties.magnitude_thresholds(lambda: iter(()), [10, 10], 10) == [0.0, 0.0]


@pytest.mark.parametrize("rescale", ["inverse_keep", "l1"])
def test_dare_adds_its_dropped_task_vectors_as_sum_of_them(rescale):
    """DARE over task arithmetic drops and adds one task vector at a time: bit for bit the sum of the K dropped
    task vectors (methods.base.sum_of), each the draw of drop_and_rescale with its key's seed."""
    from mergecal.methods.base import sum_of
    from mergecal.methods.dare import key_seed

    g = torch.Generator().manual_seed(2)
    taus = [torch.randn(37, 29, generator=g) for _ in range(4)]
    method = get_merge_method("dare", rescale=rescale, seed=3)
    expected = sum_of([drop_and_rescale(tau, 0.9, key_seed(3, t, "w"), rescale) for t, tau in enumerate(taus)])
    assert torch.equal(method.combine("w", taus), expected)
    assert torch.equal(taus[0], torch.randn(37, 29, generator=torch.Generator().manual_seed(2)))  # inputs untouched
