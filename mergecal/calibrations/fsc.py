"""MAGIC's FSC, Feature Space Calibration, after MAGIC, Li et al., arXiv:2512.19320 (Sec. II-D,
III-B, Algorithm 1, Eq. 18-19) and the authors' code (docs/references.md, MAGIC, **FSC**; authoritative).

Measurement, for each hooked module m (see ``mergecal.feature_hooks``) and each task t with its own unlabeled
batch x_t (``n_samples_per_task`` samples, default 1):
  1. run the MERGED model on x_t; at m capture its input (args and kwargs: open_clip calls
     ``attn(x, x, x, need_weights=False, attn_mask=...)``) and its output f_m^merged(x);
  2. feed that same input to the pretrained copy of m and to task t's fine-tuned copy of m:
        Delta_merged = f_m^merged(x) - f_m^0(x),   Delta_t = f_m^t(x) - f_m^0(x);
  3. r = ||Delta_t|| / ||Delta_merged|| (L1 by default) over the feature (last) dimension, one value per
     sample and position, then averaged over the batch: one ratio per token position; one scalar for
     LayerNorms (average over everything); per output channel for conv1 (norm over spatial positions);
  4. average over the K tasks (Eq. 18; ``aggregate=t``: task t's ratio alone, the paper's target enhancement of
     Fig. 10); entries that are NaN or inf (Delta_merged = 0, e.g. the parameter-free gelu) -> 1.
With ``task_feature="network"`` (the paper's Eq. 3; steps 1-3 above, ``module_replay``, are the default)
the task feature of module m comes from whole-network runs instead: run the merged, the pretrained and task t's
fine-tuned MODEL each on x_t and capture m's output in each run,
     Delta_merged = f_m(x; theta_merged) - f_m(x; theta_0),   Delta_t = f_m(x; theta_t) - f_m(x; theta_0);
r = ||Delta_t|| / ||Delta_merged|| over everything a sample gives at m (all positions and features), averaged
over the batch: ONE scalar per module (the paper's xi^l; ``token_ratios`` does not apply); then step 4, the
conservative rule and the inference below, as for the default. A parameter-free module (gelu) gets a measured
r in this form, but f_m^0 = f_m^merged on the same input, so applying it changes nothing.
Conservative (XOR) rule per ratio entry (Eq. 19): in a magnitude-sensitive module apply r only where r < 1;
elsewhere only where r > 1; with no sensitive set (None) apply r both ways. (The authors' code instead
only clips sensitive modules to r <= 1: ``conservative="clip_sensitive"``.)

Inference: each calibrated module outputs f_m^0(x) + r * (f_m^merged(x) - f_m^0(x)). A per-token r cannot
in general be folded into weights, so those modules keep a forward hook and a pretrained copy of the module
(``FeatureCalibratedModel``). Where r is one scalar (or one value per output channel of a convolution) and
the module is affine in its parameters (nn.Linear, nn.Conv*, nn.LayerNorm; ``feature_hooks.is_affine_in_parameters``)
the same output is obtained EXACTLY (up to floating-point rounding) by folding r into the weights:
p = p0 + r (pm - p0). Modules whose applied ratio is 1 everywhere are left untouched ("identity").
Nothing here approximates: every calibrated module computes the formula above.

DSC = WSC, then FSC measured on the WSC-calibrated model: pass that model as ``merged``. DSC-A
(``data="task_agnostic"``) uses task-agnostic data: one shared batch whose consecutive chunks of
``n_samples_per_task`` samples serve the K tasks (each task still uses its own fine-tuned model).

Saved form (``save_fsc`` / ``load_fsc``): safetensors and JSON only, never pickles.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
from pydantic import ValidationError, model_serializer
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import load_state_dict, save_state_dict
from ..config_types import Count, NonNegativeInt
from ..errors import CheckpointError, IncompatibleModelsError, ParameterError, UnknownNameError
from ..feature_hooks import HookedArchitecture, ModuleSpec, is_affine_in_parameters, resolve_architecture
from ..methods.base import build_params, format_params
from ..outputs import OutputDir
from .base import CalibrationParams
from .registry import register_calibration
from .wsc import conservative as xor_rule

FORMAT = "mergecal-fsc"
VERSION = 1
CONFIG_FILE = "fsc.json"
MODEL_FILE = "model.safetensors"
PRETRAINED_FILE = "pretrained_modules.safetensors"
RATIOS_FILE = "ratios.safetensors"
RAW_RATIOS_FILE = "raw_ratios.safetensors"


class FscParams(CalibrationParams):
    """FSC hyperparameters (defaults: the paper's and the authors' code's, docs/references.md)."""

    n_samples_per_task: Count = 1  # unlabeled samples per task (paper: 1)
    norm: Literal["l1", "l2"] = "l1"  # norm over the feature dimension
    # "mean" over the K tasks (Eq. 18), or a task's index t: its ratio alone, the merged model's feature magnitude
    # matched to that specialised model's (the paper's "target enhancement", Fig. 10)
    aggregate: Literal["mean"] | NonNegativeInt = "mean"
    # "mean": one scalar per module (not the reference); task_feature="network" always gives one scalar
    token_ratios: Literal["per_token", "mean"] = "per_token"
    sensitive: list[str] | None = None  # magnitude-sensitive modules or parameter keys (from probing); None: no rule
    conservative: Literal["xor", "clip_sensitive"] = "xor"  # paper Eq. 19 / authors' code
    data: Literal["task", "task_agnostic"] = "task"  # task_agnostic (DSC-A): one shared batch may serve all tasks
    # module_replay: the authors' code (the merged model's input at each module replayed through its pretrained and
    # fine-tuned copies); network: the paper's Eq. 3 (whole-network runs, one scalar per module)
    task_feature: Literal["module_replay", "network"] = "module_replay"

    @model_serializer(mode="wrap")
    def _default_task_feature_left_out(self, handler: Callable[[Any], dict]) -> dict:
        """``task_feature`` came after the recipe ids were recorded (cache keys, run names, logged params): at its
        default it is left out of the dump, so those stay as they were; ``FscParams(**dump)`` fills it back in."""
        data = handler(self)
        if self.task_feature == "module_replay":
            del data["task_feature"]
        return data


Status = Literal["folded", "hooked", "identity"]


@dataclass
class ModuleRecord:
    """What FSC did to one module: the applied ratio (after the conservative rule), the measured one, and how."""

    spec: ModuleSpec
    status: Status
    ratio: torch.Tensor
    raw_ratio: torch.Tensor
    sensitive: bool | None = None
    module_type: str = ""


# --- measurement ---------------------------------------------------------------------------------------


def _main_tensor(output: Any) -> torch.Tensor:
    """The feature a module outputs: the tensor itself, or the first element of a tuple (MultiheadAttention)."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise ParameterError(f"fsc: a hooked module returned {type(output).__name__}, "
                         "expected a tensor or a tuple starting with one")


def feature_norms(delta: torch.Tensor, spec: ModuleSpec, norm: str) -> torch.Tensor:
    """Norm of a task feature per sample and position: over the last dimension, or for ``channel``
    granularity over the spatial positions of each channel ([N, C, *spatial] -> [N, C]); float64."""
    order = 1 if norm == "l1" else 2
    delta = delta.double()
    if spec.granularity == "channel":
        if delta.dim() < 3:
            raise ParameterError(f"fsc: module {spec.name!r} is channel-granular but returned shape "
                                 f"{tuple(delta.shape)}")
        return torch.linalg.vector_norm(delta.flatten(2), ord=order, dim=-1)
    return torch.linalg.vector_norm(delta, ord=order, dim=-1)


def batch_ratio(delta_task: torch.Tensor, delta_merged: torch.Tensor, spec: ModuleSpec,
                norm: str = "l1") -> torch.Tensor:
    """||Delta_t|| / ||Delta_merged|| per sample and position, averaged over the batch (per token / per channel),
    or over everything (``scalar``). May hold NaN or inf; float64."""
    ratio = feature_norms(delta_task, spec, norm) / feature_norms(delta_merged, spec, norm)
    if spec.granularity == "scalar" or ratio.dim() == 0:
        return ratio.mean()
    return ratio.mean(dim=0 if spec.granularity == "channel" else spec.batch_dim)


def sample_norms(delta: torch.Tensor, batch_dim: int, norm: str) -> torch.Tensor:
    """Norm of a task feature per sample over everything the sample holds (all positions and features); float64."""
    order = 1 if norm == "l1" else 2
    per_sample = delta.double().movedim(batch_dim, 0)
    return torch.linalg.vector_norm(per_sample.reshape(per_sample.shape[0], -1), ord=order, dim=-1)


def network_ratio(delta_task: torch.Tensor, delta_merged: torch.Tensor, spec: ModuleSpec,
                  norm: str = "l1") -> torch.Tensor:
    """The paper's per-task term of Eq. 18: ||Delta_t|| / ||Delta_merged|| per sample, averaged over the batch;
    one scalar. May be NaN or inf; float64."""
    return (sample_norms(delta_task, spec.batch_dim, norm) / sample_norms(delta_merged, spec.batch_dim, norm)).mean()


def _check_called_once(calls: Mapping[str, int]) -> None:
    for name, count in calls.items():
        if count != 1:
            raise ParameterError(f"fsc: module {name!r} ran {count} times in one forward pass, "
                                 "expected once (check the architecture or the run function)")


class _Capture:
    """Forward hook that keeps the feature a module outputs in one forward pass."""

    def __init__(self):
        self.calls = 0
        self.output: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple, output: Any) -> None:
        self.calls += 1
        self.output = _main_tensor(output)


def _network_features(model: nn.Module, modules: Mapping[str, nn.Module], run: Callable[[nn.Module, Any], Any],
                      batch: Any) -> dict[str, torch.Tensor]:
    """Each of ``modules`` (submodules of ``model``) output during one run of the whole ``model`` on ``batch``."""
    captures = _run_hooked(model, modules, {name: _Capture() for name in modules}, run, batch)
    return {name: capture.output for name, capture in captures.items()}


def _run_hooked(model: nn.Module, modules: Mapping[str, nn.Module], hooks: dict[str, Any],
                run: Callable[[nn.Module, Any], Any], batch: Any, with_kwargs: bool = False) -> dict[str, Any]:
    """Run ``model`` on ``batch`` with ``hooks[name]`` as a forward hook on ``modules[name]``, removed afterwards;
    each hook must have been called once (its ``calls``). Returns ``hooks``."""
    handles = [modules[name].register_forward_hook(hook, with_kwargs=with_kwargs) for name, hook in hooks.items()]
    try:
        run(model, batch)
    finally:
        for handle in handles:
            handle.remove()
    _check_called_once({name: hook.calls for name, hook in hooks.items()})
    return hooks


def _network_ratios(specs: Sequence[ModuleSpec], merged: Mapping[str, torch.Tensor], base: Mapping[str, torch.Tensor],
                    task: Mapping[str, torch.Tensor], norm: str) -> dict[str, torch.Tensor]:
    """One task's ratio per module from the outputs of whole-network runs (``task_feature="network"``)."""
    return {s.name: network_ratio(task[s.name].double() - base[s.name].double(),
                                  merged[s.name].double() - base[s.name].double(), s, norm) for s in specs}


class _Probe:
    """Forward hook (with kwargs) on a merged module: replays its input on the pretrained and fine-tuned copies."""

    def __init__(self, spec: ModuleSpec, base: nn.Module, task: nn.Module, norm: str):
        self.spec, self.base, self.task, self.norm = spec, base, task, norm
        self.calls = 0
        self.ratio: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.calls += 1
        merged = _main_tensor(output)
        base = _main_tensor(self.base(*args, **kwargs))
        task = _main_tensor(self.task(*args, **kwargs))
        self.ratio = batch_ratio(task - base, merged - base, self.spec, self.norm)


def _replay_ratios(specs: Sequence[ModuleSpec], merged: nn.Module, merged_modules: Mapping[str, nn.Module],
                   base_modules: Mapping[str, nn.Module], task_modules: Mapping[str, nn.Module],
                   run: Callable[[nn.Module, Any], Any], batch: Any, norm: str) -> dict[str, torch.Tensor]:
    """One task's ratio per module by replaying the merged model's input at each module (the authors' code)."""
    probes = {s.name: _Probe(s, base_modules[s.name], task_modules[s.name], norm) for s in specs}
    probes = _run_hooked(merged, merged_modules, probes, run, batch, with_kwargs=True)
    return {name: probe.ratio for name, probe in probes.items()}


def _num_samples(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 0
    values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for value in values:
        if isinstance(value, torch.Tensor) and value.dim():
            return value.shape[0]
    raise ParameterError(f"fsc: cannot find a batch dimension in a task input of type {type(batch).__name__}")


def _slice(batch: Any, start: int, stop: int) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[start:stop]
    if isinstance(batch, Mapping):
        return {k: _slice(v, start, stop) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_slice(v, start, stop) for v in batch)
    return batch


def _to_device(batch: Any, device: torch.device) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, Mapping):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to_device(v, device) for v in batch)
    return batch


def _task_batches(task_inputs: Sequence[Any], k: int, params: FscParams) -> list[Any]:
    """Each task's first ``n`` samples; with ``data='task_agnostic'`` one shared batch is split in K chunks of n."""
    if not isinstance(task_inputs, (list, tuple)):
        raise ParameterError(f"fsc: task_inputs must be a list with one batch per task, "
                             f"got {type(task_inputs).__name__}")
    n = params.n_samples_per_task
    if params.data == "task_agnostic" and len(task_inputs) == 1 and k > 1:
        shared = task_inputs[0]
        if _num_samples(shared) < k * n:
            raise ParameterError(f"fsc: the shared task-agnostic batch holds {_num_samples(shared)} samples; "
                                 f"{k} tasks x n_samples_per_task={n} need {k * n}")
        return [_slice(shared, t * n, (t + 1) * n) for t in range(k)]
    if len(task_inputs) != k:
        hint = " (data='task_agnostic' also accepts one shared batch)" if params.data == "task_agnostic" else ""
        raise ParameterError(f"fsc: got {len(task_inputs)} task inputs for {k} fine-tuned models{hint}")
    out = []
    for t, batch in enumerate(task_inputs):
        have = _num_samples(batch)
        if have < n:
            raise ParameterError(f"fsc: task {t} input holds {have} samples, n_samples_per_task={n}")
        out.append(_slice(batch, 0, n))
    return out


@contextmanager
def _eval_mode(*models: nn.Module):
    """Every module of ``models`` in eval mode; each module's own training flag restored afterwards."""
    states = [(m, m.training) for model in models for m in model.modules()]
    try:
        for model in models:
            model.eval()
        yield
    finally:
        for module, training in states:
            module.training = training


def _matching_module(model: nn.Module, name: str, reference: nn.Module, which: str) -> nn.Module:
    """``model``'s module ``name``, checked to have the type and parameter shapes of ``reference``."""
    try:
        module = model.get_submodule(name)
    except AttributeError:
        raise IncompatibleModelsError(f"fsc: the {which} model has no module {name!r}") from None
    if type(module) is not type(reference):
        raise IncompatibleModelsError(f"fsc: module {name!r} is {type(module).__name__} in the {which} model, "
                                      f"{type(reference).__name__} in the merged model")
    ours = {k: tuple(v.shape) for k, v in reference.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    if ours != theirs:
        key = next(k for k in sorted(set(ours) | set(theirs)) if ours.get(k) != theirs.get(k))
        raise IncompatibleModelsError(f"fsc: {name}.{key} has shape {theirs.get(key)} in the {which} model, "
                                      f"{ours.get(key)} in the merged model")
    return module


def _check_specs(specs: Sequence[ModuleSpec]) -> None:
    names = [s.name for s in specs]
    if not names:
        raise ParameterError("fsc: no module to calibrate")
    if len(set(names)) != len(names):
        raise ParameterError("fsc: a module is listed twice")
    ordered = sorted(names)
    for a, b in zip(ordered, ordered[1:]):
        if b.startswith(a + "."):
            raise ParameterError(f"fsc: hooked modules must not be nested ({a!r} contains {b!r})")
    for spec in specs:
        if spec.granularity not in ("token", "channel", "scalar"):
            raise ParameterError(f"fsc: module {spec.name!r} has unknown granularity {spec.granularity!r}")


def sensitive_flags(model: nn.Module, names: Sequence[str], sensitive: Sequence[str] | None) -> dict[str, bool | None]:
    """Whether each hooked module is magnitude-sensitive: the sensitive set may name the module itself or any of
    its parameter keys (probing ranks parameter keys; ``...attn.out_proj.weight`` marks ``...attn``). Every name
    must exist in the model; names of parameters outside the hooked modules (e.g. ``visual.proj``) mark nothing."""
    if sensitive is None:
        return {name: None for name in names}
    known = {n for n, _ in model.named_modules()} | {n for n, _ in model.named_parameters(remove_duplicate=False)}
    known |= {n for n, _ in model.named_buffers(remove_duplicate=False)}
    unknown = [s for s in sensitive if s not in known]
    if unknown:
        raise UnknownNameError(f"fsc: sensitive name {unknown[0]!r} is neither a module nor a parameter of the model")
    return {name: any(s == name or s.startswith(name + ".") for s in sensitive) for name in names}


def conservative(ratio: torch.Tensor, sensitive: bool | None, rule: str = "xor") -> torch.Tensor:
    """MAGIC's conservative rule per ratio entry. ``xor`` (Eq. 19): apply r where (r > 1) XOR sensitive;
    ``clip_sensitive`` (authors' code): sensitive modules only where r < 1, others everywhere.
    ``sensitive=None`` (no sensitive set): r everywhere."""
    if sensitive is None:
        return ratio
    if rule == "xor":
        return xor_rule(ratio, sensitive)
    if rule == "clip_sensitive":
        return torch.clamp(ratio, max=1.0) if sensitive else ratio
    raise ParameterError(f"fsc: parameter 'conservative': unknown rule {rule!r}")


@dataclass
class FscMeasurement:
    """Measured FSC ratios. ``raw_ratios``: Eq. 18 (mean over the K tasks, non-finite -> 1), before the
    conservative rule; ``per_task``: each task's batch-averaged ratios as measured (may hold NaN/inf)."""

    architecture: str
    specs: list[ModuleSpec]
    raw_ratios: dict[str, torch.Tensor]
    per_task: list[dict[str, torch.Tensor]]
    sensitive: dict[str, bool | None]
    params: FscParams

    def applied_ratios(self) -> dict[str, torch.Tensor]:
        """The ratios after the conservative rule (Eq. 19)."""
        return {s.name: conservative(self.raw_ratios[s.name], self.sensitive[s.name], self.params.conservative)
                for s in self.specs}

    def apply(self, merged: nn.Module, pretrained: nn.Module, *, fold: bool = True, copy_model: bool = True
              ) -> "FeatureCalibratedModel":
        """The calibrated model (see ``build_calibrated_model``)."""
        return build_calibrated_model(merged, pretrained, self.applied_ratios(), self.specs, raw_ratios=self.raw_ratios,
                                      sensitive=self.sensitive, fold=fold, copy_model=copy_model,
                                      architecture=self.architecture, params=self.params)


def _resolve_params(params: FscParams | None, values: dict[str, Any]) -> FscParams:
    if params is not None and values:
        raise ParameterError("fsc: pass either a Params object or keyword parameters, not both")
    return params if params is not None else build_params(FscParams, "fsc", values)


@torch.no_grad()
def measure_fsc(merged: nn.Module, pretrained: nn.Module, finetuned: Sequence[nn.Module], task_inputs: Sequence[Any], *,
                architecture: HookedArchitecture | str | Sequence[str] | None = None, params: FscParams | None = None,
                run: Callable[[nn.Module, Any], Any] | None = None, progress: bool = True,
                **values: Any) -> FscMeasurement:
    """Measure the FSC ratios of every hooked module (module docstring, steps 1-4).

    ``merged``, ``pretrained`` and each of ``finetuned`` are nn.Modules of the same architecture on the same
    device (``finetuned`` may be a lazy Sequence: item t is read once, while task t is measured);
    ``task_inputs[t]`` is task t's batch (a tensor, a mapping of tensors or a tuple, as ``run`` takes
    it; its first ``n_samples_per_task`` samples are used). ``architecture``: a registered name, an architecture, a list
    of module names, or None to detect. ``run(model, batch)`` defaults to the architecture's (open_clip:
    ``encode_image``). All models run in eval mode; their training flags are restored afterwards.
    """
    params = _resolve_params(params, values)
    fam = resolve_architecture(architecture, merged)
    specs = fam.fsc_modules(merged)
    _check_specs(specs)
    if len(finetuned) == 0:  # a Sequence: finetuned[t] is read once, in task order (it may build the model lazily)
        raise ParameterError("fsc: at least one fine-tuned model is required")
    if params.aggregate != "mean" and params.aggregate >= len(finetuned):
        raise ParameterError(f"fsc: parameter 'aggregate'={params.aggregate} names a task index; there are "
                             f"{len(finetuned)} tasks (0-{len(finetuned) - 1})")
    batches = _task_batches(task_inputs, len(finetuned), params)
    flags = sensitive_flags(merged, [s.name for s in specs], params.sensitive)
    merged_modules = {s.name: merged.get_submodule(s.name) for s in specs}
    base_modules = {n: _matching_module(pretrained, n, m, "pretrained") for n, m in merged_modules.items()}
    run = run or fam.run
    device = next((p.device for p in merged.parameters()), torch.device("cpu"))

    per_task: list[dict[str, torch.Tensor]] = []
    with _eval_mode(merged, pretrained):
        for t in tqdm(range(len(finetuned)), desc="fsc: measuring task features", unit="task", disable=not progress):
            task_model = finetuned[t]
            task_modules = {n: _matching_module(task_model, n, m, f"fine-tuned #{t}")
                            for n, m in merged_modules.items()}
            batch = _to_device(batches[t], device)
            with _eval_mode(task_model):
                if params.task_feature == "network":
                    outputs = [_network_features(model, modules, run, batch) for model, modules in
                               ((merged, merged_modules), (pretrained, base_modules), (task_model, task_modules))]
                    per_task.append(_network_ratios(specs, *outputs, params.norm))
                else:
                    per_task.append(_replay_ratios(specs, merged, merged_modules, base_modules, task_modules, run,
                                                   batch, params.norm))

    raw: dict[str, torch.Tensor] = {}
    for spec in specs:
        ratios = [task[spec.name] for task in per_task]
        if params.token_ratios == "mean" and spec.granularity == "token":
            ratios = [r.mean() for r in ratios]
        shapes = {tuple(r.shape) for r in ratios}
        if len(shapes) != 1:
            raise ParameterError(f"fsc: module {spec.name!r} gave ratios of different shapes across tasks "
                                 f"{sorted(shapes)}; per-token ratios need inputs of one sequence length "
                                 "(pad them) or token_ratios='mean'")
        combined = torch.stack(ratios).mean(dim=0) if params.aggregate == "mean" else ratios[params.aggregate]
        raw[spec.name] = torch.where(torch.isfinite(combined), combined, torch.ones_like(combined)).float()
    return FscMeasurement(architecture=fam.name, specs=list(specs), raw_ratios=raw, per_task=per_task, sensitive=flags,
                          params=params)


# --- the calibrated model ------------------------------------------------------------------------------


def _broadcast_ratio(ratio: torch.Tensor, out: torch.Tensor, spec: ModuleSpec) -> torch.Tensor:
    """``ratio`` shaped to multiply ``out``: per token, the batch and feature dims are inserted;
    per channel [1, C, 1..]."""
    ratio = ratio.to(device=out.device, dtype=out.dtype)
    if ratio.dim() == 0:
        return ratio
    if spec.granularity == "channel":
        expected = tuple(out.shape[1:2])
    else:
        b = spec.batch_dim
        expected = tuple(out.shape[:b]) + tuple(out.shape[b + 1:-1])
    if tuple(ratio.shape) != expected:
        raise ParameterError(f"fsc: module {spec.name!r} was calibrated for positions {tuple(ratio.shape)} "
                             f"but its output {tuple(out.shape)} has {expected}; use inputs of the calibration's "
                             "sequence length (pad them) or calibrate with token_ratios='mean'")
    if spec.granularity == "channel":
        return ratio.view(1, -1, *([1] * (out.dim() - 2)))
    return ratio.unsqueeze(spec.batch_dim).unsqueeze(-1)


class _Site(nn.Module):
    """A hooked module's pretrained copy and ratio; ``hook`` makes the merged module output f0 + r (fm - f0)."""

    def __init__(self, spec: ModuleSpec, pretrained_module: nn.Module, ratio: torch.Tensor):
        super().__init__()
        self.spec = spec
        self.pretrained = pretrained_module.requires_grad_(False)
        self.register_buffer("ratio", ratio.detach().clone().float())

    def hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        merged = _main_tensor(output)
        base = _main_tensor(self.pretrained(*args, **kwargs))
        calibrated = base + _broadcast_ratio(self.ratio, merged, self.spec) * (merged - base)
        if isinstance(output, torch.Tensor):
            return calibrated
        return type(output)((calibrated, *output[1:]))


class FeatureCalibratedModel(nn.Module):
    """The merged model with FSC applied (docs/references.md, MAGIC **FSC**).

    ``model`` is the merged model whose ``folded`` modules already hold p0 + r (pm - p0) and whose
    ``hooked`` modules carry a forward hook computing f0(x) + r (fm(x) - f0(x)) with a pretrained copy
    of the module; ``identity`` modules (applied ratio 1 everywhere) are unchanged. ``forward`` calls the
    merged model; other attributes (e.g. ``encode_image``) are looked up on it. ``records`` maps each
    module name to its ``ModuleRecord``. Build it with ``calibrate_fsc`` or ``build_calibrated_model``.
    """

    def __init__(self, model: nn.Module, records: Sequence[ModuleRecord], pretrained_modules: Mapping[str, nn.Module],
                 *, architecture: str = "", params: FscParams | None = None):
        super().__init__()
        self.model = model
        self.records: dict[str, ModuleRecord] = {r.spec.name: r for r in records}
        self.architecture = architecture
        self.params = params
        self.sites = nn.ModuleDict()
        for i, record in enumerate(r for r in records if r.status == "hooked"):
            if record.spec.name not in pretrained_modules:
                raise ParameterError(f"fsc: hooked module {record.spec.name!r} has no pretrained copy")
            site = _Site(record.spec, pretrained_modules[record.spec.name], record.ratio)
            self.sites[f"site{i}"] = site
            model.get_submodule(record.spec.name).register_forward_hook(site.hook, with_kwargs=True)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.model(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(super().__getattr__("model"), name)

    def _names(self, status: str) -> list[str]:
        return [name for name, record in self.records.items() if record.status == status]

    @property
    def folded(self) -> list[str]:
        return self._names("folded")

    @property
    def hooked(self) -> list[str]:
        return self._names("hooked")

    @property
    def identity(self) -> list[str]:
        return self._names("identity")

    @property
    def ratios(self) -> dict[str, torch.Tensor]:
        """Applied ratios (after the conservative rule), by module name."""
        return {name: record.ratio for name, record in self.records.items()}

    def pretrained_module(self, name: str) -> nn.Module:
        """The pretrained copy held for a hooked module."""
        for site in self.sites.values():
            if site.spec.name == name:
                return site.pretrained
        raise KeyError(name)


def _shared_parameter_ids(model: nn.Module) -> set[int]:
    counts: dict[int, int] = {}
    for _, p in model.named_parameters(remove_duplicate=False):
        counts[id(p)] = counts.get(id(p), 0) + 1
    return {pid for pid, n in counts.items() if n > 1}


def can_fold(module: nn.Module, ratio: torch.Tensor, spec: ModuleSpec, shared: set[int] = frozenset()) -> bool:
    """Whether f0 + r (fm - f0) equals the module with p0 + r (pm - p0) exactly: an affine-in-parameters type,
    a scalar r (or per output channel of a non-transposed convolution), and no parameter shared elsewhere."""
    params = list(module.parameters(recurse=False))
    if not params or not is_affine_in_parameters(module) or any(id(p) in shared for p in params):
        return False
    if list(module.children()):
        return False
    if ratio.dim() == 0:
        return True
    return (spec.granularity == "channel" and ratio.dim() == 1 and isinstance(module, nn.modules.conv._ConvNd)
            and not module.transposed and ratio.numel() == module.out_channels)


@torch.no_grad()
def fold_ratio(module: nn.Module, pretrained_module: nn.Module, ratio: torch.Tensor) -> None:
    """In place: every parameter p of ``module`` becomes p0 + r (p - p0) (r per output channel when 1-D), in float64."""
    for name, param in module.named_parameters(recurse=False):
        p0 = pretrained_module.get_parameter(name).double().to(param.device)
        r = ratio.double().to(param.device)
        if r.dim() == 1:
            r = r.view(-1, *([1] * (param.dim() - 1)))
        param.copy_((p0 + r * (param.double() - p0)).to(param.dtype))


def build_calibrated_model(merged: nn.Module, pretrained: nn.Module, ratios: Mapping[str, torch.Tensor],
                           specs: Sequence[ModuleSpec], *, raw_ratios: Mapping[str, torch.Tensor] | None = None,
                           sensitive: Mapping[str, bool | None] | None = None, fold: bool = True,
                           skip_identity: bool = True, copy_model: bool = True, architecture: str = "",
                           params: FscParams | None = None) -> FeatureCalibratedModel:
    """Apply given (already conservative-ruled) ``ratios`` to ``merged``.

    Per module: ratio 1 everywhere and ``skip_identity`` -> unchanged; foldable (``can_fold``) and ``fold``
    -> weights p0 + r (pm - p0); otherwise a hook with a pretrained copy. ``copy_model=False`` modifies
    ``merged`` in place (folded weights, hooks).
    """
    _check_specs(specs)
    missing = [s.name for s in specs if s.name not in ratios]
    if missing:
        raise ParameterError(f"fsc: no ratio given for module {missing[0]!r}")
    model = copy.deepcopy(merged) if copy_model else merged
    shared = _shared_parameter_ids(model)
    records, pretrained_modules = [], {}
    for spec in specs:
        module = model.get_submodule(spec.name)
        base = _matching_module(pretrained, spec.name, module, "pretrained")
        ratio = torch.as_tensor(ratios[spec.name]).detach().float().cpu()
        if not torch.isfinite(ratio).all():
            raise ParameterError(f"fsc: the ratio for module {spec.name!r} is not finite")
        if skip_identity and bool((ratio == 1).all()):
            status = "identity"
        elif fold and can_fold(module, ratio, spec, shared):
            status = "folded"
            fold_ratio(module, base, ratio)
        else:
            status = "hooked"
            device = next((p.device for p in module.parameters()), None)
            pretrained_modules[spec.name] = (copy.deepcopy(base).to(device) if device is not None
                                             else copy.deepcopy(base))
        raw = raw_ratios[spec.name] if raw_ratios is not None else ratio
        records.append(ModuleRecord(spec=spec, status=status, ratio=ratio, raw_ratio=torch.as_tensor(raw).float().cpu(),
                                    sensitive=(sensitive or {}).get(spec.name), module_type=type(module).__name__))
    return FeatureCalibratedModel(model, records, pretrained_modules, architecture=architecture, params=params)


@register_calibration("fsc", phase="feature", needs_data=True)
class Fsc:
    """FSC as a configured calibration step (``name``/``Params``/``id`` like the weight-space calibrations)."""

    name: ClassVar[str] = "fsc"
    Params: ClassVar[type[FscParams]] = FscParams

    def __init__(self, params: FscParams | None = None, **values: Any):
        self.params = _resolve_params(params, values)

    @property
    def id(self) -> str:
        return f"{self.name}({format_params(self.params)})"

    def measure(self, merged, pretrained, finetuned, task_inputs, **kwargs) -> FscMeasurement:
        return measure_fsc(merged, pretrained, finetuned, task_inputs, params=self.params, **kwargs)

    def calibrate(self, merged, pretrained, finetuned, task_inputs, *, fold: bool = True, copy_model: bool = True,
                  **kwargs) -> FeatureCalibratedModel:
        return self.measure(merged, pretrained, finetuned, task_inputs, **kwargs).apply(
            merged, pretrained, fold=fold, copy_model=copy_model)

    @staticmethod
    def run_step(params: FscParams, merged: nn.Module, pretrained: nn.Module, finetuned: Sequence[nn.Module],
                 task_inputs: Sequence[Any], **kwargs: Any) -> tuple[FeatureCalibratedModel, dict[str, Any]]:
        """A recipe's FSC step (the registry's ``run``: ``mergecal.run_recipe``, the CLIP cells' session): the
        calibrated model (``calibrate_fsc``; ``kwargs`` its options) and the step's diagnostics."""
        model = calibrate_fsc(merged, pretrained, finetuned, task_inputs, params=params, **kwargs)
        return model, {"ratios": model.ratios, "folded": model.folded, "hooked": model.hooked,
                       "identity": model.identity}


def calibrate_fsc(merged: nn.Module, pretrained: nn.Module, finetuned: Sequence[nn.Module],
                  task_inputs: Sequence[Any], *,
                  architecture: HookedArchitecture | str | Sequence[str] | None = None, params: FscParams | None = None,
                  fold: bool = True, copy_model: bool = True, run: Callable[[nn.Module, Any], Any] | None = None,
                  progress: bool = True, **values: Any) -> FeatureCalibratedModel:
    """Measure FSC ratios (``measure_fsc``), apply the conservative rule, and return the calibrated model.
    ``merged`` is deep-copied unless ``copy_model=False``; parameters as ``FscParams`` or keywords."""
    measurement = measure_fsc(merged, pretrained, finetuned, task_inputs, architecture=architecture, params=params,
                              run=run, progress=progress, **values)
    return measurement.apply(merged, pretrained, fold=fold, copy_model=copy_model)


# --- save / load ---------------------------------------------------------------------------------------


def save_fsc(model: FeatureCalibratedModel, directory: str | Path, *, overwrite: bool = False) -> Path:
    """Write ``model`` as a directory: merged weights (folds applied), the pretrained copies of the hooked
    modules, the applied and raw ratios (safetensors) and ``fsc.json`` (modules, status, architecture, shapes,
    params). Written in a staging directory that then replaces ``directory``; a directory that mergecal did
    not write is replaced only with ``overwrite=True`` (``mergecal.outputs``)."""
    if not isinstance(model, FeatureCalibratedModel):
        raise ParameterError(f"fsc: save_fsc expects a FeatureCalibratedModel, got {type(model).__name__}")
    directory = Path(directory)
    meta = {"format": FORMAT}
    with OutputDir(directory, overwrite=overwrite) as staging:
        save_state_dict({k: v.detach().clone() for k, v in model.model.state_dict().items()},
                        staging / MODEL_FILE, meta)
        pretrained = {}
        for site in model.sites.values():
            for key, value in site.pretrained.state_dict().items():
                pretrained[f"{site.spec.name}.{key}"] = value.detach().clone()
        save_state_dict(pretrained, staging / PRETRAINED_FILE, meta)
        save_state_dict({n: r.ratio for n, r in model.records.items()}, staging / RATIOS_FILE, meta)
        save_state_dict({n: r.raw_ratio for n, r in model.records.items()}, staging / RAW_RATIOS_FILE, meta)
        config = {
            "format": FORMAT, "version": VERSION, "architecture": model.architecture,
            "params": model.params.model_dump() if model.params is not None else None,
            "exact": True,  # every calibrated module computes f0 + r (fm - f0); nothing is approximated
            "files": {"model": MODEL_FILE, "pretrained_modules": PRETRAINED_FILE, "ratios": RATIOS_FILE,
                      "raw_ratios": RAW_RATIOS_FILE},
            "modules": [{"name": n, "status": r.status, "granularity": r.spec.granularity,
                         "batch_dim": r.spec.batch_dim, "ratio_shape": list(r.ratio.shape), "sensitive": r.sensitive,
                         "module_type": r.module_type}
                        for n, r in model.records.items()],
        }
        (staging / CONFIG_FILE).write_text(json.dumps(config, indent=2))
    return directory


def _read_config(directory: Path) -> dict:
    path = directory / CONFIG_FILE
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: FSC model config not found") from None
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{path}: not JSON ({err})") from None
    if not isinstance(config, dict) or config.get("format") != FORMAT:
        raise CheckpointError(f"{path}: not a {FORMAT} config")
    if config.get("version") != VERSION:
        raise CheckpointError(f"{path}: unsupported {FORMAT} version {config.get('version')!r} (expected {VERSION})")
    return config


def _load_into(module: nn.Module, state: Mapping[str, torch.Tensor], where: str) -> None:
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(state)), sorted(set(state) - expected)
    if missing or unexpected:
        what = f"missing key {missing[0]!r}" if missing else f"unexpected key {unexpected[0]!r}"
        raise CheckpointError(f"{where}: does not fit the model from build_model ({what})")
    try:
        module.load_state_dict(state, strict=True)
    except RuntimeError as err:
        last = str(err).strip().splitlines()[-1].strip()
        raise CheckpointError(f"{where}: does not fit the model from build_model ({last})") from None


def load_fsc(directory: str | Path, build_model: Callable[[], nn.Module] | nn.Module) -> FeatureCalibratedModel:
    """Rebuild a ``save_fsc`` directory. ``build_model()`` returns a model of the saved architecture (its weights
    are overwritten; an nn.Module is used as is). Returns the calibrated model in eval mode, giving the saved
    model's outputs. Reads only safetensors and JSON."""
    directory = Path(directory)
    config = _read_config(directory)
    model = build_model if isinstance(build_model, nn.Module) else build_model()
    if not isinstance(model, nn.Module):
        raise ParameterError(f"fsc: build_model returned {type(model).__name__}, expected an nn.Module")
    _load_into(model, load_state_dict(directory / MODEL_FILE), str(directory / MODEL_FILE))
    ratios = load_state_dict(directory / RATIOS_FILE)
    raw = load_state_dict(directory / RAW_RATIOS_FILE)
    stored = load_state_dict(directory / PRETRAINED_FILE)
    try:
        params = FscParams(**config["params"]) if config.get("params") is not None else None
        entries = [(e["name"], e["status"], ModuleSpec(e["name"], e["granularity"], int(e["batch_dim"])),
                    e.get("sensitive"), e.get("module_type", "")) for e in config["modules"]]
    except (KeyError, TypeError, ValueError, ValidationError) as err:
        first = str(err).splitlines()[0]
        raise CheckpointError(f"{directory / CONFIG_FILE}: malformed ({type(err).__name__}: {first})") from None
    records, pretrained_modules = [], {}
    for name, status, spec, sensitive, module_type in entries:
        if status not in ("folded", "hooked", "identity") or name not in ratios:
            raise CheckpointError(f"{directory}: module {name!r} has status {status!r} or no stored ratio")
        try:
            module = model.get_submodule(name)
        except AttributeError:
            raise CheckpointError(f"{directory}: module {name!r} is not in the model from build_model") from None
        if status == "hooked":
            copy_ = copy.deepcopy(module)
            prefix = name + "."
            _load_into(copy_, {k[len(prefix):]: v for k, v in stored.items() if k.startswith(prefix)},
                       f"{directory / PRETRAINED_FILE} ({name})")
            pretrained_modules[name] = copy_
        records.append(ModuleRecord(spec=spec, status=status, ratio=ratios[name], raw_ratio=raw.get(name, ratios[name]),
                                    sensitive=sensitive, module_type=module_type))
    architecture = config.get("architecture", config.get("family", ""))  # "family": written before #57
    return FeatureCalibratedModel(model, records, pretrained_modules, architecture=architecture, params=params).eval()
