"""PEFT adapters as experts (mergecal/adapters/): a LoRA expert's task vector is peft's merged delta bit for bit, an
IA³ expert merges in vector form, a merge of LoRA experts can be written back as a LoRA adapter that peft loads, and
every adapter mergecal cannot merge faithfully is refused in one line. Tiny models built from transformers configs;
nothing is downloaded."""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mergecal.adapters import (IA3Expert, IA3Identity, IA3Vectors, LoraExpert, adapter_from_tensors, expert_kind,
                               linear_layouts, merge_experts, read_adapter)
from mergecal.checkpoint import SafetensorsSource, load_state_dict
from mergecal.cli import main
from mergecal.errors import CheckpointError, IncompatibleModelsError, MergecalError, ParameterError
from mergecal.merge import iter_weight_space
from mergecal.recipe import Recipe
from mergecal.task_vectors import TaskVectorSet

from local_models import perturb_trainable

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LLAMA = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=64, max_position_embeddings=64)


@pytest.fixture(autouse=True)
def _quiet():
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _save_base(model, path: Path) -> str:
    model.save_pretrained(str(path))
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA))
    return _save_base(model, tmp_path_factory.mktemp("llama") / "base")


@pytest.fixture(scope="module")
def llama_bf16(tmp_path_factory) -> str:
    torch.manual_seed(1)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**LLAMA)).to(torch.bfloat16)
    return _save_base(model, tmp_path_factory.mktemp("llama_bf16") / "base")


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory) -> str:
    torch.manual_seed(2)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32,
                                     bos_token_id=0, eos_token_id=0)
    model = transformers.GPT2LMHeadModel(config)
    with torch.no_grad():  # GPT-2 initialises its biases to zero; an IA³ merge scales them
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.02)
    return _save_base(model, tmp_path_factory.mktemp("gpt2") / "base")


@pytest.fixture(scope="module")
def t5(tmp_path_factory) -> str:
    torch.manual_seed(3)
    config = transformers.T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                   decoder_start_token_id=0)
    return _save_base(transformers.T5ForConditionalGeneration(config), tmp_path_factory.mktemp("t5") / "base")


def _load(base: str):
    """The base model as peft will wrap it, from its directory (its dtype as saved)."""
    config = transformers.AutoConfig.from_pretrained(base)
    cls = getattr(transformers, config.architectures[0])
    return cls.from_pretrained(base, dtype="auto").eval()



def _adapter(base: str, out: Path, config, seed: int = 0) -> str:
    model = peft.get_peft_model(_load(base), config)
    perturb_trainable(model, seed)
    model.save_pretrained(str(out))
    return str(out)


def _peft_merged(base: str, adapter: str) -> dict[str, torch.Tensor]:
    """peft's own answer: the adapter loaded on the base and merged (merge_and_unload)."""
    return peft.PeftModel.from_pretrained(_load(base), adapter).merge_and_unload().state_dict()


def _assert_task_vectors_are_peft_deltas(base: str, adapter: str, layouts=None) -> int:
    """Every float key's task vector equals peft's merged weight minus the base, bit for bit; the count of keys the
    adapter changed."""
    source = SafetensorsSource(base)
    tvs = TaskVectorSet.from_models(source, [LoraExpert(source, read_adapter(adapter), layouts=layouts)])
    merged, pre = _peft_merged(base, adapter), load_state_dict(base)
    changed = 0
    for key in tvs.keys:
        expected = merged[key].float() - pre[key].float()
        assert torch.equal(tvs.load(key)[0], expected), key
        changed += bool(expected.any())
    return changed


LORA_CONFIGS = {
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]),
    "rslora": dict(r=4, lora_alpha=6, use_rslora=True, target_modules=["q_proj", "k_proj", "up_proj"]),
    "patterns": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"],
                     rank_pattern={"v_proj": 2, "layers.1.self_attn.q_proj": 6},
                     alpha_pattern={"gate_proj": 3, "layers.0.self_attn.q_proj": 5}),
    "embedding_and_modules_to_save": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "o_proj"],
                                          modules_to_save=["lm_head"]),
}


@pytest.mark.parametrize("name", sorted(LORA_CONFIGS))
def test_lora_task_vectors_are_peft_merge_deltas_bit_for_bit(llama, tmp_path, name):
    config = peft.LoraConfig(init_lora_weights=False, **LORA_CONFIGS[name])
    adapter = _adapter(llama, tmp_path / name, config, seed=1)
    assert _assert_task_vectors_are_peft_deltas(llama, adapter) >= 4


def test_rank_and_alpha_patterns_set_each_layers_scaling(llama, tmp_path):
    adapter = read_adapter(_adapter(llama, tmp_path / "a", peft.LoraConfig(
        init_lora_weights=False, **LORA_CONFIGS["patterns"])))
    q0, q1 = (adapter.modules[f"model.layers.{i}.self_attn.q_proj.weight"] for i in (0, 1))
    v0 = adapter.modules["model.layers.0.self_attn.v_proj.weight"]
    assert (q0.r, q0.alpha, q0.scaling) == (4, 5, 5 / 4) and (q1.r, q1.alpha, q1.scaling) == (6, 8, 8 / 6)
    assert (v0.r, v0.scaling) == (2, 4.0)
    rs = read_adapter(_adapter(llama, tmp_path / "rs", peft.LoraConfig(init_lora_weights=False,
                                                                       **LORA_CONFIGS["rslora"])))
    assert all(m.scaling == 6 / 2.0 for m in rs.modules.values())  # alpha / sqrt(r)


def test_bfloat16_base_takes_the_float32_delta_as_peft_does(llama_bf16, tmp_path):
    """peft upcasts the adapter to float32 on a bfloat16 base and adds the float32 delta (linear) or the delta cast
    first (embedding): the expert follows both, so the task vectors still match bit for bit."""
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "embed_tokens"])
    assert _assert_task_vectors_are_peft_deltas(llama_bf16, _adapter(llama_bf16, tmp_path / "a", config)) >= 3


def test_fan_in_fan_out_conv1d_lora_bias_and_biases_saved_whole(gpt2, tmp_path):
    """GPT-2's Conv1D stores (in, out): peft transposes B @ A there (fan_in_fan_out), adds lora_B's bias
    (lora_bias) and saves every bias whole (bias="all")."""
    config = peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, fan_in_fan_out=True, lora_bias=True,
                             bias="all", target_modules=["c_attn", "c_proj", "c_fc"])
    adapter = _adapter(gpt2, tmp_path / "a", config)
    parsed = read_adapter(adapter)
    assert any(k.endswith("base_layer.bias") for k in parsed.replacements.values())
    assert _assert_task_vectors_are_peft_deltas(gpt2, adapter) >= 12


def test_a_square_conv1d_takes_its_orientation_from_the_base_model(tmp_path):
    """peft sets fan_in_fan_out per layer type and saves the flag as it last set it: LoRA on GPT-2's square Conv1D
    c_proj and on the linear score head saves false. The base's model (built on the meta device) settles it."""
    torch.manual_seed(5)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, vocab_size=64, n_positions=32, num_labels=3,
                                     pad_token_id=0, bos_token_id=0, eos_token_id=0)
    base = _save_base(transformers.GPT2ForSequenceClassification(config), tmp_path / "base")
    adapter = _adapter(base, tmp_path / "a", peft.LoraConfig(r=4, init_lora_weights=False,
                                                             target_modules=["attn.c_proj", "score"]))
    assert json.loads((Path(adapter) / "adapter_config.json").read_text())["fan_in_fan_out"] is False
    layouts = linear_layouts(base)
    assert layouts["transformer.h.0.attn.c_proj.weight"] is True and layouts["score.weight"] is False
    assert _assert_task_vectors_are_peft_deltas(base, adapter, layouts) == 3
    with pytest.raises(AssertionError):  # the saved flag alone transposes the square Conv1D's delta
        _assert_task_vectors_are_peft_deltas(base, adapter)
    out = tmp_path / "merged"  # the CLI asks the base's model itself
    assert main(["merge", "--pretrained", base, "--finetuned", adapter, "--method", "task_arithmetic",
                 "--set", "scaling=1.0", "--out", str(out)]) == 0
    merged, pre = load_state_dict(out), load_state_dict(base)
    expected = _peft_merged(base, adapter)
    assert all(torch.equal(merged[k], (expected[k].float() - pre[k].float() + pre[k]).to(pre[k].dtype)) for k in pre)


def test_lora_on_a_custom_module_by_target_name(tmp_path):
    """open_clip-like blocks (plain torch modules, no transformers): LoRA by module name, a state dict on disk."""

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln_1 = torch.nn.LayerNorm(16)
            self.mlp = torch.nn.ModuleDict({"c_fc": torch.nn.Linear(16, 32), "c_proj": torch.nn.Linear(32, 16)})

        def forward(self, x):
            return x + self.mlp["c_proj"](self.mlp["c_fc"](self.ln_1(x)).relu())

    class Tower(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])
            self.proj = torch.nn.Parameter(torch.randn(16, 8))

        def forward(self, x):
            for block in self.blocks:
                x = block(x)
            return x @ self.proj

    torch.manual_seed(4)
    tower = Tower()
    pre = {k: v.clone() for k, v in tower.state_dict().items()}
    save_file(pre, str(tmp_path / "base.safetensors"))
    model = peft.get_peft_model(copy.deepcopy(tower), peft.LoraConfig(r=2, target_modules=["c_fc", "c_proj"],
                                                                      init_lora_weights=False))
    model.save_pretrained(str(tmp_path / "adapter"))
    merged = model.merge_and_unload().state_dict()
    source = SafetensorsSource(tmp_path / "base.safetensors")
    tvs = TaskVectorSet.from_models(source, [LoraExpert(source, read_adapter(tmp_path / "adapter"))])
    for key in tvs.keys:
        assert torch.equal(tvs.load(key)[0], merged[key] - pre[key]), key
    assert sum(bool(tvs.load(k)[0].any()) for k in tvs.keys) == 4


# ------------------------------------------------------------------------------------------------------------ IA³

IA3_CONFIGS = {"llama": dict(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"]),
               "t5": dict(target_modules=["k", "v", "wo"], feedforward_modules=["wo"]),
               "gpt2": dict(target_modules=["c_attn", "mlp.c_proj"], feedforward_modules=["mlp.c_proj"],
                            fan_in_fan_out=True)}


@pytest.mark.parametrize("family", sorted(IA3_CONFIGS))
def test_ia3_vectors_minus_one_and_the_full_form_is_peft_merge(request, tmp_path, family):
    base = request.getfixturevalue(family)
    adapter_dir = _adapter(base, tmp_path / "ia3", peft.IA3Config(**IA3_CONFIGS[family]), seed=5)
    adapter, source = read_adapter(adapter_dir), SafetensorsSource(base)
    vectors = IA3Vectors(source, adapter)
    tvs = TaskVectorSet.from_models(IA3Identity(vectors), [vectors])
    assert tvs.keys and all(len(tvs.shape(k)) == 1 for k in tvs.keys)
    for key in tvs.keys:
        saved = adapter.tensors.get(key).float().reshape(-1)  # saved under the same key
        assert torch.equal(tvs.load(key)[0], saved - 1), key
    assert any(m.feedforward for m in adapter.modules.values()) and not all(m.feedforward
                                                                            for m in adapter.modules.values())
    merged, full = _peft_merged(base, adapter_dir), IA3Expert(source, adapter)
    changed = 0
    for key in source.keys():
        assert torch.equal(full.get(key), merged[key]), key
        changed += not torch.equal(full.get(key), source.get(key))
    assert changed == len(full.modules) + len(full.biases)  # a non-feedforward layer's bias is scaled too
    assert bool(full.biases) == (family == "gpt2")  # GPT-2's c_attn has a bias, Llama and T5 have none


# -------------------------------------------------------------------------------------------------- merging, CLI

@pytest.fixture(scope="module")
def two_loras(llama, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("loras")
    return [_adapter(llama, root / "a", peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                         target_modules=["q_proj", "v_proj", "embed_tokens"]), seed=6),
            _adapter(llama, root / "b", peft.LoraConfig(r=2, lora_alpha=4, init_lora_weights=False, use_rslora=True,
                                                         target_modules=["q_proj", "down_proj"],
                                                         modules_to_save=["lm_head"]), seed=7)]


def _peft_deltas(base: str, adapters: list[str]) -> list[dict[str, torch.Tensor]]:
    pre = load_state_dict(base)
    return [{k: m[k].float() - pre[k].float() for k in pre} for m in (_peft_merged(base, a) for a in adapters)]


def test_cli_task_arithmetic_of_two_loras_is_base_plus_lambda_times_the_deltas(llama, two_loras, tmp_path, capsys):
    out = tmp_path / "merged"
    assert main(["merge", "--pretrained", llama, "--finetuned", *two_loras, "--method", "task_arithmetic",
                 "--set", "scaling=0.7", "--out", str(out)]) == 0
    assert "merged checkpoint written" in capsys.readouterr().out
    merged, pre = load_state_dict(out), load_state_dict(llama)
    d1, d2 = _peft_deltas(llama, two_loras)
    for key, theta in pre.items():
        assert torch.equal(merged[key], ((d1[key] + d2[key]) * 0.7 + theta).to(theta.dtype)), key
    assert (out / "config.json").is_file() and all(a in (out / "README.md").read_text() for a in two_loras)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out))  # a Hugging Face directory, as for full merges
    assert torch.equal(model.state_dict()["lm_head.weight"], merged["lm_head.weight"])


def test_as_lora_at_full_rank_loads_in_peft_and_reproduces_the_merge(llama, two_loras, tmp_path, capsys):
    full, low = tmp_path / "full", tmp_path / "lora"
    assert main(["merge", "--pretrained", llama, "--finetuned", *two_loras, "--method", "task_arithmetic",
                 "--set", "scaling=0.5", "--out", str(full)]) == 0
    assert main(["merge", "--pretrained", llama, "--finetuned", *two_loras, "--method", "task_arithmetic",
                 "--set", "scaling=0.5", "--as-lora", "64", "--out", str(low)]) == 0
    assert "energy kept 100.0000% overall" in capsys.readouterr().out
    energy = json.loads((low / "lora_energy.json").read_text())
    assert set(energy["keys"]) == {f"model.layers.{i}.{m}.weight" for i in (0, 1)
                                   for m in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")} | {
        "model.embed_tokens.weight"}
    loaded = peft.PeftModel.from_pretrained(_load(llama), str(low)).merge_and_unload().state_dict()
    expected, pre = load_state_dict(full), load_state_dict(llama)
    for key in pre:
        scale = float((expected[key] - pre[key]).abs().max()) + 1e-30
        # float32 factors of a float64 SVD: the delta within 1e-5 of its largest entry (measured ~1e-7)
        assert (loaded[key] - expected[key]).abs().max() <= 1e-5 * scale, key
    assert torch.equal(loaded["lm_head.weight"], expected["lm_head.weight"])  # saved whole, merged as the full merge
    assert json.loads((low / "adapter_config.json").read_text())["rank_pattern"]  # v_proj: 16 < 64


def test_as_lora_truncation_error_is_the_discarded_energy(llama, two_loras, tmp_path):
    result = merge_experts(llama, two_loras, "ties", tmp_path / "r3", as_lora=3, top_k=0.5)
    taus = dict(iter_weight_space(Recipe.parse("ties(top_k=0.5)"),
                                  TaskVectorSet.from_models(SafetensorsSource(llama),
                                                            [LoraExpert(SafetensorsSource(llama), read_adapter(a))
                                                             for a in two_loras])))
    loaded = peft.PeftModel.from_pretrained(_load(llama), str(result.path)).merge_and_unload().state_dict()
    pre = load_state_dict(llama)
    kept_total = total = 0.0
    for key, info in result.energy["keys"].items():
        delta = taus[key].double()
        S = torch.linalg.svdvals(delta)
        discarded = float(S[info["rank"]:].square().sum())
        error = float((loaded[key].double() - pre[key].double() - delta).square().sum())
        assert info["rank"] == min(3, *delta.shape)
        assert abs(error - discarded) <= 1e-4 * float(S.square().sum()), key  # Eckart-Young, float32 factors
        assert info["energy"] == pytest.approx(1 - discarded / float(S.square().sum()), abs=1e-9)
        kept_total, total = kept_total + float(S.square().sum()) - discarded, total + float(S.square().sum())
    assert result.energy["overall"] == pytest.approx(kept_total / total, rel=1e-9) and result.energy["overall"] < 1


def test_as_lora_merges_the_same_updates_as_the_full_merge(llama, two_loras):
    """The task vectors --as-lora merges (zero, unread, where no adapter writes) give the full merge's updates bit for
    bit, global statistics (TIES' top-k over the model) and calibrations included."""
    recipe = Recipe.parse("ties(top_k=0.3)>svc")
    source = SafetensorsSource(llama)
    experts = [LoraExpert(source, read_adapter(a)) for a in two_loras]
    full = dict(iter_weight_space(recipe, TaskVectorSet.from_models(source, experts)))
    sparse = dict(iter_weight_space(recipe, TaskVectorSet([e.task_vectors() for e in experts], None)))
    assert full.keys() == sparse.keys() and all(torch.equal(full[k], sparse[k]) for k in full)


def test_ia3_merge_writes_an_adapter_peft_loads_and_the_full_model(llama, tmp_path, capsys):
    config = dict(IA3_CONFIGS["llama"], modules_to_save=["lm_head"])  # a matrix saved whole merges beside the vectors
    experts = [_adapter(llama, tmp_path / f"e{i}", peft.IA3Config(**config), seed=10 + i) for i in range(2)]
    out = tmp_path / "ia3"
    assert main(["merge", "--pretrained", llama, "--finetuned", *experts, "--method", "ties", "--set", "top_k=0.5",
                 "--out", str(out)]) == 0
    assert "IA³ adapter written" in capsys.readouterr().out
    saved = load_state_dict(out / "adapter_model.safetensors")
    vectors = [IA3Vectors(SafetensorsSource(llama), read_adapter(e)) for e in experts]
    tvs = TaskVectorSet.from_models(IA3Identity(vectors[0]), vectors)
    expected = dict(iter_weight_space(Recipe.parse("ties(top_k=0.5)"), tvs))
    pre = load_state_dict(llama)
    assert set(expected) == set(saved) and "base_model.model.lm_head.weight" in saved
    for key, update in expected.items():
        if key.endswith(".ia3_l"):
            assert torch.equal(saved[key].reshape(-1), (update + 1).to(saved[key].dtype)), key
        else:
            assert torch.equal(saved[key], (update + pre["lm_head.weight"]).to(saved[key].dtype)), key
    model = peft.PeftModel.from_pretrained(_load(llama), str(out))  # loads: same config, merged vectors
    assert json.loads((out / "adapter_config.json").read_text())["feedforward_modules"] == ["down_proj"]
    merged = model.merge_and_unload().state_dict()
    full = tmp_path / "ia3_full"
    assert main(["merge", "--pretrained", llama, "--finetuned", *experts, "--method", "ties", "--set", "top_k=0.5",
                 "--full-model", "--out", str(full)]) == 0
    written = load_state_dict(full)
    assert written.keys() == load_state_dict(llama).keys()
    assert all(torch.equal(written[k], merged[k]) for k in written)
    assert main(["merge", "--pretrained", llama, "--finetuned", *experts, "--recipe",
                 "ties>svc(calibrate_vectors=true)", "--out", str(tmp_path / "svc_vectors")]) == 0


# ------------------------------------------------------------------------------------------------------ refusals

def _one_line(err: pytest.ExceptionInfo, *names: str) -> str:
    message = str(err.value)
    assert "\n" not in message and all(name in message for name in names), message
    return message


def test_dora_and_lora_variants_are_refused_naming_the_config_key(llama, tmp_path):
    dora = _adapter(llama, tmp_path / "dora", peft.LoraConfig(r=2, target_modules=["q_proj"], use_dora=True))
    with pytest.raises(CheckpointError) as err:
        read_adapter(dora)
    _one_line(err, "adapter_config.json", "use_dora")
    for key, value in (("layer_replication", [[0, 1]]), ("init_lora_weights", "pissa"),
                       ("trainable_token_indices", [1, 2]), ("peft_type", "LOHA")):
        bad = tmp_path / f"bad_{key}"
        bad.mkdir()
        config = json.loads((Path(dora) / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": False, key: value}))
        (bad / "adapter_model.safetensors").write_bytes((Path(dora) / "adapter_model.safetensors").read_bytes())
        with pytest.raises(CheckpointError) as err:
            read_adapter(bad)
        _one_line(err, str(bad / "adapter_config.json"), key)


def test_pickled_and_missing_adapter_weights_are_refused(llama, tmp_path):
    model = peft.get_peft_model(_load(llama), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    model.save_pretrained(str(tmp_path / "bin"), safe_serialization=False)
    assert (tmp_path / "bin" / "adapter_model.bin").is_file()
    with pytest.raises(CheckpointError) as err:
        read_adapter(tmp_path / "bin")
    _one_line(err, "adapter_model.bin", "unpickling")
    (tmp_path / "bin" / "adapter_model.bin").unlink()
    with pytest.raises(CheckpointError) as err:
        read_adapter(tmp_path / "bin")
    _one_line(err, "adapter_model.safetensors", "not found")
    with pytest.raises(CheckpointError) as err:
        read_adapter(tmp_path)
    _one_line(err, str(tmp_path), "adapter_config.json")


def test_lora_on_a_convolution_is_refused(tmp_path):
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Flatten(), torch.nn.LazyLinear(2))
    model(torch.zeros(1, 3, 5, 5))
    peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["0"])).save_pretrained(str(tmp_path / "conv"))
    with pytest.raises(CheckpointError) as err:
        read_adapter(tmp_path / "conv")
    _one_line(err, "adapter_model.safetensors", "0.lora_A.weight", "convolution")


def test_a_target_missing_from_the_base_is_refused(llama, gpt2, tmp_path):
    adapter = read_adapter(_adapter(llama, tmp_path / "a", peft.LoraConfig(r=2, target_modules=["q_proj"])))
    with pytest.raises(IncompatibleModelsError) as err:
        LoraExpert(SafetensorsSource(gpt2), adapter)
    _one_line(err, "adapter_model.safetensors", "model.layers.0.self_attn.q_proj.weight", gpt2)


def test_mixed_kinds_and_matrix_methods_on_ia3_are_refused(llama, two_loras, tmp_path, capsys):
    ia3 = _adapter(llama, tmp_path / "ia3", peft.IA3Config(**IA3_CONFIGS["llama"]))
    assert (expert_kind(ia3), expert_kind(two_loras[0]), expert_kind(llama)) == ("ia3", "lora", "full")
    for finetuned in ([two_loras[0], ia3], [llama, two_loras[0]]):
        assert main(["merge", "--pretrained", llama, "--finetuned", *finetuned, "--method", "task_arithmetic",
                     "--out", str(tmp_path / "out")]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "one kind" in error and finetuned[1] in error, error
    for how in (["--method", "tsv_m"], ["--method", "iso_c"], ["--method", "iso_cts"], ["--recipe", "ties>svc"],
                ["--recipe", "task_arithmetic>wsc"]):
        assert main(["merge", "--pretrained", llama, "--finetuned", ia3, ia3, *how, "--out",
                     str(tmp_path / "out")]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "vector keys" in error, error
    with pytest.raises(ParameterError) as err:
        merge_experts(llama, [ia3], "ties", tmp_path / "out", as_lora=4)
    _one_line(err, "as_lora")
    assert not (tmp_path / "out").exists()


def test_an_adapter_in_memory_and_the_output_is_never_an_input(llama, two_loras, tmp_path):
    """``adapter_from_tensors`` reads tensors already in memory; the output may not be an input adapter."""
    parsed = read_adapter(two_loras[0])
    again = adapter_from_tensors(parsed.config, parsed.tensors, "in memory")
    assert again.modules == parsed.modules
    with pytest.raises(MergecalError) as err:
        merge_experts(llama, two_loras, "task_arithmetic", two_loras[0])
    _one_line(err, two_loras[0])


def test_a_merge_of_full_checkpoints_as_lora_loads_in_peft(gpt2, tmp_path, capsys):
    """Full fine-tunes of a Hugging Face base: the changed Conv1D, linear and embedding weights factorised (their
    layer types from the base's config.json, built on the meta device), the changed biases and norms saved whole."""
    pre = load_state_dict(gpt2)
    experts = []
    for seed in (20, 21):
        g = torch.Generator().manual_seed(seed)
        save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) if v.is_floating_point() else v
                   for k, v in pre.items()}, str(tmp_path / f"ft{seed}.safetensors"))
        experts.append(str(tmp_path / f"ft{seed}.safetensors"))
    full, low = tmp_path / "full", tmp_path / "lora"
    assert main(["merge", "--pretrained", gpt2, "--finetuned", *experts, "--method", "ties", "--out", str(full)]) == 0
    assert main(["merge", "--pretrained", gpt2, "--finetuned", *experts, "--method", "ties", "--as-lora", "32",
                 "--out", str(low)]) == 0
    assert "energy kept 100.0000% overall" in capsys.readouterr().out
    config = json.loads((low / "adapter_config.json").read_text())
    assert "transformer.h.0.attn.c_attn" in config["target_modules"] and config["fan_in_fan_out"]
    assert "transformer.h.0.ln_1" in config["modules_to_save"] and config["bias"] == "all"
    loaded = peft.PeftModel.from_pretrained(_load(gpt2), str(low)).merge_and_unload().state_dict()
    expected = load_state_dict(full)
    for key, theta in expected.items():
        if key.endswith(".weight") and theta.dim() == 2:  # factorised: float32 factors of a float64 SVD
            assert (loaded[key] - theta).abs().max() <= 1e-5 * float((theta - pre[key]).abs().max()), key
        else:  # saved whole (biases, norms) or untouched buffers
            assert torch.equal(loaded[key], theta), key
    with pytest.raises(ParameterError) as err:
        merge_experts(str(tmp_path / "ft20.safetensors"), experts, "ties", tmp_path / "x", as_lora=4)
    _one_line(err, "Hugging Face model directory")


def test_full_checkpoints_take_the_unchanged_path(llama, tmp_path):
    """Full checkpoints as experts: the CLI writes what merge_checkpoints writes, byte for byte."""
    from mergecal.merge import merge_checkpoints

    pre = load_state_dict(llama)
    g = torch.Generator().manual_seed(30)
    save_file({k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in pre.items()},
              str(tmp_path / "ft.safetensors"))
    assert main(["merge", "--pretrained", llama, "--finetuned", str(tmp_path / "ft.safetensors"), "--method", "ties",
                 "--out", str(tmp_path / "cli")]) == 0
    merge_checkpoints(llama, [str(tmp_path / "ft.safetensors")], "ties", tmp_path / "lib")
    names = sorted(p.name for p in (tmp_path / "cli").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "lib").iterdir()) and "model.safetensors" in names
    assert all((tmp_path / "cli" / n).read_bytes() == (tmp_path / "lib" / n).read_bytes() for n in names)


# --------------------------------------------------------------------------- lora_deltas: merged (peft's) or float32

@pytest.fixture(scope="module")
def two_bf16_loras(llama_bf16, tmp_path_factory) -> list[str]:
    root = tmp_path_factory.mktemp("bf16_loras")
    return [_adapter(llama_bf16, root / "a", peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                              target_modules=["q_proj", "v_proj"]), seed=40),
            _adapter(llama_bf16, root / "b", peft.LoraConfig(r=2, lora_alpha=3, init_lora_weights=False,
                                                              target_modules=["q_proj", "down_proj"]), seed=41)]


def _float32_deltas(adapter: str) -> dict[str, torch.Tensor]:
    """B @ A * alpha / r in float32 for each target weight, from the adapter's own files (plain LoRA, linear layers,
    no fan_in_fan_out): computed here, not by mergecal."""
    config = json.loads((Path(adapter) / "adapter_config.json").read_text())
    saved = load_state_dict(Path(adapter) / "adapter_model.safetensors")
    deltas = {}
    for name, A in saved.items():
        if name.endswith(".lora_A.weight"):
            B = saved[name.replace(".lora_A.", ".lora_B.")]
            module = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
            deltas[f"{module}.weight"] = (B.float() @ A.float()) * (config["lora_alpha"] / config["r"])
    assert deltas
    return deltas


def test_lora_deltas_float32_rounds_a_bfloat16_merge_once(llama_bf16, two_bf16_loras, tmp_path):
    """float32: base + lambda * sum of the float32 deltas, rounded to bfloat16 once; merged (the default): peft's
    merged weights minus the base, each already rounded to bfloat16 (K + 1 roundings). They differ on this base."""
    runs = {}
    for deltas in ("merged", "float32"):
        out = tmp_path / deltas
        assert main(["merge", "--pretrained", llama_bf16, "--finetuned", *two_bf16_loras, "--method",
                     "task_arithmetic", "--set", "scaling=0.7", "--lora-deltas", deltas, "--out", str(out)]) == 0
        runs[deltas] = load_state_dict(out)
    pre = load_state_dict(llama_bf16)
    f1, f2 = (_float32_deltas(a) for a in two_bf16_loras)
    p1, p2 = _peft_deltas(llama_bf16, two_bf16_loras)
    zero = torch.zeros(())
    differ = 0
    for key, theta in pre.items():
        assert runs["float32"][key].dtype == runs["merged"][key].dtype == theta.dtype == torch.bfloat16
        exact = (theta.float() + (f1.get(key, zero) + f2.get(key, zero)) * 0.7).to(theta.dtype)
        assert torch.equal(runs["float32"][key], exact), key
        assert torch.equal(runs["merged"][key], ((p1[key] + p2[key]) * 0.7 + theta).to(theta.dtype)), key
        differ += not torch.equal(runs["float32"][key], runs["merged"][key])
    assert set(f1) | set(f2) == {k for k in pre if not torch.equal(runs["float32"][k], pre[k])}
    assert differ >= 2  # the double rounding shows on a bfloat16 base


def test_lora_deltas_float32_in_row_blocks_is_the_whole_key_merge(llama_bf16, two_bf16_loras):
    """A blockwise merge reads the float32 deltas row block by row block (``get_rows``, the key's delta computed
    once): the same model, bit for bit, as the merge of whole keys."""
    from mergecal.adapters.experts import SharedBase
    from mergecal.adapters.merge import _TaskVectorsOverBase
    from mergecal.merge import _iter_model, iter_merge, iter_model_in_blocks
    from mergecal.methods import get_merge_method

    base = SharedBase(SafetensorsSource(llama_bf16))
    experts = [LoraExpert(base, read_adapter(a)) for a in two_bf16_loras]
    tvs = _TaskVectorsOverBase([e.task_vectors("float32") for e in experts], base)
    method = get_merge_method("task_arithmetic", scaling=0.7)
    blocks = dict(iter_model_in_blocks(tvs, method, block=100))
    whole = dict(_iter_model(tvs, iter_merge(tvs, method), None))
    assert blocks.keys() == whole.keys() and all(torch.equal(blocks[k], whole[k]) for k in whole)


def test_lora_deltas_agree_on_a_float32_base(llama, two_loras, tmp_path):
    """On a float32 base the merged weight is the float32 delta rounded once, at the base's magnitude: the two readings
    agree to float32 rounding (embedding, rslora and a module saved whole included)."""
    merged = merge_experts(llama, two_loras, "ties", tmp_path / "merged", top_k=0.5)
    exact = merge_experts(llama, two_loras, "ties", tmp_path / "float32", top_k=0.5, lora_deltas="float32")
    a, b, pre = load_state_dict(merged.path), load_state_dict(exact.path), load_state_dict(llama)
    assert a.keys() == b.keys() == pre.keys()
    assert all(a[k].dtype == b[k].dtype for k in a)
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-6
    assert torch.equal(a["lm_head.weight"], b["lm_head.weight"])  # saved whole: its difference either way
    source = SafetensorsSource(llama)
    expert = LoraExpert(source, read_adapter(two_loras[0]))
    key = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(expert.task_vectors("float32").get(key), expert.delta(key, torch.float32))
    assert not expert.task_vectors("float32").get("model.norm.weight").any()


def test_lora_deltas_float32_as_lora_factorises_the_float32_merge(llama_bf16, two_bf16_loras, tmp_path):
    """--as-lora with float32 deltas: each key's saved B @ A (scaling 1) is the float32 merged update
    lambda * sum of the deltas, up to the energy the truncation discards (Eckart-Young)."""
    result = merge_experts(llama_bf16, two_bf16_loras, "task_arithmetic", tmp_path / "r2", as_lora=2, scaling=0.7,
                           lora_deltas="float32")
    full = merge_experts(llama_bf16, two_bf16_loras, "task_arithmetic", tmp_path / "r64", as_lora=64, scaling=0.7,
                         lora_deltas="float32")
    f1, f2 = (_float32_deltas(a) for a in two_bf16_loras)
    zero = torch.zeros(())
    for out, rank in ((result, 2), (full, 64)):
        saved = load_state_dict(out.path / "adapter_model.safetensors")
        assert set(out.energy["keys"]) == set(f1) | set(f2)
        for key, info in out.energy["keys"].items():
            module = key.removesuffix(".weight")
            B, A = (saved[f"base_model.model.{module}.lora_{m}.weight"].double() for m in "BA")
            update = ((f1.get(key, zero) + f2.get(key, zero)) * 0.7).double()
            S = torch.linalg.svdvals(update)
            discarded, total = float(S[info["rank"]:].square().sum()), float(S.square().sum())
            error = float((B @ A - update).square().sum())
            assert info["rank"] == min(rank, *update.shape)
            assert abs(error - discarded) <= 1e-5 * total, key  # float32 factors of a float64 SVD
    assert result.energy["overall"] < 1 and full.energy["overall"] == pytest.approx(1.0)


def test_lora_deltas_refuses_an_unknown_value_and_other_experts(llama, two_loras, tmp_path, capsys):
    for call in (lambda: merge_experts(llama, two_loras, "task_arithmetic", tmp_path / "o", lora_deltas="fp32"),
                 lambda: merge_experts(llama, two_loras, "task_arithmetic", tmp_path / "o", as_lora=4,
                                       lora_deltas="bf16"),
                 lambda: LoraExpert(SafetensorsSource(llama), read_adapter(two_loras[0])).task_vectors("exact")):
        with pytest.raises(ParameterError) as err:
            call()
        _one_line(err, "lora_deltas", "merged", "float32")
    ia3 = _adapter(llama, tmp_path / "ia3", peft.IA3Config(**IA3_CONFIGS["llama"]))
    for experts in ([ia3], [llama]):
        with pytest.raises(ParameterError) as err:
            merge_experts(llama, experts, "task_arithmetic", tmp_path / "o", lora_deltas="float32")
        _one_line(err, "lora_deltas", "LoRA", experts[0])
        assert main(["merge", "--pretrained", llama, "--finetuned", *experts, "--method", "task_arithmetic",
                     "--lora-deltas", "float32", "--out", str(tmp_path / "o")]) == 2
        error = capsys.readouterr().err
        assert error.count("\n") == 1 and "lora_deltas" in error, error
    assert not (tmp_path / "o").exists()
