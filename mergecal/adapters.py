"""PEFT adapters as experts: a LoRA or IA³ adapter directory merged like a fine-tuned checkpoint.

A lab's fine-tunes are often PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``) beside
one base model. Here each one is read as peft 0.21 reads it, without importing peft (an optional dependency):

* a **LoRA** expert is a ``TensorSource`` over the base (``LoraExpert``): a target key is the base plus the adapter's
  delta, computed when the key is asked for (one key's delta at a time, never the whole model's), in the order and
  dtype of peft's ``get_delta_weight`` and ``merge``, so that its task vector equals peft's
  ``merge_and_unload()`` weight minus the base bit for bit; every other key is the base's tensor;
* an **IA³** expert is merged in vector form, as the TIES and MAGIC papers merge IA³ models: the expert's model is its
  vectors, its pretrained model ones of the same shapes (``IA3Vectors``, ``IA3Identity``), so its task vector is the
  vector minus the identity; the merge is written back as an IA³ adapter, or as the full model (``IA3Expert``: the
  base scaled by the vectors, rows or columns, as peft's ``merge_and_unload`` scales them).

The merge of LoRA experts is written as a full model (``mergecal.merge.merge_checkpoints``) or, with ``as_lora=RANK``,
re-factorised key by key by truncated SVD into a LoRA adapter that ``PeftModel.from_pretrained(base, out)`` loads; a
merge of full checkpoints of a Hugging Face base can be written as one too (``merge_full_as_lora``).

peft's conventions followed (peft 0.21.2, transformers 5): saved keys are the PeftModel's parameter names without the
adapter name (``base_model.model.<module>.lora_A.weight``; ``get_peft_model_state_dict``); the base key of a module is
``<module>.weight`` with ``base_model.model.`` and any ``.base_layer`` segment removed (what ``merge_and_unload``
leaves); an adapter weight is held in the base layer's dtype, upcast to float32 from 16- and 8-bit floats (peft's
default ``autocast_adapter_dtype=True``); the merge is peft's default, not ``safe_merge``. Nothing here unpickles:
``adapter_model.bin`` is refused.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from .checkpoint import (SafetensorsSource, ShardedCheckpointWriter, TensorSource, convert_hint, readable_file,
                         save_state_dict)
from .errors import CheckpointError, IncompatibleModelsError, ParameterError
from .outputs import OutputDir, check_target, remove_stale

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"
ENERGY_FILE = "lora_energy.json"
PEFT_PREFIX = "base_model.model."  # what a PeftModel puts before the base model's module names
KIND_NAMES = {"full": "a full checkpoint", "lora": "a LoRA adapter", "ia3": "an IA³ adapter"}

# LoRA tensors as get_peft_model_state_dict saves them (the adapter name removed), by suffix of the module name
_LORA_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B", ".lora_B.bias": "bias",
                  ".lora_embedding_A": "A", ".lora_embedding_B": "B"}
_IA3_SUFFIX = ".ia3_l"

# LoraConfig fields whose merged weight is not base + scaling * B A on the base as given; set, they are refused
_LORA_REFUSED = {
    "use_dora": "DoRA rescales the merged columns by a learned magnitude, so its weight is not base + B A",
    "velora_config": "a LoRA variant (VeLoRA)",
    "alora_invocation_tokens": "activated LoRA applies only after its invocation tokens and cannot be merged",
    "monteclora_config": "a LoRA variant (MonteCLoRA)",
    "use_bdlora": "a LoRA variant (block-diagonal factors)",
    "arrow_config": "Arrow routes between adapters per token",
    "kasa_config": "a LoRA variant (KaSA changes the base weight)",
    "use_qalora": "QALoRA pools the inputs of a quantized layer",
    "layer_replication": "it repeats layers of the base, so the model is not the base's",
    "target_parameters": "LoRA on nn.Parameter (MoE experts) is not read",
    "trainable_token_indices": "trainable tokens are not read",
}
# init_lora_weights values that train against a base other than the one given (the residual of PiSSA, OLoRA, CorDA,
# LoRA-GA; LoftQ's quantized one) or that select a variant (MiCA); peft rewrites them to true when it converts such
# an adapter to plain LoRA (save_pretrained's path_initial_model_for_weight_conversion)
_INIT_REFUSED = ("pissa", "olora", "corda", "lora_ga", "loftq", "mica")


# ---------------------------------------------------------------------------------------------------------- reading

@dataclass(frozen=True)
class LoraModule:
    """One LoRA layer: where its factors are saved and the scaling peft gives it."""

    module: str  # the module's name in the base model (peft's ``current_key``), e.g. model.layers.0.self_attn.q_proj
    layer: str  # "linear" (nn.Linear, or transformers' Conv1D when transposed) or "embedding"
    a_key: str
    b_key: str
    bias_key: str | None  # lora_B's bias (lora_bias=true)
    r: int
    alpha: float
    scaling: float
    transposed: bool  # delta = (B A)^T: an embedding always, a linear layer with fan_in_fan_out (Conv1D)

    @property
    def key(self) -> str:
        return f"{self.module}.weight"

    @property
    def bias_target(self) -> str:
        return f"{self.module}.bias"


@dataclass(frozen=True)
class IA3Module:
    """One IA³ layer: its saved vector, (out, 1) scaling outputs or (1, in) scaling inputs (feedforward)."""

    module: str
    vector_key: str
    shape: tuple[int, ...]
    feedforward: bool
    fan_in_fan_out: bool  # the weight is stored (in, out) (transformers' Conv1D)

    @property
    def key(self) -> str:
        return f"{self.module}.weight"

    @property
    def name(self) -> str:
        """The vector's key in the vector form and in a written adapter."""
        return f"{PEFT_PREFIX}{self.module}{_IA3_SUFFIX}"


@dataclass
class Adapter:
    """A parsed adapter: its config, its saved tensors (read lazily), its layers by the base key they change, and the
    tensors it replaces whole (``modules_to_save``, biases saved with ``bias="all"``, a targeted embedding's saved
    base layer), by base key."""

    where: str  # the directory (or a name) for messages
    config: dict[str, Any]
    kind: str  # "lora" or "ia3"
    tensors: TensorSource
    modules: dict[str, LoraModule | IA3Module]
    replacements: dict[str, str] = field(default_factory=dict)  # base key -> saved key
    path: Path | None = None

    @property
    def weights_path(self) -> str:
        return f"{self.where}/{ADAPTER_WEIGHTS}" if self.path is not None else self.where


def is_adapter_dir(path: str | os.PathLike) -> bool:
    """A directory holding a PEFT ``adapter_config.json`` (a path that cannot be read is not one: the checkpoint
    reader reports it)."""
    try:
        return Path(path).is_dir() and (Path(path) / ADAPTER_CONFIG).is_file()
    except OSError:
        return False


def _load_config(path: Path) -> dict[str, Any]:
    config_file = path / ADAPTER_CONFIG
    if not path.is_dir() or not config_file.is_file():
        raise CheckpointError(f"{path}: not a PEFT adapter directory (expected {ADAPTER_CONFIG} and "
                              f"{ADAPTER_WEIGHTS})")
    try:
        config = json.loads(readable_file(config_file).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{config_file}: not JSON ({err})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: expected a JSON object, got {type(config).__name__}")
    return config


def expert_kind(path: str | os.PathLike) -> str:
    """``"lora"`` or ``"ia3"`` for a PEFT adapter directory (its ``peft_type``), ``"full"`` for anything else (a
    checkpoint, read later by ``SafetensorsSource``); an adapter of another type is refused in one line."""
    path = Path(path)
    if not is_adapter_dir(path):
        return "full"
    config = _load_config(path)
    return _kind(config, f"{path}/{ADAPTER_CONFIG}")


def _kind(config: Mapping[str, Any], where: str) -> str:
    peft_type = config.get("peft_type")
    if peft_type == "LORA":
        return "lora"
    if peft_type == "IA3":
        return "ia3"
    if peft_type is None:
        raise CheckpointError(f"{where}: no 'peft_type'; expected a PEFT adapter config (LORA or IA3)")
    raise CheckpointError(f"{where}: peft_type {peft_type!r} is not read; mergecal merges LORA and IA3 adapters")


def read_adapter(path: str | os.PathLike) -> Adapter:
    """Read a PEFT adapter directory: its config and its safetensors weights (opened lazily, never unpickled).
    LoRA (with rsLoRA, rank/alpha patterns, fan_in_fan_out, embeddings, lora_bias, modules_to_save) and IA³ are read;
    anything whose merge is not peft's plain ``merge_and_unload`` of these is refused in one line naming the key."""
    path = Path(path)
    config = _load_config(path)
    weights = path / ADAPTER_WEIGHTS
    if not weights.exists():
        pickled = path / PICKLED_WEIGHTS
        if pickled.exists():
            raise CheckpointError(f"{pickled}: pickled adapter weights are not read (unpickling can run code); save "
                                  f"the adapter with safetensors (peft's default) or {convert_hint(pickled)}")
        raise CheckpointError(f"{weights}: adapter weights not found (expected {ADAPTER_WEIGHTS} beside "
                              f"{ADAPTER_CONFIG})")
    return adapter_from_tensors(config, SafetensorsSource(weights), str(path), path=path)


def adapter_from_tensors(config: Mapping[str, Any], tensors: TensorSource, where: str, *,
                         path: Path | None = None) -> Adapter:
    """An ``Adapter`` from a config and saved tensors (keys as ``save_pretrained`` writes them)."""
    config = dict(config)
    config_where = f"{where}/{ADAPTER_CONFIG}" if path is not None else where
    weights_where = f"{where}/{ADAPTER_WEIGHTS}" if path is not None else where
    kind = _kind(config, config_where)
    if kind == "lora":
        _check_lora_config(config, config_where)
        modules, replacements = _lora_layers(config, tensors, config_where, weights_where)
    else:
        modules, replacements = _ia3_layers(config, tensors, config_where, weights_where)
    if not modules:
        raise CheckpointError(f"{weights_where}: no {'LoRA' if kind == 'lora' else 'IA³'} tensors found")
    return Adapter(where, config, kind, tensors, modules, replacements, path)


def _check_lora_config(config: Mapping[str, Any], where: str) -> None:
    for key, why in _LORA_REFUSED.items():
        if config.get(key):
            raise CheckpointError(f"{where}: {key} is set; not read, since {why}; mergecal merges plain LoRA "
                                  "(and rsLoRA) adapters")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_INIT_REFUSED):
        raise CheckpointError(f"{where}: init_lora_weights={init!r}: this adapter is relative to a base its "
                              "initialisation changed (or is a LoRA variant); convert it to plain LoRA with peft's "
                              "save_pretrained(path_initial_model_for_weight_conversion=...) first")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise CheckpointError(f"{where}: {key} must be a positive number, got {value!r}")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise CheckpointError(f"{where}: {key} must map module names to numbers, got {config.get(key)!r}")


def _pattern_key(patterns: Iterable[str], module: str) -> str | None:
    """peft's ``get_pattern_key``: the first pattern that matches the end of the module name at a dot."""
    for pattern in patterns:
        if re.match(rf"(.*\.)?({pattern})$", module):
            return pattern
    return None


def _module_name(saved_key: str, suffix: str) -> str:
    return saved_key.removeprefix(PEFT_PREFIX)[: -len(suffix)]


def _base_key(saved_key: str) -> str:
    """The base model's key of a tensor an adapter saves whole: peft's wrapper segments removed."""
    return re.sub(r"(^|\.)base_layer\.", r"\1", saved_key.removeprefix(PEFT_PREFIX))


def _replacement(replacements: dict[str, str], saved_key: str, where: str) -> None:
    base_key = _base_key(saved_key)
    if base_key in replacements:
        raise CheckpointError(f"{where}: keys {replacements[base_key]!r} and {saved_key!r} both replace {base_key!r}")
    replacements[base_key] = saved_key


def _lora_layers(config: dict[str, Any], tensors: TensorSource, config_where: str,
                 weights_where: str) -> tuple[dict[str, LoraModule], dict[str, str]]:
    found: dict[str, dict[str, str]] = {}
    embedding: dict[str, bool] = {}
    replacements: dict[str, str] = {}
    for key in tensors.keys():
        suffix = next((s for s in _LORA_SUFFIXES if key.endswith(s)), None)
        if suffix is None:
            if re.search(r"(^|\.)lora_", key):
                raise CheckpointError(f"{weights_where}: key {key!r} is not a tensor of plain LoRA (lora_A, lora_B, "
                                      "lora_embedding_A/B); a LoRA variant is not read")
            _replacement(replacements, key, weights_where)
            continue
        module = _module_name(key, suffix)
        found.setdefault(module, {})[_LORA_SUFFIXES[suffix]] = key
        if suffix != ".lora_B.bias":
            if embedding.setdefault(module, "embedding" in suffix) != ("embedding" in suffix):
                raise CheckpointError(f"{weights_where}: module {module!r} has both lora_A/B and lora_embedding_A/B")
    rank_pattern, alpha_pattern = config.get("rank_pattern") or {}, config.get("alpha_pattern") or {}
    modules = {}
    for module, keys in found.items():
        if "A" not in keys or "B" not in keys:
            have = next(iter(keys.values()))
            raise CheckpointError(f"{weights_where}: key {have!r} has no lora_{'B' if 'A' in keys else 'A'} partner")
        a_shape, b_shape = tuple(tensors.shape(keys["A"])), tuple(tensors.shape(keys["B"]))
        if len(a_shape) != 2 or len(b_shape) != 2:
            raise CheckpointError(f"{weights_where}: key {keys['A']!r} has shape {a_shape}: LoRA on convolution layers "
                                  "is not read (expected 2-D lora_A/lora_B of a linear or embedding layer)")
        # peft's LoraModel._create_and_replace: rank and alpha from the first matching pattern, else r / lora_alpha
        r_key, alpha_key = _pattern_key(rank_pattern, module), _pattern_key(alpha_pattern, module)
        r = rank_pattern[r_key] if r_key is not None else config["r"]
        alpha = alpha_pattern[alpha_key] if alpha_key is not None else config["lora_alpha"]
        if a_shape[0] != r or b_shape[1] != r:
            source = f"rank_pattern[{r_key!r}]" if r_key is not None else "r"
            raise CheckpointError(f"{weights_where}: key {keys['A']!r} has rank {a_shape[0]} (lora_B {b_shape[1]}) but "
                                  f"{source} in {ADAPTER_CONFIG} is {r}")
        scaling = alpha / math.sqrt(r) if config.get("use_rslora") else alpha / r
        is_embedding = embedding[module]
        modules[f"{module}.weight"] = LoraModule(
            module=module, layer="embedding" if is_embedding else "linear", a_key=keys["A"], b_key=keys["B"],
            bias_key=keys.get("bias"), r=r, alpha=alpha, scaling=scaling,
            transposed=True if is_embedding else bool(config.get("fan_in_fan_out")))
    return modules, replacements


def _feedforward(config: Mapping[str, Any], module: str) -> bool | None:
    """peft's ``IA3Model._check_target_module_feedforward`` (None when the config lists no feedforward modules)."""
    modules = config.get("feedforward_modules")
    if modules is None:
        return None
    if isinstance(modules, str):
        return re.fullmatch(modules, module) is not None
    return any(module.endswith(name) for name in modules)


def _ia3_layers(config: dict[str, Any], tensors: TensorSource, config_where: str,
                weights_where: str) -> tuple[dict[str, IA3Module], dict[str, str]]:
    modules, replacements = {}, {}
    for key in tensors.keys():
        if not key.endswith(_IA3_SUFFIX):
            _replacement(replacements, key, weights_where)
            continue
        module = _module_name(key, _IA3_SUFFIX)
        shape = tuple(tensors.shape(key))
        if len(shape) != 2 or 1 not in shape:
            raise CheckpointError(f"{weights_where}: key {key!r} has shape {shape}: IA³ on convolution layers is not "
                                  "read (expected an (out, 1) or (1, in) vector of a linear layer)")
        feedforward = shape[0] == 1 and shape[1] != 1  # peft: (1, in) scales inputs, (out, 1) outputs
        declared = _feedforward(config, module)
        if declared is not None and declared != feedforward and shape != (1, 1):
            raise CheckpointError(f"{config_where}: feedforward_modules {'lists' if declared else 'does not list'} "
                                  f"{module!r} but its vector {key!r} has shape {shape}")
        modules[f"{module}.weight"] = IA3Module(module, key, shape, feedforward if shape != (1, 1) else bool(declared),
                                                bool(config.get("fan_in_fan_out")))
    return modules, replacements


# ------------------------------------------------------------------------------------------------------ the experts

def adapter_dtype(base_dtype: torch.dtype) -> torch.dtype:
    """The dtype peft holds an adapter's weights in on a base layer of ``base_dtype``: the base's, upcast to float32
    from 16- and 8-bit floats (``autocast_adapter_dtype=True``, peft's default)."""
    return base_dtype if base_dtype in (torch.float32, torch.float64) else torch.float32


def _read_rows(source: TensorSource, key: str, start: int, stop: int) -> torch.Tensor:
    get_rows = getattr(source, "get_rows", None)
    return get_rows(key, start, stop) if get_rows is not None else source.get(key)[start:stop]


class SharedBase:
    """The base model as the K experts built on it read it: each key read once while they ask for it in turn (the
    last key is kept), so a merge of K adapters reads the base as a merge of full checkpoints reads each."""

    def __init__(self, source: TensorSource):
        self.source = source
        self.name = source.name
        self._key: str | None = None
        self._tensor: torch.Tensor | None = None

    def keys(self) -> list[str]:
        return self.source.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.source.shape(key))

    def dtype(self, key: str) -> torch.dtype:
        return self.source.dtype(key)

    def get(self, key: str) -> torch.Tensor:
        if key != self._key:
            self._key, self._tensor = None, None  # the previous key is released before the next is read
            self._tensor, self._key = self.source.get(key), key
        return self._tensor

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self._tensor[start:stop] if key == self._key else _read_rows(self.source, key, start, stop)


def _shared(base: TensorSource) -> SharedBase:
    return base if isinstance(base, SharedBase) else SharedBase(base)


def _check_base_key(base_keys: set[str], base: TensorSource, key: str, adapter: Adapter, what: str) -> None:
    if key not in base_keys:
        raise IncompatibleModelsError(f"{adapter.weights_path}: {what} key {key!r} is not in the base model "
                                      f"{base.name}")
    if not base.dtype(key).is_floating_point:
        raise IncompatibleModelsError(f"{adapter.weights_path}: {what} key {key!r} is {base.dtype(key)} in the base "
                                      f"model {base.name}, expected a floating-point weight")


def _check_replacements(base: TensorSource, base_keys: set[str], adapter: Adapter) -> None:
    for key, saved in adapter.replacements.items():
        _check_base_key(base_keys, base, key, adapter, f"saved tensor {saved!r}'s")
        if tuple(adapter.tensors.shape(saved)) != tuple(base.shape(key)):
            raise IncompatibleModelsError(f"{adapter.weights_path}: key {saved!r} has shape "
                                          f"{tuple(adapter.tensors.shape(saved))} but {key!r} is "
                                          f"{tuple(base.shape(key))} in the base model {base.name}")


def _settle_orientation(options: Sequence[tuple[bool, tuple[int, ...]]], declared: bool, shape: tuple[int, ...],
                        what: str, known: bool | None = None) -> bool:
    """The orientation peft gives a layer: fan_in_fan_out by the layer's type (transformers' Conv1D, stored (in,
    out): true; nn.Linear: false), overriding the config's flag, which ``save_pretrained`` writes as peft last set it.
    The type is ``known`` from the base's model (``linear_layouts``) when given; else the base weight's shape shows
    it, unless the layer is square: then the config's flag holds."""
    fits = [flag for flag, candidate in options if candidate == shape]
    if not fits:
        raise IncompatibleModelsError(f"{what} does not fit the base weight's shape {shape}")
    if known is not None:
        if known not in fits:
            raise IncompatibleModelsError(f"{what} does not fit the base's {'Conv1D' if known else 'linear'} layer of "
                                          f"shape {shape}")
        return known
    return declared if declared in fits else fits[0]


def linear_layouts(pretrained: str | os.PathLike) -> dict[str, bool] | None:
    """``{weight key: stored (in, out)}`` of the linear layers (nn.Linear: false, transformers' Conv1D: true) of a
    Hugging Face base directory's model (``hf_layers``), which settles the orientation of a square layer; None when
    the base is not one transformers can build."""
    from .errors import MergecalError

    try:
        layers, _ = hf_layers(pretrained)
    except MergecalError:  # not a Hugging Face directory, no transformers, a model it cannot build
        return None
    return {key: transposed for key, (_, layer, transposed) in layers.items() if layer == "linear"}


def _square_targets(base: TensorSource, adapters: Sequence[Adapter]) -> bool:
    """Whether a linear layer an adapter targets is square (its orientation not shown by its shape)."""
    keys = set(base.keys())
    return any(key in keys and len(set(base.shape(key))) == 1 and getattr(module, "layer", "linear") == "linear"
               for adapter in adapters for key, module in adapter.modules.items())


class LoraExpert:
    """A LoRA adapter over its base model as a ``TensorSource``: a target key is ``base + delta`` as peft's
    ``merge_and_unload`` computes it (the key's delta computed when the key is read, the last key kept for
    ``get_rows``), a key the adapter saves whole (``modules_to_save``) is that tensor, every other key the base's.
    ``layouts``: the base's linear layers (``linear_layouts``), for the orientation of square Conv1D layers."""

    def __init__(self, base: TensorSource, adapter: Adapter, name: str | None = None, *,
                 layouts: Mapping[str, bool] | None = None):
        if adapter.kind != "lora":
            raise ParameterError(f"{adapter.where}: expected a LoRA adapter, got {KIND_NAMES[adapter.kind]}")
        self.base = _shared(base)
        self.adapter = adapter
        self.name = name or f"LoRA adapter {adapter.where}"
        base_keys = set(self.base.keys())
        self.modules: dict[str, LoraModule] = {}
        self.biases: dict[str, LoraModule] = {}
        for key, module in adapter.modules.items():
            _check_base_key(base_keys, self.base, key, adapter, f"module {module.module!r}'s target")
            shape = tuple(self.base.shape(key))
            a_shape, b_shape = tuple(adapter.tensors.shape(module.a_key)), tuple(adapter.tensors.shape(module.b_key))
            product = (b_shape[0], a_shape[1])
            what = f"{adapter.weights_path}: module {module.module!r} (lora_B @ lora_A is {product})"
            if module.layer == "embedding":
                _settle_orientation([(True, product[::-1])], True, shape, what)
            else:
                module = replace(module, transposed=_settle_orientation(
                    [(False, product), (True, product[::-1])], module.transposed, shape, what,
                    (layouts or {}).get(key)))
            self.modules[key] = module
            if module.bias_key is not None:
                _check_base_key(base_keys, self.base, module.bias_target, adapter, "lora_bias target")
                if tuple(self.base.shape(module.bias_target)) != (b_shape[0],):
                    raise IncompatibleModelsError(f"{adapter.weights_path}: key {module.bias_key!r} has shape "
                                                  f"({b_shape[0]},) but {module.bias_target!r} is "
                                                  f"{tuple(self.base.shape(module.bias_target))} in {self.base.name}")
                self.biases[module.bias_target] = module
        _check_replacements(self.base, base_keys, adapter)
        self._last: tuple[str, torch.Tensor] | None = None

    def __str__(self) -> str:  # a model card lists the expert by its directory
        return self.adapter.where

    def keys(self) -> list[str]:
        return self.base.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self.base.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.base.dtype(key)

    def touches(self, key: str) -> bool:
        """Whether the adapter changes ``key`` (a LoRA target or bias, or a tensor saved whole)."""
        return key in self.modules or key in self.biases or key in self.adapter.replacements

    def delta(self, key: str) -> torch.Tensor:
        """peft's ``get_delta_weight`` for the module of ``key``: ``transpose(B @ A, fan_in_fan_out) * scaling`` in the
        adapter's dtype on this base (``adapter_dtype``)."""
        module = self.modules[key]
        dtype = adapter_dtype(self.base.dtype(key))
        product = self.adapter.tensors.get(module.b_key).to(dtype) @ self.adapter.tensors.get(module.a_key).to(dtype)
        return (product.T if module.transposed else product) * module.scaling

    def _own_base(self, key: str) -> torch.Tensor:
        saved = self.adapter.replacements.get(key)
        if saved is None:
            return self.base.get(key)
        return self.adapter.tensors.get(saved).to(self.base.dtype(key))  # loaded into the base layer's parameter

    def _merged(self, key: str) -> torch.Tensor:
        weight = self._own_base(key)
        if key in self.modules:
            delta = self.delta(key)
            if self.modules[key].layer == "embedding":  # lora.Embedding.merge: weight += delta.to(weight.dtype)
                return weight + delta.to(weight.dtype)
            return torch.add(weight, delta).to(weight.dtype)  # lora.Linear.merge: weight += delta, in the wider dtype
        if key in self.biases:  # lora_bias: bias += lora_B.bias * scaling
            module = self.biases[key]
            added = self.adapter.tensors.get(module.bias_key).to(adapter_dtype(weight.dtype)) * module.scaling
            return torch.add(weight, added).to(weight.dtype)
        return weight

    def get(self, key: str) -> torch.Tensor:
        if not self.touches(key):
            return self.base.get(key)
        if self._last is None or self._last[0] != key:
            self._last = None
            self._last = (key, self._merged(key))
        return self._last[1]

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        if not self.touches(key):
            return _read_rows(self.base, key, start, stop)
        return self.get(key)[start:stop]

    def task_vectors(self) -> "LoraTaskVectors":
        return LoraTaskVectors(self)


class LoraTaskVectors:
    """A LoRA expert's task vector as a ``TensorSource`` (float32): ``theta - theta_0`` as ``TaskVectorSet`` computes
    it on a target key, and zero on every other key without reading the base (a zero expanded from one element, so
    a merge that only needs the task vectors, ``--as-lora``, reads the base at the keys the adapters change alone)."""

    def __init__(self, expert: LoraExpert):
        self.expert = expert
        self.name = expert.name

    def keys(self) -> list[str]:
        return self.expert.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self.expert.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.expert.dtype(key)

    def get(self, key: str) -> torch.Tensor:
        if not self.expert.touches(key):
            return torch.zeros((), dtype=torch.float32).expand(tuple(self.shape(key)))
        # TaskVectorSet._differences: both in float32, then the difference
        return self.expert.get(key).to(torch.float32) - self.expert.base.get(key).to(torch.float32)


class IA3Vectors:
    """An IA³ expert in vector form: its vectors flattened to 1-D, as peft holds them on this base
    (``adapter_dtype``), named ``base_model.model.<module>.ia3_l``; a tensor it saves whole, under
    ``base_model.model.<base key>``, in the base's dtype. ``IA3Identity`` is its pretrained model."""

    def __init__(self, base: TensorSource, adapter: Adapter, name: str | None = None, *,
                 layouts: Mapping[str, bool] | None = None):
        if adapter.kind != "ia3":
            raise ParameterError(f"{adapter.where}: expected an IA³ adapter, got {KIND_NAMES[adapter.kind]}")
        self.base = _shared(base)
        self.adapter = adapter
        self.name = name or f"IA³ adapter {adapter.where}"
        self.modules = _bind_ia3(self.base, adapter, layouts)
        self._vectors = {m.name: m for m in self.modules.values()}
        self._whole = {f"{PEFT_PREFIX}{key}": key for key in adapter.replacements}

    def __str__(self) -> str:
        return self.adapter.where

    def keys(self) -> list[str]:
        return [*self._vectors, *self._whole]

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._vectors:
            return (math.prod(self._vectors[key].shape),)
        return tuple(self.base.shape(self._whole[key]))

    def dtype(self, key: str) -> torch.dtype:
        if key in self._vectors:
            return adapter_dtype(self.base.dtype(self._vectors[key].key))
        return self.base.dtype(self._whole[key])

    def get(self, key: str) -> torch.Tensor:
        if key in self._vectors:
            return self.adapter.tensors.get(self._vectors[key].vector_key).to(self.dtype(key)).reshape(-1)
        base_key = self._whole[key]
        return self.adapter.tensors.get(self.adapter.replacements[base_key]).to(self.base.dtype(base_key))

    def vector_shape(self, key: str) -> tuple[int, ...]:
        """The saved (out, 1) or (1, in) shape of a vector key."""
        return self._vectors[key].shape


class IA3Identity:
    """The pretrained model of IA³ experts in vector form: ones where they hold vectors, the base's tensor where they
    save one whole (same keys, shapes and dtypes as ``IA3Vectors``)."""

    def __init__(self, like: IA3Vectors):
        self.like = like
        self.name = f"the identity of {like.name}"

    def keys(self) -> list[str]:
        return self.like.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self.like.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.like.dtype(key)

    def get(self, key: str) -> torch.Tensor:
        if key in self.like._vectors:
            return torch.ones(self.shape(key), dtype=self.dtype(key))
        return self.like.base.get(self.like._whole[key])


def _bind_ia3(base: TensorSource, adapter: Adapter, layouts: Mapping[str, bool] | None) -> dict[str, IA3Module]:
    """The adapter's IA³ layers checked against the base: each target weight present, 2-D, its orientation settled."""
    base_keys = set(base.keys())
    bound = {}
    for key, module in adapter.modules.items():
        _check_base_key(base_keys, base, key, adapter, f"module {module.module!r}'s target")
        shape = tuple(base.shape(key))
        n = max(module.shape)
        what = f"{adapter.weights_path}: IA³ vector {module.vector_key!r} of shape {module.shape}"
        if len(shape) != 2:
            raise IncompatibleModelsError(f"{what} targets {key!r} of shape {shape}; expected a 2-D linear weight")
        # a vector of outputs scales the rows of an (out, in) weight, the columns of a Conv1D's (in, out); of inputs
        # (feedforward) the other way round
        rows = 0 if not module.feedforward else 1
        options = [(flag, shape) for flag in (False, True) if shape[rows if not flag else 1 - rows] == n]
        flag = _settle_orientation(options, module.fan_in_fan_out, shape, what, (layouts or {}).get(key))
        bound[key] = replace(module, fan_in_fan_out=flag)
    _check_replacements(base, base_keys, adapter)
    return bound


class IA3Expert:
    """An IA³ adapter applied to its base, as peft's ``merge_and_unload`` applies it: a target weight times its vector
    (``torch.mul(W, transpose(l, fan_in_fan_out))``: rows scaled by an output vector, columns by an input one), the
    bias of a non-feedforward layer times the vector, a tensor saved whole as saved, the rest the base's."""

    def __init__(self, base: TensorSource, adapter: Adapter, name: str | None = None, *,
                 layouts: Mapping[str, bool] | None = None):
        self.vectors = IA3Vectors(base, adapter, layouts=layouts)
        self.base = self.vectors.base
        self.adapter = adapter
        self.name = name or f"IA³ adapter {adapter.where} applied to {self.base.name}"
        base_keys = set(self.base.keys())
        self.modules = self.vectors.modules
        self.biases = {f"{m.module}.bias": m for m in self.modules.values()
                       if not m.feedforward and f"{m.module}.bias" in base_keys}
        self._last: tuple[str, torch.Tensor] | None = None

    def __str__(self) -> str:
        return self.adapter.where

    def keys(self) -> list[str]:
        return self.base.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self.base.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.base.dtype(key)

    def touches(self, key: str) -> bool:
        return key in self.modules or key in self.biases or key in self.adapter.replacements

    def _vector(self, module: IA3Module, dtype: torch.dtype) -> torch.Tensor:
        return self.adapter.tensors.get(module.vector_key).to(adapter_dtype(dtype))

    def _scaled(self, key: str) -> torch.Tensor:
        if key in self.modules:
            module = self.modules[key]
            weight = self.base.get(key)
            vector = self._vector(module, weight.dtype)
            return torch.mul(weight, vector.T if module.fan_in_fan_out else vector).to(weight.dtype)
        if key in self.biases:
            bias = self.base.get(key)
            return torch.mul(bias, self._vector(self.biases[key], self.base.dtype(key)).reshape(bias.shape)).to(
                bias.dtype)
        return self.adapter.tensors.get(self.adapter.replacements[key]).to(self.base.dtype(key))

    def get(self, key: str) -> torch.Tensor:
        if not self.touches(key):
            return self.base.get(key)
        if self._last is None or self._last[0] != key:
            self._last = None
            self._last = (key, self._scaled(key))
        return self._last[1]

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        if not self.touches(key):
            return _read_rows(self.base, key, start, stop)
        return self.get(key)[start:stop]


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


def _located(path: str | os.PathLike) -> Path:
    """An output path as ``OutputDir`` checks it (absolute, its parent's symlinks resolved)."""
    path = Path(os.path.abspath(path))
    return Path(os.path.realpath(path.parent)) / path.name


def _inputs(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike]) -> list[str | os.PathLike]:
    """The paths a merge reads, which its output may not be or hold."""
    return [p for p in (pretrained, *finetuned) if isinstance(p, (str, os.PathLike))]


def _resolve_method(method, params: Mapping[str, Any]):
    """``(recipe or None, merge method)`` as ``merge_checkpoints`` resolves them."""
    from .merge import require_data_free
    from .methods import MERGE_METHODS, get_merge_method
    from .recipe import Recipe

    if isinstance(method, Recipe):
        if params:
            raise ParameterError(f"recipe {method.label!r}: give parameters inside the recipe, e.g. svc(alpha=1.0), "
                                 f"not as keywords ({sorted(params)[0]!r})")
        require_data_free(method)
        return method, MERGE_METHODS[method.merge.name](method.merge.params)
    return None, get_merge_method(method, **params)


def _merged_updates(tvs, recipe, method, progress: bool) -> Iterator[tuple[str, torch.Tensor]]:
    from .merge import iter_merge, iter_weight_space

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


def write_adapter(out_dir: str | os.PathLike, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor], *,
                  metadata: Mapping[str, str] | None = None, files: Mapping[str, str] | None = None,
                  inputs: Iterable[str | os.PathLike] = (), overwrite: bool = False) -> Path:
    """Write a PEFT adapter directory atomically (a staging directory renamed into place, ``mergecal.outputs``):
    ``adapter_config.json``, ``adapter_model.safetensors`` and any other small text ``files``."""
    remove_stale(out_dir)
    with OutputDir(out_dir, inputs=inputs, overwrite=overwrite) as staging:
        save_state_dict(tensors, staging / ADAPTER_WEIGHTS, metadata={"format": "pt", **(metadata or {})})
        (staging / ADAPTER_CONFIG).write_text(json.dumps(dict(config), indent=2, sort_keys=True) + "\n")
        for name, text in (files or {}).items():
            (staging / name).write_text(text)
    return Path(out_dir)


def _bound(pretrained: str | os.PathLike | TensorSource, finetuned: Sequence[str | os.PathLike]):
    from .checkpoint import as_source

    base = SharedBase(as_source(pretrained, name="pretrained"))
    return base, [read_adapter(path) for path in finetuned]


def merge_lora(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike], method, out_dir, *,
               as_lora: int | None = None, out_dtype: torch.dtype | None = None, device: str | None = None,
               max_shard_bytes: int = 2 * 1024**3, progress: bool = False, overwrite: bool = False,
               hf_directory: bool | None = None, tokenizer_from: str | os.PathLike | None = None,
               **params: Any) -> MergeOutput:
    """Merge LoRA adapters of one base. Without ``as_lora``: the merged full model, written by
    ``merge_checkpoints`` (each expert a ``LoraExpert``; what it writes for full checkpoints, it writes here). With
    ``as_lora=RANK``: each changed key's merged update re-factorised by truncated SVD into a LoRA adapter (lora_alpha =
    r, so peft's scaling is 1), the energy kept per key and overall in ``lora_energy.json``."""
    from .merge import merge_checkpoints
    from .task_vectors import TaskVectorSet

    base, adapters = _bound(pretrained, finetuned)
    for adapter, path in zip(adapters, finetuned):
        if adapter.kind != "lora":
            raise ParameterError(f"finetuned: {path} is {KIND_NAMES[adapter.kind]}; expected a LoRA adapter")
    layouts = linear_layouts(pretrained) if _square_targets(base, adapters) else None
    experts = [LoraExpert(base, adapter, layouts=layouts) for adapter in adapters]
    if as_lora is None:
        check_target(_located(out_dir), list(finetuned))  # merge_checkpoints checks the paths it is given
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
    tvs = TaskVectorSet([e.task_vectors() for e in experts], None, names=[e.name for e in experts], device=device)
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
    from .task_vectors import check_finite

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


def hf_layers(pretrained: str | os.PathLike) -> tuple[dict[str, tuple[str, str, bool]], set[str]]:
    """The layers a LoRA adapter can hold in a Hugging Face model directory's model, built from its config.json on
    the meta device (no weight read; needs transformers): ``{weight key: (module, layer, transposed)}`` for
    nn.Linear (not inside nn.MultiheadAttention, which reads it directly), transformers' Conv1D (transposed) and
    nn.Embedding, as peft dispatches them; and the model's own state-dict keys."""
    try:
        import transformers
        from transformers.pytorch_utils import Conv1D
    except ImportError:
        raise ParameterError("as_lora with full checkpoints: needs transformers, to tell each key's layer from the "
                             "base's config.json") from None
    from .backbones.hf_directory import is_hf_model_dir

    if not is_hf_model_dir(pretrained):
        raise ParameterError(f"as_lora with full checkpoints: {pretrained} is not a Hugging Face model directory "
                             "(config.json), which tells each key's layer (linear, Conv1D, embedding)")
    try:
        config = transformers.AutoConfig.from_pretrained(str(pretrained), local_files_only=True)
    except Exception as err:  # an unknown model type, custom code: transformers' own message, first line
        raise CheckpointError(f"{pretrained}/config.json: transformers cannot read it "
                              f"({str(err).splitlines()[0] if str(err) else type(err).__name__})") from None
    name = (getattr(config, "architectures", None) or [None])[0]
    cls = getattr(transformers, name, None) if name else None
    if cls is None:
        raise CheckpointError(f"{pretrained}/config.json: architectures {name!r} is not a transformers model class")
    try:
        with torch.device("meta"):
            model = cls(config)
    except Exception as err:
        raise CheckpointError(f"{pretrained}/config.json: transformers cannot build {name} on the meta device "
                              f"({type(err).__name__})") from None
    layers: dict[str, tuple[str, str, bool]] = {}
    modules = dict(model.named_modules())
    for module_name, module in modules.items():
        parent = modules.get(module_name.rpartition(".")[0]) if "." in module_name else model
        if isinstance(parent, torch.nn.MultiheadAttention):
            continue
        if isinstance(module, torch.nn.Embedding):
            layers[f"{module_name}.weight"] = (module_name, "embedding", True)
        elif isinstance(module, Conv1D):
            layers[f"{module_name}.weight"] = (module_name, "linear", True)
        elif isinstance(module, torch.nn.Linear):
            layers[f"{module_name}.weight"] = (module_name, "linear", False)
    return layers, set(model.state_dict())


def merge_full_as_lora(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike], method, out_dir, *,
                       as_lora: int, out_dtype: torch.dtype | None = None, device: str | None = None,
                       progress: bool = False, overwrite: bool = False,
                       tokenizer_from: str | os.PathLike | None = None, **params: Any) -> MergeOutput:
    """The merge of full checkpoints as a LoRA adapter of their Hugging Face base: each linear, Conv1D or embedding
    weight the merge changes factorised at ``as_lora`` (``factorize``), every other changed key (norms, biases)
    written whole, its layer a module to save; the energy kept as for LoRA experts."""
    from .task_vectors import TaskVectorSet

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
    from .merge import weight_calibrations
    from .methods.base import MatrixMergeMethod

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
    from .task_vectors import TaskVectorSet, check_finite

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
    merged_adapter = adapter_from_tensors(first.adapter.config, _Tensors(merged), "the merged IA³ adapter")
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


class _Tensors:
    """A ``TensorSource`` over in-memory tensors (the merged IA³ vectors) under their adapter keys."""

    name = "the merged IA³ adapter"

    def __init__(self, tensors: Mapping[str, torch.Tensor]):
        self._tensors = dict(tensors)

    def keys(self) -> list[str]:
        return list(self._tensors)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._tensors[key].shape)

    def dtype(self, key: str) -> torch.dtype:
        return self._tensors[key].dtype

    def get(self, key: str) -> torch.Tensor:
        return self._tensors[key]


def write_full_model(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike], model: TensorSource,
                     out_dir, *, metadata: Mapping[str, str], label: str, out_dtype: torch.dtype | None = None,
                     max_shard_bytes: int = 2 * 1024**3, overwrite: bool = False, hf_directory: bool | None = None,
                     tokenizer_from: str | os.PathLike | None = None) -> Path:
    """Write a model source key by key as ``merge_checkpoints`` writes a merge: float keys in ``out_dtype`` (else
    their own), sharded, atomically, and as a Hugging Face model directory when the base is one."""
    from . import __version__
    from .backbones.hf_directory import (SAFETENSORS_METADATA, check_hf_sources, is_hf_model_dir, model_card,
                                         write_hf_files)
    from .task_vectors import check_finite

    remove_stale(out_dir)
    hf = is_hf_model_dir(pretrained) if hf_directory is None else hf_directory
    if hf and not is_hf_model_dir(pretrained):
        raise CheckpointError(f"{pretrained}: not a Hugging Face model directory (no config.json); a Hugging Face "
                              "output needs one as the pretrained model")
    if tokenizer_from is not None and not hf:
        raise ParameterError(f"tokenizer_from {tokenizer_from}: tokenizer files go with a Hugging Face output")
    if hf:
        check_hf_sources(pretrained, tokenizer_from)
    metadata = {**metadata, **(SAFETENSORS_METADATA if hf else {})}
    inputs = [*_inputs(pretrained, finetuned), *([tokenizer_from] if tokenizer_from is not None else [])]
    with ShardedCheckpointWriter(out_dir, max_shard_bytes=max_shard_bytes, metadata=metadata, inputs=inputs,
                                 overwrite=overwrite) as writer:
        for key in model.keys():
            tensor = model.get(key)
            if tensor.is_floating_point():
                tensor = tensor.to(out_dtype or tensor.dtype)
                check_finite(tensor, key, f"the merged model ({tensor.dtype})")
            writer.add(key, tensor)
        writer.finish()
        if hf:
            card = model_card(pretrained, finetuned, label, __version__, out_dtype, tokenizer_from)
            write_hf_files(writer.staging, pretrained, tokenizer_from=tokenizer_from, dtype=out_dtype, card=card)
    return Path(out_dir)


def merge_experts(pretrained: str | os.PathLike, finetuned: Sequence[str | os.PathLike], method, out_dir, *,
                  as_lora: int | None = None, full_model: bool = False, **kwargs: Any) -> MergeOutput:
    """Merge experts of one kind: full checkpoints (``merge_checkpoints``), LoRA adapters (``merge_lora``) or IA³
    adapters (``merge_ia3``). ``as_lora`` applies to LoRA experts, ``full_model`` to IA³ ones."""
    from .merge import merge_checkpoints

    if isinstance(finetuned, (str, os.PathLike)):
        raise ParameterError(f"finetuned: expected a list of experts, got a single path {str(finetuned)!r}")
    if is_adapter_dir(pretrained):
        raise ParameterError(f"pretrained {pretrained}: is a PEFT adapter; give the base model its adapters were "
                             "trained on")
    kind = expert_kinds(finetuned)
    if as_lora is not None and kind == "ia3":
        raise ParameterError("as_lora: re-factorises a merge of LoRA adapters or full checkpoints; IA³ experts merge "
                             "into an IA³ adapter (or --full-model)")
    if full_model and kind != "ia3":
        raise ParameterError(f"full_model: applies to IA³ experts (LoRA merges are full models unless as_lora); the "
                             f"experts are {KIND_NAMES[kind]}s")
    if kind == "lora":
        return merge_lora(pretrained, finetuned, method, out_dir, as_lora=as_lora, **kwargs)
    if kind == "ia3":
        return merge_ia3(pretrained, finetuned, method, out_dir, full_model=full_model, **kwargs)
    if as_lora is not None:
        for unused in ("max_shard_bytes", "hf_directory"):
            kwargs.pop(unused, None)
        return merge_full_as_lora(pretrained, finetuned, method, out_dir, as_lora=as_lora, **kwargs)
    return MergeOutput(Path(merge_checkpoints(pretrained, finetuned, method, out_dir, **kwargs)), "full")


__all__ = ["ADAPTER_CONFIG", "ADAPTER_WEIGHTS", "Adapter", "IA3Expert", "IA3Identity", "IA3Module", "IA3Vectors",
           "LoraExpert", "LoraModule", "LoraTaskVectors", "MergeOutput", "SharedBase", "adapter_dtype",
           "adapter_from_tensors", "expert_kind", "expert_kinds", "factorize", "hf_layers", "is_adapter_dir",
           "linear_layouts", "merge_experts", "merge_full_as_lora", "merge_ia3", "merge_lora", "read_adapter",
           "write_adapter", "write_full_model"]
