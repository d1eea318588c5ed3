"""DARE (Yu et al., 2024): drop each task-vector entry with probability p, rescale the survivors,
then merge with Task Arithmetic (default) or TIES.

Rescaling: ``"inverse_keep"`` multiplies survivors by 1/(1-p) (the paper; unbiased in expectation);
``"l1"`` rescales each tensor so its L1 norm is unchanged (MergeKit). p = 0.9 is the paper's rate (the
MAGIC authors' code drops 10% by mistake). The random mask of task t at key ``key`` is drawn from a
generator seeded by sha256(seed, t, key): the result does not depend on key order or on which other
keys are merged, and the same seed gives the same merge on the same device type.
K = 1: lambda * the dropped and rescaled task vector (then trimmed, with ``base="ties"``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Literal

import torch
from pydantic import Field

from .base import MergeMethod, MergeParams, register
from .ties import TiesCore


class DareParams(MergeParams):
    scaling: float = 0.3  # lambda of the base method
    drop_rate: float = Field(0.9, ge=0.0, lt=1.0)  # p
    seed: int = 0
    rescale: Literal["inverse_keep", "l1"] = "inverse_keep"
    base: Literal["task_arithmetic", "ties"] = "task_arithmetic"
    # used when base == "ties"
    top_k: float = Field(0.2, gt=0.0, le=1.0)
    trim_scope: Literal["global", "per_tensor"] = "global"
    sign_vote: Literal["mass", "count"] = "mass"
    disjoint: Literal["mean", "sum", "max"] = "mean"


def key_seed(seed: int, task_index: int, key: str) -> int:
    digest = hashlib.sha256(f"{seed}:{task_index}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def keep_mask(tau: torch.Tensor, drop_rate: float, generator: torch.Generator) -> torch.Tensor:
    """Which entries of ``tau`` survive a drop with probability ``drop_rate``: the generator's next ``tau.numel()``
    draws, so a key's row blocks taken in order draw the whole key's mask."""
    return torch.rand(tau.shape, generator=generator, device=tau.device) >= drop_rate


def drop_and_rescale(tau: torch.Tensor, drop_rate: float, seed: int, rescale: str) -> torch.Tensor:
    """One DARE draw: zero entries with probability ``drop_rate``, rescale the rest."""
    if drop_rate == 0.0:
        return tau.clone()
    out = tau * keep_mask(tau, drop_rate, torch.Generator(device=tau.device).manual_seed(seed))
    if rescale == "inverse_keep":
        return out.div_(1.0 - drop_rate)  # in place: the same bits, one key-sized buffer less
    kept_l1 = out.abs().sum()
    return out.mul_(tau.abs().sum() / kept_l1) if kept_l1 > 0 else out


class _DroppedTaskVectors:
    """A view of a TaskVectorSet whose loads are DARE-sparsified (for the base method's fit pass)."""

    def __init__(self, task_vectors, drop):
        self._tvs = task_vectors
        self._drop = drop
        self.K = task_vectors.K

    def shape(self, key):
        return self._tvs.shape(key)

    def load(self, key):
        return self._drop(key, self._tvs.load(key))


@register
class Dare(MergeMethod):
    name = "dare"
    Params = DareParams
    key_rule = "all_float"
    summary = "random drop with rescale, then TA or TIES"

    def __init__(self, params=None, **values):
        super().__init__(params, **values)
        self._ties = TiesCore(self.params, self.name) if self.params.base == "ties" else None

    @property
    def blockwise(self) -> bool:
        # TIES's trim reads each key's magnitude statistics, except at top_k = 1 within each tensor (ties.TiesCore)
        return self._ties is None or self._ties.blockwise

    def drop(self, key: str, taus: list[torch.Tensor]) -> list[torch.Tensor]:
        p = self.params
        return [drop_and_rescale(tau, p.drop_rate, key_seed(p.seed, t, key), p.rescale) for t, tau in enumerate(taus)]

    def fit(self, task_vectors, keys: Sequence[str]) -> None:
        if self._ties is not None:
            self._ties.fit(_DroppedTaskVectors(task_vectors, self.drop), keys)

    def combine(self, key, taus):
        if self._ties is not None:
            return self._ties.combine(key, self.drop(key, taus))
        # sum_of(self.drop(key, taus)), one dropped task vector at a time: the same additions in the same order
        p, total = self.params, None
        for t, tau in enumerate(taus):
            draw = drop_and_rescale(tau, p.drop_rate, key_seed(p.seed, t, key), p.rescale)
            total = draw if total is None else total.add_(draw)
        return total

    def combine_blocks(self, key, blocks):
        """DARE in row blocks: each task's generator continues from block to block, so the masks are the whole
        key's and inverse-keep rescaling gives ``combine``'s bits (over task arithmetic, and over TIES at top_k = 1,
        whose two passes see the same masks, kept: 1 byte an element and task). The L1 rescaling needs each task
        vector's whole-key L1 norms first: a first pass draws the masks (kept) and sums the norms, each block in
        float32 and the blocks in float64 (``combine``: one float32 sum of the key), so its factor may differ from
        ``combine``'s in the last bit."""
        if self._ties is not None:  # drop_rate 0: drop_and_rescale's copies, unchanged; TIES stacks its own
            yield from self._ties.combine_blocks(
                blocks if self.params.drop_rate == 0.0 else self._dropped_blocks(key, blocks, passes=2))
            return
        if self.params.drop_rate == 0.0:
            yield from super().combine_blocks(key, blocks)
            return
        for taus in self._dropped_blocks(key, blocks, passes=1)():
            total = taus[0]
            for tau in taus[1:]:
                total.add_(tau)  # combine's order; each dropped block is a buffer of its own
            yield total

    def _dropped_blocks(self, key, blocks, passes):
        """``blocks`` dropped and rescaled, iterable ``passes`` times: the masks are drawn once, in order (kept when
        the L1 norms or a second pass need them, each block's freed after its last pass)."""
        p = self.params
        draws = None

        def keep_masks(taus):
            nonlocal draws
            draws = draws or [torch.Generator(device=tau.device).manual_seed(key_seed(p.seed, t, key))
                              for t, tau in enumerate(taus)]
            return [keep_mask(tau, p.drop_rate, g) for tau, g in zip(taus, draws)]

        scales, masks = None, None
        if p.rescale == "l1" or passes > 1:
            masks, sums = [], None
            for taus in blocks():
                masks.append(keep_masks(taus))
                if p.rescale == "l1":
                    sums = sums or [[0.0, 0.0] for _ in taus]
                    for t, (tau, keep) in enumerate(zip(taus, masks[-1])):
                        magnitude = tau.abs()
                        sums[t][0] += float(magnitude.sum())
                        sums[t][1] += float(magnitude.mul_(keep).sum())  # |tau * keep| = |tau| * keep
            if p.rescale == "l1":
                scales = [torch.tensor(whole, dtype=torch.float32) / torch.tensor(kept, dtype=torch.float32)
                          if kept > 0 else None for whole, kept in sums or []]
        remaining = passes

        def dropped():
            nonlocal remaining
            remaining -= 1
            for i, taus in enumerate(blocks()):
                keeps = keep_masks(taus) if masks is None else masks[i]
                outs = []
                for tau, keep, scale in zip(taus, keeps, scales or [None] * len(taus)):
                    out = tau * keep  # drop_and_rescale's product
                    if scales is None:
                        out.div_(1.0 - p.drop_rate)
                    elif scale is not None:
                        out.mul_(scale)
                    outs.append(out)
                if masks is not None and remaining == 0:
                    masks[i] = None
                yield outs

        return dropped
