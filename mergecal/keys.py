"""Named key-selection rules: each method states exactly which state-dict keys it touches.

The rules follow ../shared/notes/reference-details.md ("Which parameters each method touches").
A rule sees a key's name, shape and dtype only, so it can be applied to checkpoint metadata
without loading tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import UnknownNameError


@dataclass(frozen=True)
class KeyRule:
    """Select floating-point keys by number of dimensions and name substrings."""

    name: str
    description: str
    ndims: frozenset[int] | None = None  # None: any number of dimensions
    min_ndim: int = 0
    exclude: tuple[str, ...] = ()  # a key containing any of these substrings is not selected
    require: tuple[str, ...] = ()  # a key must contain every one of these substrings

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
            "2-D keys whose name contains neither 'text_projection' nor 'embedding' (SVC authors)",
            ndims=frozenset({2}),
            exclude=("text_projection", "embedding"),
        ),
        KeyRule("vectors", "1-D keys (biases, LayerNorm parameters, class embedding)", ndims=frozenset({1})),
        KeyRule(
            "wsc_weights",
            "keys containing 'weight' with 2 or more dimensions, reshaped to [out, -1] (MAGIC WSC; "
            "LayerNorm weights are 1-D and so excluded)",
            min_ndim=2,
            require=("weight",),
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
