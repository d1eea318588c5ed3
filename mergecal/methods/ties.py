"""TIES-Merging (Yadav et al., 2023): trim, elect sign, disjoint merge.

1. Trim: keep each task vector's top-k fraction of entries by magnitude (k = 0.2). The original code
   and FusionBench rank over the whole flattened model (``trim_scope="global"``, default); MergeKit and
   PEFT rank within each tensor (``"per_tensor"``). The global threshold is found exactly in a
   streaming pass (mergecal.magnitude), so no flattened copy of the model is ever built.
   ``int(k * n)`` entries are kept (entries tied with the threshold are kept too; the original's
   ``kthvalue`` comparison keeps one entry more).
2. Elect: per coordinate the sign of the total mass sum_t trimmed_t (``sign_vote="mass"``, the paper);
   ``"count"`` takes the sign of the sum of signs (MergeKit's ``count``). A zero vote takes the
   majority elected sign over the trim scope, as the original code does. Where that majority is itself 0,
   nothing is kept at the coordinate (the original's ``where(sign > 0, T > 0, T < 0)`` keeps the negative
   entries there, an artefact of its comparison; it needs exactly balanced votes over the whole scope).
3. Disjoint merge: mean of the entries that agree with the elected sign (``disjoint="mean"``, the
   paper; ``"sum"`` as in FusionBench's config; ``"max"`` keeps the largest agreeing magnitude).
Then theta = theta_0 + lambda * merged, lambda = 1 by default (chosen on validation in the paper).
K = 1: no sign conflicts, so lambda * the trimmed task vector (its top-k entries; the rest is zero).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field

from ..errors import ParameterError
from ..magnitude import kth_largest_magnitudes
from .base import MergeMethod, MergeParams, register


class TiesParams(MergeParams):
    scaling: float = 1.0  # lambda
    top_k: float = Field(0.2, gt=0.0, le=1.0)  # fraction of entries kept per task vector
    trim_scope: Literal["global", "per_tensor"] = "global"
    sign_vote: Literal["mass", "count"] = "mass"
    disjoint: Literal["mean", "sum", "max"] = "mean"


def trim(taus: list[torch.Tensor], thresholds: Sequence[float]) -> torch.Tensor:
    """Stack of the task vectors with entries below each task's magnitude threshold set to zero."""
    stacked = torch.stack(taus)
    for t, threshold in enumerate(thresholds):
        stacked[t].masked_fill_(stacked[t].abs() < threshold, 0.0)
    return stacked


def elect_signs(trimmed: torch.Tensor, sign_vote: str) -> torch.Tensor:
    votes = trimmed.sum(dim=0) if sign_vote == "mass" else torch.sign(trimmed).sum(dim=0)
    return torch.sign(votes)


def disjoint_merge(trimmed: torch.Tensor, signs: torch.Tensor, how: str) -> torch.Tensor:
    agree = (torch.sign(trimmed) == signs.unsqueeze(0)) & (trimmed != 0)
    selected = trimmed * agree
    if how == "mean":
        return selected.sum(dim=0) / agree.sum(dim=0).clamp(min=1)
    if how == "sum":
        return selected.sum(dim=0)
    return selected.abs().amax(dim=0) * signs


BLOCK = 1 << 22  # elements of each task vector merged at a time (16 MB in float32)


def kept_count(top_k: float, numel: int) -> int:
    return int(top_k * numel)


def magnitude_thresholds(stream, counts: list[int], numel: int) -> list[float]:
    """``kth_largest_magnitudes(stream, counts)`` for ``trim``, without its two passes over the data when every
    count keeps all ``numel`` elements (top_k = 1: DARE over TIES as MergeKit's ``dare_ties``, say): 0.0 then trims
    nothing, exactly as the smallest magnitude would (``trim`` zeroes only magnitudes strictly below it)."""
    if all(count >= numel for count in counts):
        return [0.0] * len(counts)
    return kth_largest_magnitudes(stream, counts)


class TiesCore:
    """TIES' trim / elect / merge with its (optionally global) statistics; shared with DARE+TIES."""

    def __init__(self, params: TiesParams | "MergeParams", owner: str):
        self.p = params
        self.owner = owner
        self._thresholds: list[float] | None = None
        self._majority: float | None = None

    def fit(self, task_vectors, keys: Sequence[str]) -> None:
        if self.p.trim_scope != "global":
            return
        numel = sum(int(torch.Size(task_vectors.shape(k)).numel()) for k in keys)
        n_keep = kept_count(self.p.top_k, numel)
        K = task_vectors.K
        self._thresholds = magnitude_thresholds(lambda: (task_vectors.load(k) for k in keys), [n_keep] * K, numel)
        # the original resolves zero votes with the majority elected sign over the flattened model
        total = 0.0
        for key in keys:
            trimmed = trim(task_vectors.load(key), self._thresholds)
            total += float(elect_signs(trimmed, self.p.sign_vote).sum())
        self._majority = float(torch.sign(torch.tensor(total)))

    def combine(self, key: str, taus: list[torch.Tensor]) -> torch.Tensor:
        if self.p.trim_scope == "global" and self._thresholds is None:
            raise ParameterError(f"{self.owner}: trim_scope='global' needs fit() over the keys before combine()")
        # every step below is per coordinate but the thresholds and the zero-vote majority, which are sums over the
        # tensor: so the K task vectors are walked in blocks of ~4M elements, never stacked whole (a 65M-element
        # embedding's stack and its masks held 5 GB); the histograms and the vote total add up exactly as one pass
        flat = [tau.reshape(-1) for tau in taus]
        blocks = [(start, min(start + BLOCK, flat[0].numel())) for start in range(0, flat[0].numel(), BLOCK)]

        def in_blocks():
            return ([t[a:b] for t in flat] for a, b in blocks)

        if self.p.trim_scope == "global":
            thresholds, majority = self._thresholds, self._majority
        else:
            numel = flat[0].numel()
            thresholds = magnitude_thresholds(in_blocks, [kept_count(self.p.top_k, numel)] * len(flat), numel)
            votes = sum(float(elect_signs(trim(part, thresholds), self.p.sign_vote).sum(dtype=torch.float64))
                        for part in in_blocks())
            majority = float(torch.sign(torch.tensor(votes)))
        merged = torch.empty_like(flat[0])
        for (a, b), part in zip(blocks, in_blocks()):
            trimmed = trim(part, thresholds)
            signs = elect_signs(trimmed, self.p.sign_vote)
            signs[signs == 0] = majority
            merged[a:b] = disjoint_merge(trimmed, signs, self.p.disjoint)
        return merged.reshape(taus[0].shape)

    @property
    def blockwise(self) -> bool:
        """top_k = 1 within each tensor trims nothing: what is left of a key's statistics is the zero-vote majority,
        a sum of per-coordinate signs that a first pass over the row blocks adds up exactly as ``combine`` does."""
        return self.p.top_k >= 1.0 and self.p.trim_scope == "per_tensor"

    def combine_blocks(self, blocks):
        """``combine``'s bits in two passes over the row blocks (``blockwise`` only): the vote total, then the
        merge. No trim (its thresholds would be 0.0, which zero nothing); the votes are integers summed in
        float64, so any partition of the key into blocks adds them to the same total."""
        votes = sum(float(elect_signs(torch.stack(part), self.p.sign_vote).sum(dtype=torch.float64))
                    for part in blocks())
        majority = float(torch.sign(torch.tensor(votes)))
        for part in blocks():
            stacked = torch.stack(part)
            signs = elect_signs(stacked, self.p.sign_vote)
            signs[signs == 0] = majority
            yield disjoint_merge(stacked, signs, self.p.disjoint)


@register
class Ties(MergeMethod):
    name = "ties"
    Params = TiesParams
    key_rule = "all_float"
    summary = "trim to top-k, elect sign by mass, disjoint mean"

    def __init__(self, params=None, **values):
        super().__init__(params, **values)
        self._core = TiesCore(self.params, self.name)

    @property
    def blockwise(self) -> bool:
        return self._core.blockwise

    def fit(self, task_vectors, keys):
        self._core.fit(task_vectors, keys)

    def combine(self, key, taus):
        return self._core.combine(key, taus)

    def combine_blocks(self, key, blocks):
        return self._core.combine_blocks(blocks)
