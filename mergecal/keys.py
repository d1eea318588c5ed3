"""Named key-selection rules: each method states exactly which state-dict keys it touches.

The rules follow the authors' code (docs/references.md, "Which parameters each method touches").
A rule sees a key's name, shape and dtype only, so it can be applied to checkpoint metadata
without loading tensors. The authors wrote their rules for open_clip names; ``key_role`` lets a rule pick the
same parameters (by role) under HF CLIP, BERT-family and Llama names too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .architecture_specs import ARCHITECTURE_SPECS, ROLES
from .errors import UnknownNameError

# The roles the authors' substring rules single out by open_clip name, for every architecture
# (``architecture_specs``: each declares its patterns and how a key of its other layouts reads in its own, HF CLIP's
# by its open_clip counterpart). The architectures' names do not collide, so the first match is the role. The patch
# embedding (conv1) is a conv layer, role "other"; LayerNorm/RMSNorm parameters are 1-D and no rule below takes them.
_ROLES = [(role, spec.canonical_name or (lambda key: key), pattern)
          for role in ROLES for spec in ARCHITECTURE_SPECS.values()
          for name, pattern in spec.role_patterns().items() if name == role]


def key_role(key: str) -> str:
    """``"embedding"``, ``"projection"`` or ``"other"`` for a parameter name of any architecture in
    ``architecture_specs``."""
    return next((role for role, canonical, pattern in _ROLES if pattern.search(canonical(key))), "other")


@dataclass(frozen=True)
class KeyRule:
    """Select floating-point keys by number of dimensions and name substrings."""

    name: str
    description: str
    ndims: frozenset[int] | None = None  # None: any number of dimensions
    min_ndim: int = 0
    exclude: tuple[str, ...] = ()  # a key containing any of these substrings is not selected
    require: tuple[str, ...] = ()  # a key must contain every one of these substrings
    exclude_roles: frozenset[str] = frozenset()  # a key whose key_role is one of these is not selected

    def matches(self, key: str, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> bool:
        if not dtype.is_floating_point:
            return False
        ndim = len(shape)
        if self.ndims is not None and ndim not in self.ndims:
            return False
        if ndim < self.min_ndim:
            return False
        if any(pattern in key for pattern in self.exclude):
            return False
        if self.exclude_roles and key_role(key) in self.exclude_roles:
            return False
        return all(pattern in key for pattern in self.require)


KEY_RULES: dict[str, KeyRule] = {
    rule.name: rule
    for rule in [
        KeyRule("all_float", "every floating-point key (TA, WA, TIES, DARE, Consensus)"),
        KeyRule("matrices", "every 2-D key (FusionBench's SVC)", ndims=frozenset({2})),
        KeyRule(
            "matrices_except_text_projection",
            "2-D keys except text_projection (TSV-M, Iso-C, Iso-CTS; positional_embedding included)",
            ndims=frozenset({2}),
            exclude=("text_projection",),
        ),
        KeyRule(
            "svc_authors",
            "2-D keys whose name contains neither 'text_projection' nor 'embedding' (SVC authors), nor any embedding "
            "under other names (Llama's embed_tokens and lm_head); final projections stay covered, as visual.proj is",
            ndims=frozenset({2}),
            exclude=("text_projection", "embedding"),
            exclude_roles=frozenset({"embedding"}),
        ),
        KeyRule("vectors", "1-D keys (biases, LayerNorm parameters, class embedding)", ndims=frozenset({1})),
        KeyRule(
            "wsc_weights",
            "keys containing 'weight' with 2 or more dimensions, reshaped to [out, -1] (MAGIC WSC; "
            "LayerNorm weights are 1-D and so excluded); embeddings and final projections are left alone in every "
            "layout, the patch embedding conv1 is covered",
            min_ndim=2,
            require=("weight",),
            # open_clip spells most embeddings and projections without 'weight', HF names end in '.weight'. The
            # one open_clip key this takes out is the text tower's token_embedding.weight, which the authors'
            # substring rule covered with no effect (their text tower is never fine-tuned: a zero update)
            exclude_roles=frozenset({"embedding", "projection"}),
        ),
    ]
}


def get_key_rule(name: str) -> KeyRule:
    try:
        return KEY_RULES[name]
    except KeyError:
        raise UnknownNameError(
            f"unknown key rule {name!r}; choose one of: {', '.join(sorted(KEY_RULES))}"
        ) from None
