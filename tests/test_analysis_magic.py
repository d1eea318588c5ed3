"""The data of MAGIC's analysis figures (mergecal.analysis.magic_features), on a tiny open_clip CLIP and fabricated
fine-tunes. Known answers are computed independently where they can be: by hand from conv1's weights (a linear map of
the image), with plain forward hooks on models built here, or from the library's FSC measured directly."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fsc_models import sequence_first, tiny_open_clip
from mergecal.analysis.magic_features import (
    _top_components,
    clip_probe,
    default_operations,
    feature_projection,
    fsc_coefficients,
    layer_swap_gain,
    magnitude_ratios,
    merge_visual,
    task_sensitivity,
)
from mergecal.calibrations.fsc import FscParams, measure_fsc
from mergecal.errors import ParameterError

pytest.importorskip("open_clip")

K, N = 3, 4
BLOCK = ("ln_1", "attn", "ln_2", "mlp.c_fc", "mlp.c_proj")
WEIGHT_LAYERS = (["visual.conv1", "visual.ln_pre"]
                 + [f"visual.transformer.resblocks.{i}.{s}" for i in range(2) for s in BLOCK] + ["visual.ln_post"])
C_FC = "visual.transformer.resblocks.0.mlp.c_fc"
ATTN = "visual.transformer.resblocks.0.attn"
N_TOKENS = (32 // 8) ** 2 + 1


def visual(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if k.startswith("visual.")}


def noisy(state, seed, keys=None, scale=0.05):
    """``state`` plus seeded noise on ``keys`` (default: every key)."""
    g = torch.Generator().manual_seed(seed)
    return {k: v + scale * torch.randn(v.shape, generator=g) if keys is None or k in keys else v.clone()
            for k, v in state.items()}


def images(seed: int, n: int = N) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


def strictly_json(result) -> dict:
    return json.loads(json.dumps(result, allow_nan=False))


@pytest.fixture(scope="module")
def setup():
    clip = tiny_open_clip(0)
    pre = visual(clip)
    finetuned = [noisy(pre, 100 + t) for t in range(K)]
    return {"clip": clip, "pre": pre, "ft": finetuned, "x": [images(t) for t in range(K)]}


def built(clip, state):
    model = copy.deepcopy(clip)
    model.load_state_dict(state, strict=False)
    return model.eval()


@torch.no_grad()
def output_of(model, name, x):
    """``name``'s output when ``model`` encodes ``x`` (a plain forward hook), batch first, float64."""
    got = []
    handle = model.get_submodule(name).register_forward_hook(lambda m, a, out: got.append(out))
    try:
        model.encode_image(x)
    finally:
        handle.remove()
    out = got[0][0] if isinstance(got[0], tuple) else got[0]
    return out.double()


# --- Fig. 1 -----------------------------------------------------------------------------------------------------------


def test_feature_projection_shapes_and_the_specialised_model_as_the_merge(setup):
    result = strictly_json(feature_projection(setup["clip"], setup["pre"], setup["ft"], setup["ft"][1], setup["x"],
                                              C_FC, task_names=["a", "b", "c"]))
    assert result["tasks"] == ["a", "b", "c"] and result["models"] == ["merged", "specialised"]
    assert result["projection"] == "pca" and result["centered"] is False and result["feature"] == "task"
    for model in ("merged", "specialised"):
        assert [len(p) for p in result["points"][model]] == [N] * K
        assert all(len(xy) == 2 for task in result["points"][model] for xy in task)
        assert [len(m) for m in result["magnitudes"][model]] == [N] * K
    # merged = theta_b: on task b the merged feature is the specialised one
    assert result["points"]["merged"][1] == result["points"]["specialised"][1]
    assert result["magnitude_ratio"]["merged"][1] == pytest.approx(1.0, abs=1e-12)
    assert result["cosine"]["merged"][1] == pytest.approx([1.0] * N, abs=1e-9)
    assert all(abs(r - 1.0) > 1e-3 for r in (result["magnitude_ratio"]["merged"][0],
                                             result["magnitude_ratio"]["merged"][2]))
    # a projection through the origin never lengthens a feature; the magnitudes are the true L2 norms
    for model in ("merged", "specialised"):
        for task, mags in zip(result["points"][model], result["magnitudes"][model]):
            assert all(np.hypot(*xy) <= m * (1 + 1e-9) for xy, m in zip(task, mags))
    spec_b = output_of(built(setup["clip"], setup["ft"][1]), C_FC, setup["x"][1])
    base_b = output_of(built(setup["clip"], setup["pre"]), C_FC, setup["x"][1])
    expected = (spec_b - base_b).flatten(1).norm(dim=1)
    assert result["magnitudes"]["specialised"][1] == pytest.approx(expected.tolist(), rel=1e-9)
    ev = result["explained_variance_ratio"]
    assert len(ev) == 2 and ev[0] >= ev[1] >= 0 and sum(ev) <= 1 + 1e-9


def test_feature_projection_of_several_named_merges(setup):
    merges = {"ta": merge_visual(setup["pre"], setup["ft"], "task_arithmetic", scaling=0.3),
              "avg": merge_visual(setup["pre"], setup["ft"], "weight_averaging")}
    result = strictly_json(feature_projection(setup["clip"], setup["pre"], setup["ft"], merges, setup["x"],
                                              "visual.ln_post", feature="raw", center=True))
    assert result["models"] == ["ta", "avg", "specialised"] and set(result["cosine"]) == {"ta", "avg"}
    # centred: the projections of all points sum to zero
    flat = np.array([xy for m in result["models"] for task in result["points"][m] for xy in task])
    assert np.allclose(flat.sum(axis=0), 0.0, atol=1e-8)
    with pytest.raises(ParameterError, match="'specialised' is taken"):
        feature_projection(setup["clip"], setup["pre"], setup["ft"], {"specialised": setup["ft"][0]}, setup["x"],
                           C_FC)


@pytest.mark.parametrize("shape", [(7, 40), (40, 7)])
def test_pca_equals_an_svd(shape):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    projected, components, ratios = _top_components(x, center=False)
    u, s, vt = np.linalg.svd(x.numpy(), full_matrices=False)
    assert np.allclose(np.abs(projected.numpy()), np.abs(u[:, :2] * s[:2]), atol=1e-9)
    assert np.allclose(np.abs(components.numpy()), np.abs(vt[:2].T), atol=1e-9)
    assert ratios == pytest.approx((s[:2] ** 2 / (s ** 2).sum()).tolist(), rel=1e-9)
    # the sign convention: each component's largest loading is positive
    assert all(components[components[:, c].abs().argmax(), c] > 0 for c in range(2))


# --- Fig. 3 -----------------------------------------------------------------------------------------------------------


def test_magnitude_ratios_shapes_and_known_answers(setup):
    pre, ft, x = setup["pre"], setup["ft"], setup["x"]
    result = strictly_json(magnitude_ratios(setup["clip"], pre, ft, x))
    assert result["layers"] == WEIGHT_LAYERS and set(result["operations"]) == {"trim", "sum", "disjoint"}
    assert result["operations"]["sum"]["params"] == {"scaling": pytest.approx(1 / K)}
    for op in result["operations"].values():
        for field in ("weight_ratio", "feature_ratio"):
            assert len(op[field]) == len(WEIGHT_LAYERS) and all(len(row) == K for row in op[field])
            assert len(op["layer_mean"][field]) == len(WEIGHT_LAYERS)
    taus = [{k: ft[t][k] - pre[k] for k in pre} for t in range(K)]
    # trim: TIES' global top 20 % of tau_i's magnitudes over the whole encoder, computed here from scratch
    for t in (0, 2):
        flat = torch.cat([v.reshape(-1) for v in taus[t].values()]).abs()
        threshold = flat.topk(int(0.2 * flat.numel())).values.min()
        for row, layer in enumerate(WEIGHT_LAYERS):
            tensors = [v for k, v in taus[t].items() if k.startswith(layer + ".")]
            kept = torch.cat([(v * (v.abs() >= threshold)).reshape(-1) for v in tensors]).norm()
            assert result["operations"]["trim"]["weight_ratio"][row][t] == pytest.approx(
                float(kept / torch.cat([v.reshape(-1) for v in tensors]).norm()), rel=1e-5), (layer, t)
    # conv1 is linear in its weight and has no bias: its task feature is conv(x, tau), so the feature ratio of the
    # trimmed model is ||conv(x, trim(tau))|| / ||conv(x, tau)||, per image
    row = WEIGHT_LAYERS.index("visual.conv1")
    for t in range(K):
        tau = taus[t]["visual.conv1.weight"]
        flat = torch.cat([v.reshape(-1) for v in taus[t].values()]).abs()
        threshold = flat.topk(int(0.2 * flat.numel())).values.min()
        full = F.conv2d(x[t], tau, stride=8).flatten(1).abs().sum(1)
        trimmed = F.conv2d(x[t], tau * (tau.abs() >= threshold), stride=8).flatten(1).abs().sum(1)
        assert result["operations"]["trim"]["feature_ratio"][row][t] == pytest.approx(
            float((trimmed / full).mean()), rel=1e-4)
    # sum at lambda = 1/K: ||mean tau|| / ||tau_i|| per layer
    for row, layer in enumerate(WEIGHT_LAYERS):
        keys = [k for k in pre if k.startswith(layer + ".")]
        mean = torch.cat([(sum(tau[k] for tau in taus) / K).reshape(-1) for k in keys]).norm()
        for t in range(K):
            own = torch.cat([taus[t][k].reshape(-1) for k in keys]).norm()
            assert result["operations"]["sum"]["weight_ratio"][row][t] == pytest.approx(float(mean / own), rel=1e-5)
    # three independent fine-tunes: averaging shrinks every layer's task vector (Eq. 4)
    assert all(r < 1 for row in result["operations"]["sum"]["weight_ratio"] for r in row)


def test_magnitude_ratios_of_identical_finetunes_and_a_custom_operation(setup):
    pre, x = setup["pre"], setup["x"]
    same = [setup["ft"][0]] * K
    ops = {"sum": default_operations(K)["sum"],
           "double": {"method": "task_arithmetic", "params": {"scaling": 2.0}, "per_task": True}}
    layers = ["visual.conv1", C_FC, "visual.ln_post"]
    result = strictly_json(magnitude_ratios(setup["clip"], pre, same, x, layers=layers, operations=ops))
    assert result["layers"] == layers and list(result["operations"]) == ["sum", "double"]
    total_sum = result["operations"]["sum"]
    assert np.allclose(total_sum["weight_ratio"], 1.0, atol=1e-6)
    assert np.allclose(total_sum["feature_ratio"], 1.0, atol=1e-4)
    double = result["operations"]["double"]
    assert np.allclose(double["weight_ratio"], 2.0, rtol=1e-6)
    assert np.allclose(double["feature_ratio"][0], 2.0, rtol=1e-4)  # conv1: linear in its weight, no bias
    assert not np.allclose(double["feature_ratio"][2], 2.0, rtol=1e-4)  # after a LayerNorm and attention: not linear
    with pytest.raises(ParameterError, match="no weights"):
        magnitude_ratios(setup["clip"], pre, same, x, layers=["visual.transformer.resblocks.0.mlp.gelu"])
    with pytest.raises(ParameterError, match="unknown merge method"):
        magnitude_ratios(setup["clip"], pre, same, x, layers=layers, operations={"x": {"method": "nope"}})


# --- Fig. 4 -----------------------------------------------------------------------------------------------------------


def test_layer_swap_gain_is_zero_where_the_merge_already_holds_the_swapped_layer(setup):
    layers = [C_FC, "visual.ln_post"]
    result = strictly_json(layer_swap_gain(setup["clip"], setup["pre"], setup["ft"], setup["ft"][2], setup["x"],
                                           layers))
    assert result["layers"] == layers and set(result["swaps"]) == set(layers)
    for layer in layers:
        gain, ratio = np.array(result["swaps"][layer]["gain"]), np.array(result["swaps"][layer]["ratio"])
        assert gain.shape == ratio.shape == (K, K) and len(result["swaps"][layer]["merged_magnitude"]) == K
        assert np.all(gain[:, 2] == 0.0) and np.all(ratio[:, 2] == 1.0)  # theta_2's layer into theta_2: no change
        assert np.all(np.abs(gain[:, :2]) > 1e-6)


def test_layer_swap_gain_equals_a_swapped_model_built_by_hand(setup):
    pre, ft, x, clip = setup["pre"], setup["ft"], setup["x"], setup["clip"]
    merged = merge_visual(pre, ft, "weight_averaging")
    result = layer_swap_gain(clip, pre, ft, merged, x, [ATTN])["swaps"][ATTN]
    base, merged_model = built(clip, pre), built(clip, merged)
    for i, j in ((0, 1), (2, 0)):
        swapped = built(clip, {**merged, **{k: v for k, v in ft[j].items() if k.startswith(ATTN + ".")}})
        h0 = output_of(base, ATTN, x[i])
        before = (output_of(merged_model, ATTN, x[i]) - h0).flatten(1).abs().sum(1)
        after = (output_of(swapped, ATTN, x[i]) - h0).flatten(1).abs().sum(1)
        assert result["gain"][i][j] == pytest.approx(float((after - before).mean()), rel=1e-6)
        assert result["ratio"][i][j] == pytest.approx(float((after / before).mean()), rel=1e-6)
        assert result["merged_magnitude"][i] == pytest.approx(float(before.mean()), rel=1e-6)
    # the merged model's weights are restored after every swap: conv1, swapped first, runs before ATTN
    assert layer_swap_gain(clip, pre, ft, merged, x, ["visual.conv1", ATTN])["swaps"][ATTN] == result


def test_sequence_first_blocks_give_the_same_numbers(setup):
    """open_clip < 2.24 ran residual blocks sequence-first ([L, N, D]): samples are found on the batch dimension."""
    pre, ft, x = setup["pre"], setup["ft"], setup["x"]
    merged = merge_visual(pre, ft, "weight_averaging")
    old = sequence_first(setup["clip"])
    assert old.visual.transformer.batch_first is False
    ours = layer_swap_gain(setup["clip"], pre, ft, merged, x, [ATTN])["swaps"][ATTN]
    theirs = layer_swap_gain(old, pre, ft, merged, x, [ATTN])["swaps"][ATTN]
    assert np.allclose(ours["gain"], theirs["gain"], rtol=1e-4) and np.allclose(ours["ratio"], theirs["ratio"])
    ours = feature_projection(setup["clip"], pre, ft, merged, x, C_FC)["magnitudes"]
    theirs = feature_projection(old, pre, ft, merged, x, C_FC)["magnitudes"]
    assert np.allclose(ours["merged"], theirs["merged"], rtol=1e-5)


# --- Fig. 5 -----------------------------------------------------------------------------------------------------------


def test_task_sensitivity_finds_the_keys_each_task_vector_moved(setup):
    pre, clip = setup["pre"], setup["clip"]
    a, b, c = ("visual.transformer.resblocks.0.mlp.c_fc.weight", "visual.transformer.resblocks.1.attn.in_proj_weight",
               "visual.ln_post.weight")
    moved = [{a, b}, {a, c}, {a, b}]
    finetuned = [noisy(pre, 200 + t, keys, scale=0.3) for t, keys in enumerate(moved)]
    probe = images(9, 6)

    def distance_to(state):
        with torch.no_grad():
            reference = built(clip, state).encode_image(probe)

        def evaluate(model):  # per example: minus the distance to the specialised model's features
            with torch.no_grad():
                return -(model.encode_image(probe) - reference).norm(dim=1)
        return evaluate

    result = strictly_json(task_sensitivity(clip, pre, finetuned, [distance_to(s) for s in finetuned], top=2))
    assert result["keys"] == list(pre) and result["scale"] == 1.1 and result["top"] == 2
    assert np.array(result["score"]).shape == np.array(result["sensitivity"]).shape == (K, len(pre))
    assert result["baseline"] == [0.0] * K
    for t, keys in enumerate(moved):
        assert set(result["sensitive"][t]) == keys
        for key, s in zip(result["keys"], result["sensitivity"][t]):
            assert (s < 0) if key in keys else (s == 0.0), (t, key)
        assert len(result["drop_interval"][t]) == len(pre) and len(result["drop_interval"][t][0]) == 3
    assert result["jaccard"] == [[1.0, 1 / 3, 1.0], [1 / 3, 1.0, 1 / 3], [1.0, 1 / 3, 1.0]]
    assert np.allclose(np.diag(result["spearman"]), 1.0)
    assert result["spearman"][0][2] > result["spearman"][0][1]


def test_task_sensitivity_with_a_shared_zero_shot_probe(setup):
    pre, ft, clip = setup["pre"], setup["ft"], setup["clip"]
    head = F.normalize(torch.randn(16, 5, generator=torch.Generator().manual_seed(4)), dim=0)
    x = images(11, 8)
    with torch.no_grad():
        labels = (F.normalize(built(clip, pre).encode_image(x), dim=-1) @ head).argmax(-1)
    evaluate = clip_probe(head, [(x, labels)], metric="nll")
    keys = ["visual.conv1.weight", "visual.ln_post.weight", "visual.proj"]
    result = strictly_json(task_sensitivity(clip, pre, ft, evaluate, keys=keys, top=1, task_names=list("abc")))
    assert result["keys"] == [k for k in pre if k in keys]  # in model order
    assert result["tasks"] == ["a", "b", "c"] and [len(s) for s in result["sensitive"]] == [1] * K
    assert all(r[t] == 1.0 for t, r in enumerate(result["jaccard"]))
    with pytest.raises(ParameterError, match="one callable or 3"):
        task_sensitivity(clip, pre, ft, [evaluate], keys=keys)


# --- Fig. 9 -----------------------------------------------------------------------------------------------------------


def test_fsc_coefficients_are_what_measure_fsc_reports(setup):
    pre, ft, x, clip = setup["pre"], setup["ft"], setup["x"], setup["clip"]
    merged = merge_visual(pre, ft, "weight_averaging")
    layers = [ATTN, "visual.ln_post"]
    result = strictly_json(fsc_coefficients(clip, pre, ft, merged, x, layers, per_position=True))
    assert result["layers"] == layers and result["norm"] == "l1" and result["task_feature"] == "module_replay"
    models = [built(clip, merged), built(clip, pre), [built(clip, s) for s in ft]]
    whole = measure_fsc(*models, x, n_samples_per_task=N, progress=False)
    first = measure_fsc(*models, [xs[:1] for xs in x], progress=False)
    for layer in layers:
        entry = result["coefficients"][layer]
        assert [len(v) for v in entry["xi"]] == [N] * K and len(entry["task_mean"]) == K
        for t in range(K):
            assert entry["xi"][t][0] == pytest.approx(float(first.per_task[t][layer].double().mean()), rel=1e-12)
            assert entry["task_mean"][t] == pytest.approx(float(whole.per_task[t][layer].double().mean()), rel=1e-5)
        assert entry["mean"] == pytest.approx(float(np.mean(entry["task_mean"])), rel=1e-12)
    attn_positions = result["coefficients"][ATTN]["positions"]
    assert len(attn_positions[0][0]) == N_TOKENS and result["coefficients"]["visual.ln_post"]["positions"][0][0] > 0
    # Eq. 18 over the tasks, as one scalar: FSC's own raw ratio with token_ratios="mean"
    scalar = measure_fsc(*models, x, n_samples_per_task=N, token_ratios="mean", progress=False)
    assert result["coefficients"][ATTN]["mean"] == pytest.approx(float(scalar.raw_ratios[ATTN]), rel=1e-5)


def test_fsc_coefficients_of_the_specialised_model_are_one(setup):
    pre, ft, x, clip = setup["pre"], setup["ft"], setup["x"], setup["clip"]
    merged_model = built(clip, ft[0])  # a model is accepted as the merge
    result = fsc_coefficients(clip, pre, ft, merged_model, x, C_FC, params=None)["coefficients"][C_FC]
    assert result["xi"][0] == pytest.approx([1.0] * N, abs=1e-12)
    assert all(abs(v - 1.0) > 1e-3 for v in result["xi"][1])
    network = fsc_coefficients(clip, pre, ft, merged_model, x, C_FC, params=FscParams(task_feature="network"),
                               task_names=list("abc"))
    assert network["tasks"] == ["a", "b", "c"] and network["task_feature"] == "network"
    assert network["coefficients"][C_FC]["xi"][0] == pytest.approx([1.0] * N, abs=1e-12)
    with pytest.raises(ParameterError, match="not a module FSC hooks"):
        fsc_coefficients(clip, pre, ft, merged_model, x, "visual.transformer.resblocks.0.attn.out_proj")
    with pytest.raises(ParameterError, match="expected 3 batches"):
        fsc_coefficients(clip, pre, ft, merged_model, x[:2], C_FC)
