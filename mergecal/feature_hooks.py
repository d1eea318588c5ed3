"""Architectures: per architecture, which modules a feature-space method hooks and how to read them.

One place for the architecture knowledge that MAGIC's FSC needs (and that other feature-space code can
reuse): the qualified names of the hooked modules, the layout of each module's output (which dimension is
the batch, which the token position), how to run the model on a batch, and which module types are affine
in their parameters (so that a scalar or per-output-channel feature rescaling can be folded into weights).

Registered architectures (see docs/references.md, MAGIC, **FSC**), one per ``mergecal.architecture_specs`` entry that
declares its FSC modules (``FscModules``: this module turns the declaration into a ``HookedArchitecture``):

- ``open_clip_vit``: the VISUAL tower of an open_clip ``VisionTransformer`` (standalone, inside ``CLIP``,
  or inside any wrapper): ``visual.conv1``, ``visual.ln_pre``, per resblock ``ln_1``, ``attn`` (the
  ``nn.MultiheadAttention`` as one unit: its ``out_proj`` is never called as a module), ``ln_2``,
  ``mlp.c_fc``, ``mlp.gelu``, ``mlp.c_proj``, then ``visual.ln_post``. Residual blocks run batch-first in
  open_clip >= 2.24 (``transformer.batch_first``, True by default in 3.3.0: outputs [N, L, D]); older
  releases ran them sequence-first ([L, N, D]), which the batch dimension of the block modules follows.
- ``hf_bert``: a Hugging Face ``BertModel`` (alone or inside ``BertFor...``): ``embeddings.LayerNorm`` and per
  layer ``attention.self.query/key/value``, ``attention.output.dense``, ``attention.output.LayerNorm``,
  ``intermediate.dense``, ``output.dense``, ``output.LayerNorm`` (all outputs [N, L, D]). Not hooked: the
  nn.Embedding lookups, ``intermediate_act_fn`` (parameter-free: its ratio is always 1), the pooler and any
  task head (the analogue of open_clip's ``visual.proj``, a bare parameter that FSC never sees).

Optional backbones (open_clip, transformers) are never imported here: a model of such a class can only
exist if its library is already imported, so detection looks the classes up in ``sys.modules``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import nn

from .architecture_specs import ARCHITECTURE_SPECS, ArchitectureSpec, FscModules
from .errors import ParameterError, UnknownNameError

Granularity = Literal["token", "channel", "scalar"]


@dataclass(frozen=True)
class ModuleSpec:
    """One hooked module and the layout of its (first) output tensor.

    ``granularity`` says what one calibration ratio covers:
      - ``"token"``: the feature (last) dimension is reduced; one ratio per remaining position after the
        batch dimension ``batch_dim`` is averaged out (per token for [N, L, D] or [L, N, D]; a single
        value for a 2-D [N, D] output);
      - ``"channel"``: a convolution's output [N, C, *spatial]; spatial positions are reduced, one ratio
        per output channel;
      - ``"scalar"``: one ratio for the whole module (LayerNorms).
    """

    name: str
    granularity: Granularity = "token"
    batch_dim: int = 0


def default_granularity(module: nn.Module) -> Granularity:
    """The ratio granularity MAGIC uses for a module type: conv -> channel, norm layers -> scalar, else token."""
    if isinstance(module, nn.modules.conv._ConvNd):
        return "channel"
    if isinstance(module, (nn.LayerNorm, nn.RMSNorm)):
        return "scalar"
    return "token"


def _known_affine_types() -> tuple[type, ...]:
    types: list[type] = [nn.Linear, nn.modules.linear.NonDynamicallyQuantizableLinear, nn.Conv1d, nn.Conv2d,
                         nn.Conv3d, nn.LayerNorm, nn.RMSNorm]
    oc = sys.modules.get("open_clip.transformer")
    if oc is not None:  # open_clip's LayerNorm subclasses only cast dtypes around F.layer_norm
        types += [getattr(oc, n) for n in ("LayerNorm", "LayerNormFp32") if hasattr(oc, n)]
    return tuple(types)


def is_affine_in_parameters(module: nn.Module) -> bool:
    """Whether ``module``'s output is an affine function of its own parameters for a fixed input.

    True only for an allow-list of EXACT types (nn.Linear, nn.Conv1d/2d/3d, nn.LayerNorm, nn.RMSNorm and
    open_clip's LayerNorm casts); subclasses such as quantised or LoRA linears are not trusted. For these,
    f(x; p0 + r (pm - p0)) = f0(x) + r (fm(x) - f0(x)) holds exactly for a scalar r, and for a per-output-
    channel r on Linear/Conv (non-transposed) weights and biases.
    """
    return type(module) in _known_affine_types()


def default_run(model: nn.Module, batch: Any) -> Any:
    """Run ``model`` on a batch: ``model(**batch)`` for a mapping, ``model(*batch)`` for a tuple/list, else
    ``model(batch)``."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


@dataclass(frozen=True)
class HookedArchitecture:
    """An architecture: how to find it in a model, which modules FSC hooks, and how to run it.

    ``fsc_modules(model)`` returns the hooked modules with their output layout (qualified names relative
    to ``model``); ``run(model, batch)`` runs a forward pass that reaches every hooked module.
    """

    name: str
    description: str
    detect: Callable[[nn.Module], bool]
    fsc_modules: Callable[[nn.Module], list[ModuleSpec]]
    run: Callable[[nn.Module, Any], Any] = default_run

    def fsc_module_names(self, model: nn.Module) -> list[str]:
        """Qualified names (as in ``model.named_modules()``) of the modules MAGIC-FSC hooks."""
        return [spec.name for spec in self.fsc_modules(model)]


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


def _find_instances(model: nn.Module, cls: type | None) -> list[tuple[str, nn.Module]]:
    if cls is None:
        return []
    return [(name, module) for name, module in model.named_modules() if isinstance(module, cls)]


def _require(model: nn.Module, names: Sequence[str], architecture: str) -> None:
    present = dict(model.named_modules())
    for name in names:
        if name not in present:
            raise ParameterError(f"{architecture}: expected module {name!r} is missing from the model")


# --- architectures from their specs (mergecal.architecture_specs) --------------------------------------------------

def _class(model_class: str) -> type | None:
    """``"module:Class"`` if its module is already imported (a model of it can exist only then), else None."""
    module_name, class_name = model_class.split(":")
    module = sys.modules.get(module_name)
    return getattr(module, class_name, None) if module is not None else None


def _instance(model: nn.Module, layout: FscModules, architecture: str) -> tuple[str, nn.Module]:
    found = _find_instances(model, _class(layout.model_class))
    if len(found) != 1:
        raise ParameterError(f"{architecture}: expected exactly one {layout.what} in the model, found {len(found)}")
    return found[0]


def _batch_first(instance: nn.Module, attribute: str | None) -> bool:
    if attribute is None:
        return True
    owner, _, name = attribute.rpartition(".")
    return bool(getattr(instance.get_submodule(owner) if owner else instance, name, False))


def _declared_modules(layout: FscModules, architecture: str) -> Callable[[nn.Module], list[ModuleSpec]]:
    def fsc_modules(model: nn.Module) -> list[ModuleSpec]:
        prefix, instance = _instance(model, layout, architecture)
        block_batch_dim = 0 if _batch_first(instance, layout.batch_first) else 1

        def present(name: str) -> bool:  # an optional module replaced by nn.Identity is not hooked
            return not (name in layout.optional and isinstance(instance.get_submodule(name), nn.Identity))

        names = [(n, 0) for n in layout.before if present(n)]
        for i in range(len(instance.get_submodule(layout.blocks))):
            names += [(f"{layout.blocks}.{i}.{sub}", block_batch_dim) for sub in layout.block]
        names += [(n, 0) for n in layout.after if present(n)]
        qualified = [(_join(prefix, n), dim) for n, dim in names]
        _require(model, [n for n, _ in qualified], architecture)
        for name, _ in qualified:
            if name.rpartition(".")[2] in layout.multihead_attention and \
                    not isinstance(model.get_submodule(name), nn.MultiheadAttention):
                raise ParameterError(f"{architecture}: {name!r} is not an nn.MultiheadAttention "
                                     "(custom attention blocks are not supported; pass explicit module names)")
        return [ModuleSpec(n, default_granularity(model.get_submodule(n)), dim) for n, dim in qualified]

    return fsc_modules


def _declared_run(method: str | None) -> Callable[[nn.Module, Any], Any]:
    if method is None:
        return default_run

    def run(model: nn.Module, batch: Any) -> Any:
        """The batch through ``method`` when the model has one (one tower of a two-tower model)."""
        if hasattr(model, method) and not isinstance(batch, Mapping):
            return getattr(model, method)(batch)
        return default_run(model, batch)

    return run


def architecture_of(spec: ArchitectureSpec) -> HookedArchitecture:
    """The FSC architecture of an architecture spec (which must declare its ``fsc`` modules)."""
    layout = spec.fsc
    if layout is None:
        raise ParameterError(f"{spec.name}: the architecture spec declares no FSC modules")
    return HookedArchitecture(name=spec.name, description=spec.description,
                          detect=lambda model: len(_find_instances(model, _class(layout.model_class))) == 1,
                          fsc_modules=_declared_modules(layout, spec.name),
                          run=_declared_run(layout.run_method))


HOOKED_ARCHITECTURES: dict[str, HookedArchitecture] = {s.name: architecture_of(s) for s in ARCHITECTURE_SPECS.values()
                                                       if s.fsc is not None}
OPEN_CLIP_VIT = HOOKED_ARCHITECTURES["open_clip_vit"]
HF_BERT = HOOKED_ARCHITECTURES["hf_bert"]


def get_architecture(name: str) -> HookedArchitecture:
    try:
        return HOOKED_ARCHITECTURES[name]
    except KeyError:
        raise UnknownNameError(f"unknown architecture {name!r}; "
                               f"choose one of: {', '.join(sorted(HOOKED_ARCHITECTURES))}") from None


def architecture_for(model: nn.Module) -> HookedArchitecture:
    """The registered architecture whose ``detect`` accepts ``model`` (exactly one must)."""
    matches = [architecture for architecture in HOOKED_ARCHITECTURES.values() if architecture.detect(model)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise UnknownNameError(f"no architecture recognises {type(model).__name__}; known architectures: "
                               f"{', '.join(sorted(HOOKED_ARCHITECTURES))} (or pass explicit module names)")
    raise UnknownNameError(f"{type(model).__name__} matches several architectures "
                           f"({', '.join(f.name for f in matches)}); name one explicitly")


def explicit_architecture(module_names: Sequence[str], *, batch_dim: int = 0,
                          name: str = "explicit") -> HookedArchitecture:
    """An architecture over an explicit list of module names; granularity from each module's type
    (``default_granularity``) and the batch at ``batch_dim`` of every token-granular output."""
    names = list(module_names)
    if not names:
        raise ParameterError(f"{name}: the list of module names is empty")
    if len(set(names)) != len(names):
        raise ParameterError(f"{name}: module names are repeated")

    def fsc_modules(model: nn.Module) -> list[ModuleSpec]:
        present = dict(model.named_modules())
        for module_name in names:
            if module_name not in present:
                raise ParameterError(f"{name}: module {module_name!r} is not in the model")
        return [ModuleSpec(n, default_granularity(present[n]), batch_dim) for n in names]

    return HookedArchitecture(name=name, description=f"explicit list of {len(names)} modules",
                              detect=lambda model: False, fsc_modules=fsc_modules)


def resolve_architecture(architecture: HookedArchitecture | str | Sequence[str] | None,
                         model: nn.Module) -> HookedArchitecture:
    """``None``: detect from ``model``; a name: the registered architecture; a list of names:
    ``explicit_architecture``."""
    if architecture is None:
        return architecture_for(model)
    if isinstance(architecture, HookedArchitecture):
        return architecture
    if isinstance(architecture, str):
        return get_architecture(architecture)
    if isinstance(architecture, Sequence):
        return explicit_architecture(architecture)
    raise ParameterError(f"architecture: expected an architecture name, a HookedArchitecture or a list of module "
                         f"names, got {type(architecture).__name__}")
