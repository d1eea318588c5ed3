"""A merge of Hugging Face model directories is a Hugging Face model directory (#43): `mergecal merge` writes the
base's configs, the tokenizer files and a model card beside the weights, so `from_pretrained(out)` loads the merge
(a tiny Llama with its tokenizer, a tiny CLIP with its image processor)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from local_models import write_llm_family
from mergecal import __version__
from mergecal.checkpoint import load_state_dict
from mergecal.cli import main
from mergecal.merge import merge_models
from mergecal.run_recipe import RecipeInputs, run_recipe


@pytest.fixture(scope="module")
def llm_family(tmp_path_factory) -> dict:
    return write_llm_family(tmp_path_factory.mktemp("llm"), "lab_llm")


def test_a_merge_of_llama_directories_loads_with_from_pretrained(llm_family, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, experts = llm_family["base"], list(llm_family["experts"].values())
    out = tmp_path / "merged"
    assert main(["merge", "--pretrained", base, "--finetuned", *experts, "--recipe", "ties>svc",
                 "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True)
    # the weights: the recipe run in memory on the loaded state dicts, bit for bit
    pre = load_state_dict(base)
    expected = run_recipe("ties>svc", pre, [load_state_dict(e) for e in experts], RecipeInputs(progress=False))
    loaded = model.state_dict()
    assert expected.state_dict.keys() <= loaded.keys()
    for key, value in expected.state_dict.items():
        assert torch.equal(loaded[key], value), key
    assert any(not torch.equal(loaded[k], pre[k]) for k in pre)
    tokenizer, reference = (AutoTokenizer.from_pretrained(p, local_files_only=True) for p in (str(out), base))
    assert tokenizer("max(12, 7) = 12")["input_ids"] == reference("max(12, 7) = 12")["input_ids"]
    with torch.no_grad():  # it runs: a generation step from the loaded directory
        logits = model(**tokenizer("max(3, 4) =", return_tensors="pt")).logits
    assert torch.isfinite(logits).all()
    card = (out / "README.md").read_text()
    assert f"mergecal {__version__}" in card and "ties(" in card and "svc(" in card and base in card
    assert all(e in card for e in experts)
    assert json.loads((out / "config.json").read_text()) == json.loads((Path(base) / "config.json").read_text())


def test_dtype_is_recorded_and_tokenizer_from_names_another_input(llm_family, tmp_path):
    from transformers import AutoModelForCausalLM

    base, experts = llm_family["base"], list(llm_family["experts"].values())
    out = tmp_path / "bf16"
    assert main(["merge", "--pretrained", base, "--finetuned", *experts, "--method", "task_arithmetic",
                 "--dtype", "bfloat16", "--tokenizer-from", base, "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert "bfloat16" in {config.get("dtype"), config.get("torch_dtype")}
    model = AutoModelForCausalLM.from_pretrained(str(out), local_files_only=True, dtype="auto")
    assert next(model.parameters()).dtype == torch.bfloat16
    weights_only = tmp_path / "weights"
    assert main(["merge", "--pretrained", base, "--finetuned", *experts, "--method", "task_arithmetic",
                 "--weights-only", "--out", str(weights_only)]) == 0
    assert sorted(p.name for p in weights_only.iterdir() if not p.name.startswith(".")) == ["model.safetensors"]


def test_a_tokenizer_source_without_tokenizer_files_is_refused_before_merging(llm_family, tmp_path, capsys):
    base, experts = llm_family["base"], list(llm_family["experts"].values())
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "never"
    assert main(["merge", "--pretrained", base, "--finetuned", *experts, "--method", "task_arithmetic",
                 "--tokenizer-from", str(empty), "--out", str(out)]) != 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"--tokenizer-from {empty}: no tokenizer files there" in err[0]
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".never")]
    assert main(["merge", "--pretrained", base, "--finetuned", *experts, "--method", "task_arithmetic",
                 "--weights-only", "--tokenizer-from", base, "--out", str(out)]) != 0
    assert "a weights-only output has none" in capsys.readouterr().err


def test_a_merge_of_clip_directories_loads_with_from_pretrained(tmp_path):
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(0)
    tower = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)
    config = CLIPConfig(text_config=dict(tower, vocab_size=100, max_position_embeddings=16, bos_token_id=0,
                                         eos_token_id=99), vision_config=dict(tower, image_size=32, patch_size=8),
                        projection_dim=16)
    paths = []
    for i in range(3):
        model = CLIPModel(config)
        if i:  # the fine-tuned models: the base moved
            model.load_state_dict({k: v + 0.01 * torch.randn_like(v) if v.is_floating_point() else v
                                   for k, v in paths[0][1].items()})
        model.save_pretrained(str(tmp_path / f"m{i}"))
        paths.append((str(tmp_path / f"m{i}"), model.state_dict()))
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size=32).save_pretrained(paths[0][0])
    out = tmp_path / "merged"
    assert main(["merge", "--pretrained", paths[0][0], "--finetuned", paths[1][0], paths[2][0],
                 "--method", "task_arithmetic", "--set", "scaling=0.5", "--out", str(out)]) == 0
    merged = CLIPModel.from_pretrained(str(out), local_files_only=True)
    expected = merge_models(paths[0][0], [paths[1][0], paths[2][0]], "task_arithmetic", scaling=0.5)
    for key, value in merged.state_dict().items():
        if key in expected:
            assert torch.equal(value, expected[key]), key
    assert (out / "preprocessor_config.json").is_file()
    CLIPImageProcessor.from_pretrained(str(out), local_files_only=True)
