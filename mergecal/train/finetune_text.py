"""Fine-tuning a text classifier (encoder + task head) on one task, and scoring it.

Protocol: AdamW (weight decay 0.1), linear warmup then cosine decay, cross-entropy (label smoothing for the
low-confidence regime), the head trained jointly from a seeded initialisation; the word/position embeddings
can be frozen (they are most of MiniLM's parameters and barely move; freezing halves the step cost on CPU).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..config_types import Count, Flag, NonNegativeInt, NonNegativeReal, PositiveReal, Probability, Steps
from ..backbones.hf_text import build_classifier, load_encoder, tokenize
from ..confidence import expected_calibration_error, prediction_entropy
from ..errors import ParameterError
from .lr_schedule import warmup_cosine


@dataclass(frozen=True)
class TextFinetuneConfig:
    # 80 steps at 2e-4, length 32 (padding trimmed per batch): 4 tasks individual 0.830, TA merged 0.604 in a
    # pilot (the earlier 150 steps at 1e-4, length 48, 5 tasks cost about 4x as much).
    steps: Steps = 80
    batch_size: Count = 32
    lr: PositiveReal = 2e-4
    weight_decay: NonNegativeReal = 0.1
    warmup_fraction: Probability = 0.1
    label_smoothing: Probability = 0.0
    max_length: Count = 32
    freeze_embeddings: Flag = True
    seed: NonNegativeInt = 0


# CI size: a handful of short steps (the packaged MiniLM is still loaded and trained for real).
SMOKE_TEXT_FINETUNE = TextFinetuneConfig(steps=3, batch_size=8, max_length=16)


def _trim(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Drop the padding columns that no row of the batch uses: the masked mean pooling gives the same result
    and a batch of short glosses costs a fraction of ``max_length`` (training only; evaluation keeps the
    fixed length that FSC needs)."""
    width = max(1, int(mask.sum(1).max()))
    return ids[:, :width], mask[:, :width]


def finetune_text_task(encoder_state: Mapping[str, torch.Tensor], texts: Sequence[str], labels: np.ndarray,
                       n_classes: int, config: TextFinetuneConfig = TextFinetuneConfig(), *, progress: bool = True,
                       device: str = "cpu") -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], list[dict]]:
    """Fine-tune from ``encoder_state``; returns (encoder state, head state, history). Seeded and
    deterministic on CPU; the caller's global RNG state is left unchanged."""
    if config.steps < 1 or config.batch_size < 1:
        raise ParameterError("finetune_text_task: steps and batch_size must be >= 1")
    if len(texts) != len(labels) or len(texts) == 0:
        raise ParameterError(f"finetune_text_task: {len(texts)} texts but {len(labels)} labels")
    _, tokenizer = load_encoder()
    encoded = tokenize(tokenizer, texts, config.max_length)
    targets = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        model = build_classifier(encoder_state, None, n_classes).to(device).train()
        if config.freeze_embeddings:
            model.encoder.embeddings.requires_grad_(False)
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=config.lr, weight_decay=config.weight_decay)
        warmup = int(config.warmup_fraction * config.steps)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, config.steps, warmup))
        generator = torch.Generator().manual_seed(config.seed)
        order = torch.randperm(len(targets), generator=generator)
        history, cursor = [], 0
        for step in tqdm(range(config.steps), desc="fine-tune text", unit="step", disable=not progress):
            if cursor + config.batch_size > len(order):
                order, cursor = torch.randperm(len(targets), generator=generator), 0
            idx = order[cursor:cursor + config.batch_size]
            cursor += config.batch_size
            ids, mask = _trim(encoded["input_ids"][idx], encoded["attention_mask"][idx])
            logits = model(ids.to(device), mask.to(device))
            loss = F.cross_entropy(logits, targets[idx].to(device), label_smoothing=config.label_smoothing)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            scheduler.step()
            history.append({"step": step + 1, "loss": loss.item(), "lr": scheduler.get_last_lr()[0]})
    return model.encoder_state(), model.head_state(), history


@torch.no_grad()
def classifier_logits(model: torch.nn.Module, encoded: Mapping[str, torch.Tensor], *, batch_size: int = 128,
                      device: str = "cpu") -> torch.Tensor:
    """Logits of ``model`` on tokenized inputs, in their order. Rows are batched longest first and each batch
    drops the padding columns none of its rows uses: with the attention mask and masked mean pooling the
    result is the padded computation's (up to float rounding), at the cost of the real lengths."""
    mask = encoded["attention_mask"]
    order = torch.argsort(mask.sum(1), descending=True, stable=True)
    chunks = []
    # no autograd bookkeeping; speed as no_grad within noise (evidence/scripts/perf_eval_speed.py)
    with torch.inference_mode():
        for i in range(0, len(order), batch_size):
            idx = order[i:i + batch_size]
            ids, batch_mask = _trim(encoded["input_ids"][idx], mask[idx])
            chunks.append(model(ids.to(device), batch_mask.to(device)).float().cpu())
    logits = torch.cat(chunks) if chunks else torch.empty(0)
    out = torch.empty_like(logits)
    out[order] = logits
    return out


def text_scores(logits: torch.Tensor, labels: np.ndarray, *, per_example: bool = False) -> dict[str, float]:
    """Accuracy, mean prediction entropy and ECE; with ``per_example`` also ``"correct"`` (0/1 per example)."""
    targets = torch.as_tensor(np.asarray(labels), dtype=torch.long)
    hits = logits.argmax(-1) == targets
    scores = {"accuracy": float(hits.float().mean()),
              "entropy": prediction_entropy(logits), "ece": expected_calibration_error(logits, targets)}
    if per_example:
        scores["correct"] = hits.int().tolist()
    return scores


@torch.no_grad()
def evaluate_text(encoder_state: Mapping[str, torch.Tensor], head_state: Mapping[str, torch.Tensor],
                  texts: Sequence[str], labels: np.ndarray, n_classes: int, *, max_length: int = 64,
                  batch_size: int = 128, device: str = "cpu") -> dict[str, float]:
    """Accuracy, mean prediction entropy and ECE of an encoder with a task's head."""
    model = build_classifier(encoder_state, head_state, n_classes).to(device).eval()
    _, tokenizer = load_encoder()
    encoded = tokenize(tokenizer, texts, max_length)
    return text_scores(classifier_logits(model, encoded, batch_size=batch_size, device=device), labels)
