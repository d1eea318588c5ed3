"""Each method's own cost in a cell (MAGIC's Table VII: a method's time beside its accuracy): the seconds of the
merge and of each calibration step, and their peak memory, not the evaluation or the scaling search around them.

A caller that wants them opens ``recording()`` (the benchmark's flow, around one cell); the library's steps report
into it, and cost nothing beyond a thread-local read when nobody records:

* the merge: the time spent producing its stream of merged keys (``fit`` included: TIES's global threshold), the
  task vectors' reads included;
* a weight-space calibration (WSC, SVC): its ``calibrate`` calls, with the read of a key's task vectors counted
  to the first calibration that covers the key. The merge and these stream together, key by key, so their memory
  is one figure, ``weight_space``: the peak of anonymous resident memory above its value when the stream began;
* a pre-merge or feature-space step (DisTaC, rescale, FSC): its registry ``run`` (building the models it is
  given is the caller's), time and peak memory of its own.

``calls`` counts the passes: a scaling search merges again at each value when the recipe cannot be rescaled, and
FSC runs once per value, so one pass costs ``seconds / calls``. Memory is the process's: when two cells run at
once in one process (the thread runner), the other's allocations count too, so it is an upper bound there.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from .perf.memory import peak_anonymous_memory

#: the memory figure shared by the merge and the weight-space calibrations (they stream together)
WEIGHT_SPACE = "weight_space"

_LOCAL = threading.local()


@dataclass
class StepCosts:
    """Seconds and passes per step name, peak extra MiB per step name (or ``WEIGHT_SPACE``): the largest of its
    passes."""

    seconds: dict[str, float] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    peak_mib: dict[str, float] = field(default_factory=dict)

    def add_seconds(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds

    def add_call(self, name: str) -> None:
        self.calls[name] = self.calls.get(name, 0) + 1

    def add_peak(self, name: str, mib: float) -> None:
        self.peak_mib[name] = max(self.peak_mib.get(name, 0.0), mib)

    def metrics(self) -> dict[str, float]:
        """MLflow metrics: ``cost.seconds.<step>`` (one pass: the total over ``calls``), ``cost.calls.<step>``,
        ``cost.peak_mib.<step or weight_space>``."""
        out = {}
        for name, total in sorted(self.seconds.items()):
            calls = max(self.calls.get(name, 1), 1)
            out[f"cost.seconds.{name}"] = total / calls
            out[f"cost.calls.{name}"] = float(calls)
        out.update({f"cost.peak_mib.{name}": mib for name, mib in sorted(self.peak_mib.items())})
        return out


def current() -> StepCosts | None:
    """The costs being recorded in this thread, or None."""
    return getattr(_LOCAL, "costs", None)


@contextmanager
def recording() -> Iterator[StepCosts]:
    """Record the cost of every step run in this thread until the block ends."""
    previous, _LOCAL.costs = current(), StepCosts()
    try:
        yield _LOCAL.costs
    finally:
        _LOCAL.costs = previous


@contextmanager
def step(name: str, *, memory: bool = True, call: bool = True) -> Iterator[None]:
    """Time one pass of step ``name`` (and its peak memory unless ``memory=False``) when recording."""
    costs = current()
    if costs is None:
        yield
        return
    start = time.perf_counter()
    with peak_anonymous_memory() if memory else nullcontext() as peak:
        try:
            yield
        finally:
            costs.add_seconds(name, time.perf_counter() - start)
            if call:
                costs.add_call(name)
    if peak is not None:
        costs.add_peak(name, peak.extra_mb)


def count_pass(names: Iterable[str]) -> None:
    """One more pass of each step in ``names`` (steps timed key by key, ``step(..., call=False)``)."""
    costs = current()
    for name in names if costs is not None else ():
        costs.add_call(name)


def timed(name: str, stream: Iterable) -> Iterator:
    """``stream`` passed through, the time spent producing its items counted to ``name`` (one pass)."""
    costs = current()
    if costs is None:
        yield from stream
        return
    costs.add_call(name)
    iterator = iter(stream)
    while True:
        start = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        finally:
            costs.add_seconds(name, time.perf_counter() - start)
        yield item


def peak_of(name: str, stream: Iterable) -> Iterator:
    """``stream`` passed through, the peak memory while it is consumed counted to ``name``."""
    costs = current()
    if costs is None:
        yield from stream
        return
    peak = None
    try:
        with peak_anonymous_memory() as peak:
            yield from stream
    finally:  # also when the consumer stops at the last item and the stream is closed (GeneratorExit)
        if peak is not None:
            costs.add_peak(name, peak.extra_mb)
