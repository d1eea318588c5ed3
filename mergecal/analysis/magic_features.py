"""The data of MAGIC's analysis figures ("MAGIC: Achieving Superior Model Merging via Magnitude Calibration", Li et
al., arXiv:2512.19320): Fig. 1 (``feature_projection``), Fig. 3 (``magnitude_ratios``), Fig. 4 (``layer_swap_gain``),
Fig. 5 (``task_sensitivity``) and Fig. 9 (``fsc_coefficients``), each as a JSON-able dict (lists of floats and
names; a non-finite number is written as None). No plotting here.

Common inputs. ``clip``: an open_clip CLIP (or a zero-argument factory returning one) of the architecture of the
state dicts; its own weights do not matter: a copy is made and the given weights are loaded into it
(``mergecal.backbones.clip_checkpoints.load_visual``). ``pretrained``: theta_0's image-encoder state dict
(``visual.*`` keys, as in the model's ``state_dict()``); ``finetuned``: the K fine-tuned image encoders in the same
keys (task t's specialised model is theta_t = theta_0 + tau_t); ``task_images``: one preprocessed image batch per
task; ``merged``: a merged image encoder's state dict (``merge_visual`` makes one with a registered merge method)
or, where said, a model. A layer is a module name (``visual.transformer.resblocks.1.mlp.c_fc``); its weights are the
state-dict entries under that name (an attention's in_proj and out_proj together). By default the layers are the
modules MAGIC's FSC hooks (``mergecal.feature_hooks``) that have weights.

Task feature, the paper's Eq. 3: Delta h^l_theta(x) = f^l(x; theta) - f^l(x; theta_0), the output of layer l when
the whole network with weights theta runs on x, minus that layer's output in the whole pretrained network (hooks
from ``mergecal.calibrations.fsc``, the forward pass of the architecture: ``encode_image``). Its magnitude is a norm
per sample over everything the sample gives at the layer (all token positions and features), as FSC's
``task_feature="network"`` measures it (``mergecal.calibrations.fsc.sample_norms``). The merges are the library's
(``mergecal.merge``, ``mergecal.methods.MERGE_METHODS``), the probe ``mergecal.calibrations.probing`` and FSC's
coefficient ``mergecal.calibrations.fsc.measure_fsc``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np
import scipy.linalg
import torch
from scipy import stats
from torch import nn

from ..backbones.clip_checkpoints import load_visual
from ..calibrations.fsc import (FscParams, _eval_mode, _main_tensor, _network_features, _run_hooked, measure_fsc,
                                sample_norms)
from ..calibrations.probing import make_probe, probe_sensitivity
from ..errors import ParameterError
from ..feature_hooks import HookedArchitecture, ModuleSpec, resolve_architecture
from ..merge import merge_models, merge_task_vectors
from ..methods import MERGE_METHODS
from ..task_vectors import TaskVectorSet, apply_task_vector, task_vector

ModelSource = nn.Module | Callable[[], nn.Module]
StateDict = Mapping[str, torch.Tensor]
Architecture = HookedArchitecture | str | Sequence[str] | None
Norm = Literal["l1", "l2"]


# --- helpers ----------------------------------------------------------------------------------------------------------


def _finite(value: float) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _json(value: Any) -> Any:
    """Nested lists of Python floats (None for NaN / inf) from a tensor, an array or nested sequences of numbers."""
    if isinstance(value, (torch.Tensor, np.ndarray)):
        value = np.asarray(torch.as_tensor(value).detach().double().cpu()).tolist()
    if isinstance(value, (list, tuple)):
        return [_json(v) for v in value]
    return _finite(value)


def _task_names(task_names: Sequence[str] | None, k: int) -> list[str]:
    if task_names is None:
        return [f"task{t}" for t in range(k)]
    names = [str(n) for n in task_names]
    if len(names) != k:
        raise ParameterError(f"task_names: expected {k} names (one per fine-tuned model), got {len(names)}")
    return names


def _check_tasks(finetuned: Sequence[StateDict], task_images: Sequence[torch.Tensor] | None) -> int:
    if isinstance(finetuned, Mapping) or len(finetuned) == 0:
        raise ParameterError("finetuned: expected a list of at least one image-encoder state dict")
    if task_images is not None:
        if len(task_images) != len(finetuned):
            raise ParameterError(f"task_images: expected {len(finetuned)} batches (one per task), "
                                 f"got {len(task_images)}")
        for t, images in enumerate(task_images):
            if not isinstance(images, torch.Tensor) or images.dim() == 0 or images.shape[0] == 0:
                raise ParameterError(f"task_images[{t}]: expected a non-empty batch tensor")
    return len(finetuned)


def _new_model(clip: ModelSource) -> nn.Module:
    model = copy.deepcopy(clip) if isinstance(clip, nn.Module) else clip()
    if not isinstance(model, nn.Module):
        raise ParameterError(f"clip: the factory returned {type(model).__name__}, expected an nn.Module")
    return model.eval()


def _load(model: nn.Module, state: StateDict, what: str) -> nn.Module:
    own = model.state_dict()
    unknown = [k for k in state if k not in own]
    if unknown:
        raise ParameterError(f"{what}: key {unknown[0]!r} is not a parameter of the model")
    load_visual(model, state.items())
    return model


def _device(model: nn.Module) -> torch.device:
    return next((p.device for p in model.parameters()), torch.device("cpu"))


def _submodule(model: nn.Module, name: str) -> nn.Module:
    try:
        return model.get_submodule(name)
    except AttributeError:
        raise ParameterError(f"layer {name!r} is not a module of the model") from None


def _layer_keys(state: StateDict, layer: str) -> list[str]:
    return [k for k in state if k.startswith(layer + ".") and state[k].is_floating_point()]


def _weight_layers(fam: HookedArchitecture, model: nn.Module, state: StateDict) -> list[str]:
    """The modules FSC hooks that have weights in ``state`` (a parameter-free gelu has none), in model order."""
    return [s.name for s in fam.fsc_modules(model) if _layer_keys(state, s.name)]


def _batch_dims(fam: HookedArchitecture, model: nn.Module, layers: Sequence[str]) -> dict[str, int]:
    """Where each layer's output holds the batch: the architecture's spec of that module, else of the first hooked
    module inside it (a residual block's output is laid out as its sub-modules'), else 0."""
    specs = fam.fsc_modules(model)
    dims = {}
    for name in layers:
        _submodule(model, name)
        found = [s for s in specs if s.name == name] or [s for s in specs if s.name.startswith(name + ".")]
        dims[name] = (found or [ModuleSpec(name)])[0].batch_dim
    return dims


def _check_layers(layers: str | Sequence[str] | None, what: str) -> list[str] | None:
    if layers is None:
        return None
    names = [layers] if isinstance(layers, str) else list(layers)
    if not names or len(set(names)) != len(names):
        raise ParameterError(f"{what}: expected distinct layer names, got {names!r}")
    return names


@torch.no_grad()
def _features(model: nn.Module, fam: HookedArchitecture, dims: Mapping[str, int], images: torch.Tensor
              ) -> dict[str, torch.Tensor]:
    """Each layer's output when the whole ``model`` runs on ``images``, batch first, float64 [N, ...]."""
    modules = {name: _submodule(model, name) for name in dims}
    with _eval_mode(model):
        out = _network_features(model, modules, fam.run, images.to(_device(model)))
    return {name: out[name].movedim(dims[name], 0).double() for name in dims}


def _norms(delta: torch.Tensor, norm: Norm) -> torch.Tensor:
    """Per-sample norm of a batch-first task feature over everything the sample holds (float64 [N])."""
    return sample_norms(delta, 0, norm)


def _weight_norm(tensors: Iterable[torch.Tensor], norm: Norm) -> float:
    flat = torch.cat([t.detach().double().reshape(-1).cpu() for t in tensors])
    return float(torch.linalg.vector_norm(flat, ord=1 if norm == "l1" else 2))


def merge_visual(pretrained: StateDict, finetuned: Sequence[StateDict], method: str, **params: Any
                 ) -> dict[str, torch.Tensor]:
    """theta_0 + the merged task vector of ``method`` (a ``mergecal.methods.MERGE_METHODS`` name, with its
    hyperparameters as keywords) over the image-encoder keys: ``mergecal.merge.merge_models``."""
    return merge_models(pretrained, list(finetuned), method, **params)


# --- Fig. 1 -----------------------------------------------------------------------------------------------------------


def _named_merges(merged: Any) -> dict[str, StateDict | nn.Module]:
    """One merged model (a state dict or a module) as ``{"merged": it}``; a mapping of names to them as it is."""
    if isinstance(merged, nn.Module):
        return {"merged": merged}
    if isinstance(merged, Mapping) and merged and all(isinstance(v, torch.Tensor) for v in merged.values()):
        return {"merged": merged}
    if isinstance(merged, Mapping) and merged and all(isinstance(v, (Mapping, nn.Module)) for v in merged.values()):
        names = [str(n) for n in merged]
        if "specialised" in names:
            raise ParameterError("merged: the name 'specialised' is taken by the fine-tuned models")
        return {str(n): m for n, m in merged.items()}
    raise ParameterError("merged: expected a state dict, a model, or a mapping of names to state dicts / models")


def _top_components(x: torch.Tensor, center: bool) -> tuple[torch.Tensor, torch.Tensor, list[float]]:
    """The 2-D PCA of the rows of ``x`` (float64): (projections [M, 2], components [D, 2], explained ratios).
    Exact (eigendecomposition of the smaller Gram matrix), deterministic; each component's sign makes its largest
    loading positive. Without ``center`` the best 2-D subspace through the origin (a truncated SVD)."""
    x = x.detach().double().cpu()
    if center:
        x = x - x.mean(dim=0, keepdim=True)
    m, d = x.shape
    total = float(x.pow(2).sum())
    gram = (x.T @ x) if d <= m else (x @ x.T)
    n = gram.shape[0]
    values, vectors = scipy.linalg.eigh(gram.numpy(), subset_by_index=[max(0, n - 2), n - 1])
    top = torch.from_numpy(values[::-1].copy())
    vectors = torch.from_numpy(vectors[:, ::-1].copy())
    if d <= m:
        components = vectors
    else:
        components = x.T @ vectors
        components = components / torch.linalg.vector_norm(components, dim=0).clamp(min=1e-300)
    if components.shape[1] < 2:  # one row or one feature: pad with a zero component
        components = torch.cat([components, torch.zeros(d, 2 - components.shape[1], dtype=x.dtype)], dim=1)
        top = torch.cat([top, torch.zeros(2 - top.shape[0], dtype=x.dtype)])
    signs = torch.sign(components.gather(0, components.abs().argmax(dim=0, keepdim=True))).squeeze(0)
    components = components * torch.where(signs == 0, torch.ones_like(signs), signs)
    ratios = [float(v) / total if total > 0 else float("nan") for v in top.clamp(min=0)]
    return x @ components, components, ratios


def feature_projection(clip: ModelSource, pretrained: StateDict, finetuned: Sequence[StateDict], merged: Any,
                       task_images: Sequence[torch.Tensor], layer: str, *, feature: Literal["task", "raw"] = "task",
                       center: bool = False, norm: Norm = "l2", task_names: Sequence[str] | None = None,
                       architecture: Architecture = None) -> dict[str, Any]:
    """Fig. 1: the merged model's and the specialised models' features at ``layer`` on each task's images,
    projected to 2-D, with their magnitudes.

    For task t and each of its N images x: the merged model's feature and the specialised model theta_t's feature
    (the paper's optimal reference), each the task feature Delta h^l(x) of Eq. 3 (``feature="task"``; the paper's
    magnitude deviation, Sec. II-B, is between task features) or the layer output f^l(x; theta) itself
    (``feature="raw"``), flattened over positions and features. The paper says only "projected onto two dimensions":
    this is PCA (exact, deterministic), fitted on all points together, by default without centring (the best 2-D
    subspace through the origin, where the pretrained feature sits, so projected lengths never exceed the true ones
    and angles to the origin are kept as well as 2-D allows). ``merged``: a state dict or a model (a calibrated one,
    say), or a mapping of names to them (TA, Iso-C, ... side by side).

    Returns ``points[model][t][n] = [x, y]`` and ``magnitudes[model][t][n]`` (the ``norm`` of the full feature), for
    each merged model's name and ``"specialised"``; per merged model ``cosine[name][t][n]`` (to the specialised
    feature, full dimension) and ``magnitude_ratio[name][t]`` = mean_n ||merged|| / ||specialised||;
    ``explained_variance_ratio`` of the two components (share of the total sum of squares).
    """
    k = _check_tasks(finetuned, task_images)
    names = _task_names(task_names, k)
    if feature not in ("task", "raw"):
        raise ParameterError(f"feature: expected 'task' or 'raw', got {feature!r}")
    merges = _named_merges(merged)
    work = _new_model(clip)
    fam = resolve_architecture(architecture, work)
    dims = _batch_dims(fam, work, [layer])

    def run(source: StateDict | nn.Module, images: torch.Tensor, what: str) -> torch.Tensor:
        if isinstance(source, nn.Module):
            model_dims = _batch_dims(resolve_architecture(architecture, source), source, [layer])
            return _features(source, fam, model_dims, images)[layer]
        return _features(_load(work, source, what), fam, dims, images)[layer]

    vectors: dict[str, list[torch.Tensor]] = {name: [] for name in [*merges, "specialised"]}
    for t in range(k):
        x = task_images[t]
        base = run(pretrained, x, "pretrained") if feature == "task" else 0.0
        for name, source in merges.items():
            vectors[name].append((run(source, x, f"merged[{name}]") - base).flatten(1))
        vectors["specialised"].append((run(finetuned[t], x, f"finetuned[{t}]") - base).flatten(1))
    order = [(name, t) for name in vectors for t in range(k)]
    stacked = torch.cat([vectors[name][t] for name, t in order])
    projected, _, explained = _top_components(stacked, center)
    points: dict[str, list] = {name: [None] * k for name in vectors}
    start = 0
    for name, t in order:
        n = vectors[name][t].shape[0]
        points[name][t] = _json(projected[start:start + n])
        start += n
    magnitudes = {name: [_json(_norms(v, norm)) for v in vs] for name, vs in vectors.items()}
    cosine, ratio = {}, {}
    for name in merges:
        cosine[name] = [_json(torch.nn.functional.cosine_similarity(m, s, dim=1))
                        for m, s in zip(vectors[name], vectors["specialised"])]
        ratio[name] = [_finite((_norms(m, norm) / _norms(s, norm)).mean())
                       for m, s in zip(vectors[name], vectors["specialised"])]
    return {"figure": "MAGIC Fig. 1", "layer": layer, "feature": feature, "projection": "pca",
            "centered": center, "norm": norm, "tasks": names, "models": list(vectors),
            "explained_variance_ratio": _json(explained), "points": points, "magnitudes": magnitudes,
            "cosine": cosine, "magnitude_ratio": ratio}


# --- Fig. 3 -----------------------------------------------------------------------------------------------------------


def default_operations(k: int, top_k: float = 0.2) -> dict[str, dict[str, Any]]:
    """Fig. 3's magnitude-altering operations (Sec. II-B-1), each a registered merge method with its parameters:
    ``trim``: TIES' top-k trim of ONE task vector (TIES on K = 1 keeps its top ``top_k`` magnitudes over the whole
    encoder, ``per_task``); ``sum``: Task Arithmetic at lambda = 1/K, the arithmetic mean of Eq. 4 and Fig. 2(b);
    ``disjoint``: TIES' sign election and disjoint mean without trimming (top_k = 1)."""
    return {"trim": {"method": "ties", "params": {"top_k": top_k, "scaling": 1.0}, "per_task": True},
            "sum": {"method": "task_arithmetic", "params": {"scaling": 1.0 / k}, "per_task": False},
            "disjoint": {"method": "ties", "params": {"top_k": 1.0, "scaling": 1.0}, "per_task": False}}


def _operation_updates(pretrained: StateDict, finetuned: Sequence[StateDict], spec: Mapping[str, Any], name: str
                       ) -> list[dict[str, torch.Tensor]]:
    """The operation's task vector(s): one per task (``per_task``: the method on that task's vector alone) or one
    shared by every task (the method over the K task vectors)."""
    unknown = set(spec) - {"method", "params", "per_task"}
    if unknown or "method" not in spec:
        raise ParameterError(f"operations[{name!r}]: expected keys method, params, per_task")
    method = spec["method"]
    if method not in MERGE_METHODS:
        raise ParameterError(f"operations[{name!r}]: unknown merge method {method!r}; "
                             f"choose one of: {', '.join(sorted(MERGE_METHODS))}")
    params = dict(spec.get("params") or {})
    if spec.get("per_task", False):
        return [merge_task_vectors(TaskVectorSet.from_models(pretrained, [ft]), method, **params) for ft in finetuned]
    shared = merge_task_vectors(TaskVectorSet.from_models(pretrained, list(finetuned)), method, **params)
    return [shared] * len(finetuned)


def magnitude_ratios(clip: ModelSource, pretrained: StateDict, finetuned: Sequence[StateDict],
                     task_images: Sequence[torch.Tensor], *, layers: Sequence[str] | None = None,
                     operations: Mapping[str, Mapping[str, Any]] | None = None, top_k: float = 0.2,
                     norm: Norm = "l1", weight_norm: Norm = "l2", task_names: Sequence[str] | None = None,
                     architecture: Architecture = None) -> dict[str, Any]:
    """Fig. 3: per layer and task, the weight-space against the feature-space magnitude ratio of an operation.

    "Each point represents the ratio between the modified magnitude after the operation and the original magnitude
    before the operation" (Fig. 3). For operation o (``default_operations``: trim, sum, disjoint; or ``operations``,
    name -> {method, params, per_task}) with task vector tau_o (per task for trim, shared for a fusion), layer l and
    task i, on task i's N images x:
      weight_ratio[o][l][i]  = ||tau_o^l|| / ||tau_i^l||                      (``weight_norm``, Eq. 4's L_p norm)
      feature_ratio[o][l][i] = mean_n ||Delta h^l_{theta_0 + tau_o}(x_n)|| / ||Delta h^l_{theta_i}(x_n)||  (Eq. 3)
    i.e. the specialised model theta_i = theta_0 + tau_i is "before" and theta_0 + tau_o "after". ``layer_mean``
    averages each over the tasks. The default layers are the FSC modules with weights.
    """
    k = _check_tasks(finetuned, task_images)
    names = _task_names(task_names, k)
    ops = dict(operations) if operations is not None else default_operations(k, top_k)
    if not ops:
        raise ParameterError("operations: at least one operation is required")
    work = _new_model(clip)
    fam = resolve_architecture(architecture, work)
    layers = _check_layers(layers, "layers") or _weight_layers(fam, work, pretrained)
    keys = {layer: _layer_keys(pretrained, layer) for layer in layers}
    empty = [layer for layer, ks in keys.items() if not ks]
    if empty:
        raise ParameterError(f"layers: {empty[0]!r} has no weights in the state dicts (no weight ratio)")
    dims = _batch_dims(fam, work, layers)
    taus = [task_vector(ft, pretrained) for ft in finetuned]
    updates = {name: _operation_updates(pretrained, finetuned, spec, name) for name, spec in ops.items()}
    states = {name: {} for name in ops}  # a shared update's model is built once
    weight = {name: torch.full((len(layers), k), float("nan"), dtype=torch.float64) for name in ops}
    feature = {name: torch.full((len(layers), k), float("nan"), dtype=torch.float64) for name in ops}
    for i in range(k):
        x = task_images[i]
        h0 = _features(_load(work, pretrained, "pretrained"), fam, dims, x)
        hi = _features(_load(work, finetuned[i], f"finetuned[{i}]"), fam, dims, x)
        before = {layer: _norms(hi[layer] - h0[layer], norm) for layer in layers}
        tau_norm = [_weight_norm((taus[i][key] for key in keys[layer]), weight_norm) for layer in layers]
        for name in ops:
            update = updates[name][i]
            if id(update) not in states[name]:
                states[name] = {id(update): apply_task_vector(pretrained, update)}
            h = _features(_load(work, states[name][id(update)], f"operations[{name!r}]"), fam, dims, x)
            for row, layer in enumerate(layers):
                weight[name][row, i] = _weight_norm((update[key] for key in keys[layer]), weight_norm) / tau_norm[row]
                feature[name][row, i] = (_norms(h[layer] - h0[layer], norm) / before[layer]).mean()
    return {"figure": "MAGIC Fig. 3", "layers": layers, "tasks": names, "norm": norm, "weight_norm": weight_norm,
            "operations": {name: {"method": spec["method"], "params": dict(spec.get("params") or {}),
                                  "per_task": bool(spec.get("per_task", False)),
                                  "weight_ratio": _json(weight[name]), "feature_ratio": _json(feature[name]),
                                  "layer_mean": {"weight_ratio": _json(weight[name].mean(dim=1)),
                                                 "feature_ratio": _json(feature[name].mean(dim=1))}}
                           for name, spec in ops.items()}}


# --- Fig. 4 -----------------------------------------------------------------------------------------------------------


class _Replay:
    """Forward hook (with kwargs) keeping what a module was called with and what it returned, in one pass (for
    ``mergecal.calibrations.fsc._run_hooked``, which registers, counts and removes it)."""

    def __init__(self):
        self.calls = 0
        self.args: tuple = ()
        self.kwargs: dict = {}
        self.output: torch.Tensor | None = None

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.calls += 1
        self.args, self.kwargs, self.output = args, kwargs, _main_tensor(output)


def layer_swap_gain(clip: ModelSource, pretrained: StateDict, finetuned: Sequence[StateDict], merged: StateDict,
                    task_images: Sequence[torch.Tensor], layers: str | Sequence[str] | None = None, *,
                    norm: Norm = "l1", task_names: Sequence[str] | None = None,
                    architecture: Architecture = None) -> dict[str, Any]:
    """Fig. 4: the task-feature magnitude gained at layer l when the merged model's task vector of that layer is
    replaced by a specialised model's (weight disentanglement, Lemma 1).

    "The data in the i-th row and j-th column represents the increase in the task feature, measured by L1 norm,
    resulting from substituting Delta theta_j^l for Delta theta_merge^l during inference on task i" (Fig. 4). The
    swapped model is the merged one with every weight of layer l set to theta_j's (theta_0^l + tau_j^l); the task
    features are Eq. 3's at layer l's output; on task i's N images x_n:
      gain[i][j]  = mean_n ( ||Delta h^l_swap(j)(x_n)|| - ||Delta h^l_merged(x_n)|| )     (``norm``, L1 as the paper)
      ratio[i][j] = mean_n ||Delta h^l_swap(j)(x_n)|| / ||Delta h^l_merged(x_n)||
    and ``merged_magnitude[i]`` = mean_n ||Delta h^l_merged(x_n)||. Per layer (default: the FSC modules with
    weights) a K x K matrix, rows the inference task, columns the substituted task vector. Everything before layer l
    is the merged model's, so the swapped model's layer-l output is layer l with theta_j's weights called on what
    the merged model feeds it: each task runs the merged and the pretrained network once, whatever L and K.
    """
    k = _check_tasks(finetuned, task_images)
    names = _task_names(task_names, k)
    work = _load(_new_model(clip), merged, "merged")
    fam = resolve_architecture(architecture, work)
    layers = _check_layers(layers, "layers") or _weight_layers(fam, work, pretrained)
    dims = _batch_dims(fam, work, layers)
    base = _load(_new_model(clip), pretrained, "pretrained")
    merged_modules = {layer: _submodule(work, layer) for layer in layers}
    swapped = {layer: copy.deepcopy(module).eval() for layer, module in merged_modules.items()}
    local = {}  # layer -> [(state-dict key, the key inside the layer's module)]
    for layer in layers:
        keys = _layer_keys(pretrained, layer)
        if not keys:
            raise ParameterError(f"layers: {layer!r} has no weights in the state dicts (nothing to swap)")
        local[layer] = [(key, key[len(layer) + 1:]) for key in keys]
    gain = {layer: torch.full((k, k), float("nan"), dtype=torch.float64) for layer in layers}
    ratio = {layer: torch.full((k, k), float("nan"), dtype=torch.float64) for layer in layers}
    magnitude = {layer: [None] * k for layer in layers}
    with torch.no_grad():
        for i, x in enumerate(task_images):
            h0 = _features(base, fam, dims, x)
            with _eval_mode(work):
                seen = _run_hooked(work, merged_modules, {layer: _Replay() for layer in layers}, fam.run,
                                   x.to(_device(work)), with_kwargs=True)
            for layer in layers:
                replay = seen[layer]
                before = _norms(replay.output.movedim(dims[layer], 0).double() - h0[layer], norm)
                magnitude[layer][i] = _finite(before.mean())
                module, own = swapped[layer], swapped[layer].state_dict()
                for j in range(k):
                    for key, name in local[layer]:
                        own[name].copy_(finetuned[j][key])
                    out = _main_tensor(module(*replay.args, **replay.kwargs))
                    after = _norms(out.movedim(dims[layer], 0).double() - h0[layer], norm)
                    gain[layer][i, j] = (after - before).mean()
                    ratio[layer][i, j] = (after / before).mean()
    out = {layer: {"gain": _json(gain[layer]), "ratio": _json(ratio[layer]), "merged_magnitude": magnitude[layer]}
           for layer in layers}
    return {"figure": "MAGIC Fig. 4", "layers": layers, "tasks": names, "norm": norm, "rows": "inference task",
            "columns": "substituted task vector", "swaps": out}


# --- Fig. 5 -----------------------------------------------------------------------------------------------------------


class _ZeroShot(nn.Module):
    """A CLIP as a classifier: ``logit_scale * normalize(encode_image(x)) @ head``."""

    def __init__(self, model: nn.Module, head: torch.Tensor):
        super().__init__()
        self.model = model
        self.register_buffer("head", head)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        from ..backbones.open_clip_vit import logits

        return logits(self.model, self.head, images)


def clip_probe(head: torch.Tensor, batches: Iterable, metric: str = "accuracy", max_samples: int | None = None,
               device: str | torch.device = "cpu") -> Callable[[nn.Module], torch.Tensor]:
    """An ``evaluate`` for ``task_sensitivity``: per-example scores (``mergecal.calibrations.probing.make_probe``) of a
    CLIP's zero-shot logits with the class embeddings ``head`` [embed_dim, C] over ``(images, labels)`` batches (a
    generic data set such as CIFAR-100 in the paper; re-iterable, in a fixed order)."""
    probe = make_probe(batches, metric, max_samples, device)

    def evaluate(model: nn.Module) -> torch.Tensor:
        return probe(_ZeroShot(model, head.detach().to(_device(model))))

    return evaluate


def _jaccard(a: set[str], b: set[str]) -> float:
    union = a | b
    return len(a & b) / len(union) if union else 1.0


def task_sensitivity(clip: ModelSource, pretrained: StateDict, finetuned: Sequence[StateDict],
                     evaluate: Callable[[nn.Module], Any] | Sequence[Callable[[nn.Module], Any]], *,
                     scale: float = 1.1, top: int = 10, keys: Sequence[str] | None = None,
                     key_pattern: str | None = None, key_rule: str | None = None,
                     task_names: Sequence[str] | None = None, seed: int = 0) -> dict[str, Any]:
    """Fig. 5: the layer sensitivity s_t^l of each specialised model's task vector, and how far the tasks agree.

    For each task t, on the specialised model theta_0 + tau_t, ``mergecal.calibrations.probing.probe_sensitivity``
    scales one key's task vector by ``scale`` (Eq. 9 and Theorem 1: (1 + epsilon) = 1.1, the paper's setting),
    scores the model with ``evaluate`` (one shared probe, e.g. ``clip_probe`` on CIFAR-100 as in the paper, or one
    per task), restores the key, and moves on. Per task and key (model order, ``keys``):
      score[t][key]       = P(perturbed)                         (mean of ``evaluate``)
      sensitivity[t][key] = P(perturbed) - P(theta_t)             (Eq. 10; negative: amplifying the key hurts)
      sensitive[t]        = the ``top`` lowest-scoring keys (the probe's ranking, ties in model order)
    Agreement between tasks a, b (the paper: "the same layers across different task vectors behave similarly"):
      jaccard[a][b]  = |sensitive[a] & sensitive[b]| / |sensitive[a] | sensitive[b]|  (1 on the diagonal)
      spearman[a][b] = Spearman's rank correlation of sensitivity[a] and sensitivity[b] over the keys (None when
                       one of them is constant).
    ``drop_interval[t][key]`` = [drop, low, high] when ``evaluate`` returns per-example scores (else None).
    Candidate keys: the float keys of ``pretrained`` (restricted by ``keys``, ``key_pattern``, ``key_rule``).
    """
    k = _check_tasks(finetuned, None)
    names = _task_names(task_names, k)
    if callable(evaluate):
        evaluators = [evaluate] * k
    else:
        evaluators = list(evaluate)
        if len(evaluators) != k or not all(callable(e) for e in evaluators):
            raise ParameterError(f"evaluate: expected one callable or {k} (one per task)")
    work = _new_model(clip)
    rankings = []
    for t in range(k):
        _load(work, finetuned[t], f"finetuned[{t}]")
        rankings.append(probe_sensitivity(work, pretrained, evaluators[t], scale=scale, top=top, keys=keys,
                                          key_pattern=key_pattern, key_rule=key_rule, progress=False, seed=seed,
                                          metadata={"task": names[t]}))
    probed = {key for key, _ in rankings[0].scores}
    order = [key for key in work.state_dict() if key in probed]
    by_key = [dict(r.scores) for r in rankings]
    scores = np.array([[s[key] for key in order] for s in by_key], dtype=np.float64)
    baselines = np.array([r.baseline for r in rankings], dtype=np.float64)
    sensitivity = scores - baselines[:, None]
    sets = [set(r.sensitive) for r in rankings]
    jaccard = [[_jaccard(a, b) for b in sets] for a in sets]
    with np.errstate(invalid="ignore", divide="ignore"):
        ranks = stats.rankdata(sensitivity, axis=1)
        spearman = np.corrcoef(ranks) if len(order) > 1 else np.full((k, k), np.nan)
    spearman = np.atleast_2d(spearman)
    intervals = [[r.drops[key] for key in order] if r.drops else None for r in rankings]
    return {"figure": "MAGIC Fig. 5", "tasks": names, "keys": order, "scale": scale, "top": top,
            "baseline": _json(baselines), "score": _json(scores), "sensitivity": _json(sensitivity),
            "sensitive": [r.sensitive for r in rankings], "jaccard": _json(jaccard), "spearman": _json(spearman),
            "drop_interval": [_json(i) if i is not None else None for i in intervals],
            "top_separated": [r.top_separated for r in rankings]}


# --- Fig. 9 -----------------------------------------------------------------------------------------------------------


def _restricted(fam: HookedArchitecture, model: nn.Module, layers: Sequence[str]) -> HookedArchitecture:
    """``fam`` hooking only ``layers`` (which must be among the modules FSC hooks)."""
    hooked = fam.fsc_module_names(model)
    missing = [layer for layer in layers if layer not in hooked]
    if missing:
        raise ParameterError(f"layers: {missing[0]!r} is not a module FSC hooks; choose among: {', '.join(hooked)}")
    wanted = set(layers)
    return dataclasses.replace(fam, fsc_modules=lambda m: [s for s in fam.fsc_modules(m) if s.name in wanted])


def fsc_coefficients(clip: ModelSource, pretrained: StateDict, finetuned: Sequence[StateDict],
                     merged: StateDict | nn.Module, task_images: Sequence[torch.Tensor], layers: str | Sequence[str],
                     *, params: FscParams | None = None, per_position: bool = False,
                     task_names: Sequence[str] | None = None, architecture: Architecture = None) -> dict[str, Any]:
    """Fig. 9: FSC's calibration coefficient xi of a layer, per task and per sample.

    xi for task t and its n-th image is FSC's per-task ratio (Eq. 16 / the summand of Eq. 18,
    ||Delta h_t^l(x)|| / ||Delta h_merge^l(x)||) measured by ``mergecal.calibrations.fsc.measure_fsc`` on that one
    image (``n_samples_per_task = 1``), with task t's fine-tuned model: its ``per_task`` ratio for the layer. FSC's
    default measures one ratio per token position (per channel for conv1; module replay, the authors' code);
    ``xi[t][n]`` is its mean over the positions (with ``params.task_feature="network"`` it is already one scalar),
    ``positions[t][n]`` the ratios themselves (``per_position``). Also ``task_mean[t]`` = mean_n xi[t][n] and ``mean``
    = mean_t task_mean[t], Eq. 18's coefficient as a scalar (before the conservative rule). ``params``: FSC's
    (norm, task_feature); its sample count, data and sensitive set are set here. ``merged``: a state dict or a model.
    """
    k = _check_tasks(finetuned, task_images)
    names = _task_names(task_names, k)
    layers = _check_layers(layers, "layers")
    if not layers:
        raise ParameterError("layers: name at least one layer")
    params = (params or FscParams()).model_copy(update={"n_samples_per_task": 1, "data": "task", "sensitive": None})
    merged_model = merged if isinstance(merged, nn.Module) else _load(_new_model(clip), merged, "merged")
    fam = _restricted(resolve_architecture(architecture, merged_model), merged_model, layers)
    base = _load(_new_model(clip), pretrained, "pretrained")
    task_model = _new_model(clip)
    xi = {layer: [[] for _ in range(k)] for layer in layers}
    positions = {layer: [[] for _ in range(k)] for layer in layers}
    for t in range(k):
        _load(task_model, finetuned[t], f"finetuned[{t}]")
        images = task_images[t]
        for n in range(images.shape[0]):
            measured = measure_fsc(merged_model, base, [task_model], [images[n:n + 1]], architecture=fam,
                                   params=params, progress=False)
            for layer in layers:
                ratio = measured.per_task[0][layer].double()
                xi[layer][t].append(float(ratio.mean()))
                positions[layer][t].append(ratio)
    out = {}
    for layer in layers:
        per_task = [torch.tensor(values, dtype=torch.float64) for values in xi[layer]]
        task_mean = torch.stack([v.mean() for v in per_task])
        entry = {"xi": [_json(v) for v in per_task], "task_mean": _json(task_mean),
                 "task_std": _json(torch.stack([v.std(unbiased=False) for v in per_task])),
                 "mean": _finite(task_mean.mean())}
        if per_position:
            entry["positions"] = [[_json(r) for r in rs] for rs in positions[layer]]
        out[layer] = entry
    return {"figure": "MAGIC Fig. 9", "layers": layers, "tasks": names, "norm": params.norm,
            "task_feature": params.task_feature, "coefficients": out}
