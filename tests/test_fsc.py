"""MAGIC FSC (feature space calibration) and the architectures it hooks.

Expected values are computed independently of mergecal.calibrations.fsc: by hand from the weights and
inputs of small layers, or with the original pretrained / merged modules called directly.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fsc_models import averaged, perturbed, sequence_first, tiny_bert, tiny_open_clip
from mergecal.calibrations.fsc import (
    Fsc,
    FscMeasurement,
    FscParams,
    build_calibrated_model,
    calibrate_fsc,
    conservative,
    load_fsc,
    measure_fsc,
    save_fsc,
)
from mergecal.checkpoint import MARKER, SafetensorsSource
from mergecal.errors import CheckpointError, IncompatibleModelsError, ParameterError, UnknownNameError
from mergecal.feature_hooks import HF_BERT, OPEN_CLIP_VIT, explicit_architecture, architecture_for, get_architecture

pytest.importorskip("open_clip")

BLOCK = ("ln_1", "attn", "ln_2", "mlp.c_fc", "mlp.gelu", "mlp.c_proj")
VIT_NAMES = (["visual.conv1", "visual.ln_pre"]
             + [f"visual.transformer.resblocks.{i}.{s}" for i in range(2) for s in BLOCK] + ["visual.ln_post"])
N_TOKENS = (32 // 8) ** 2 + 1


def images(seed: int, n: int = 1) -> torch.Tensor:
    return torch.randn(n, 3, 32, 32, generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def clip():
    """theta_0, K = 3 fine-tuned visual towers, their weight average, one image per task."""
    pre = tiny_open_clip(0)
    finetuned = [perturbed(pre, 100 + t, prefix="visual.") for t in range(3)]
    merged = averaged(finetuned)
    inputs = [images(t) for t in range(3)]
    measurement = measure_fsc(merged, pre, finetuned, inputs, progress=False)
    return {"pre": pre, "finetuned": finetuned, "merged": merged, "inputs": inputs, "m": measurement}


@pytest.fixture(scope="module")
def calibrated(clip):
    return clip["m"].apply(clip["merged"], clip["pre"])


def test_target_enhancement_takes_one_tasks_ratio_instead_of_the_mean(clip):
    """aggregate=t (MAGIC's Fig. 10): the merged model's feature magnitude matched to task t's alone."""
    mean = clip["m"]
    assert all(torch.equal(mean.raw_ratios[n], torch.where(torch.isfinite(r := torch.stack(
        [task[n] for task in mean.per_task]).mean(0)), r, torch.ones_like(r)).float()) for n in mean.raw_ratios)
    target = measure_fsc(clip["merged"], clip["pre"], clip["finetuned"], clip["inputs"], aggregate=1, progress=False)
    for name, ratio in target.raw_ratios.items():
        own = target.per_task[1][name]
        assert torch.equal(ratio, torch.where(torch.isfinite(own), own, torch.ones_like(own)).float())
    assert any(not torch.equal(target.raw_ratios[n], mean.raw_ratios[n]) for n in mean.raw_ratios)
    with pytest.raises(ParameterError, match="'aggregate'=3 names a task index; there are 3 tasks"):
        measure_fsc(clip["merged"], clip["pre"], clip["finetuned"], clip["inputs"], aggregate=3, progress=False)


# --- architectures --------------------------------------------------------------------------------------


def test_open_clip_family_names_and_layout(clip):
    pre = clip["pre"]
    assert architecture_for(pre) is OPEN_CLIP_VIT
    assert OPEN_CLIP_VIT.fsc_module_names(pre) == VIT_NAMES
    assert OPEN_CLIP_VIT.fsc_module_names(pre.visual) == [n[len("visual."):] for n in VIT_NAMES]
    assert isinstance(pre.get_submodule("visual.transformer.resblocks.1.attn"), nn.MultiheadAttention)
    specs = {s.name: s for s in OPEN_CLIP_VIT.fsc_modules(pre)}
    assert specs["visual.conv1"].granularity == "channel"
    assert {specs[n].granularity for n in VIT_NAMES if ".ln_" in n} == {"scalar"}
    # open_clip 3.3.0 runs residual blocks batch-first: outputs [N, L, D], tokens on dim 1
    assert pre.visual.transformer.batch_first and specs["visual.transformer.resblocks.0.attn"].batch_dim == 0
    shapes = {n: tuple(r.shape) for n, r in clip["m"].raw_ratios.items()}
    assert shapes["visual.conv1"] == (32,)
    assert (shapes["visual.transformer.resblocks.0.attn"] == shapes["visual.transformer.resblocks.1.mlp.c_fc"]
            == (N_TOKENS,))
    assert shapes["visual.ln_pre"] == shapes["visual.ln_post"] == ()


def test_sequence_first_open_clip_gives_the_same_ratios(clip):
    """Older open_clip runs residual blocks as [L, N, D]: the token position is then dim 0, and FSC must find it."""
    pre, merged = sequence_first(clip["pre"]), sequence_first(clip["merged"])
    finetuned = [sequence_first(m) for m in clip["finetuned"]]
    assert not merged.visual.transformer.batch_first and not merged.visual.transformer.resblocks[0].attn.batch_first
    specs = {s.name: s for s in OPEN_CLIP_VIT.fsc_modules(merged)}
    assert specs["visual.transformer.resblocks.0.mlp.c_fc"].batch_dim == 1
    inputs = [torch.cat([x, images(90 + t)]) for t, x in enumerate(clip["inputs"])]  # N = 2 != L, so a mix-up shows
    m_seq = measure_fsc(merged, pre, finetuned, inputs, n_samples_per_task=2, progress=False)
    m_bf = measure_fsc(clip["merged"], clip["pre"], clip["finetuned"], inputs, n_samples_per_task=2, progress=False)
    for name, ratio in m_bf.raw_ratios.items():
        torch.testing.assert_close(m_seq.raw_ratios[name], ratio, rtol=1e-4, atol=1e-5, msg=name)
    x = images(91, n=2)
    torch.testing.assert_close(m_seq.apply(merged, pre).encode_image(x),
                               m_bf.apply(clip["merged"], clip["pre"]).encode_image(x), rtol=1e-4, atol=1e-5)


def test_bert_family_names():
    pytest.importorskip("transformers")
    layer = ("attention.self.query", "attention.self.key", "attention.self.value", "attention.output.dense",
             "attention.output.LayerNorm", "intermediate.dense", "output.dense", "output.LayerNorm")
    expected = ["embeddings.LayerNorm"] + [f"encoder.layer.{i}.{s}" for i in range(2) for s in layer]
    bert = tiny_bert(0)
    assert architecture_for(bert) is HF_BERT
    assert HF_BERT.fsc_module_names(bert) == expected
    wrapped = tiny_bert(0, classification=True)
    assert HF_BERT.fsc_module_names(wrapped) == [f"bert.{n}" for n in expected]


def test_unknown_family_lists_the_known_ones():
    with pytest.raises(UnknownNameError, match="known architectures: hf_bert, open_clip_vit"):
        architecture_for(nn.Linear(2, 2))
    with pytest.raises(UnknownNameError, match="choose one of: hf_bert, open_clip_vit"):
        get_architecture("resnet")
    with pytest.raises(ParameterError, match="not in the model"):
        explicit_architecture(["nope"]).fsc_modules(nn.Sequential(nn.Linear(2, 2)))


# --- one-layer models: ratios by hand --------------------------------------------------------------


class SeqFirst(nn.Module):
    """[N, L, D] -> [L, N, D]: the next module sees a sequence-first layout (old open_clip)."""

    def forward(self, x):
        return x.transpose(0, 1)


@torch.no_grad()
def _one_layer_models(k: int, seed: int = 0, d_in: int = 4, d_out: int = 3):
    torch.manual_seed(seed)
    pre = nn.Sequential(SeqFirst(), nn.Linear(d_in, d_out))
    finetuned = [perturbed(pre, 10 + t, scale=0.3) for t in range(k)]
    merged = averaged(finetuned)
    return pre, finetuned, merged


def _hand_delta(model, pre, x):
    """x @ (W - W0)^T + (b - b0) for the Linear at index 1, on the sequence-first input, float64."""
    W, b = model[1].weight.double(), model[1].bias.double()
    W0, b0 = pre[1].weight.double(), pre[1].bias.double()
    return x.double().transpose(0, 1) @ (W - W0).T + (b - b0)


@pytest.mark.parametrize("norm", ["l1", "l2"])
def test_one_layer_ratio_by_hand(norm):
    pre, finetuned, merged = _one_layer_models(k=2)
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(2, 5, 4, generator=g) for _ in range(2)]  # N = 2 samples, L = 5 tokens
    merged.train()
    m = measure_fsc(merged, pre, finetuned, inputs, architecture=explicit_architecture(["1"], batch_dim=1),
                    n_samples_per_task=2, norm=norm, progress=False)
    assert merged.training and merged[1].training  # training flags restored

    p = 1 if norm == "l1" else 2
    per_task = []
    for ft, x in zip(finetuned, inputs):
        d_t, d_m = _hand_delta(ft, pre, x), _hand_delta(merged, pre, x)  # [L, N, D]
        per_task.append((d_t.norm(p=p, dim=-1) / d_m.norm(p=p, dim=-1)).mean(dim=1))  # per token, mean over N
    expected = torch.stack(per_task).mean(0)
    assert m.raw_ratios["1"].shape == (5,)
    torch.testing.assert_close(m.raw_ratios["1"].double(), expected, rtol=1e-5, atol=1e-6)

    # the calibrated layer outputs f0 + r (fm - f0), token by token
    w = m.apply(merged, pre)
    assert w.hooked == ["1"] and w.folded == []
    x = torch.randn(3, 5, 4, generator=g)
    xs = x.transpose(0, 1)
    f0, fm = F.linear(xs, pre[1].weight, pre[1].bias), F.linear(xs, merged[1].weight, merged[1].bias)
    want = f0 + m.raw_ratios["1"].view(5, 1, 1) * (fm - f0)
    torch.testing.assert_close(w(x), want, rtol=1e-5, atol=1e-6)


def test_scalar_ratio_of_a_linear_is_folded_exactly():
    torch.manual_seed(3)
    pre = nn.Sequential(nn.Linear(4, 3))
    finetuned = [perturbed(pre, 20 + t, scale=0.3) for t in range(3)]
    merged = averaged(finetuned)
    inputs = [torch.randn(1, 4, generator=torch.Generator().manual_seed(t)) for t in range(3)]  # [N, D]: one ratio
    m = measure_fsc(merged, pre, finetuned, inputs, architecture=["0"], progress=False)
    W0, b0, Wm, bm = (t.double() for t in (pre[0].weight, pre[0].bias, merged[0].weight, merged[0].bias))
    ratios = []
    for ft, x in zip(finetuned, inputs):
        d_t = x.double() @ (ft[0].weight.double() - W0).T + (ft[0].bias.double() - b0)
        d_m = x.double() @ (Wm - W0).T + (bm - b0)
        ratios.append(d_t.abs().sum() / d_m.abs().sum())
    r = torch.stack(ratios).mean()
    torch.testing.assert_close(m.raw_ratios["0"].double(), r, rtol=1e-5, atol=0)

    w = m.apply(merged, pre)
    assert w.folded == ["0"] and w.hooked == [] and len(w.sites) == 0
    torch.testing.assert_close(w.model[0].weight.double(), W0 + r * (Wm - W0), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(w.model[0].bias.double(), b0 + r * (bm - b0), rtol=1e-6, atol=1e-6)
    x = torch.randn(7, 4)
    f0, fm = pre(x).double(), merged(x).double()
    torch.testing.assert_close(w(x).double(), f0 + r * (fm - f0), rtol=1e-5, atol=1e-6)
    assert torch.equal(merged[0].weight, averaged(finetuned)[0].weight)  # the input model is not modified


def test_k1_merged_equal_to_finetuned_gives_ratio_one_everywhere(clip):
    ft = clip["finetuned"][0]
    merged = copy.deepcopy(ft)
    m = measure_fsc(merged, clip["pre"], [ft], [images(7, n=2)], n_samples_per_task=2, progress=False)
    for name, ratio in m.raw_ratios.items():
        assert torch.equal(ratio, torch.ones_like(ratio)), name
    # the parameter-free gelu gives 0 / 0 = NaN per task, mapped to 1
    assert torch.isnan(m.per_task[0]["visual.transformer.resblocks.0.mlp.gelu"]).all()


# --- conservative rule -----------------------------------------------------------------------------


def test_conservative_rule_branches():
    r = torch.tensor([0.5, 1.0, 2.0])
    assert torch.equal(conservative(r, True), torch.tensor([0.5, 1.0, 1.0]))  # sensitive: only r < 1
    assert torch.equal(conservative(r, False), torch.tensor([1.0, 1.0, 2.0]))  # not sensitive: only r > 1
    assert torch.equal(conservative(r, None), r)  # no sensitive set: both ways
    assert torch.equal(conservative(r, True, "clip_sensitive"), torch.tensor([0.5, 1.0, 1.0]))
    assert torch.equal(conservative(r, False, "clip_sensitive"), r)  # authors' code: others unclipped


def test_conservative_rule_per_module(clip):
    attn0, cfc0 = "visual.transformer.resblocks.0.attn", "visual.transformer.resblocks.0.mlp.c_fc"
    # a parameter key from probing marks the module that owns it; a key outside hooked modules marks nothing
    params = clip["m"].params.model_copy(update={"sensitive": [f"{attn0}.out_proj.weight", "visual.proj"]})
    straddle = torch.linspace(0.5, 1.5, N_TOKENS)
    raw = {**clip["m"].raw_ratios, attn0: straddle, cfc0: straddle}
    flags = {s.name: s.name == attn0 for s in clip["m"].specs}
    m = FscMeasurement(architecture="open_clip_vit", specs=clip["m"].specs, raw_ratios=raw, per_task=[],
                       sensitive=flags, params=params)
    applied = m.applied_ratios()
    assert torch.equal(applied[attn0], torch.where(straddle < 1, straddle, torch.ones_like(straddle)))
    assert torch.equal(applied[cfc0], torch.where(straddle > 1, straddle, torch.ones_like(straddle)))
    m_none = FscMeasurement(architecture="open_clip_vit", specs=clip["m"].specs, raw_ratios=raw, per_task=[],
                            sensitive={s.name: None for s in clip["m"].specs}, params=clip["m"].params)
    assert torch.equal(m_none.applied_ratios()[attn0], straddle)

    # end to end: the flags come from the names given to measure_fsc
    measured = measure_fsc(clip["merged"], clip["pre"], clip["finetuned"], clip["inputs"], params=params,
                           progress=False)
    assert measured.sensitive[attn0] is True and measured.sensitive[cfc0] is False
    r = measured.raw_ratios[attn0]
    assert torch.equal(measured.applied_ratios()[attn0], torch.where(r < 1, r, torch.ones_like(r)))
    with pytest.raises(UnknownNameError, match="'visual.nope'"):
        measure_fsc(clip["merged"], clip["pre"], clip["finetuned"], clip["inputs"], sensitive=["visual.nope"],
                    progress=False)


# --- the calibrated forward ------------------------------------------------------------------------


def test_forced_ratio_one_reproduces_the_merged_model(clip):
    merged, pre = clip["merged"], clip["pre"]
    ones = {n: torch.ones_like(r) for n, r in clip["m"].raw_ratios.items()}
    x = images(50, n=2)
    want = merged.encode_image(x)
    untouched = build_calibrated_model(merged, pre, ones, clip["m"].specs)
    assert untouched.identity == VIT_NAMES
    assert torch.equal(untouched.encode_image(x), want)
    for fold in (False, True):
        w = build_calibrated_model(merged, pre, ones, clip["m"].specs, skip_identity=False, fold=fold)
        assert (len(w.hooked) == len(VIT_NAMES)) == (not fold)
        torch.testing.assert_close(w.encode_image(x), want, rtol=0, atol=1e-6)


def test_hooked_module_outputs_f0_plus_r_times_task_feature(clip, calibrated):
    merged, pre = clip["merged"], clip["pre"]
    cfc, attn, gelu = ("visual.transformer.resblocks.0.mlp.c_fc", "visual.transformer.resblocks.1.attn",
                       "visual.transformer.resblocks.0.mlp.gelu")
    assert {cfc, attn} <= set(calibrated.hooked) and gelu in calibrated.identity
    seen = {}

    def spy(name):
        def hook(module, args, kwargs, output):  # registered after FSC's hook: sees the calibrated output
            seen[name] = (args, kwargs, output)
        return hook

    handles = [calibrated.model.get_submodule(n).register_forward_hook(spy(n), with_kwargs=True)
               for n in (cfc, attn, gelu)]
    try:
        calibrated.encode_image(images(60, n=2))
    finally:
        for handle in handles:
            handle.remove()

    args, _, out = seen[cfc]
    fm = F.linear(args[0], merged.get_submodule(cfc).weight, merged.get_submodule(cfc).bias)
    f0 = F.linear(args[0], pre.get_submodule(cfc).weight, pre.get_submodule(cfc).bias)
    r = calibrated.ratios[cfc].view(1, N_TOKENS, 1)
    torch.testing.assert_close(out, f0 + r * (fm - f0), rtol=1e-5, atol=1e-6)

    args, kwargs, out = seen[attn]
    assert kwargs.get("need_weights") is False
    fm = merged.get_submodule(attn)(*args, **kwargs)[0]
    f0 = pre.get_submodule(attn)(*args, **kwargs)[0]
    r = calibrated.ratios[attn].view(1, N_TOKENS, 1)
    torch.testing.assert_close(out[0], f0 + r * (fm - f0), rtol=1e-5, atol=1e-6)

    args, _, out = seen[gelu]
    torch.testing.assert_close(out, F.gelu(args[0]), rtol=0, atol=0)


def test_folding_is_exact_for_layernorm_and_conv1(clip, calibrated):
    merged, pre = clip["merged"], clip["pre"]
    assert {"visual.conv1", "visual.ln_pre", "visual.ln_post"} <= set(calibrated.folded)
    g = torch.Generator().manual_seed(70)

    r = calibrated.ratios["visual.ln_pre"]
    assert r.dim() == 0
    for p in ("weight", "bias"):
        p0, pm = pre.visual.ln_pre.get_parameter(p).double(), merged.visual.ln_pre.get_parameter(p).double()
        torch.testing.assert_close(calibrated.model.visual.ln_pre.get_parameter(p).double(), p0 + r * (pm - p0),
                                   rtol=1e-6, atol=1e-7)
    x = torch.randn(2, N_TOKENS, 32, generator=g)
    f0, fm = pre.visual.ln_pre(x), merged.visual.ln_pre(x)
    torch.testing.assert_close(calibrated.model.visual.ln_pre(x), f0 + r * (fm - f0), rtol=1e-5, atol=1e-6)

    r = calibrated.ratios["visual.conv1"]
    assert r.shape == (32,) and pre.visual.conv1.bias is None
    w0, wm = pre.visual.conv1.weight.double(), merged.visual.conv1.weight.double()
    torch.testing.assert_close(calibrated.model.visual.conv1.weight.double(), w0 + r.view(-1, 1, 1, 1) * (wm - w0),
                               rtol=1e-6, atol=1e-7)
    x = images(71, n=2)
    f0, fm = pre.visual.conv1(x), merged.visual.conv1(x)
    torch.testing.assert_close(calibrated.model.visual.conv1(x), f0 + r.view(1, -1, 1, 1) * (fm - f0),
                               rtol=1e-5, atol=1e-5)

    # the whole model: folding == hooking the same modules
    hooked = clip["m"].apply(merged, pre, fold=False)
    assert hooked.folded == [] and set(hooked.hooked) == set(calibrated.hooked) | set(calibrated.folded)
    x = images(72, n=2)
    torch.testing.assert_close(calibrated.encode_image(x), hooked.encode_image(x), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(calibrated.encode_image(x), merged.encode_image(x), atol=1e-3)  # FSC changed something


# --- save / load -----------------------------------------------------------------------------------


def test_save_load_round_trip(clip, calibrated, tmp_path):
    out = save_fsc(calibrated, tmp_path / "fsc")
    files = sorted(p.name for p in out.iterdir() if p.name != MARKER)
    assert files == ["fsc.json", "model.safetensors", "pretrained_modules.safetensors", "ratios.safetensors",
                     "raw_ratios.safetensors"]
    for name in files[1:]:
        assert SafetensorsSource(out / name).keys()  # real safetensors files
    config = json.loads((out / "fsc.json").read_text())
    assert config["architecture"] == "open_clip_vit" and config["exact"] is True
    status = {e["name"]: e["status"] for e in config["modules"]}
    assert status == {n: r.status for n, r in calibrated.records.items()}
    assert {e["name"]: e["ratio_shape"] for e in config["modules"]}["visual.transformer.resblocks.0.attn"] == [N_TOKENS]

    loaded = load_fsc(out, lambda: tiny_open_clip(seed=123))
    x = images(80, n=3)
    assert torch.equal(loaded.encode_image(x), calibrated.encode_image(x))
    assert loaded.hooked == calibrated.hooked and loaded.folded == calibrated.folded
    assert loaded.params == calibrated.params

    save_fsc(loaded, out)  # overwriting goes through a staging directory, nothing is left beside it
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fsc"]
    with pytest.raises(CheckpointError, match="does not fit the model from build_model"):
        load_fsc(out, nn.Linear(2, 2))
    with pytest.raises(CheckpointError, match="fsc.json: FSC model config not found"):
        load_fsc(tmp_path, lambda: tiny_open_clip(0))


# --- BERT end to end -------------------------------------------------------------------------------


def test_bert_end_to_end(tmp_path):
    pytest.importorskip("transformers")
    pre = tiny_bert(0)
    finetuned = [perturbed(pre, 200 + t, scale=0.02) for t in range(2)]
    merged = averaged(finetuned)
    g = torch.Generator().manual_seed(5)
    batch = lambda n, length=8: {"input_ids": torch.randint(0, 50, (n, length), generator=g),  # noqa: E731
                                 "attention_mask": torch.ones(n, length, dtype=torch.long)}
    w = calibrate_fsc(merged, pre, finetuned, [batch(1), batch(1)], progress=False)
    assert w.architecture == "hf_bert" and set(w.records) == set(HF_BERT.fsc_module_names(pre))
    for name, record in w.records.items():
        assert torch.isfinite(record.raw_ratio).all(), name
        assert record.ratio.shape == (() if "LayerNorm" in name else (8,)), name
    assert all("LayerNorm" in n for n in w.folded) and all("LayerNorm" not in n for n in w.hooked)

    x = batch(2)
    want = merged(**x).last_hidden_state
    assert not torch.allclose(w(**x).last_hidden_state, want, atol=1e-4)
    ones = {n: torch.ones_like(r.ratio) for n, r in w.records.items()}
    forced = build_calibrated_model(merged, pre, ones, HF_BERT.fsc_modules(merged), skip_identity=False, fold=False)
    torch.testing.assert_close(forced(**x).last_hidden_state, want, rtol=0, atol=1e-6)

    with pytest.raises(ParameterError, match="sequence length"):
        w(**batch(1, length=6))

    # one ratio per module: every BERT module is Linear or LayerNorm, so everything folds into the weights
    w_mean = Fsc(token_ratios="mean").calibrate(merged, pre, finetuned, [batch(1), batch(1)], progress=False)
    assert w_mean.hooked == [] and len(w_mean.folded) == len(w_mean.records)
    w_mean(**batch(1, length=6))

    save_fsc(w, tmp_path / "bert")
    loaded = load_fsc(tmp_path / "bert", lambda: tiny_bert(9))
    assert torch.equal(loaded(**x).last_hidden_state, w(**x).last_hidden_state)


# --- task_feature="network": the paper's Eq. 3 ------------------------------------------------------


def _outputs_in_a_whole_run(model, names, x):
    """Each named module's output (its first element for attention) in one run of the whole visual tower."""
    out = {}
    hooks = [model.get_submodule(n).register_forward_hook(
        lambda module, args, o, n=n: out.__setitem__(n, o[0] if isinstance(o, tuple) else o)) for n in names]
    with torch.no_grad():
        model.encode_image(x)
    for hook in hooks:
        hook.remove()
    return out


def test_network_task_feature_is_the_papers_per_layer_ratio(clip):
    """xi^l = (1/K) sum_k mean_i ||h_k^l(x_i) - h_0^l(x_i)||_1 / ||h_merge^l(x_i) - h_0^l(x_i)||_1, each h a module's
    output in a run of the WHOLE model (Eq. 3, 18), computed here with plain hooks on float64 copies."""
    pre, merged, finetuned = (copy.deepcopy(m).double() for m in (clip["pre"], clip["merged"], clip["finetuned"][0]))
    finetuned = [finetuned] + [copy.deepcopy(m).double() for m in clip["finetuned"][1:]]
    inputs = [images(20 + t, n=2).double() for t in range(3)]  # two samples per task: the per-sample ratios averaged
    m = measure_fsc(merged, pre, finetuned, inputs, n_samples_per_task=2, task_feature="network", progress=False)

    per_task = []
    for ft, x in zip(finetuned, inputs):
        h0, hm, ht = (_outputs_in_a_whole_run(model, VIT_NAMES, x) for model in (pre, merged, ft))
        per_task.append({n: torch.stack([(ht[n][i] - h0[n][i]).abs().sum() / (hm[n][i] - h0[n][i]).abs().sum()
                                         for i in range(2)]).mean() for n in VIT_NAMES})  # batch-first outputs
    for name in VIT_NAMES:
        expected = torch.stack([task[name] for task in per_task]).mean()
        assert m.raw_ratios[name].shape == (), name
        torch.testing.assert_close(m.raw_ratios[name].double(), expected, rtol=1e-6, atol=0, msg=name)
    # one scalar per layer: folded into the affine modules, hooked (attention, gelu) otherwise, as the default's
    w = m.apply(merged, pre)
    assert set(w.folded) == {n for n in VIT_NAMES if not n.endswith((".attn", ".gelu"))}
    assert set(w.hooked) == {n for n in VIT_NAMES if n.endswith((".attn", ".gelu"))}
    # sequence-first blocks ([L, N, D]) hold the same samples: the same xi
    seq_first = [sequence_first(model).double() for model in (merged, pre, *finetuned)]
    m_seq = measure_fsc(seq_first[0], seq_first[1], seq_first[2:], inputs, n_samples_per_task=2,
                        task_feature="network", progress=False)
    for name, ratio in m.raw_ratios.items():
        torch.testing.assert_close(m_seq.raw_ratios[name], ratio, rtol=1e-6, atol=0, msg=name)


def test_network_and_module_replay_task_features_differ(clip):
    """Past the first layer the two forms see different inputs (the merged model's replayed vs each model's own),
    so even with one scalar per module (token_ratios='mean') their xi differ."""
    args = (clip["merged"], clip["pre"], clip["finetuned"], clip["inputs"])
    replay = measure_fsc(*args, token_ratios="mean", progress=False)
    network = measure_fsc(*args, task_feature="network", progress=False)
    for name in VIT_NAMES[1:]:
        if name.endswith(".gelu"):  # parameter-free: 0 / 0 -> 1 in the replay, a measured ratio in the network form
            assert replay.raw_ratios[name] == 1 and network.raw_ratios[name] != 1
            continue
        assert abs(float(network.raw_ratios[name]) - float(replay.raw_ratios[name])) > 1e-3, name


def test_task_feature_in_the_recipe_id_only_when_set():
    default = ("fsc(aggregate='mean',conservative='xor',data='task',n_samples_per_task=1,norm='l1',sensitive=None,"
               "token_ratios='per_token')")
    assert Fsc().id == Fsc(task_feature="module_replay").id == default  # the ids recorded before the option
    assert "task_feature" not in FscParams().model_dump()  # nor in the logged params and saved configs
    assert FscParams(**FscParams(task_feature="network").model_dump()).task_feature == "network"
    network = Fsc(task_feature="network").id
    assert network == default.replace("sensitive=None,", "sensitive=None,task_feature='network',")
    from mergecal.recipe import Recipe

    assert Recipe.parse("ties->fsc(task_feature=module_replay)").id == Recipe.parse("ties->fsc").id
    recipe = Recipe.parse(f"ties->{network}")
    assert recipe.steps[-1].params.task_feature == "network" and Recipe.parse(recipe.id) == recipe
    for composite in ("dsc", "dsc_a"):  # DSC and DSC-A pass it to their FSC part
        step = Recipe.parse(f"ties->{composite}(fsc={{task_feature: network}})").steps[-1]
        assert step.name == "fsc" and step.params.task_feature == "network"
        assert "task_feature='network'" in step.id


# --- parameters and input checks -------------------------------------------------------------------


def test_params_validation_and_recipe():
    assert FscParams() == FscParams(n_samples_per_task=1, norm="l1", aggregate="mean", sensitive=None, data="task")
    with pytest.raises(ParameterError, match="fsc: unknown parameter 'lam'"):
        measure_fsc(nn.Linear(2, 2), nn.Linear(2, 2), [nn.Linear(2, 2)], [torch.zeros(1, 2)], lam=1)
    with pytest.raises(ParameterError,
                       match="fsc: parameter 'n_samples_per_task': Input should be greater than or equal to 1"):
        Fsc(n_samples_per_task=0)
    assert Fsc(norm="l2").id == ("fsc(aggregate='mean',conservative='xor',data='task',n_samples_per_task=1,norm='l2',"
                                 "sensitive=None,token_ratios='per_token')")
    from mergecal.recipe import Recipe

    recipe = Recipe.parse("task_arithmetic→dsc_a")
    assert recipe.steps[-1].name == "fsc" and recipe.steps[-1].params.data == "task_agnostic"


def test_task_agnostic_shared_batch_is_split_per_task():
    pre, finetuned, merged = _one_layer_models(k=3, seed=4)
    architecture = explicit_architecture(["1"], batch_dim=1)
    shared = torch.randn(6, 5, 4, generator=torch.Generator().manual_seed(2))
    a = measure_fsc(merged, pre, finetuned, [shared], architecture=architecture, data="task_agnostic",
                    n_samples_per_task=2, progress=False)
    b = measure_fsc(merged, pre, finetuned, [shared[0:2], shared[2:4], shared[4:6]], architecture=architecture,
                    n_samples_per_task=2, progress=False)
    assert torch.equal(a.raw_ratios["1"], b.raw_ratios["1"])
    with pytest.raises(ParameterError, match="need 9"):
        measure_fsc(merged, pre, finetuned, [shared], architecture=architecture, data="task_agnostic",
                    n_samples_per_task=3, progress=False)
    with pytest.raises(ParameterError, match="got 1 task inputs for 3 fine-tuned models"):
        measure_fsc(merged, pre, finetuned, [shared], architecture=architecture, progress=False)


def test_input_checks():
    lin = nn.Linear(3, 3)
    twice = nn.Sequential(lin, lin)  # one module called twice per forward
    with pytest.raises(ParameterError, match="ran 2 times"):
        measure_fsc(twice, copy.deepcopy(twice), [copy.deepcopy(twice)], [torch.zeros(1, 3)], architecture=["0"],
                    progress=False)
    seq = nn.Sequential(nn.Sequential(nn.Linear(3, 3)))
    with pytest.raises(ParameterError, match="must not be nested"):
        measure_fsc(seq, seq, [seq], [torch.zeros(1, 3)], architecture=["0", "0.0"], progress=False)
    other = nn.Sequential(nn.Sequential(nn.Linear(3, 4)))
    with pytest.raises(IncompatibleModelsError, match=r"fsc: 0\.0\.bias has shape \(4,\) in the pretrained model"):
        measure_fsc(seq, other, [seq], [torch.zeros(1, 3)], architecture=["0.0"], progress=False)
    with pytest.raises(ParameterError, match="task 0 input holds 1 samples"):
        measure_fsc(seq, seq, [seq], [torch.zeros(1, 3)], architecture=["0.0"], n_samples_per_task=2, progress=False)
