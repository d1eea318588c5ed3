"""Key rules by role, whatever the naming layout: open_clip, HF CLIP, BERT family, Llama (issue #13, item 8) and T5
(issue #60).

Every state dict is a real tiny model's (nothing downloaded), cut to its first layer, and each test lists the
exact keys a rule covers. The decisions per role (docs/references.md, "Which parameters each method touches"):
- patch embedding (4-D conv): WSC only;
- position / class / token embeddings (Llama's ``lm_head`` too: the output embedding, one tensor with
  ``embed_tokens`` when tied; T5's ``shared`` and its ``relative_attention_bias``, a position embedding):
  TSV-M/Iso only; never SVC (authors: no 'embedding') nor WSC (authors: left alone);
- final projection (open_clip ``visual.proj``, HF ``visual_projection.weight``, BERT ``pooler.dense``): SVC and
  TSV-M/Iso, not WSC; ``text_projection`` in either spelling: none of the three;
- attention and MLP matrices: all three; LayerNorm/RMSNorm weights and biases (1-D): none.
"""

import re

import pytest
import torch

from mergecal.backbones.clip_layouts import hf_clip_to_open_clip
from mergecal.keys import get_key_rule

from fsc_models import tiny_open_clip

RULES = ("svc_authors", "wsc_weights", "matrices_except_text_projection")
WIDTH = 32


def covered(state: dict[str, torch.Tensor], rule: str) -> set[str]:
    r = get_key_rule(rule)
    return {k for k, v in state.items() if r.matches(k, v.shape, v.dtype)}


def first_layer(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop every block but block 0 (the tiny models have one or two)."""
    return {k: v for k, v in state.items() if not re.search(r"\.(resblocks|layers|layer)\.[1-9]\d*\.", k)}


def open_clip_expected() -> dict[str, set[str]]:
    blocks = {f"{p}{m}" for p in ("visual.transformer.resblocks.0.", "transformer.resblocks.0.")
              for m in ("attn.in_proj_weight", "attn.out_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")}
    return {
        "svc_authors": blocks | {"visual.proj"},
        "wsc_weights": blocks | {"visual.conv1.weight"},
        "matrices_except_text_projection": blocks | {"visual.proj", "visual.positional_embedding",
                                                     "positional_embedding", "token_embedding.weight"},
    }


@pytest.fixture(scope="module")
def hf_clip_state():
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    tower = dict(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=1, num_attention_heads=2)
    model = CLIPModel(CLIPConfig(text_config=dict(tower, vocab_size=100, max_position_embeddings=16,
                                                  bos_token_id=0, eos_token_id=99),
                                 vision_config=dict(tower, image_size=32, patch_size=8), projection_dim=16))
    return model.state_dict()


@pytest.mark.parametrize("rule", RULES)
def test_open_clip(rule):
    state = first_layer(tiny_open_clip().state_dict())
    assert covered(state, rule) == open_clip_expected()[rule]


@pytest.mark.parametrize("rule", RULES)
def test_hf_clip(hf_clip_state, rule):
    blocks = {f"{tower}.encoder.layers.0.{m}.weight" for tower in ("vision_model", "text_model")
              for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.out_proj",
                        "mlp.fc1", "mlp.fc2")}
    expected = {
        "svc_authors": blocks | {"visual_projection.weight"},
        "wsc_weights": blocks | {"vision_model.embeddings.patch_embedding.weight"},
        "matrices_except_text_projection": blocks | {
            "visual_projection.weight", "vision_model.embeddings.position_embedding.weight",
            "text_model.embeddings.position_embedding.weight", "text_model.embeddings.token_embedding.weight"},
    }
    assert covered(hf_clip_state, rule) == expected[rule]
    # the same model in open_clip's names (clip_layouts' mapping): the same parameters, q/k/v fused into in_proj
    assert covered(hf_clip_to_open_clip(hf_clip_state), rule) == open_clip_expected()[rule]


@pytest.mark.parametrize("prefix", ["", "bert."])  # BertModel alone (the text track's encoder) or in BertFor...
@pytest.mark.parametrize("rule", RULES)
def test_bert(rule, prefix):
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    model = BertModel(BertConfig(vocab_size=100, hidden_size=WIDTH, num_hidden_layers=1, num_attention_heads=2,
                                 intermediate_size=4 * WIDTH, max_position_embeddings=16))
    state = {prefix + k: v for k, v in model.state_dict().items()}
    blocks = {f"encoder.layer.0.{m}.weight" for m in ("attention.self.query", "attention.self.key",
                                                       "attention.self.value", "attention.output.dense",
                                                       "intermediate.dense", "output.dense")}
    embeddings = {f"embeddings.{e}_embeddings.weight" for e in ("word", "position", "token_type")}
    expected = {
        "svc_authors": blocks | {"pooler.dense.weight"},
        "wsc_weights": blocks,
        "matrices_except_text_projection": blocks | embeddings | {"pooler.dense.weight"},
    }
    assert covered(state, rule) == {prefix + k for k in expected[rule]}


@pytest.mark.parametrize("rule", RULES)
def test_llama(rule):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, tie_word_embeddings=False))
    blocks = {f"model.layers.0.{m}.weight" for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                                                      "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                      "mlp.down_proj")}
    expected = {
        "svc_authors": blocks,
        "wsc_weights": blocks,
        "matrices_except_text_projection": blocks | {"model.embed_tokens.weight", "lm_head.weight"},
    }
    assert covered(model.state_dict(), rule) == expected[rule]


@pytest.mark.parametrize("rule", RULES)
def test_t5(rule):
    from transformers import T5Config, T5ForConditionalGeneration

    torch.manual_seed(0)
    model = T5ForConditionalGeneration(T5Config(vocab_size=100, d_model=WIDTH, d_kv=8, d_ff=64, num_layers=1,
                                                num_decoder_layers=1, num_heads=2, feed_forward_proj="gated-gelu",
                                                tie_word_embeddings=False))
    state = dict(model.state_dict())
    attention = ("q", "k", "v", "o")
    blocks = ({f"encoder.block.0.layer.0.SelfAttention.{m}.weight" for m in attention}
              | {f"decoder.block.0.layer.0.SelfAttention.{m}.weight" for m in attention}
              | {f"decoder.block.0.layer.1.EncDecAttention.{m}.weight" for m in attention}
              | {f"{stack}.block.0.layer.{i}.DenseReluDense.{m}.weight" for stack, i in (("encoder", 1), ("decoder", 2))
                 for m in ("wi_0", "wi_1", "wo")})
    embeddings = ({"shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight", "lm_head.weight"}
                  | {f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight"
                     for stack in ("encoder", "decoder")}) & set(state)
    assert "shared.weight" in embeddings and len(embeddings) >= 3
    expected = {
        "svc_authors": blocks,
        "wsc_weights": blocks,
        "matrices_except_text_projection": blocks | embeddings,
    }
    assert covered(state, rule) == expected[rule]
