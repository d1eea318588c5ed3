"""The merge routes: experts of one kind merged, LoRA ones written as a full model or re-factorised into a LoRA
adapter (``--as-lora``, also for full checkpoints of a Hugging Face base), IA³ ones in vector form."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..checkpoint import DictSource, TensorSource
from ..errors import CheckpointError, IncompatibleModelsError, ParameterError
from ..outputs import check_target
from ..task_vectors import COMPUTE_DTYPE, TaskVectorSet
from .experts import (IA3Expert, IA3Identity, IA3Vectors, LoraDeltas, LoraExpert, SharedBase, _square_targets,
                      check_lora_deltas, hf_layers, linear_layouts)
from .read import KIND_NAMES, PEFT_PREFIX, LoraModule, adapter_from_tensors, expert_kind, is_adapter_dir, read_adapter
from .write import _inputs, _located, write_adapter, write_full_model

ENERGY_FILE = "lora_energy.json"


# ------------------------------------------------------------------------------------------------------- factorising

def factorize(delta: torch.Tensor, rank: int) -> tuple[torch.Tensor, torch.Tensor, float, float]:
    """Truncated SVD of a 2-D update (in float64): ``B = U_r S_r`` (m x r), ``A = V_r^T`` (r x n) with
    ``r = min(rank, m, n)``, so that ``B @ A`` is the best rank-r approximation (Eckart-Young) and a LoRA scaling of 1
    adds it unscaled; also the kept and the total energy (sums of sigma^2, float64)."""
    if rank < 1:
        raise ParameterError(f"as_lora: expected a rank of at least 1, got {rank}")
    U, S, Vh = torch.linalg.svd(delta.to(torch.float64), full_matrices=False)
    r = min(rank, S.numel())
    energy = S.square()
    return U[:, :r] * S[:r], Vh[:r], float(energy[:r].sum()), float(energy.sum())


# -------------------------------------------------------------------------------------------------------- merging

@dataclass
class MergeOutput:
    """What ``merge_experts`` wrote: the directory, its form (``full``, ``lora`` or ``ia3``) and, for a LoRA
    re-factorisation, the energy kept (``lora_energy.json``)."""

    path: Path
    form: str
    energy: dict[str, Any] | None = None


def expert_kinds(finetuned: Sequence[str | os.PathLike]) -> str:
    """The one kind of all experts (``full``, ``lora`` or ``ia3``); mixing kinds is a one-line error."""
    kinds = [expert_kind(path) for path in finetuned]
    for path, kind in zip(finetuned, kinds):
        if kind != kinds[0]:
            raise ParameterError(f"finetuned: {finetuned[0]} is {KIND_NAMES[kinds[0]]} but {path} is "
                                 f"{KIND_NAMES[kind]}; merge experts of one kind (all full checkpoints, all LoRA or "
                                 "all IA³ adapters)")
    return kinds[0]


def _resolve_method(method, params: Mapping[str, Any]):
    """``(recipe or None, merge method)`` as ``merge_checkpoints`` resolves them."""
    from ..merge import require_data_free
    from ..methods import MERGE_METHODS, get_merge_method
    from ..recipe import Recipe

    if isinstance(method, Recipe):
        if params:
            raise ParameterError(f"recipe {method.label!r}: give parameters inside the recipe, e.g. svc(alpha=1.0), "
                                 f"not as keywords ({sorted(params)[0]!r})")
        require_data_free(method)
        return method, MERGE_METHODS[method.merge.name](method.merge.params)
    return None, get_merge_method(method, **params)


def _merged_updates(tvs, recipe, method, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from ..merge import iter_merge, iter_weight_space

    if recipe is None:
        return iter_merge(tvs, method, progress=progress)
    return iter_weight_space(recipe, tvs, progress=progress)


def _metadata(recipe, method, K: int, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    metadata = {"format": "pt", "mergecal_method": method.id, "mergecal_num_models": str(K), **(extra or {})}
    if recipe is not None:
        metadata["mergecal_recipe"] = recipe.id
    return metadata


def _offset(stored: torch.Tensor, update: torch.Tensor) -> torch.Tensor:
    """theta_0 + update as ``TaskVectorSet.add_pretrained`` adds them (float64 stored: added in float32)."""
    stored = stored.to(update.device)
    if torch.promote_types(stored.dtype, torch.float32) != torch.float32:
        stored = stored.to(torch.float32)
    return torch.add(update, stored)



class _TaskVectorsOverBase(TaskVectorSet):
    """Task vectors read as given (as ``TaskVectorSet.from_task_vectors`` reads them, not differenced against the
    base) over the base they are added to (``add_pretrained``, its integer keys): LoRA experts' float32 deltas
    (``lora_deltas="float32"``), merged into a full model by ``merge_checkpoints(task_vectors=...)``."""

    def _differences(self, key: str, read) -> list[torch.Tensor]:
        if key not in self._dtypes or not self._dtypes[key].is_floating_point:
            raise CheckpointError(f"key {key!r} is not a floating-point key of these models")
        return [read(s).to(device=self.device, dtype=COMPUTE_DTYPE) for s in self.sources]


class _Stream:
    """A merged model streamed key by key (``(key, tensor)`` in ``keys`` order) as the ``TensorSource`` that
    ``write_full_model`` reads: each key once, in order."""

    def __init__(self, keys: Sequence[str], stream: Iterator[tuple[str, torch.Tensor]]):
        self._keys, self._stream = list(keys), stream

    def keys(self) -> list[str]:
        return self._keys

    def get(self, key: str) -> torch.Tensor:
        found, tensor = next(self._stream)
        if found != key:
            raise CheckpointError(f"key {key!r}: the merged stream gave {found!r}")
        return tensor


def _write_merged(tvs: TaskVectorSet, pretrained, finetuned, method, out_dir, params: Mapping[str, Any], *,
                  out_dtype: torch.dtype | None, max_shard_bytes: int, progress: bool, overwrite: bool,
                  hf_directory: bool | None, tokenizer_from) -> Path:
    """``tvs`` merged and added to its base, written as ``merge_checkpoints`` writes a merge (the same stream:
    row blocks for a blockwise method, else key by key; the same metadata, model card and Hugging Face files)."""
    from ..merge import _iter_merged_model, _iter_model, iter_weight_space  # merge_checkpoints' own stream

    recipe, merge = _resolve_method(method, params)
    stream = (_iter_merged_model(tvs, merge, out_dtype, progress) if recipe is None else
              _iter_model(tvs, iter_weight_space(recipe, tvs, progress=progress), out_dtype))
    metadata = {k: v for k, v in _metadata(recipe, merge, tvs.K).items() if k != "format"}
    return write_full_model(pretrained, finetuned, _Stream(tvs.all_keys, stream), out_dir, metadata=metadata,
                            label=recipe.id if recipe is not None else merge.id, out_dtype=out_dtype,
                            max_shard_bytes=max_shard_bytes, overwrite=overwrite, hf_directory=hf_directory,
                            tokenizer_from=tokenizer_from)


def _bound(pretrained: str | os.PathLike | TensorSource, finetuned: Sequence[str | os.PathLike]):
    from ..checkpoint import as_source

    base = SharedBase(as_source(pretrained, name="pretrained"))
    return base, [read_adapter(path) for path in finetuned]


def merge_lora(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike], method, out_dir, *,
               as_lora: int | None = None, out_dtype: torch.dtype | None = None, device: str | None = None,
               max_shard_bytes: int = 2 * 1024**3, progress: bool = False, overwrite: bool = False,
               hf_directory: bool | None = None, tokenizer_from: str | os.PathLike | None = None,
               lora_deltas: LoraDeltas = "merged", **params: Any) -> MergeOutput:
    """Merge LoRA adapters of one base. Without ``as_lora``: the merged full model, written by
    ``merge_checkpoints`` (each expert a ``LoraExpert``; what it writes for full checkpoints, it writes here). With
    ``as_lora=RANK``: each changed key's merged update re-factorised by truncated SVD into a LoRA adapter (lora_alpha =
    r, so peft's scaling is 1), the energy kept per key and overall in ``lora_energy.json``.

    ``lora_deltas``: how each expert's task vector is read on a target key (``LoraTaskVectors``). ``merged`` (the
    default): peft's merged weight minus the base, bit for bit what peft's ``merge_and_unload`` adds, so on a 16-bit
    base each expert is rounded to the base's dtype before the merge and the merge again when written (K + 1
    roundings). ``float32``: the float32 delta ``transpose(B @ A, fan_in_fan_out) * scaling``, unrounded, so the
    merge is rounded once, when written. A key with no low-rank delta (a tensor saved whole, ``modules_to_save``;
    a ``lora_bias`` target) is the difference either way. On a float32 base the two agree to float32 rounding."""
    from ..merge import merge_checkpoints

    check_lora_deltas(lora_deltas)
    base, adapters = _bound(pretrained, finetuned)
    for adapter, path in zip(adapters, finetuned):
        if adapter.kind != "lora":
            raise ParameterError(f"finetuned: {path} is {KIND_NAMES[adapter.kind]}; expected a LoRA adapter")
    layouts = linear_layouts(pretrained) if _square_targets(base, adapters) else None
    experts = [LoraExpert(base, adapter, layouts=layouts) for adapter in adapters]
    if as_lora is None:
        check_target(_located(out_dir), list(finetuned))  # merge_checkpoints checks the paths it is given
        if lora_deltas == "float32":  # the deltas as they are, over the base the merge is added to
            tvs = _TaskVectorsOverBase([e.task_vectors(lora_deltas) for e in experts], base,
                                       names=[e.name for e in experts], device=device)
            return MergeOutput(_write_merged(tvs, pretrained, finetuned, method, out_dir, params, out_dtype=out_dtype,
                                             max_shard_bytes=max_shard_bytes, progress=progress, overwrite=overwrite,
                                             hf_directory=hf_directory, tokenizer_from=tokenizer_from), "full")
        path = merge_checkpoints(pretrained, experts, method, out_dir, out_dtype=out_dtype, device=device,
                                 max_shard_bytes=max_shard_bytes, progress=progress, overwrite=overwrite,
                                 hf_directory=hf_directory, tokenizer_from=tokenizer_from, **params)
        return MergeOutput(Path(path), "full")
    _check_rank(as_lora, tokenizer_from)
    targets: dict[str, LoraModule] = {}
    for expert in experts:
        for key, module in expert.modules.items():
            known = targets.setdefault(key, module)
            if (known.layer, known.transposed) != (module.layer, module.transposed):
                raise IncompatibleModelsError(f"key {key!r}: a {known.layer} layer in {experts[0].adapter.where} but "
                                              f"a {module.layer} one in {expert.adapter.where}")
    first = experts[0].adapter.config
    plan = _LoraPlan(
        targets={key: (m.module, m.layer, m.transposed) for key, m in targets.items()},
        biases={key: m.module for e in experts for key, m in e.biases.items()},
        whole={key for e in experts for key in e.adapter.replacements} - set(targets),
        modules_to_save=sorted({m for e in experts for m in e.adapter.config.get("modules_to_save") or []}),
        bias="all" if any(e.adapter.config.get("bias", "none") != "none" for e in experts) else "none",
        extra={"task_type": first.get("task_type"), "base_model_name_or_path": first.get("base_model_name_or_path")})
    tvs = TaskVectorSet([e.task_vectors(lora_deltas) for e in experts], None, names=[e.name for e in experts],
                        device=device)
    return _write_as_lora(tvs, base, plan, method, out_dir, rank=as_lora, out_dtype=out_dtype, progress=progress,
                          overwrite=overwrite, inputs=_inputs(pretrained, finetuned), params=params)


def _check_rank(rank: Any, tokenizer_from) -> None:
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ParameterError(f"as_lora: expected a rank of at least 1, got {rank!r}")
    if tokenizer_from is not None:
        raise ParameterError("tokenizer_from: an adapter output (--as-lora) holds no tokenizer files")


@dataclass
class _LoraPlan:
    """Where each key of a merge goes in a LoRA adapter. ``targets``: key -> (module, layer, transposed), factorised
    (LoRA experts: every key an adapter targets; full checkpoints: the linear, Conv1D and embedding weights the merge
    changes); ``biases``: key -> module, written as lora_B's bias; ``whole``: keys written whole (the merged tensor);
    ``layers`` (full checkpoints): the model's layers, whose changed weights become targets and whose other changed
    keys are written whole; ``state_keys``: the model's own keys (peft loads a tensor saved whole by its key)."""

    targets: dict[str, tuple[str, str, bool]]
    biases: dict[str, str] = field(default_factory=dict)
    whole: set[str] = field(default_factory=set)
    modules_to_save: list[str] = field(default_factory=list)
    bias: str = "none"
    extra: dict[str, Any] = field(default_factory=dict)
    layers: dict[str, tuple[str, str, bool]] | None = None
    state_keys: set[str] | None = None


def _write_as_lora(tvs, base: TensorSource, plan: _LoraPlan, method, out_dir, *, rank: int,
                   out_dtype: torch.dtype | None, progress: bool, overwrite: bool, inputs: Sequence,
                   params: Mapping[str, Any]) -> MergeOutput:
    """Merge, then write each key where ``plan`` says: a target by ``factorize`` at ``rank``, a bias as lora_B's
    bias, a key saved whole as the merged tensor; a changed key with no place is a one-line error."""
    from ..task_vectors import check_finite

    recipe, merge = _resolve_method(method, params)
    check_target(_located(out_dir), inputs)  # before the merge: a bad output fails fast
    dtype = out_dtype or torch.float32
    tensors: dict[str, torch.Tensor] = {}
    energy: dict[str, dict[str, float | int]] = {}
    rank_pattern: dict[str, int] = {}
    targets: dict[str, tuple[str, str, bool]] = {}
    whole: list[str] = []
    kept_total, energy_total = 0.0, 0.0
    for key, update in _merged_updates(tvs, recipe, merge, progress):
        changed = bool(update.any())
        target = plan.targets.get(key) or (plan.layers.get(key) if plan.layers is not None and changed else None)
        if target is not None:
            module, layer, transposed = targets[key] = target
            B, A, kept, total = factorize(update.T if transposed else update, rank)
            check_finite(B, key, "the re-factorised merge")
            names = ("lora_embedding_A", "lora_embedding_B") if layer == "embedding" else ("lora_A.weight",
                                                                                           "lora_B.weight")
            tensors[f"{PEFT_PREFIX}{module}.{names[0]}"] = A.to(dtype)
            tensors[f"{PEFT_PREFIX}{module}.{names[1]}"] = B.to(dtype)
            if A.shape[0] != rank:
                rank_pattern[module] = A.shape[0]
            energy[key] = {"rank": A.shape[0], "energy": kept / total if total > 0 else 1.0}
            kept_total, energy_total = kept_total + kept, energy_total + total
        elif key in plan.biases:  # lora_B.bias at scaling 1 adds the merged bias update
            tensors[f"{PEFT_PREFIX}{plan.biases[key]}.lora_B.bias"] = update.to(dtype)
        elif key in plan.whole or (plan.layers is not None and changed):
            if plan.state_keys is not None and key not in plan.state_keys:
                raise CheckpointError(f"key {key!r}: changed by the merge but not a parameter of the model its base "
                                      "config builds, so a LoRA adapter cannot carry it; write the full model")
            theta = _offset(base.get(key), update).to(out_dtype or base.dtype(key))
            check_finite(theta, key, "the merged model")
            tensors[key] = theta  # renamed below, once the targets are known
            whole.append(key)
        elif changed:
            raise ParameterError(f"key {key!r}: the merge changed a key no adapter changes, which a LoRA adapter "
                                 "cannot hold; write the full model (without --as-lora)")
    target_modules = {module for module, _, _ in targets.values()}
    for key in whole:  # a bias (or other tensor) of a targeted layer lives in its base_layer
        module, _, param = key.rpartition(".")
        tensors[f"{PEFT_PREFIX}{module}.base_layer.{param}" if module in target_modules
                else f"{PEFT_PREFIX}{key}"] = tensors.pop(key)
    if plan.layers is not None:  # full checkpoints: layers changed whole are peft's modules to save (not one that
        # holds a target: peft would wrap the target twice; its tensors load by their keys all the same)
        saved = {k.rpartition(".")[0] for k in whole} - target_modules - {""}
        plan.modules_to_save = sorted(m for m in saved if not any(t.startswith(f"{m}.") for t in target_modules))
        plan.bias = "all" if any(k.rpartition(".")[0] in target_modules for k in whole) else "none"
    summary = {"rank": rank, "overall": kept_total / energy_total if energy_total > 0 else 1.0, "keys": energy}
    config = _lora_config(plan, targets, rank, rank_pattern, base)
    metadata = _metadata(recipe, merge, tvs.K, {"mergecal_lora_rank": str(rank)})
    path = write_adapter(out_dir, config, tensors, metadata=metadata, inputs=inputs, overwrite=overwrite,
                         files={ENERGY_FILE: json.dumps(summary, indent=2, sort_keys=True) + "\n"})
    return MergeOutput(path, "lora", summary)


def _lora_config(plan: _LoraPlan, targets: Mapping[str, tuple[str, str, bool]], rank: int,
                 rank_pattern: Mapping[str, int], base: TensorSource) -> dict[str, Any]:
    """A plain LoRA config for the re-factorised merge: every merged module targeted by its full name (an anchored
    pattern when one name ends another's at a dot), lora_alpha = r (scaling 1), smaller ranks by rank/alpha pattern
    (anchored at the start of the module name)."""
    names = sorted({module for module, _, _ in targets.values()})
    base_modules = {key.rpartition(".")[0] for key in base.keys()}
    collide = any(other != name and other.endswith(f".{name}") for name in names for other in base_modules)
    linear = [transposed for _, layer, transposed in targets.values() if layer == "linear"]
    return {
        "peft_type": "LORA", "r": rank, "lora_alpha": rank, "use_rslora": False, "lora_dropout": 0.0,
        "target_modules": names if not collide else "|".join(re.escape(name) for name in names),
        "init_lora_weights": True, "inference_mode": True, "use_dora": False,
        "fan_in_fan_out": bool(linear) and all(linear),  # peft sets it per layer type anyway (Conv1D or Linear)
        "rank_pattern": {f"^{re.escape(name)}": r for name, r in rank_pattern.items()},
        "alpha_pattern": {f"^{re.escape(name)}": r for name, r in rank_pattern.items()},
        "lora_bias": bool(plan.biases),
        # tensors saved whole load by their keys; these say which peft trains and saves again
        "bias": plan.bias, "modules_to_save": plan.modules_to_save or None, **plan.extra,
    }



def merge_full_as_lora(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike], method, out_dir, *,
                       as_lora: int, out_dtype: torch.dtype | None = None, device: str | None = None,
                       progress: bool = False, overwrite: bool = False,
                       tokenizer_from: str | os.PathLike | None = None, **params: Any) -> MergeOutput:
    """The merge of full checkpoints as a LoRA adapter of their Hugging Face base: each linear, Conv1D or embedding
    weight the merge changes factorised at ``as_lora`` (``factorize``), every other changed key (norms, biases)
    written whole, its layer a module to save; the energy kept as for LoRA experts."""
    _check_rank(as_lora, tokenizer_from)
    layers, state_keys = hf_layers(pretrained)
    tvs = TaskVectorSet.from_models(pretrained, finetuned, device=device)
    plan = _LoraPlan(targets={}, layers=layers, state_keys=state_keys)
    return _write_as_lora(tvs, tvs.pretrained, plan, method, out_dir, rank=as_lora, out_dtype=out_dtype,
                          progress=progress, overwrite=overwrite, inputs=_inputs(pretrained, finetuned), params=params)


def _refuse_matrix_steps(recipe, method, tvs) -> None:
    """Methods and calibrations defined on matrices do not apply to IA³ vectors (the TIES and MAGIC papers print '—'
    there): a matrix merge (TSV-M, Iso-C, Iso-CTS would average the vectors) or a weight-space step that covers no
    vector key (SVC's matrix rule, WSC) is refused in one line."""
    from ..merge import weight_calibrations
    from ..methods.base import MatrixMergeMethod

    if isinstance(method, MatrixMergeMethod):
        raise ParameterError(f"{method.name}: merges matrices (key rule {method.params.key_rule}); it does not "
                             "apply to the vector keys of IA³ experts (the papers print '—'); use task_arithmetic, "
                             "ties, dare, weight_averaging or consensus")
    if recipe is None:
        return
    for step, calibration in zip(recipe.phase("weight"), weight_calibrations(recipe)):
        if not any(calibration.covers(key, tvs.shape(key), tvs.dtype(key)) for key in tvs.keys):
            hint = "; svc(calibrate_vectors=true) calibrates vectors" if step.name == "svc" else ""
            raise ParameterError(f"{step.name}: calibrates matrices (key rule {step.params.key_rule}); it does not "
                                 f"apply to the vector keys of IA³ experts (the papers print '—'){hint}")


def merge_ia3(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike], method, out_dir, *,
              full_model: bool = False, out_dtype: torch.dtype | None = None, device: str | None = None,
              max_shard_bytes: int = 2 * 1024**3, progress: bool = False, overwrite: bool = False,
              hf_directory: bool | None = None, tokenizer_from: str | os.PathLike | None = None,
              **params: Any) -> MergeOutput:
    """Merge IA³ adapters of one base in vector form (task vector = vector - 1). Written as an IA³ adapter with the
    first expert's config and the merged vectors, or with ``full_model`` as the base scaled by the merged vectors
    (``IA3Expert``; a Hugging Face model directory when the base is one, as ``merge_checkpoints`` writes it)."""
    from ..task_vectors import check_finite

    base, adapters = _bound(pretrained, finetuned)
    for adapter, path in zip(adapters, finetuned):
        if adapter.kind != "ia3":
            raise ParameterError(f"finetuned: {path} is {KIND_NAMES[adapter.kind]}; expected an IA³ adapter")
    recipe, merge = _resolve_method(method, params)
    layouts = linear_layouts(pretrained) if _square_targets(base, adapters) else None
    experts = [IA3Vectors(base, adapter, layouts=layouts) for adapter in adapters]
    for expert in experts[1:]:  # flattened, an input vector and an output vector of a square layer look alike
        for key in set(expert.keys()) & set(experts[0].keys()):
            if key in expert._vectors and expert.vector_shape(key) != experts[0].vector_shape(key):
                raise IncompatibleModelsError(f"key {key!r}: shape {experts[0].vector_shape(key)} in "
                                              f"{experts[0].adapter.where} but {expert.vector_shape(key)} in "
                                              f"{expert.adapter.where} (feedforward_modules differ)")
    tvs = TaskVectorSet(experts, IA3Identity(experts[0]), names=[e.name for e in experts], device=device)
    _refuse_matrix_steps(recipe, merge, tvs)
    inputs = _inputs(pretrained, finetuned)
    check_target(_located(out_dir), inputs)
    first = experts[0]
    merged: dict[str, torch.Tensor] = {}
    for key, update in _merged_updates(tvs, recipe, merge, progress):
        theta = tvs.add_pretrained(key, update).to(tvs.dtype(key)).cpu()
        check_finite(theta, key, f"the merged model ({theta.dtype})")
        merged[key] = theta.reshape(first.vector_shape(key)) if key in first._vectors else theta
    metadata = _metadata(recipe, merge, len(experts))
    merged_adapter = adapter_from_tensors(first.adapter.config, DictSource(merged, "the merged IA³ adapter"),
                                          "the merged IA³ adapter")
    if not full_model:
        if tokenizer_from is not None:
            raise ParameterError("tokenizer_from: an adapter output holds no tokenizer files; add --full-model")
        written = {k: v.to(out_dtype) for k, v in merged.items()} if out_dtype is not None else merged
        return MergeOutput(write_adapter(out_dir, first.adapter.config, written, metadata=metadata, inputs=inputs,
                                         overwrite=overwrite), "ia3")
    model = IA3Expert(base, merged_adapter, layouts=layouts)
    path = write_full_model(pretrained, finetuned, model, out_dir, metadata={k: v for k, v in metadata.items()
                                                                              if k != "format"},
                            label=recipe.id if recipe is not None else merge.id, out_dtype=out_dtype,
                            max_shard_bytes=max_shard_bytes, overwrite=overwrite, hf_directory=hf_directory,
                            tokenizer_from=tokenizer_from)
    return MergeOutput(path, "full")



def merge_experts(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike], method, out_dir, *,
                  as_lora: int | None = None, full_model: bool = False, lora_deltas: LoraDeltas = "merged",
                  **kwargs: Any) -> MergeOutput:
    """Merge experts of one kind: full checkpoints (``merge_checkpoints``), LoRA adapters (``merge_lora``) or IA³
    adapters (``merge_ia3``). ``as_lora`` applies to LoRA experts and full checkpoints, ``full_model`` to IA³
    experts, ``lora_deltas`` (``merged``, the default, or ``float32``: how a LoRA expert's task vector is read,
    ``merge_lora``) to LoRA experts."""
    from ..merge import merge_checkpoints

    if isinstance(finetuned, (str, os.PathLike)):
        raise ParameterError(f"finetuned: expected a list of experts, got a single path {str(finetuned)!r}")
    if is_adapter_dir(pretrained):
        raise ParameterError(f"pretrained {pretrained}: is a PEFT adapter; give the base model its adapters were "
                             "trained on")
    check_lora_deltas(lora_deltas)
    kind = expert_kinds(finetuned)
    if lora_deltas != "merged" and kind != "lora":
        raise ParameterError(f"lora_deltas {lora_deltas!r}: applies to LoRA experts (how their task vectors are read); "
                             f"{finetuned[0]} is {KIND_NAMES[kind]}")
    if as_lora is not None and kind == "ia3":
        raise ParameterError("as_lora: re-factorises a merge of LoRA adapters or full checkpoints; IA³ experts merge "
                             "into an IA³ adapter (or --full-model)")
    if full_model and kind != "ia3":
        raise ParameterError(f"full_model: applies to IA³ experts (LoRA merges are full models unless as_lora); the "
                             f"experts are {KIND_NAMES[kind]}s")
    if kind == "lora":
        return merge_lora(pretrained, finetuned, method, out_dir, as_lora=as_lora, lora_deltas=lora_deltas, **kwargs)
    if kind == "ia3":
        return merge_ia3(pretrained, finetuned, method, out_dir, full_model=full_model, **kwargs)
    if as_lora is not None:
        for unused in ("max_shard_bytes", "hf_directory"):
            kwargs.pop(unused, None)
        return merge_full_as_lora(pretrained, finetuned, method, out_dir, as_lora=as_lora, **kwargs)
    return MergeOutput(Path(merge_checkpoints(pretrained, finetuned, method, out_dir, **kwargs)), "full")


