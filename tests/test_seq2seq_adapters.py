"""PEFT adapters of a sequence-to-sequence (T5-shaped) model as experts, against peft 0.21 itself.

The SVC paper (Table 13) and the MAGIC paper (Table IV) merge T0-3B, a T5 v1.1 fine-tuned with IA³, so what
tests/test_adapters.py shows on a tiny Llama must hold on a tiny ``T5ForConditionalGeneration`` (built from a
``T5Config``, saved with ``save_pretrained(safe_serialization=True)``; nothing downloaded). Two bases: the original
T5 layout (``DenseReluDense`` a ``T5DenseActDense``, tied embeddings and ``lm_head``) and T0's (T5 v1.1:
gated-gelu, ``DenseReluDense`` a ``T5DenseGatedActDense`` with wi_0, wi_1, wo; ``lm_head`` untied). Adapters are
made with peft's own T5 defaults (``task_type="SEQ_2_SEQ_LM"``; IA³: targets k, v, wo, feedforward wo), in the
encoder's ``SelfAttention`` and the decoder's ``SelfAttention`` and ``EncDecAttention``.

Tied embeddings: a T5 checkpoint stores the one tied tensor once, as ``shared.weight`` (its aliases
``encoder.embed_tokens.weight``, ``decoder.embed_tokens.weight`` and, when tied, ``lm_head.weight`` are not in the
file; ``from_pretrained`` ties them again). mergecal's keys are the file's, so a delta on ``shared`` is added once, to
``shared.weight``, and the written model holds the base file's keys only; reloaded, every alias equals peft's merged
model. A LoRA on the aliases themselves (``target_modules=["embed_tokens"]``: one LoRA on the encoder's module, one on
the decoder's, over one tied parameter) is refused in one line: peft's ``merge_and_unload`` adds both deltas to the
one parameter, which is then also the other side's embedding and the ``lm_head``, a model neither adapter trained.
"""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pytest
import torch

from mergecal.adapters import IA3Expert, IA3Identity, IA3Vectors, LoraExpert, merge_experts, read_adapter
from mergecal.checkpoint import SafetensorsSource, load_state_dict
from mergecal.cli import main
from mergecal.errors import IncompatibleModelsError

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

from mergecal.task_vectors import TaskVectorSet  # noqa: E402

T5 = dict(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
          decoder_start_token_id=0)
BASES = {"t5": dict(T5), "t0": dict(T5, feed_forward_proj="gated-gelu", tie_word_embeddings=False)}
TIED = ("shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
EPS = torch.finfo(torch.float32).eps


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


@pytest.fixture(scope="module", params=sorted(BASES))
def base(request, tmp_path_factory) -> str:
    torch.manual_seed(3)
    model = transformers.T5ForConditionalGeneration(transformers.T5Config(**BASES[request.param]))
    path = tmp_path_factory.mktemp(request.param) / "base"
    model.save_pretrained(str(path), safe_serialization=True)
    return str(path)


def _load(base: str):
    return transformers.T5ForConditionalGeneration.from_pretrained(base).eval()


def _adapter(base: str, out: Path, config, seed: int) -> str:
    """An adapter with peft's config, its trained tensors random: IA³ vectors uniform in [0.5, 1.5] (not the
    identity; ``l - 1 + 1 == l`` exactly there), every LoRA factor normal (lora_B and an embedding's lora_A start at
    zero)."""
    model = peft.get_peft_model(_load(base), config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ia3_l." in name:
                param.copy_(torch.empty(param.shape).uniform_(0.5, 1.5, generator=g))
            elif ".lora_" in name or name.endswith("lm_head.modules_to_save.default.weight"):
                param.add_(torch.randn(param.shape, generator=g))
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


def _ia3(base: str, out: Path, seed: int, **extra) -> str:
    return _adapter(base, out, peft.IA3Config(task_type="SEQ_2_SEQ_LM", **extra), seed)


def _peft_merged(base: str, adapter: str) -> dict[str, torch.Tensor]:
    """peft's answer: the adapter loaded on the base and merged; every key of the model, tied aliases included."""
    return peft.PeftModel.from_pretrained(_load(base), adapter).merge_and_unload().state_dict()


def _equal_models(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert got.keys() == want.keys()
    for key in want:
        assert torch.equal(got[key], want[key]), key


def _written_and_reloaded(base: str, out: Path) -> dict[str, torch.Tensor]:
    """The written model holds the base file's keys, each once (the tied aliases not written, so nothing is added to
    them twice), and ``from_pretrained`` loads it; its state dict, aliases tied again."""
    assert load_state_dict(out).keys() == load_state_dict(base).keys()
    return _load(str(out)).state_dict()


# ---------------------------------------------------------------------------------- 1. one adapter, bit for bit


def test_ia3_with_peft_t5_defaults_is_peft_merge_bit_for_bit(base, tmp_path):
    """IA³ on peft's T5 defaults: the vector-form task vector is the vector minus 1 (and 1 plus it is the vector),
    the feedforward layers are exactly the ``DenseReluDense.wo`` (inputs scaled; a ``T5DenseGatedActDense`` in
    T0's layout), the attention ``k``/``v`` of ``SelfAttention`` and ``EncDecAttention`` scale outputs; applied to
    the base (the ``IA3Expert``, and a task-arithmetic merge of the one adapter at λ = 1 written with
    ``--full-model``) it equals peft's ``merge_and_unload()`` on every key of the model, tied aliases included, with
    torch.equal."""
    adapter_dir = _ia3(base, tmp_path / "ia3", seed=1)
    adapter, source = read_adapter(adapter_dir), SafetensorsSource(base)
    assert sorted(adapter.config["target_modules"]) == ["k", "v", "wo"] and adapter.config["feedforward_modules"] == [
        "wo"]
    ff = "DenseReluDense"  # the attribute's name in both layouts (T5DenseGatedActDense in T0's: wi_0, wi_1, wo)
    assert (f"encoder.block.0.layer.1.{ff}.wi_0.weight" in source.keys()) == _load(base).config.is_gated_act
    expected = {f"encoder.block.{i}.layer.0.SelfAttention.{m}": False for i in (0, 1) for m in "kv"}
    expected |= {f"decoder.block.{i}.layer.{j}.{att}.{m}": False for i in (0, 1)
                 for j, att in ((0, "SelfAttention"), (1, "EncDecAttention")) for m in "kv"}
    expected |= {f"encoder.block.{i}.layer.1.{ff}.wo": True for i in (0, 1)}
    expected |= {f"decoder.block.{i}.layer.2.{ff}.wo": True for i in (0, 1)}
    assert {m.module: m.feedforward for m in adapter.modules.values()} == expected

    vectors = IA3Vectors(source, adapter)
    tvs = TaskVectorSet.from_models(IA3Identity(vectors), [vectors])
    for key in tvs.keys:
        saved = adapter.tensors.get(key).reshape(-1)
        tau = tvs.load(key)[0]
        assert torch.equal(tau, saved - 1) and torch.equal(tvs.add_pretrained(key, tau), saved), key

    merged, full = _peft_merged(base, adapter_dir), IA3Expert(source, adapter)
    for key in source.keys():
        assert torch.equal(full.get(key), merged[key]), key
    out = tmp_path / "full"
    merge_experts(base, [adapter_dir], "task_arithmetic", out, full_model=True, scaling=1.0)
    _equal_models(_written_and_reloaded(base, out), merged)
    pre = _load(base).state_dict()
    assert sum(not torch.equal(merged[k], pre[k]) for k in pre) == len(expected)  # no bias, no embedding touched


@pytest.mark.parametrize("targets", [["q", "v"], ["q", "v", "shared"]], ids=["q_v", "q_v_shared"])
def test_lora_with_peft_t5_defaults_is_peft_merge_bit_for_bit(base, tmp_path, targets):
    """LoRA (``SEQ_2_SEQ_LM``, q and v; and with the tied ``shared`` embedding): every key's task vector is peft's
    merged weight minus the base bit for bit, and a task-arithmetic merge of the one adapter at λ = 1, written and
    reloaded, is peft's merged model on every key. With ``shared``: its delta is added once, to ``shared.weight``,
    and every alias of it (``lm_head`` too on the tied base) carries that one delta, as in peft's merged model."""
    config = peft.LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules=targets, r=4, lora_alpha=8)
    adapter_dir = _adapter(base, tmp_path / "lora", config, seed=2)
    source = SafetensorsSource(base)
    expert = LoraExpert(source, read_adapter(adapter_dir))
    merged, pre = _peft_merged(base, adapter_dir), load_state_dict(base)
    tvs = TaskVectorSet.from_models(source, [expert])
    changed = set()
    for key in tvs.keys:
        expected = merged[key] - pre[key]
        assert torch.equal(tvs.load(key)[0], expected), key
        if expected.any():
            changed.add(key)
    attention = {f"{side}.block.{i}.layer.{j}.{att}.{m}.weight" for i in (0, 1) for m in "qv"
                 for side, layers in (("encoder", ((0, "SelfAttention"),)),
                                      ("decoder", ((0, "SelfAttention"), (1, "EncDecAttention"))))
                 for j, att in layers}
    assert changed == attention | ({"shared.weight"} if "shared" in targets else set())
    out = tmp_path / "full"
    merge_experts(base, [adapter_dir], "task_arithmetic", out, scaling=1.0)
    reloaded = _written_and_reloaded(base, out)
    _equal_models(reloaded, merged)
    aliases = TIED + (("lm_head.weight",) if _load(base).config.tie_word_embeddings else ())
    for alias in aliases:  # one delta on the one tied tensor, never one per alias
        assert torch.equal(reloaded[alias], (pre["shared.weight"] + tvs.load("shared.weight")[0])), alias


def test_lora_on_the_tied_embedding_aliases_is_refused(base, tmp_path):
    """``target_modules=["embed_tokens"]`` puts one LoRA on the encoder's and one on the decoder's embedding module,
    both over the one tied parameter that the checkpoint stores as ``shared.weight``. peft's ``merge_and_unload``
    adds both deltas to it (so the encoder's delta reaches the decoder and the ``lm_head`` too); mergecal does not
    sum them into ``shared.weight`` but refuses in one line naming the alias, which is not a key of the base."""
    config = peft.LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules=["embed_tokens"], r=4, lora_alpha=8)
    adapter_dir = _adapter(base, tmp_path / "lora", config, seed=3)
    adapter = read_adapter(adapter_dir)
    deltas = [(adapter.tensors.get(m.b_key) @ adapter.tensors.get(m.a_key)).T * m.scaling
              for m in adapter.modules.values()]
    assert len(deltas) == 2
    pre, merged = load_state_dict(base), _peft_merged(base, adapter_dir)
    both = pre["shared.weight"] + deltas[0] + deltas[1]  # peft: each delta added in place to the tied parameter
    assert torch.allclose(merged["shared.weight"], both, rtol=0, atol=16 * EPS * float(both.abs().max()))
    with pytest.raises(IncompatibleModelsError) as err:
        LoraExpert(SafetensorsSource(base), adapter)
    message = str(err.value)
    assert "\n" not in message and "embed_tokens.weight' is not in the base model" in message, message


# -------------------------------------------------------------------------------------- 2. the command line


def test_cli_merges_two_ia3_adapters_into_a_t5_that_transformers_loads(base, tmp_path, capsys):
    """``mergecal merge`` of two IA³ adapters of the T5: task arithmetic (λ = 0.7) with ``--full-model`` is
    ``T5ForConditionalGeneration.from_pretrained``-loadable and equals base + λ·Σ deltas, each delta peft's merged
    weight minus the base (the vectors' update is linear in the vectors: W ⊙ (1 + λ Σ (l_t - 1)) = W + λ Σ (W ⊙ l_t -
    W)), within float32 round-off (8 eps of the key's largest base entry; measured <= 1.8); TIES (top_k = 0.5, global
    trim, mass vote, disjoint mean) equals peft's merge of an adapter holding 1 + TIES(l_t - 1), computed here
    independently, within the same bound (measured: bit for bit); the adapter output (no ``--full-model``) loads in
    peft and merges to the full-model output bit for bit. Methods on matrices (tsv_m, iso_c, iso_cts) are refused in
    one line, as the papers' '—' rows, and write nothing."""
    experts = [_ia3(base, tmp_path / f"e{i}", seed=10 + i) for i in range(2)]
    pre = _load(base).state_dict()
    deltas = [{k: v - pre[k] for k, v in _peft_merged(base, e).items()} for e in experts]

    out = tmp_path / "ta"
    assert main(["merge", "--pretrained", base, "--finetuned", *experts, "--method", "task_arithmetic",
                 "--set", "scaling=0.7", "--full-model", "--out", str(out)]) == 0
    assert "merged checkpoint written" in capsys.readouterr().out
    got = _written_and_reloaded(base, out)
    assert got.keys() == pre.keys()
    for key, theta in pre.items():
        want = theta + 0.7 * (deltas[0][key] + deltas[1][key])
        assert float((got[key] - want).abs().max()) <= 8 * EPS * float(theta.abs().max()), key
        if not (deltas[0][key].any() or deltas[1][key].any()):
            assert torch.equal(got[key], theta), key

    out = tmp_path / "ties"
    assert main(["merge", "--pretrained", base, "--finetuned", *experts, "--method", "ties", "--set", "top_k=0.5",
                 "--full-model", "--out", str(out)]) == 0
    got = _written_and_reloaded(base, out)
    assert main(["merge", "--pretrained", base, "--finetuned", *experts, "--method", "ties", "--set", "top_k=0.5",
                 "--out", str(tmp_path / "ties_adapter")]) == 0
    assert "IA³ adapter written" in capsys.readouterr().out
    _equal_models(_peft_merged(base, str(tmp_path / "ties_adapter")), got)
    want = _peft_merged(base, _with_vectors(base, tmp_path / "ties_ref", _ties_reference(experts, 0.5)))
    for key, theta in pre.items():
        assert float((got[key] - want[key]).abs().max()) <= 8 * EPS * float(theta.abs().max()), key

    for method in ("tsv_m", "iso_c", "iso_cts"):
        assert main(["merge", "--pretrained", base, "--finetuned", *experts, "--method", method, "--full-model",
                     "--out", str(tmp_path / method)]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "vector keys of IA³ experts" in error and "—" in error, error
        assert not (tmp_path / method).exists()


def _ties_reference(experts: list[str], top_k: float) -> dict[str, torch.Tensor]:
    """TIES on the vectors' task vectors (l - 1), written out: per expert the int(top_k n) largest magnitudes over
    all vectors kept, the sign of the kept mass elected per entry, the kept entries of that sign averaged; plus 1."""
    saved = [load_state_dict(Path(e) / "adapter_model.safetensors") for e in experts]
    keys = sorted(saved[0])
    taus = torch.stack([torch.cat([s[k].reshape(-1) - 1 for k in keys]) for s in saved])
    n_keep = int(top_k * taus.shape[1])
    threshold = taus.abs().sort(dim=1, descending=True).values[:, n_keep - 1 : n_keep]
    trimmed = torch.where(taus.abs() >= threshold, taus, torch.zeros_like(taus))
    sign = torch.sign(trimmed.sum(0))
    agree = (torch.sign(trimmed) == sign) & (trimmed != 0)
    merged = (trimmed * agree).sum(0) / agree.sum(0).clamp(min=1)
    out, start = {}, 0
    for key in keys:
        n = saved[0][key].numel()
        out[key] = (1 + merged[start : start + n]).reshape(saved[0][key].shape)
        start += n
    return out


def _with_vectors(base: str, out: Path, vectors: dict[str, torch.Tensor]) -> str:
    """An IA³ adapter of peft's T5 defaults holding ``vectors`` (by saved key)."""
    model = peft.get_peft_model(_load(base), peft.IA3Config(task_type="SEQ_2_SEQ_LM"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".ia3_l." in name:
                param.copy_(vectors[name.replace(".default", "")])
    model.save_pretrained(str(out), safe_serialization=True)
    return str(out)


# ------------------------------------------------------------------------- 3. peft's own add_weighted_adapter


def _vectors(model, adapter: str) -> dict[str, torch.Tensor]:
    return {f"{name}.ia3_l": module.ia3_l[adapter].detach().clone() for name, module in model.named_modules()
            if isinstance(module, peft.tuners.ia3.IA3Layer) and adapter in module.ia3_l}


def test_peft_add_weighted_adapter_against_mergecal(base, tmp_path):
    """peft 0.21's ``IA3Model.add_weighted_adapter(adapters, weights, name)`` has no ``combination_type``: it is
    always linear, on the vectors themselves: l = Σ w_t l_t (in place, adapter by adapter). mergecal merges the task
    vectors l_t - 1 and adds the identity back. The conventions, each checked:

    * weights that sum to 1 (w_t = 1/K) are mergecal's ``weight_averaging``: 1 + mean(l_t - 1) = mean(l_t), equal
      within float32 round-off (checked at 2 eps, as the operations differ; measured: bit for bit, l_t - 1 and the
      sum of two halves being exact in [0.5, 1.5]);
    * ``task_arithmetic`` at λ is peft's weights λ plus (1 - Kλ) times the identity: peft's linear combination
      scales the identity too (at λ = 0.3, K = 2 its vectors are 0.4 short of mergecal's, everywhere);
    * TIES, DARE and the rest have no IA³ counterpart in peft (its TIES/DARE combination types are LoRA's);
    * tensors saved whole (``modules_to_save``): peft refuses two adapters that save the same module
      (ValueError), mergecal merges them as task vectors relative to the base's tensor;
    * LoRA on the same T5: peft's ``combination_type="cat"`` at weights λ (exact: the factors stacked) is mergecal's
      task arithmetic at λ within round-off (8 eps of the key's largest entry; measured <= 1.7); peft's ``"linear"``
      merges the A's and the B's separately (a product of sums, not a sum of deltas) and is not compared.
    """
    experts = [_ia3(base, tmp_path / f"e{i}", seed=20 + i) for i in range(2)]
    model = peft.PeftModel.from_pretrained(_load(base), experts[0], adapter_name="a")
    model.load_adapter(experts[1], adapter_name="b")
    model.add_weighted_adapter(["a", "b"], [0.5, 0.5], "mean")
    model.add_weighted_adapter(["a", "b"], [0.3, 0.3], "ta")
    mean, ta = _vectors(model, "mean"), _vectors(model, "ta")
    assert len(mean) == 16

    merge_experts(base, experts, "weight_averaging", tmp_path / "wa")
    merge_experts(base, experts, "task_arithmetic", tmp_path / "ta", scaling=0.3)
    wa_ours = load_state_dict(tmp_path / "wa" / "adapter_model.safetensors")
    ta_ours = load_state_dict(tmp_path / "ta" / "adapter_model.safetensors")
    assert wa_ours.keys() == ta_ours.keys() == mean.keys()
    for key in mean:
        assert float((wa_ours[key] - mean[key]).abs().max()) <= 2 * EPS, key
        assert float((ta_ours[key] - (ta[key] + (1 - 2 * 0.3))).abs().max()) <= 2 * EPS, key
        assert float((ta_ours[key] - ta[key]).abs().min()) > 0.39, key

    if not _load(base).config.tie_word_embeddings:  # T0's untied lm_head, saved whole by both adapters
        saving = [_ia3(base, tmp_path / f"s{i}", seed=30 + i, modules_to_save=["lm_head"]) for i in range(2)]
        model = peft.PeftModel.from_pretrained(_load(base), saving[0], adapter_name="a")
        model.load_adapter(saving[1], adapter_name="b")
        with pytest.raises(ValueError, match="modules_to_save"):
            model.add_weighted_adapter(["a", "b"], [0.5, 0.5], "mean")
        merge_experts(base, saving, "weight_averaging", tmp_path / "wa_saving")
        written = load_state_dict(tmp_path / "wa_saving" / "adapter_model.safetensors")
        heads = [load_state_dict(Path(s) / "adapter_model.safetensors")["base_model.model.lm_head.weight"]
                 for s in saving]
        head = written["base_model.model.lm_head.weight"]
        assert float((head - (heads[0] + heads[1]) / 2).abs().max()) <= 8 * EPS * float(head.abs().max())

    loras = [_adapter(base, tmp_path / f"l{i}", peft.LoraConfig(task_type="SEQ_2_SEQ_LM", target_modules=["q", "v"],
                                                                r=r, lora_alpha=2 * r), seed=40 + i)
             for i, r in enumerate((4, 2))]
    model = peft.PeftModel.from_pretrained(_load(base), loras[0], adapter_name="a")
    model.load_adapter(loras[1], adapter_name="b")
    model.add_weighted_adapter(["a", "b"], [0.3, 0.3], "cat", combination_type="cat")
    model.set_adapter("cat")
    cat = copy.deepcopy(model).merge_and_unload(adapter_names=["cat"]).state_dict()
    merge_experts(base, loras, "task_arithmetic", tmp_path / "lora_ta", scaling=0.3)
    ours = _load(str(tmp_path / "lora_ta")).state_dict()
    pre = _load(base).state_dict()
    assert cat.keys() == ours.keys()
    for key, theta in pre.items():
        scale = float((cat[key] - theta).abs().max())
        assert float((ours[key] - cat[key]).abs().max()) <= 8 * EPS * max(scale, float(theta.abs().max())), key
