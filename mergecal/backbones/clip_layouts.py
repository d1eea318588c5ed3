"""CLIP checkpoint layouts: Hugging Face ``CLIPModel`` <-> open_clip, and the task_vectors ``ImageEncoder``.

The key layout is part of a backbone's definition: HF CLIP stores attention as three matrices
``q_proj``/``k_proj``/``v_proj`` while open_clip fuses them into ``attn.in_proj_weight`` [3d, d] (q, k, v
stacked in that order), and every SVD-based merge or calibration sees different matrices in the two
layouts. The mapping is written out explicitly, both ways; an unknown key is an error, never dropped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from ..errors import CheckpointError

# per-block sub-keys (HF encoder layer -> open_clip residual block), attention handled separately
_BLOCK = {"self_attn.out_proj": "attn.out_proj", "layer_norm1": "ln_1", "layer_norm2": "ln_2",
          "mlp.fc1": "mlp.c_fc", "mlp.fc2": "mlp.c_proj"}
_TOWERS = {"vision_model": "visual.transformer.resblocks", "text_model": "transformer.resblocks"}
_DIRECT = {
    "vision_model.embeddings.class_embedding": "visual.class_embedding",
    "vision_model.embeddings.patch_embedding.weight": "visual.conv1.weight",
    "vision_model.embeddings.position_embedding.weight": "visual.positional_embedding",
    "vision_model.pre_layrnorm.weight": "visual.ln_pre.weight", "vision_model.pre_layrnorm.bias": "visual.ln_pre.bias",
    "vision_model.post_layernorm.weight": "visual.ln_post.weight",
    "vision_model.post_layernorm.bias": "visual.ln_post.bias",
    "text_model.embeddings.token_embedding.weight": "token_embedding.weight",
    "text_model.embeddings.position_embedding.weight": "positional_embedding",
    "text_model.final_layer_norm.weight": "ln_final.weight", "text_model.final_layer_norm.bias": "ln_final.bias",
    "logit_scale": "logit_scale",
}
_TRANSPOSED = {"visual_projection.weight": "visual.proj", "text_projection.weight": "text_projection"}
_HF_BUFFERS = re.compile(r"(^|\.)position_ids$")  # index buffers, rebuilt by the model
_LAYER = re.compile(r"^(vision_model|text_model)\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)$")


def open_clip_name(key: str) -> str:
    """The open_clip name of a HF CLIP key outside the encoder layers (embeddings, norms, projections); any other
    key as it is. Lets the key rules (mergecal.keys) judge a HF CLIP key by its open_clip counterpart."""
    return _DIRECT.get(key) or _TRANSPOSED.get(key) or key


def is_hf_clip(state_dict: Mapping[str, torch.Tensor]) -> bool:
    return any(k.startswith(("vision_model.", "text_model.")) for k in state_dict)


def hf_clip_to_open_clip(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A ``transformers`` ``CLIPModel`` (or vision-only) state dict in open_clip's layout."""
    out: dict[str, torch.Tensor] = {}
    qkv: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in state_dict.items():
        if _HF_BUFFERS.search(key):
            continue
        if key in _DIRECT:
            out[_DIRECT[key]] = value
        elif key in _TRANSPOSED:
            out[_TRANSPOSED[key]] = value.t().contiguous()
        elif match := _LAYER.match(key):
            tower, layer, sub, kind = match.groups()
            prefix = f"{_TOWERS[tower]}.{layer}"
            if sub in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                qkv.setdefault((prefix, kind), {})[sub[-6]] = value  # 'q', 'k' or 'v'
            elif sub in _BLOCK:
                out[f"{prefix}.{_BLOCK[sub]}.{kind}"] = value
            else:
                raise CheckpointError(f"HF CLIP key {key!r} has no open_clip equivalent")
        else:
            raise CheckpointError(f"HF CLIP key {key!r} has no open_clip equivalent")
    for (prefix, kind), parts in qkv.items():
        if set(parts) != {"q", "k", "v"}:
            raise CheckpointError(f"HF CLIP layer {prefix}: attention {kind} needs q_proj, k_proj and v_proj, "
                                  f"found {sorted(parts)}")
        out[f"{prefix}.attn.in_proj_{kind}"] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


_OPEN_CLIP_LAYER = re.compile(r"^(visual\.transformer|transformer)\.resblocks\.(\d+)\.(.+)$")


def open_clip_to_hf_clip(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The inverse of ``hf_clip_to_open_clip``: open_clip's fused in_proj split into q, k, v."""
    direct = {v: k for k, v in _DIRECT.items()}
    transposed = {v: k for k, v in _TRANSPOSED.items()}
    block = {v: k for k, v in _BLOCK.items()}
    towers = {"visual.transformer": "vision_model", "transformer": "text_model"}
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        if key in direct:
            out[direct[key]] = value
        elif key in transposed:
            out[transposed[key]] = value.t().contiguous()
        elif match := _OPEN_CLIP_LAYER.match(key):
            tower, layer, rest = match.groups()
            prefix = f"{towers[tower]}.encoder.layers.{layer}"
            if rest in ("attn.in_proj_weight", "attn.in_proj_bias"):
                kind = rest.rsplit("_", 1)[1]
                if value.shape[0] % 3:
                    raise CheckpointError(f"open_clip key {key!r}: first dimension {value.shape[0]} is not 3 x width")
                for name, part in zip(("q", "k", "v"), value.chunk(3, dim=0)):
                    out[f"{prefix}.self_attn.{name}_proj.{kind}"] = part.contiguous()
            else:
                module, _, kind = rest.rpartition(".")
                if module not in block:
                    raise CheckpointError(f"open_clip key {key!r} has no HF CLIP equivalent")
                out[f"{prefix}.{block[module]}.{kind}"] = value
        else:
            raise CheckpointError(f"open_clip key {key!r} has no HF CLIP equivalent")
    return out


def strip_image_encoder_prefix(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """task_vectors' ``ImageEncoder`` holds the open_clip model as ``.model``: keys ``model.visual.*`` etc."""
    if not all(k.startswith("model.") for k in state_dict):
        return dict(state_dict)
    return {k[len("model."):]: v for k, v in state_dict.items()}


_BARE_VISION = ("embeddings.", "encoder.layers.", "pre_layrnorm.", "post_layernorm.")


class OpenClipLayoutSource:
    """A ``TensorSource`` in open_clip's layout over a checkpoint in any supported layout, read key by key: HF
    CLIP keys mapped by the functions above (q, k, v fused when the fused key is read), task_vectors'
    ``model.`` prefix stripped. Names, shapes and dtypes come from the checkpoint's headers (meta tensors):
    nothing is read until ``get``."""

    def __init__(self, source, name: str | None = None):
        self.source, self.name = source, name or source.name
        keys = [k for k in source.keys() if not _HF_BUFFERS.search(k)]
        # a CLIPVisionModel saved by transformers 5 names its keys without the vision_model. prefix
        bare = bool(keys) and all(k.startswith(_BARE_VISION) for k in keys)
        self._hf_name = {("vision_model." + k if bare else k): k for k in keys}
        self.hf = is_hf_clip(self._hf_name)
        if self.hf:
            meta = {k: torch.empty(source.shape(o), dtype=source.dtype(o), device="meta")
                    for k, o in self._hf_name.items()}
            converted = hf_clip_to_open_clip(meta)
            self._parts = {k: list(open_clip_to_hf_clip({k: v})) for k, v in converted.items()}
            self._meta = {k: (tuple(v.shape), v.dtype) for k, v in converted.items()}
        else:
            strip = "model." if keys and all(k.startswith("model.") for k in keys) else ""
            self._parts = {k[len(strip):]: [k] for k in keys}
            self._meta = {k[len(strip):]: (tuple(source.shape(k)), source.dtype(k)) for k in keys}

    def keys(self) -> list[str]:
        return list(self._meta)

    def shape(self, key: str) -> tuple[int, ...]:
        return self._meta[key][0]

    def dtype(self, key: str) -> torch.dtype:
        return self._meta[key][1]

    def get(self, key: str) -> torch.Tensor:
        parts = self._parts[key]
        if self.hf:
            return hf_clip_to_open_clip({p: self.source.get(self._hf_name[p]) for p in parts})[key]
        return self.source.get(parts[0])
