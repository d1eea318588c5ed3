"""Exact k-th largest magnitude over a stream of tensors, in two streaming passes.

For non-negative float32 values the int32 bit pattern is monotonic in the value, so the k-th largest
|x| can be found by radix selection: pass 1 histograms the high 16 bits, which locates the bucket
holding the k-th value; pass 2 histograms the low 16 bits inside that bucket, which gives the value
exactly. Memory is two histograms per selection, whatever the model size; this is how TIES' global
top-k trim runs without concatenating the flattened model.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

_HIGH_BINS = 1 << 15  # abs(float32) has sign bit 0, so its high 16 bits are < 2**15
_LOW_BINS = 1 << 16


def _abs_bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().float().abs().reshape(-1).view(torch.int32)  # bincount takes int32 directly


def kth_largest_magnitudes(stream: Callable[[], Iterable[list[torch.Tensor]]], counts: list[int]) -> list[float]:
    """For each of S series, the ``counts[s]``-th largest |x| over all tensors it yields.

    ``stream()`` must return a fresh iterable on each call (it is walked twice); each item is a list of
    S tensors, the s-th belonging to series s (e.g. one key's slice of each of K task vectors).
    A count of 0 gives +inf (nothing is that large); a count above the number of elements gives 0.0.
    """
    S = len(counts)
    high = torch.zeros(S, _HIGH_BINS, dtype=torch.int64)
    for tensors in stream():
        for s, tensor in enumerate(tensors):
            high[s] += torch.bincount(_abs_bits(tensor) >> 16, minlength=_HIGH_BINS).cpu()

    # bucket b_s holding the k-th largest, and how many elements lie in higher buckets
    buckets, above = [], []
    for s in range(S):
        from_top = high[s].flip(0).cumsum(0)
        k = counts[s]
        if k <= 0 or k > int(from_top[-1]):
            buckets.append(None)
            above.append(0)
            continue
        idx = int(torch.searchsorted(from_top, torch.tensor(k)))
        bucket = _HIGH_BINS - 1 - idx
        buckets.append(bucket)
        above.append(int(from_top[idx - 1]) if idx > 0 else 0)

    low = torch.zeros(S, _LOW_BINS, dtype=torch.int64)
    if any(b is not None for b in buckets):
        for tensors in stream():
            for s, tensor in enumerate(tensors):
                if buckets[s] is None:
                    continue
                bits = _abs_bits(tensor)
                inside = bits[(bits >> 16) == buckets[s]]
                if inside.numel():
                    low[s] += torch.bincount(inside & 0xFFFF, minlength=_LOW_BINS).cpu()

    result = []
    for s in range(S):
        k = counts[s]
        if k <= 0:
            result.append(float("inf"))
            continue
        if buckets[s] is None:  # asked for more elements than exist: every element qualifies
            result.append(0.0)
            continue
        from_top = low[s].flip(0).cumsum(0)
        idx = int(torch.searchsorted(from_top, torch.tensor(k - above[s])))
        bits = (buckets[s] << 16) | (_LOW_BINS - 1 - idx)
        result.append(torch.tensor([bits], dtype=torch.int32).view(torch.float32).item())
    return result
