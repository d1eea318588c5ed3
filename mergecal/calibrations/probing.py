"""MAGIC's magnitude-sensitivity probing (Sec. III-A, Eq. 10 and 17 of the MAGIC paper; docs/library.md).

On the weight-averaged model theta_0 + mean_t tau_t, scale ONE key's task-vector slice by 1.1, measure
top-1 accuracy on a generic dataset that is none of the tasks (CIFAR-100 in the paper), restore the key
exactly, and move on. Keys are ranked by that score, lowest first (the most hurt by amplification);
the first ``top`` (alpha = 10) form the magnitude-sensitive set A used by WSC and FSC.

The differences between keys are small (0.4037-0.4062 on ViT-B/32), so the probe must be deterministic:
the evaluation is the caller's (make it deterministic: fixed data order, eval mode), the ranking breaks
ties by the keys' order in the model. The result depends only on the backbone and the task set, so it is
saved as a small JSON file and reused.

The probe's own noise: when ``evaluate`` returns one score per probe example (``make_probe``), each key's
drop (baseline - perturbed mean score) gets a paired bootstrap interval over the probe examples, and the
ranking records how many of the ``top`` keys' intervals exclude 0 (``top_separated``). ``metric="nll"``
scores each example by the log-probability of its true class (the drop is the rise in NLL), a smoother
signal than MAGIC's 0/1 accuracy on a small probe set.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from scipy import stats
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import atomic_write_text
from ..errors import CheckpointError, ParameterError
from ..keys import get_key_rule


@dataclass
class SensitivityRanking:
    """Keys ranked by probe accuracy after amplifying their task-vector slice, lowest first."""

    baseline: float
    scores: list[tuple[str, float]]
    top: int = 10
    scale: float = 1.1
    metadata: dict = field(default_factory=dict)
    drops: dict[str, list[float]] = field(default_factory=dict)  # key -> [drop, low, high] (per-example probes)

    @property
    def sensitive(self) -> list[str]:
        return [key for key, _ in self.scores[: self.top]]

    @property
    def top_separated(self) -> int | None:
        """How many of the ``top`` keys' drop intervals exclude 0 (None: the probe gave no intervals)."""
        if not self.drops:
            return None
        return sum(1 for key in self.sensitive if self.drops[key][1] > 0 or self.drops[key][2] < 0)

    def to_json(self) -> str:
        return json.dumps({"baseline": self.baseline, "top": self.top, "scale": self.scale, "metadata": self.metadata,
                           "top_separated": self.top_separated, "scores": [[k, v] for k, v in self.scores],
                           "drops": self.drops}, indent=2)

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
                       top=int(data["top"]), scale=float(data["scale"]), metadata=dict(data.get("metadata", {})),
                       drops={str(k): [float(x) for x in v] for k, v in data.get("drops", {}).items()})
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


def drop_interval(baseline: np.ndarray, perturbed: np.ndarray, *, confidence: float = 0.95,
                  n_resamples: int = 2000, seed: int = 0) -> list[float]:
    """[drop, low, high]: the mean of the paired per-example differences ``baseline - perturbed`` and its
    percentile bootstrap interval over the examples (fixed ``seed``; percentile, since 0/1 accuracy
    differences are mostly 0, where BCa degenerates). Constant differences give a zero-width interval."""
    diff = np.asarray(baseline, dtype=np.float64) - np.asarray(perturbed, dtype=np.float64)
    drop = float(diff.mean())
    if np.all(diff == diff[0]):
        return [drop, drop, drop]
    ci = stats.bootstrap((diff,), np.mean, confidence_level=confidence, n_resamples=n_resamples,
                         method="percentile", random_state=seed).confidence_interval
    return [drop, float(ci.low), float(ci.high)]


def probe_candidates(live: Mapping[str, torch.Tensor], pretrained: Mapping[str, torch.Tensor],
                     key_rule: str | None) -> list[str]:
    """The float keys of the model that have a pretrained value; with ``key_rule`` (a ``mergecal.keys`` rule,
    e.g. ``wsc_weights``: MAGIC's layers) only the keys it covers."""
    rule = get_key_rule(key_rule) if key_rule is not None else None
    return [k for k, v in live.items() if v.is_floating_point() and k in pretrained
            and (rule is None or rule.matches(k, tuple(v.shape), v.dtype))]


def _mean_and_examples(result) -> tuple[float, np.ndarray | None]:
    """``evaluate``'s result: a mean score (float) or one score per example (a 1-D tensor or array)."""
    if isinstance(result, (torch.Tensor, np.ndarray)) and np.ndim(result) == 1:
        values = np.asarray(torch.as_tensor(result).double().cpu())
        return float(values.mean()), values
    return float(result), None


@torch.no_grad()
def probe_sensitivity(model: nn.Module, pretrained: Mapping[str, torch.Tensor],
                      evaluate: Callable[[nn.Module], float | torch.Tensor], *,
                      scale: float = 1.1, top: int = 10, keys: Sequence[str] | None = None,
                      key_pattern: str | None = None, key_rule: str | None = None, progress: bool = True,
                      metadata: dict | None = None, confidence: float = 0.95, seed: int = 0) -> SensitivityRanking:
    """Rank ``model``'s keys by ``evaluate(model)`` after scaling each key's task-vector slice by ``scale``.

    ``model`` holds the weight-averaged weights; ``pretrained`` is theta_0 (same key names as
    ``model.state_dict()``). Each key is modified in place and restored bit for bit before the next.
    ``evaluate`` returns a mean score, or one score per probe example: then each key's drop gets a paired
    bootstrap interval (``drop_interval``; ``confidence``, ``seed``). ``key_rule`` restricts the candidates
    (``probe_candidates``).
    """
    if top < 0:
        raise ParameterError(f"probing: parameter 'top' must be >= 0, got {top}")
    live = model.state_dict(keep_vars=True)
    chosen = select_keys(probe_candidates(live, pretrained, key_rule), keys, key_pattern)
    baseline, baseline_examples = _mean_and_examples(evaluate(model))
    scores, drops = [], {}
    for key in tqdm(chosen, desc="probing sensitivity", unit="key", disable=not progress):
        tensor = live[key]
        saved = tensor.detach().clone()
        base = pretrained[key].to(device=saved.device, dtype=torch.float32)
        scaled = base + scale * (saved.float() - base)
        try:
            tensor.data.copy_(scaled.to(saved.dtype))
            score, examples = _mean_and_examples(evaluate(model))
        finally:
            tensor.data.copy_(saved)
        scores.append((key, score))
        if baseline_examples is not None and examples is not None:
            drops[key] = drop_interval(baseline_examples, examples, confidence=confidence, seed=seed)
    order = sorted(range(len(scores)), key=lambda i: (scores[i][1], i))  # stable: ties keep model order
    return SensitivityRanking(baseline=baseline, scores=[scores[i] for i in order], top=top, scale=scale,
                              metadata=dict(metadata or {}), drops=drops)


PROBE_METRICS = ("accuracy", "nll")


def example_scores(logits: torch.Tensor, labels: torch.Tensor, metric: str) -> torch.Tensor:
    """One score per example, higher is better: 1/0 for a correct/wrong top-1 prediction (``accuracy``, MAGIC's),
    or the log-probability of the true class (``nll``: its drop is the rise in negative log-likelihood)."""
    if metric == "accuracy":
        return (logits.argmax(dim=-1) == labels).double()
    if metric == "nll":
        return torch.log_softmax(logits.double(), dim=-1).gather(-1, labels[:, None]).squeeze(-1)
    raise ParameterError(f"probing: parameter 'metric' must be one of {', '.join(PROBE_METRICS)}, got {metric!r}")


def make_probe(batches: Iterable, metric: str = "accuracy", max_samples: int | None = None,
               device: str | torch.device = "cpu") -> Callable[[nn.Module], torch.Tensor]:
    """Per-example scores (``example_scores``) of ``model(inputs)`` over ``(inputs, labels)`` batches, at most
    ``max_samples`` examples, as one float64 tensor.

    ``batches`` is re-iterated on every call and must yield the same data in the same order each time
    (a list of tensors, or a DataLoader without shuffling).
    """
    if max_samples is not None and max_samples < 1:
        raise ParameterError(f"probing: parameter 'max_samples' must be >= 1, got {max_samples}")
    example_scores(torch.zeros(1, 1), torch.zeros(1, dtype=torch.long), metric)  # an unknown metric fails here

    @torch.no_grad()
    def evaluate(model: nn.Module) -> torch.Tensor:
        was_training = model.training
        model.eval()
        out, seen = [], 0
        try:
            for inputs, labels in batches:
                if max_samples is not None and seen >= max_samples:
                    break
                if max_samples is not None:
                    inputs, labels = inputs[: max_samples - seen], labels[: max_samples - seen]
                out.append(example_scores(model(inputs.to(device)).cpu(), labels, metric))
                seen += len(labels)
        finally:
            model.train(was_training)
        if seen == 0:
            raise ParameterError("probing: the probe dataset is empty")
        return torch.cat(out)

    return evaluate


def make_accuracy_probe(batches: Iterable, max_samples: int | None = None, device: str | torch.device = "cpu"
                        ) -> Callable[[nn.Module], float]:
    """Top-1 accuracy of ``model(inputs)`` over ``(inputs, labels)`` batches (``make_probe``'s mean)."""
    probe = make_probe(batches, "accuracy", max_samples, device)
    return lambda model: float(probe(model).mean())
