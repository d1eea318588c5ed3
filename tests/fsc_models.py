"""Tiny randomly initialised backbones for the FSC tests (nothing is downloaded).

A pretrained model theta_0, K "fine-tuned" models = theta_0 + a small random perturbation of the hooked
tower, and the weight-averaged merge of those.
"""

from __future__ import annotations

import copy
import json
import os
import tempfile

import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TINY_VIT_NAME = "mergecal-fsc-tiny-vit"
TINY_VIT_CONFIG = {
    "embed_dim": 16,
    "vision_cfg": {"image_size": 32, "layers": 2, "width": 32, "head_width": 16, "patch_size": 8},
    "text_cfg": {"context_length": 16, "vocab_size": 64, "width": 16, "heads": 2, "layers": 1},
}


def tiny_open_clip(seed: int = 0) -> nn.Module:
    """An open_clip CLIP with a 2-block ViT (image 32, patch 8, width 32, 2 heads) and a 1-block text tower."""
    import logging

    import open_clip

    if TINY_VIT_NAME not in open_clip.list_models():
        with tempfile.TemporaryDirectory() as tmp:  # open_clip reads the config into memory right away
            path = os.path.join(tmp, f"{TINY_VIT_NAME}.json")
            with open(path, "w") as fh:
                json.dump(TINY_VIT_CONFIG, fh)
            open_clip.add_model_config(path)
    torch.manual_seed(seed)
    root = logging.getLogger()
    level = root.level
    root.setLevel(logging.ERROR)  # open_clip warns "No pretrained weights loaded": expected here
    try:
        return open_clip.create_model(TINY_VIT_NAME, pretrained=None).eval()
    finally:
        root.setLevel(level)


def tiny_bert(seed: int = 0, classification: bool = False) -> nn.Module:
    from transformers import BertConfig, BertForSequenceClassification, BertModel

    torch.manual_seed(seed)
    config = BertConfig(vocab_size=50, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=32)
    cls = BertForSequenceClassification if classification else BertModel
    return cls(config).eval()


@torch.no_grad()
def perturbed(model: nn.Module, seed: int, scale: float = 0.05, prefix: str = "") -> nn.Module:
    """A copy of ``model`` with ``scale * N(0, 1)`` added to every float parameter whose name starts with ``prefix``."""
    out = copy.deepcopy(model)
    g = torch.Generator().manual_seed(seed)
    for name, p in out.named_parameters():
        if name.startswith(prefix):
            p.add_(scale * torch.randn(p.shape, generator=g))
    return out


@torch.no_grad()
def averaged(models: list[nn.Module]) -> nn.Module:
    """Weight averaging (the paper's Eq. 1)."""
    out = copy.deepcopy(models[0])
    for name, p in out.named_parameters():
        p.copy_(torch.stack([m.get_parameter(name) for m in models]).mean(0))
    return out


def sequence_first(model: nn.Module) -> nn.Module:
    """The same CLIP with its visual residual blocks run sequence-first ([L, N, D], open_clip < 2.24's layout)."""
    from open_clip.transformer import Transformer

    out = copy.deepcopy(model)
    old = out.visual.transformer
    new = Transformer(old.width, old.layers, old.resblocks[0].attn.num_heads, batch_first=False)
    new.load_state_dict(old.state_dict())
    out.visual.transformer = new.eval()
    return out
