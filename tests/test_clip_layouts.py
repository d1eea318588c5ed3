"""HF CLIP <-> open_clip key mapping (checked by running both models) and safe weight loading."""

import json
import os
import tempfile

import pytest
import torch
from torch import nn

from mergecal.backbones.clip_layouts import (hf_clip_to_open_clip, open_clip_to_hf_clip, strip_image_encoder_prefix)
from mergecal.backbones.loading import load_weights_file
from mergecal.checkpoint import save_state_dict
from mergecal.errors import CheckpointError

WIDTH, LAYERS, VOCAB = 32, 2, 100
OPEN_CLIP_NAME = "mergecal-test-hf-equivalent"


@pytest.fixture(scope="module")
def models():
    import logging

    import open_clip
    from transformers import CLIPConfig, CLIPModel

    torch.manual_seed(0)
    hf = CLIPModel(CLIPConfig(
        text_config=dict(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=1, num_attention_heads=2,
                         vocab_size=VOCAB, max_position_embeddings=16, eos_token_id=VOCAB - 1),
        vision_config=dict(hidden_size=WIDTH, intermediate_size=4 * WIDTH, num_hidden_layers=LAYERS,
                           num_attention_heads=2, image_size=32, patch_size=8), projection_dim=16)).eval()
    config = {"embed_dim": 16, "quick_gelu": True,
              "vision_cfg": {"image_size": 32, "layers": LAYERS, "width": WIDTH, "head_width": 16, "patch_size": 8},
              "text_cfg": {"context_length": 16, "vocab_size": VOCAB, "width": WIDTH, "heads": 2, "layers": 1}}
    if OPEN_CLIP_NAME not in open_clip.list_models():
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, f"{OPEN_CLIP_NAME}.json")
            with open(path, "w") as fh:
                json.dump(config, fh)
            open_clip.add_model_config(path)
    logging.getLogger().setLevel(logging.ERROR)
    oc = open_clip.create_model(OPEN_CLIP_NAME, pretrained=None).eval()
    return hf, oc


def test_hf_clip_converts_to_open_clip_and_computes_the_same_features(models):
    hf, oc = models
    converted = hf_clip_to_open_clip(hf.state_dict())
    assert set(converted) == set(oc.state_dict())
    for key, value in converted.items():
        assert tuple(value.shape) == tuple(oc.state_dict()[key].shape), key
    oc.load_state_dict(converted)
    images = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    text = torch.tensor([[5, 17, 42, VOCAB - 1] + [0] * 12, [7, VOCAB - 1] + [0] * 14])
    with torch.no_grad():
        hf_image = hf.get_image_features(pixel_values=images)
        hf_text = hf.get_text_features(input_ids=text)
        hf_image = getattr(hf_image, "pooler_output", hf_image)
        hf_text = getattr(hf_text, "pooler_output", hf_text)
        torch.testing.assert_close(oc.encode_image(images), hf_image, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(oc.encode_text(text), hf_text, rtol=1e-4, atol=1e-5)


def test_fused_in_proj_is_q_k_v_stacked_and_the_mapping_round_trips(models):
    hf, _ = models
    sd = hf.state_dict()
    converted = hf_clip_to_open_clip(sd)
    fused = converted["visual.transformer.resblocks.1.attn.in_proj_weight"]
    prefix = "vision_model.encoder.layers.1.self_attn"
    assert torch.equal(fused, torch.cat([sd[f"{prefix}.q_proj.weight"], sd[f"{prefix}.k_proj.weight"],
                                         sd[f"{prefix}.v_proj.weight"]]))
    assert torch.equal(converted["visual.proj"], sd["visual_projection.weight"].t())
    back = open_clip_to_hf_clip(converted)
    expected = {k: v for k, v in sd.items() if not k.endswith("position_ids")}
    assert set(back) == set(expected) and all(torch.equal(back[k], expected[k]) for k in expected)


def test_unknown_keys_and_partial_attention_are_errors(models):
    hf, _ = models
    sd = dict(hf.state_dict())
    with pytest.raises(CheckpointError, match="'vision_model.extra.weight' has no open_clip equivalent"):
        hf_clip_to_open_clip({**sd, "vision_model.extra.weight": torch.ones(1)})
    del sd["vision_model.encoder.layers.0.self_attn.k_proj.bias"]
    with pytest.raises(CheckpointError, match="needs q_proj, k_proj and v_proj, found \\['q', 'v'\\]"):
        hf_clip_to_open_clip(sd)
    with pytest.raises(CheckpointError, match="'visual.mystery' has no HF CLIP equivalent"):
        open_clip_to_hf_clip({"visual.mystery": torch.ones(1)})


def test_task_vectors_image_encoder_layout_and_detection(models):
    hf, oc = models
    native = oc.state_dict()
    wrapped = {f"model.{k}": v for k, v in native.items()}
    assert strip_image_encoder_prefix(wrapped).keys() == native.keys()


class Pickled(nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(2, 2)


def test_safe_loading_of_local_weight_files(tmp_path):
    sd = {"a": torch.randn(2, 2), "b": torch.arange(3)}
    save_state_dict(sd, tmp_path / "w.safetensors")
    torch.save(sd, tmp_path / "w.pt")
    torch.save({"state_dict": sd, "epoch": 3}, tmp_path / "ckpt.pt")
    for name in ("w.safetensors", "w.pt"):
        loaded = load_weights_file(tmp_path / name)
        assert loaded.keys() == sd.keys() and all(torch.equal(loaded[k], sd[k]) for k in sd)
    assert load_weights_file(tmp_path / "ckpt.pt").keys() == sd.keys()
    torch.save(Pickled(), tmp_path / "module.pt")  # a whole pickled module, like task_vectors' checkpoints
    with pytest.raises(CheckpointError,
                       match="pickled Python object.*allow_unsafe_pickle=True only for a file you trust"):
        load_weights_file(tmp_path / "module.pt")
    unsafe = load_weights_file(tmp_path / "module.pt", allow_unsafe_pickle=True)
    assert set(unsafe) == {"layer.weight", "layer.bias"}
    with pytest.raises(CheckpointError, match="weights file not found"):
        load_weights_file(tmp_path / "missing.pt")
    (tmp_path / "w.npz").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="unknown weights format"):
        load_weights_file(tmp_path / "w.npz")
