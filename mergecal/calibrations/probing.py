"""MAGIC's magnitude-sensitivity probing (Sec. III-A, Eq. 10 and 17 of the MAGIC paper).

On the weight-averaged model theta_0 + mean_t tau_t, scale ONE key's task-vector slice by 1.1, measure
top-1 accuracy on a generic dataset that is none of the tasks (CIFAR-100 in the paper), restore the key
exactly, and move on. Keys are ranked by that accuracy, lowest first (the most hurt by amplification);
the first ``top`` (alpha = 10) form the magnitude-sensitive set A used by WSC and FSC.

The differences between keys are small (0.4037-0.4062 on ViT-B/32), so the probe must be deterministic:
the evaluation is the caller's (make it deterministic: fixed data order, eval mode), the ranking breaks
ties by the keys' order in the model. The result depends only on the backbone and the task set, so it is
saved as a small JSON file and reused.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import atomic_write_text
from ..errors import CheckpointError, ParameterError


@dataclass
class SensitivityRanking:
    """Keys ranked by probe accuracy after amplifying their task-vector slice, lowest first."""

    baseline: float
    scores: list[tuple[str, float]]
    top: int = 10
    scale: float = 1.1
    metadata: dict = field(default_factory=dict)

    @property
    def sensitive(self) -> list[str]:
        return [key for key, _ in self.scores[: self.top]]

    def to_json(self) -> str:
        return json.dumps({"baseline": self.baseline, "top": self.top, "scale": self.scale, "metadata": self.metadata,
                           "scores": [[k, v] for k, v in self.scores]}, indent=2)

    def save(self, path: str | Path) -> Path:
        return atomic_write_text(path, self.to_json())

    @classmethod
    def load_or_compute(cls, path: str | Path, compute: Callable[[], "SensitivityRanking"]) -> "SensitivityRanking":
        """The ranking cached at ``path`` (one file per backbone and task set), computed and saved if absent."""
        if Path(path).exists():
            return cls.load(path)
        ranking = compute()
        ranking.save(path)
        return ranking

    @classmethod
    def load(cls, path: str | Path) -> "SensitivityRanking":
        try:
            data = json.loads(Path(path).read_text())
            return cls(baseline=float(data["baseline"]), scores=[(str(k), float(v)) for k, v in data["scores"]],
                       top=int(data["top"]), scale=float(data["scale"]), metadata=dict(data.get("metadata", {})))
        except FileNotFoundError:
            raise CheckpointError(f"{path}: sensitivity ranking not found") from None
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise CheckpointError(f"{path}: not a sensitivity ranking ({err})") from None


def select_keys(candidates: Sequence[str], keys: Sequence[str] | None = None, pattern: str | None = None) -> list[str]:
    """``candidates`` restricted to ``keys`` and/or a regular expression, in model order."""
    chosen = list(candidates)
    if keys is not None:
        unknown = sorted(set(keys) - set(candidates))
        if unknown:
            raise ParameterError(f"probing: parameter 'keys' names {unknown[0]!r}, "
                                 "which is not a float parameter of the model")
        wanted = set(keys)
        chosen = [k for k in chosen if k in wanted]
    if pattern is not None:
        try:
            regex = re.compile(pattern)
        except re.error as err:
            raise ParameterError(f"probing: parameter 'key_pattern' {pattern!r} "
                                 f"is not a regular expression: {err}") from None
        chosen = [k for k in chosen if regex.search(k)]
    if not chosen:
        raise ParameterError("probing: no parameter key matches the given 'keys' / 'key_pattern'")
    return chosen


@torch.no_grad()
def probe_sensitivity(model: nn.Module, pretrained: Mapping[str, torch.Tensor],
                      evaluate: Callable[[nn.Module], float], *,
                      scale: float = 1.1, top: int = 10, keys: Sequence[str] | None = None,
                      key_pattern: str | None = None, progress: bool = True,
                      metadata: dict | None = None) -> SensitivityRanking:
    """Rank ``model``'s keys by ``evaluate(model)`` after scaling each key's task-vector slice by ``scale``.

    ``model`` holds the weight-averaged weights; ``pretrained`` is theta_0 (same key names as
    ``model.state_dict()``). Each key is modified in place and restored bit for bit before the next.
    """
    if top < 0:
        raise ParameterError(f"probing: parameter 'top' must be >= 0, got {top}")
    live = model.state_dict(keep_vars=True)
    candidates = [k for k, v in live.items() if v.is_floating_point() and k in pretrained]
    chosen = select_keys(candidates, keys, key_pattern)
    baseline = float(evaluate(model))
    scores = []
    for key in tqdm(chosen, desc="probing sensitivity", unit="key", disable=not progress):
        tensor = live[key]
        saved = tensor.detach().clone()
        base = pretrained[key].to(device=saved.device, dtype=torch.float32)
        scaled = base + scale * (saved.float() - base)
        try:
            tensor.data.copy_(scaled.to(saved.dtype))
            scores.append((key, float(evaluate(model))))
        finally:
            tensor.data.copy_(saved)
    order = sorted(range(len(scores)), key=lambda i: (scores[i][1], i))  # stable: ties keep model order
    return SensitivityRanking(baseline=baseline, scores=[scores[i] for i in order], top=top, scale=scale,
                              metadata=dict(metadata or {}))


def make_accuracy_probe(batches: Iterable, max_samples: int | None = None, device: str | torch.device = "cpu"
                        ) -> Callable[[nn.Module], float]:
    """Top-1 accuracy of ``model(inputs)`` over ``(inputs, labels)`` batches, at most ``max_samples`` examples.

    ``batches`` is re-iterated on every call and must yield the same data in the same order each time
    (a list of tensors, or a DataLoader without shuffling).
    """
    if max_samples is not None and max_samples < 1:
        raise ParameterError(f"probing: parameter 'max_samples' must be >= 1, got {max_samples}")

    @torch.no_grad()
    def evaluate(model: nn.Module) -> float:
        was_training = model.training
        model.eval()
        correct = seen = 0
        try:
            for inputs, labels in batches:
                if max_samples is not None and seen >= max_samples:
                    break
                if max_samples is not None:
                    inputs, labels = inputs[: max_samples - seen], labels[: max_samples - seen]
                logits = model(inputs.to(device))
                correct += int((logits.argmax(dim=-1).cpu() == labels).sum())
                seen += len(labels)
        finally:
            model.train(was_training)
        if seen == 0:
            raise ParameterError("probing: the probe dataset is empty")
        return correct / seen

    return evaluate
