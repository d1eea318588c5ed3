"""Small open_clip ViTs for the project's own CLIP, and loaders for real open_clip checkpoints from local files.

The custom architectures are registered with ``open_clip.add_model_config`` (a JSON config written to a
temporary file) and built by ``open_clip.create_model_and_transforms(name, pretrained=None)``, so their
parameter names are those of ViT-B/32 (``visual.conv1.weight``, ``visual.transformer.resblocks.0.attn.in_proj_weight``,
``token_embedding.weight``, ``logit_scale``, ...) and merging code written for CLIP ViT-B/32 runs on them unchanged
(docs/references.md, "Offline materials and stack").

Zero-shot heads follow the evaluation protocol of Ilharco et al. / task_vectors (docs/references.md): per class,
encode every template, L2-normalise, average, renormalise; logits = logit_scale * normalize(encode_image(x)) @ W.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import open_clip
import torch
import torch.nn.functional as F

from ..checkpoint import load_state_dict, save_state_dict
from ..errors import CheckpointError, ParameterError
from .architectures import ARCHITECTURES
from .construction import MODEL_CONSTRUCTION

MEAN = open_clip.OPENAI_DATASET_MEAN
STD = open_clip.OPENAI_DATASET_STD


def register_architectures() -> None:
    """Register every custom architecture with open_clip (idempotent). The JSON files live in a temporary
    directory only while open_clip reads them; the registry keeps the parsed configs."""
    missing = {name: cfg for name, cfg in ARCHITECTURES.items() if name not in open_clip.list_models()}
    if not missing:
        return
    with tempfile.TemporaryDirectory(prefix="mergecal-archs-") as tmp:
        for name, cfg in missing.items():
            path = Path(tmp) / f"{name}.json"
            path.write_text(json.dumps(cfg))
            open_clip.add_model_config(path)


register_architectures()


def _check_arch(arch: str) -> None:
    if arch not in open_clip.list_models():
        raise ParameterError(f"arch={arch!r}: unknown open_clip architecture; custom ones: {', '.join(ARCHITECTURES)}")


class _RandomInitNotice(logging.Filter):
    """Drops open_clip's "No pretrained weights loaded for model <arch>. Model initialized randomly.", intended
    here: the testbed builds its architectures with ``pretrained=None`` and loads its own weights into them."""

    def __init__(self, arch: str):
        super().__init__()
        self.message = f"No pretrained weights loaded for model '{arch}'. Model initialized randomly."

    def filter(self, record: logging.LogRecord) -> bool:
        return record.getMessage() != self.message


def create_clip(arch: str = "mergecal-vit-tiny", seed: int = 0) -> torch.nn.Module:
    """A randomly initialised open_clip model (``pretrained=None``: nothing is downloaded), seeded, in eval mode."""
    _check_arch(arch)
    notice = _RandomInitNotice(arch)
    # the global RNG is reseeded, and a concurrent transformers load would make its init a no-op. A filter for
    # that one message, not ``logging.disable``: a process-wide level saved and restored by two threads at once
    # left logging disabled for good (every later line of the flow lost)
    with MODEL_CONSTRUCTION, torch.random.fork_rng(devices=[]):
        logging.getLogger().addFilter(notice)  # open_clip logs it on the root logger
        try:
            torch.manual_seed(seed)
            model = open_clip.create_model(arch, pretrained=None)
        finally:
            logging.getLogger().removeFilter(notice)
    return model.eval()


def get_tokenizer(arch: str = "mergecal-vit-tiny"):
    """open_clip's SimpleTokenizer (bundled BPE vocabulary, offline) with the architecture's context length."""
    _check_arch(arch)
    return open_clip.get_tokenizer(arch)


def _read_weights(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A state dict from a local safetensors file, or a ``torch.save``d dict read with ``weights_only=True``
    (never a full unpickle); ``{"state_dict": ...}`` wrappers and ``module.`` prefixes are unwrapped."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: pretrained weights file not found "
                              "(a local file is required; nothing is downloaded)")
    if path.suffix == ".safetensors":
        return load_state_dict(path)
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # pickled nn.Modules, TorchScript archives, corrupt files
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise CheckpointError(f"{path}: not a weights-only state dict ({first[:200]}); "
                              "convert it to safetensors or a plain state dict") from None
    if isinstance(obj, Mapping) and "state_dict" in obj and isinstance(obj["state_dict"], Mapping):
        obj = obj["state_dict"]
    if not isinstance(obj, Mapping) or not all(isinstance(v, torch.Tensor) for v in obj.values()):
        raise CheckpointError(f"{path}: expected a mapping of parameter names to tensors")
    return {(k[len("module."):] if k.startswith("module.") else k): v for k, v in obj.items()}


def load_clip(arch: str, weights: Mapping[str, torch.Tensor] | str | os.PathLike) -> torch.nn.Module:
    """Build ``arch`` and load a state dict or a safetensors path into it (strict: every key must match)."""
    state = load_state_dict(weights) if isinstance(weights, (str, os.PathLike)) else dict(weights)
    model = create_clip(arch, seed=0)
    result = model.load_state_dict(state, strict=False)
    if result.missing_keys or result.unexpected_keys:
        raise CheckpointError(f"load_clip({arch}): key mismatch, missing {result.missing_keys[:3]}, "
                              f"unexpected {result.unexpected_keys[:3]}")
    return model.eval()


def load_pretrained_file(arch: str, path: str | os.PathLike) -> torch.nn.Module:
    """A real open_clip architecture (e.g. ``ViT-B-32``) with weights from a LOCAL file: ``.safetensors``, or a
    state dict saved with ``torch.save`` (read with ``weights_only=True``). A missing file is a one-line
    ``CheckpointError`` naming it."""
    _check_arch(arch)
    state = _read_weights(path)
    return load_clip(arch, state)


def save_clip(model: torch.nn.Module, path: str | os.PathLike, metadata: Mapping[str, str] | None = None) -> Path:
    """Write the model's state dict as one safetensors file (atomic; metadata values must be strings)."""
    return save_state_dict(model.state_dict(), path, metadata={k: str(v) for k, v in (metadata or {}).items()})


def image_size(model: torch.nn.Module) -> int:
    size = model.visual.image_size
    return int(size[0] if isinstance(size, (tuple, list)) else size)


def preprocess(images: np.ndarray | torch.Tensor, size: int | None = None) -> torch.Tensor:
    """uint8 images [N, H, W, 3] -> float32 [N, 3, size, size] scaled to [0, 1] and normalised with open_clip's
    (OpenAI) mean/std; resized bicubically when ``size`` differs from H (e.g. 224 for a real ViT-B/32)."""
    x = torch.as_tensor(np.asarray(images))
    if x.dim() != 4 or x.shape[-1] != 3 or x.dtype != torch.uint8:
        raise ParameterError(f"preprocess: expected uint8 images [N, H, W, 3], got {x.dtype} {tuple(x.shape)}")
    x = x.permute(0, 3, 1, 2).float().div_(255.0)
    if size is not None and (x.shape[-2], x.shape[-1]) != (size, size):
        x = F.interpolate(x, size=(size, size), mode="bicubic", align_corners=False).clamp_(0.0, 1.0)
    mean = torch.tensor(MEAN).view(1, 3, 1, 1)
    std = torch.tensor(STD).view(1, 3, 1, 1)
    return (x - mean) / std


def zero_shot_head(model: torch.nn.Module, tokenizer, classnames: Sequence[str], templates: Sequence[str],
                   device: str | torch.device = "cpu") -> torch.Tensor:
    """Zero-shot classifier weights [embed_dim, C] (``open_clip.build_zero_shot_classifier``): per class, every
    template encoded and L2-normalised, averaged, renormalised. Excludes the logit scale."""
    was_training = model.training
    model.eval()
    head = open_clip.build_zero_shot_classifier(model, tokenizer, classnames, templates, device=device)
    model.train(was_training)
    return head.detach()


def image_features(model: torch.nn.Module, images: torch.Tensor) -> torch.Tensor:
    """L2-normalised image embeddings of preprocessed images."""
    return F.normalize(model.encode_image(images), dim=-1)


def logits(model: torch.nn.Module, head: torch.Tensor, images: torch.Tensor) -> torch.Tensor:
    """logit_scale * normalize(encode_image(x)) @ head, for preprocessed images x."""
    return model.logit_scale.exp() * image_features(model, images) @ head.to(images.device)
