"""The experts as ``TensorSource``s over their base: a LoRA expert (and its task vectors), an IA³ expert in vector form
and applied to its base, and the layouts that settle a layer's orientation."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Literal

import torch

from ..checkpoint import TensorSource
from ..errors import CheckpointError, IncompatibleModelsError, ParameterError
from .read import KIND_NAMES, PEFT_PREFIX, Adapter, IA3Module, LoraModule


# ------------------------------------------------------------------------------------------------------ the experts

LoraDeltas = Literal["merged", "float32"]
LORA_DELTAS: tuple[str, ...] = ("merged", "float32")


def check_lora_deltas(value: object) -> str:
    """``value`` when it is one of ``LORA_DELTAS`` (how a LoRA expert's task vector is read: ``merged``, peft's
    merged weight minus the base; ``float32``, the float32 delta), else a one-line error."""
    if not isinstance(value, str) or value not in LORA_DELTAS:
        raise ParameterError(f"lora_deltas: expected one of {', '.join(LORA_DELTAS)}, got {value!r}")
    return value


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
    from ..errors import MergecalError

    try:
        layers, _ = hf_layers(pretrained)
    except MergecalError:  # not a Hugging Face directory, no transformers, a model it cannot build
        return None
    return {key: transposed for key, (_, layer, transposed) in layers.items() if layer == "linear"}


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
    from ..backbones.hf_directory import is_hf_model_dir

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


def _square_targets(base: TensorSource, adapters: Sequence[Adapter]) -> bool:
    """Whether a linear layer an adapter targets is square (its orientation not shown by its shape)."""
    keys = set(base.keys())
    return any(key in keys and len(set(base.shape(key))) == 1 and getattr(module, "layer", "linear") == "linear"
               for adapter in adapters for key, module in adapter.modules.items())


class _AppliedAdapter:
    """What ``LoraExpert`` and ``IA3Expert`` share: an adapter over its base model as a ``TensorSource`` whose keys
    are the base's, a key the adapter touches read as ``_merged`` computes it (the last key kept for ``get_rows``),
    every other key the base's."""

    base: SharedBase
    adapter: Adapter
    modules: Mapping[str, LoraModule | IA3Module]
    biases: Mapping[str, LoraModule | IA3Module]
    _last: tuple[str, torch.Tensor] | None

    def __str__(self) -> str:  # a model card lists the expert by its directory
        return self.adapter.where

    def keys(self) -> list[str]:
        return self.base.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self.base.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.base.dtype(key)

    def touches(self, key: str) -> bool:
        """Whether the adapter changes ``key`` (a LoRA or IA³ target or bias, or a tensor saved whole)."""
        return key in self.modules or key in self.biases or key in self.adapter.replacements

    def _merged(self, key: str) -> torch.Tensor:
        """The touched key as the expert holds it (LoRA: base + delta; IA³: the scaled base): each kind its own."""
        raise NotImplementedError

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


class LoraExpert(_AppliedAdapter):
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

    def delta(self, key: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """peft's ``get_delta_weight`` for the module of ``key``: ``transpose(B @ A, fan_in_fan_out) * scaling`` in the
        adapter's dtype on this base (``adapter_dtype``), or computed in ``dtype`` when given."""
        module = self.modules[key]
        dtype = dtype or adapter_dtype(self.base.dtype(key))
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

    def task_vectors(self, deltas: LoraDeltas = "merged") -> "LoraTaskVectors":
        """The expert's task vector as a ``TensorSource`` (``LoraTaskVectors``), its target keys read as ``deltas``
        says (``merged`` or ``float32``)."""
        return LoraTaskVectors(self, deltas)


class LoraTaskVectors:
    """A LoRA expert's task vector as a ``TensorSource`` (float32), zero on every key the adapter leaves without
    reading the base (a zero expanded from one element, so a merge that only needs the task vectors, ``--as-lora``,
    reads the base at the keys the adapters change alone). A target key is read as ``deltas`` says: ``merged``,
    ``theta - theta_0`` as ``TaskVectorSet`` computes it (peft's merged weight, rounded to the base's dtype, minus
    the base: bit for bit what peft's ``merge_and_unload`` adds); ``float32``, the delta itself,
    ``transpose(B @ A, fan_in_fan_out) * scaling`` computed in float32, unrounded. A key with no low-rank delta (a
    tensor saved whole, ``modules_to_save``; a ``lora_bias`` target; a target also saved whole) is the difference
    either way. ``get_rows`` keeps the last key's task vector (one key-sized float32 buffer), which a merge read in
    row blocks asks for block by block."""

    def __init__(self, expert: LoraExpert, deltas: LoraDeltas = "merged"):
        self.expert = expert
        self.deltas = check_lora_deltas(deltas)
        self.name = expert.name
        self._last: tuple[str, torch.Tensor] | None = None

    def keys(self) -> list[str]:
        return self.expert.keys()

    def shape(self, key: str) -> tuple[int, ...]:
        return self.expert.shape(key)

    def dtype(self, key: str) -> torch.dtype:
        return self.expert.dtype(key)

    def get(self, key: str) -> torch.Tensor:
        if not self.expert.touches(key):
            return torch.zeros((), dtype=torch.float32).expand(tuple(self.shape(key)))
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        self._last = None
        expert = self.expert
        if self.deltas == "float32" and key in expert.modules and key not in expert.adapter.replacements:
            return expert.delta(key, torch.float32)
        # TaskVectorSet._differences: both in float32, then the difference
        return expert.get(key).to(torch.float32) - expert.base.get(key).to(torch.float32)

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        if not self.expert.touches(key):
            return self.get(key)[start:stop]
        if self._last is None or self._last[0] != key:
            self._last = None  # the previous key is released before the next is computed
            self._last = (key, self.get(key))
        return self._last[1][start:stop]


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


class IA3Expert(_AppliedAdapter):
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

    def _vector(self, module: IA3Module, dtype: torch.dtype) -> torch.Tensor:
        return self.adapter.tensors.get(module.vector_key).to(adapter_dtype(dtype))

    def _merged(self, key: str) -> torch.Tensor:
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
