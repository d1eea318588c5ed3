"""AdaMerging (Yang et al., "AdaMerging: Adaptive Model Merging for Multi-Task Learning", ICLR 2024,
arXiv:2310.02575): task arithmetic whose coefficients are learned by minimising the entropy of the merged model's
predictions on unlabelled inputs of each task (the paper uses the test split's images; which inputs is the caller's
choice of ``batches``).

    theta[key] = theta_0[key] + sum_k c_k[key] tau_k[key]       task-wise: c_k shared by all keys (K numbers)
                                                               layer-wise: one per task and merged key (K x L)
    loss = sum_k mean_{x in B_k} H(softmax(logits(f(x; theta), k)))   B_k: a batch of task k's inputs

Defaults are the authors' code's, the paper's runs (EnnengYang/AdaMerging, src/main_*_wise_adamerging.py): c = 0.3 at
the start, Adam at lr 1e-3 (betas 0.9, 0.999), 500 steps, 16 inputs per task and step, coefficients clamped to
[0, 1] where they are used (Adam moves the raw ones, as in both codes). FusionBench 0.2.33's
config/method/adamerging/clip.yaml runs 1000 steps and sets ``clamp_weights: false``. FusionBench's "layer" is each
parameter tensor, as here. Conventions, where the sources differ (docs/library.md, "AdaMerging"):

- the entropy is exact, -sum softmax * log_softmax (authors' code); FusionBench takes log(p + 1e-8);
- one batch of ``batch_size`` per task and step (FusionBench); the authors' code draws two batches of 16
  (its ``if i > 0: break``), a loss twice ours at batch_size=32, which Adam all but ignores (it is scale-free);
- the tasks are added in order, ((theta_0 + c_1 tau_1) + c_2 tau_2) + ..., as in FusionBench and the authors' code;
- the model runs in eval mode (no dropout, BatchNorm on theta_0's statistics); FusionBench calls ``train()``, the
  same for CLIP's ViTs (dropout 0);
- one backward per task, the gradients accumulated (FusionBench's order): one task's activations live at a time.

Cost: per step, K forward + backward passes of ``batch_size`` inputs through the model, and one merge of the merged
keys (K multiply-adds a weight) with its backward; memory: float32 theta_0 and K task vectors of the merged keys,
the merged weights and their graph, one task's activations. Deterministic on CPU for a given seed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import torch
from pydantic import ValidationError
from torch import nn
from torch.func import functional_call
from tqdm.auto import tqdm

from .config_types import Count
from .errors import ParameterError
from .methods.adamerging_settings import AdaMergingSettings
from .task_vectors import check_finite

StateDict = Mapping[str, torch.Tensor]


class AdaMergingConfig(AdaMergingSettings):
    """``AdaMergingSettings`` (the learning's settings and defaults, shared with the merge methods);
    ``granularity``: "layer" (one coefficient per task and merged key, the paper's best) or "task"; ``log_every``:
    per-task entropies go into the history every that many steps (and at the first and last). A bad value is a
    one-line ParameterError naming the field."""

    OWNER: ClassVar[str] = "adamerging"

    granularity: Literal["task", "layer"] = "layer"
    log_every: Count = 10

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as err:  # pydantic's message is several lines; ours names the field on one
            first = err.errors()[0]
            name = ".".join(str(p) for p in first["loc"])
            if first["type"] == "extra_forbidden":
                raise ParameterError(f"adamerging: unknown parameter {name!r}; allowed: "
                                     f"{', '.join(type(self).model_fields)}") from None
            raise ParameterError(f"adamerging: parameter {name!r}: {first['msg']} "
                                 f"(got {first.get('input')!r})") from None


@dataclass(frozen=True)
class AdaMergingResult:
    """``state``: ``pretrained`` with the merged keys replaced (their dtypes and devices); ``coefficients``: the ones
    the merge used (clamped if ``clamp``), float32 on the CPU, (K,) or (K, len(keys)); ``keys``: the merged keys, in
    the columns' order; ``history``: per step ``{"step", "loss"}`` (the loss before that step's update), with
    ``"entropy"`` (per task) at logged steps."""

    state: dict[str, torch.Tensor]
    coefficients: torch.Tensor
    keys: list[str]
    history: list[dict[str, Any]] = field(default_factory=list)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Mean Shannon entropy (nats) of the softmax of (batch, classes) logits, computed in float32."""
    z = logits.float()
    return -(z.softmax(-1) * z.log_softmax(-1)).sum(-1).mean()


def merge_with_coefficients(pretrained: StateDict, task_vectors: Sequence[StateDict], coefficients: torch.Tensor,
                            keys: Sequence[str], clamp: bool = True) -> dict[str, torch.Tensor]:
    """theta_0 + sum_k c_k tau_k on ``keys`` (float32, tasks added in order); ``coefficients`` (K,) or (K, len(keys)),
    clamped to [0, 1] first if ``clamp``. Differentiable in the coefficients."""
    c = coefficients.clamp(0, 1) if clamp else coefficients
    out = {}
    for i, key in enumerate(keys):
        merged = pretrained[key].float()
        for k, tau in enumerate(task_vectors):
            merged = merged + tau[key].float() * (c[k] if c.dim() == 1 else c[k, i])
        out[key] = merged
    return out


def _stream(source: Any, batch_size: int, seed: int, task: int) -> Iterator[torch.Tensor]:
    """Endless batches of one task's inputs: a tensor is cut into ``batch_size`` batches in a seeded order, a new
    permutation per pass (a shuffled DataLoader's epochs); an iterable of batches is cycled as it comes. Labels of
    (inputs, labels) batches are dropped: AdaMerging uses none."""
    if isinstance(source, torch.Tensor):
        if source.dim() == 0 or source.shape[0] == 0:
            raise ParameterError(f"adamerging: parameter 'batches': task {task}'s inputs are empty")
        generator = torch.Generator().manual_seed((seed << 20) + task)  # one stream per task, the same every run
        while True:
            order = torch.randperm(source.shape[0], generator=generator)
            for start in range(0, len(order), batch_size):
                yield source[order[start:start + batch_size]]
    if not isinstance(source, Iterable):
        raise ParameterError(f"adamerging: parameter 'batches': task {task} gives {type(source).__name__}, "
                             "expected a tensor of inputs or an iterable of batches")
    passes = 0
    while True:
        seen = 0
        for batch in source:
            batch = batch[0] if isinstance(batch, (tuple, list)) and batch else batch
            if not isinstance(batch, torch.Tensor) or batch.dim() == 0 or batch.shape[0] == 0:
                raise ParameterError(f"adamerging: parameter 'batches': task {task} yielded "
                                     f"{type(batch).__name__} that is not a non-empty tensor batch")
            seen += 1
            yield batch
        if seen == 0:
            raise ParameterError(f"adamerging: parameter 'batches': task {task} "
                                 + ("yielded no batch" if passes == 0 else "was exhausted after one pass"))
        passes += 1


def _merged_keys(model: nn.Module, pretrained: StateDict, task_vectors: Sequence[StateDict],
                 keys: Sequence[str] | None, tensors: Mapping[str, torch.Tensor]) -> list[str]:
    """``keys``, or the model's floating parameters that require grad and the task vectors hold (FusionBench's
    layers); each checked against theta_0, every task vector and the model."""
    if keys is None:
        keys = [n for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()
                and n in task_vectors[0]]
    keys = list(keys)
    if not keys:
        raise ParameterError("adamerging: parameter 'keys': no key to merge")
    for key in keys:
        if key not in tensors or key not in pretrained:
            raise ParameterError(f"adamerging: parameter 'keys': {key!r} is not "
                                 + ("a parameter or buffer of the model" if key not in tensors else "in pretrained"))
        if not pretrained[key].is_floating_point():
            raise ParameterError(f"adamerging: parameter 'keys': {key!r} is not floating point")
        for k, tau in enumerate(task_vectors):
            if key not in tau or tau[key].shape != pretrained[key].shape:
                raise ParameterError(f"adamerging: task vector {k} has " + (
                    f"no key {key!r}" if key not in tau else
                    f"{key!r} of shape {tuple(tau[key].shape)}, pretrained {tuple(pretrained[key].shape)}"))
            check_finite(tau[key], key, f"task vector {k}")
    return keys


def adamerging(model: nn.Module, pretrained: StateDict, task_vectors: Sequence[StateDict], batches: Sequence[Any],
               config: AdaMergingConfig | Mapping[str, Any] | None = None, *,
               logits: Callable[[Any, int], torch.Tensor] | None = None, keys: Sequence[str] | None = None,
               progress: bool = False) -> AdaMergingResult:
    """Learn AdaMerging's coefficients and merge (see the module docstring).

    ``model``: the architecture, on the device to compute on; it runs through ``torch.func.functional_call`` on
    theta_0 (``pretrained``, the entries it holds) with ``keys`` merged, its own tensors elsewhere, never changed.
    ``task_vectors``: K mappings tau_k = theta_k - theta_0. ``batches[k]``: task k's unlabelled inputs, a tensor
    (shuffled with ``config.seed`` into batches of ``config.batch_size``) or an iterable of batches (cycled; a
    DataLoader's own shuffling is then the caller's to seed). ``logits(output, k)``: task k's (batch, classes)
    logits from the model's output (e.g. a CLIP image embedding against task k's zero-shot head; default: the
    output itself). ``keys``: the keys merged (default: see ``_merged_keys``); others stay theta_0."""
    config = config if isinstance(config, AdaMergingConfig) else AdaMergingConfig(**dict(config or {}))
    K = len(task_vectors)
    if K == 0 or len(batches) != K:
        raise ParameterError(f"adamerging: parameter 'batches': {len(batches)} task(s) of inputs for {K} task "
                             "vector(s); give one per task vector, at least one")
    logits = logits if logits is not None else (lambda output, task: output)
    own = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    keys = _merged_keys(model, pretrained, task_vectors, keys, own)
    device = next(iter(own.values())).device if own else torch.device("cpu")
    # the forward's tensors: theta_0 where it has them, else the model's own, in the model's dtypes, no gradients
    fixed = {n: (pretrained[n] if n in pretrained else t).detach().to(device=device, dtype=t.dtype)
             for n, t in own.items()}
    base = {k: pretrained[k].detach().to(device=device, dtype=torch.float32) for k in keys}
    taus = [{k: tau[k].detach().to(device=device, dtype=torch.float32) for k in keys} for tau in task_vectors]
    shape = (K,) if config.granularity == "task" else (K, len(keys))
    raw = torch.full(shape, config.init, dtype=torch.float32, device=device, requires_grad=True)
    optimizer = torch.optim.Adam([raw], lr=config.lr)

    history: list[dict[str, Any]] = []
    was_training = model.training
    model.eval()
    accelerator = device.type != "cpu"
    try:
        with torch.random.fork_rng(devices=[device] if accelerator else [],
                                   device_type=device.type if accelerator else "cuda"):
            torch.manual_seed(config.seed)  # anything random in the model's forward: seeded, not leaked
            streams = [_stream(b, config.batch_size, config.seed, k) for k, b in enumerate(batches)]
            for step in tqdm(range(1, config.steps + 1), desc="adamerging", unit="step", disable=not progress):
                merged = merge_with_coefficients(base, taus, raw, keys, config.clamp)
                params = {**fixed, **{k: merged[k].to(fixed[k].dtype) for k in keys}}
                entropies = []
                for k in range(K):
                    z = logits(functional_call(model, params, (next(streams[k]).to(device),)), k)
                    if not isinstance(z, torch.Tensor) or z.dim() != 2:
                        raise ParameterError(f"adamerging: parameter 'logits' gave {getattr(z, 'shape', type(z))} "
                                             f"for task {k}; expected (batch, classes)")
                    h = entropy(z)
                    h.backward(retain_graph=k < K - 1)  # the merge's graph serves every task of the step
                    entropies.append(float(h.detach()))
                optimizer.step()
                optimizer.zero_grad()
                record: dict[str, Any] = {"step": step, "loss": sum(entropies)}
                if step == 1 or step % config.log_every == 0 or step == config.steps:
                    record["entropy"] = entropies
                history.append(record)
    finally:
        model.train(was_training)

    with torch.no_grad():
        coefficients = (raw.clamp(0, 1) if config.clamp else raw).detach()
        merged = merge_with_coefficients(base, taus, coefficients, keys, clamp=False)
    state = {k: (merged[k] if k in merged else v).detach().to(device=v.device, dtype=v.dtype).clone()
             for k, v in pretrained.items()}
    return AdaMergingResult(state, coefficients.cpu(), keys, history)
