"""Elementwise merges (task arithmetic, weight averaging, DARE over task arithmetic, TIES and DARE over TIES at
top_k = 1 within each tensor) read and merge each key in row blocks (``merge.iter_model_in_blocks``): the same bits
as the whole-key stream, K blocks held instead of K keys."""

import pytest
import torch

from mergecal.checkpoint import DictSource, save_state_dict
from mergecal.errors import NonFiniteError, ParameterError
from mergecal.merge import _iter_merged_model, _iter_model, iter_merge, iter_model_in_blocks, row_blocks
from mergecal.methods import get_merge_method
from mergecal.task_vectors import TaskVectorSet

SHAPES = {"w2d": (23, 5), "conv": (7, 3, 2, 2), "bias": (19,), "scalar": (), "empty": (0, 6), "one_row": (1, 40)}


def models(dtype, k=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    pre = {name: torch.randn(shape, generator=g).to(dtype) for name, shape in SHAPES.items()}
    pre["w2d"][0, :3] = -0.0  # zeros of theta_0's with a sign: kept through an all-zero update
    pre["frozen"] = torch.tensor([-0.0, 0.0, 1.5]).to(dtype)  # no task moves it
    pre["steps"] = torch.arange(4)  # an integer buffer
    fts = []
    for _ in range(k):
        ft = {name: (v + 0.1 * torch.randn(v.shape, generator=g).to(dtype)) if v.is_floating_point() else v.clone()
              for name, v in pre.items()}
        ft["frozen"] = pre["frozen"].clone()
        fts.append(ft)
    return pre, fts


def bits(tensor):
    """A tensor's bytes: equal bits, zeros' signs included."""
    return tensor.reshape(-1).contiguous().view(torch.uint8) if tensor.numel() else tensor


METHODS = [("task_arithmetic", {"scaling": 0.3}), ("weight_averaging", {}),
           ("dare", {"drop_rate": 0.7, "seed": 4}), ("dare", {"drop_rate": 0.0}), ("task_arithmetic", {"scaling": 0.0}),
           ("ties", {"top_k": 1.0, "trim_scope": "per_tensor", "scaling": 0.7}),
           ("ties", {"top_k": 1.0, "trim_scope": "per_tensor", "sign_vote": "count", "disjoint": "max"}),
           ("dare", {"base": "ties", "top_k": 1.0, "trim_scope": "per_tensor", "drop_rate": 0.7, "seed": 4}),
           ("dare", {"base": "ties", "top_k": 1.0, "trim_scope": "per_tensor", "drop_rate": 0.0, "disjoint": "sum"})]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("method,params", METHODS)
@pytest.mark.parametrize("block", [1, 7, 1 << 22])
def test_blocks_give_the_whole_key_streams_bits(dtype, method, params, block):
    pre, fts = models(dtype)
    out_dtype = torch.float32 if dtype == torch.float16 else None
    whole = dict(_iter_model(TaskVectorSet.from_models(pre, fts), iter_merge(TaskVectorSet.from_models(pre, fts),
                                                                             get_merge_method(method, **params)),
                             out_dtype))
    blocked = dict(iter_model_in_blocks(TaskVectorSet.from_models(pre, fts), get_merge_method(method, **params),
                                        out_dtype, block=block))
    assert list(blocked) == list(whole)
    for key, value in whole.items():
        assert blocked[key].dtype == value.dtype and blocked[key].shape == value.shape, key
        assert torch.equal(bits(blocked[key]), bits(value)), key


@pytest.mark.parametrize("base", [{}, {"base": "ties", "top_k": 1.0, "trim_scope": "per_tensor"}])
def test_dare_l1_in_blocks_equals_the_whole_key_up_to_its_factor_rounding(base):
    """The L1 factor is summed over the blocks in float64 (the whole key: in float32): same masks, factors within
    float32 rounding of each other (atol: two ulps of 1, the models' scale, for a theta_0 + tau that cancels)."""
    pre, fts = models(torch.float32)
    method = {"drop_rate": 0.6, "seed": 1, "rescale": "l1", **base}
    tvs = TaskVectorSet.from_models(pre, fts)
    whole = dict(_iter_model(tvs, iter_merge(tvs, get_merge_method("dare", **method)), None))
    blocked = dict(iter_model_in_blocks(TaskVectorSet.from_models(pre, fts), get_merge_method("dare", **method),
                                        block=5))
    for key, value in whole.items():
        assert torch.equal(blocked[key] == pre[key], value == pre[key]), key  # the same entries moved
        if value.is_floating_point():
            torch.testing.assert_close(blocked[key], value, rtol=1e-6, atol=2.4e-7)


def test_blocks_read_rows_and_never_a_whole_key(tmp_path):
    """On safetensors files every float key of rank >= 1 is read by row ranges of about ``block`` elements."""
    pre, fts = models(torch.bfloat16, k=2)
    paths = [save_state_dict(m, tmp_path / f"m{i}.safetensors") for i, m in enumerate([pre, *fts])]
    tvs = TaskVectorSet.from_models(paths[0], paths[1:])
    reads = []
    for source in [tvs.pretrained, *tvs.sources]:
        get, get_rows = source.get, source.get_rows
        source.get = lambda key, get=get: reads.append(("get", key)) or get(key)
        source.get_rows = lambda key, a, b, get_rows=get_rows: reads.append(("rows", key, a, b)) or get_rows(key, a, b)
    merged = dict(iter_model_in_blocks(tvs, get_merge_method("task_arithmetic"), block=10))
    whole = {key for kind, key, *_ in reads if kind == "get"}
    assert whole == {"scalar", "steps"}  # the 0-d float key and the integer buffer
    w2d = [(a, b) for kind, key, *ab in reads if kind == "rows" and key == "w2d" for a, b in [ab]]
    assert set(w2d) == {(0, 2), (2, 4), (4, 6), (6, 8), (8, 10), (10, 12), (12, 14), (14, 16), (16, 18), (18, 20),
                        (20, 22), (22, 23)}
    expected = dict(_iter_model(tvs, iter_merge(tvs, get_merge_method("task_arithmetic")), None))
    for key, value in expected.items():
        assert torch.equal(bits(merged[key]), bits(value)), key


def test_row_blocks_cover_the_rows_once():
    assert row_blocks((10, 3), 7) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    assert row_blocks((3, 100), 7) == [(0, 1), (1, 2), (2, 3)]  # a row wider than a block: one row at a time
    assert row_blocks((5,), 1 << 22) == [(0, 5)]


def test_a_nan_in_a_block_names_the_key_and_the_model():
    pre, fts = models(torch.float32)
    fts[1]["w2d"][20, 1] = float("nan")
    tvs = TaskVectorSet.from_models(DictSource(pre, "pre"), [DictSource(ft, f"ft{i}") for i, ft in enumerate(fts)])
    with pytest.raises(NonFiniteError, match="key 'w2d' in ft1 contains NaN"):
        dict(iter_model_in_blocks(tvs, get_merge_method("task_arithmetic"), block=7))


def test_ties_zero_votes_take_the_keys_majority_in_blocks():
    """Coordinates whose task vectors cancel exactly (a zero vote) take the majority elected sign of the key, which
    the blocks' first pass adds up: here +1 (most coordinates vote +), so the positive entry is kept there."""
    pre = {"w": torch.zeros(12, 4)}
    first = torch.rand(12, 4, generator=torch.Generator().manual_seed(2)) + 0.5
    second = first.clone()
    second[::3] = -first[::3]  # rows 0, 3, 6, 9 cancel: zero mass vote
    fts = [{"w": first}, {"w": second}]
    method = {"top_k": 1.0, "trim_scope": "per_tensor"}
    tvs = TaskVectorSet.from_models(pre, fts)
    whole = dict(_iter_model(tvs, iter_merge(tvs, get_merge_method("ties", **method)), None))["w"]
    blocked = dict(iter_model_in_blocks(TaskVectorSet.from_models(pre, fts), get_merge_method("ties", **method),
                                        block=4))["w"]
    assert torch.equal(bits(blocked), bits(whole))
    assert torch.equal(blocked[::3], first[::3])  # the majority's (+) entry alone, a mean over one
    assert torch.equal(blocked[1::3], first[1::3])  # agreeing entries: their mean, the entry itself


def test_methods_reading_whole_keys_are_not_merged_in_blocks():
    pre, fts = models(torch.float32)
    assert not get_merge_method("dare", base="ties").blockwise and not get_merge_method("ties").blockwise
    # top_k = 1 over the whole model: the zero-vote majority is the model's, found by fit
    assert not get_merge_method("ties", top_k=1.0).blockwise
    assert get_merge_method("dare", base="ties", top_k=1.0, trim_scope="per_tensor").blockwise
    with pytest.raises(ParameterError, match="ties: merges a key from statistics of the whole key"):
        next(iter_model_in_blocks(TaskVectorSet.from_models(pre, fts), get_merge_method("ties")))


def test_a_negative_scaling_takes_the_whole_key_stream():
    """theta_0's -0.0 in a key no task moved: the whole-key stream adds +0.0 (kept -0.0 -> +0.0), blocks would add
    -0.0 (kept -0.0): a negative scaling is merged by the whole-key stream, so the two routes never disagree."""
    pre, fts = models(torch.float32)
    method = get_merge_method("task_arithmetic", scaling=-0.5)
    routed = dict(_iter_merged_model(TaskVectorSet.from_models(pre, fts), method, None, False))
    tvs = TaskVectorSet.from_models(pre, fts)
    whole = dict(_iter_model(tvs, iter_merge(tvs, method), None))
    blocked = dict(iter_model_in_blocks(TaskVectorSet.from_models(pre, fts), method))
    assert torch.equal(bits(routed["frozen"]), bits(whole["frozen"]))
    assert not torch.equal(bits(blocked["frozen"]), bits(whole["frozen"]))  # why the route exists
