"""Reading a PEFT adapter directory: its config checked, its saved tensors by the base key they change."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..checkpoint import SafetensorsSource, TensorSource, convert_hint, readable_file
from ..errors import CheckpointError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PICKLED_WEIGHTS = "adapter_model.bin"
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

