"""Experts that add tokens to their base's vocabulary (WizardMath-7B-V1.0's [PAD] on Llama-2-7B), merged as DARE's
code aligns them (``mergecal.backbones.vocabulary``): checked against the alignment done with Hugging Face's own
``resize_token_embeddings`` and mean rows, then merged by mergecal on the aligned state dicts."""

from __future__ import annotations

import json

import pytest
import torch

from mergecal.merge_causal_lm import merge_causal_lms
from mergecal.backbones.vocabulary import PaddedVocabularySource, aligned_vocabulary
from mergecal.checkpoint import SafetensorsSource, load_state_dict
from mergecal.errors import CheckpointError
from mergecal.merge import merge_models

# untied, as Llama-2-7B: the embedding and the LM head are each aligned
MICRO = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=64, tie_word_embeddings=False)
ADDED = "<math_pad>"


def _perturbed(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=g))
    return model


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """A micro Llama base, an expert adding one token (its tokenizer and its rows), one that does not, and one adding
    another token (which alignment must refuse)."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from mergecal.train.lm import TinyLlamaShape, create_tiny_llama, train_tokenizer

    root = tmp_path_factory.mktemp("vocabulary")
    tokenizer = train_tokenizer(["max(12, 7) = 12", "Is 5 larger than 3? Yes."] * 20, 200)
    base = root / "base"
    create_tiny_llama(tokenizer, TinyLlamaShape(**MICRO), seed=1).save_pretrained(base)
    tokenizer.save_pretrained(base)

    def expert(name, seed, added=None):
        model, tok = LlamaForCausalLM.from_pretrained(base), AutoTokenizer.from_pretrained(base)
        if added:
            tok.add_special_tokens({"additional_special_tokens": [added]})
            model.resize_token_embeddings(len(tok))
        _perturbed(model, seed).save_pretrained(root / name)
        tok.save_pretrained(root / name)
        return root / name

    return base, expert("math", 2, ADDED), expert("chat", 3), expert("other", 4, "<other_pad>")


def _aligned_by_hf(directory, size):
    """DARE's alignment, with Hugging Face's resize and a mean row (float32), as a state dict."""
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(directory)
    own = model.config.vocab_size
    if own < size:
        model.resize_token_embeddings(size)
        for weights in (model.get_input_embeddings().weight.data, model.get_output_embeddings().weight.data):
            weights[own:] = weights[:own].mean(dim=0, keepdim=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("method, params", [("task_arithmetic", {"scaling": 0.5}), ("ties", {"top_k": 0.5})])
def test_an_added_token_is_aligned_as_dare_does_and_the_merge_loads(family, tmp_path, method, params):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base, math, chat, _ = family
    size = json.loads((math / "config.json").read_text())["vocab_size"]
    out = merge_causal_lms(base, [math, chat], method, tmp_path / "merged", align_vocabulary=True, **params)
    merged = load_state_dict(out)
    expected = merge_models(_aligned_by_hf(base, size), [_aligned_by_hf(math, size), _aligned_by_hf(chat, size)],
                            method, **params)
    assert set(merged) == set(expected) and merged["model.embed_tokens.weight"].shape[0] == size
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=1e-6, atol=1e-7, msg=key)
    model, tokenizer = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == size == len(tokenizer) and tokenizer.convert_tokens_to_ids(ADDED) == size - 1


def test_the_padded_rows_are_the_models_mean_row_read_in_blocks(family):
    base, math, chat, _ = family
    size, like, own = aligned_vocabulary(base, [math, chat])
    assert like == math and own == {base: size - 1, math: size, chat: size - 1}
    source = PaddedVocabularySource(SafetensorsSource(chat), own[chat], size)
    whole = SafetensorsSource(chat).get("lm_head.weight")
    padded = source.get("lm_head.weight")
    assert source.shape("lm_head.weight") == (size, whole.shape[1]) and torch.equal(padded[:-1], whole)
    torch.testing.assert_close(padded[-1], whole.double().mean(dim=0).float())
    assert torch.equal(torch.cat([source.get_rows("lm_head.weight", a, min(a + 7, size)) for a in range(0, size, 7)]),
                       padded)
    assert source.get("model.norm.weight") is not None and source.shape("model.norm.weight") == (MICRO["hidden_size"],)


def test_without_alignment_an_added_token_is_refused_and_two_different_additions_always_are(family, tmp_path):
    base, math, chat, other = family
    with pytest.raises(CheckpointError, match=r"math/config.json: vocab_size is \d+, the base model"):
        merge_causal_lms(base, [math, chat], "task_arithmetic", tmp_path / "a")
    with pytest.raises(CheckpointError, match=r"other: its tokenizer adds \['<other_pad>'\] where .*math adds "
                                              r"\['<math_pad>'\]: one token id would mean two tokens"):
        merge_causal_lms(base, [math, other], "task_arithmetic", tmp_path / "b", align_vocabulary=True)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_rows_without_tokens_are_refused(family, tmp_path):
    import shutil

    base, math, _, _ = family
    broken = tmp_path / "broken"
    shutil.copytree(math, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 1}))
    with pytest.raises(CheckpointError, match=r"broken: vocab_size \d+ is 2 rows beyond the base's \d+, but its "
                                              r"tokenizer adds 1 tokens there"):
        aligned_vocabulary(base, [broken])
