"""The benchmark flow's progress line (#62): cells done of the matrix, how many came from the cache and how many
failed, how many run now, the time since the cells were submitted and an estimate of the time left::

    cells 37/320 done (12 cached, 1 failed), 2 running, elapsed 6:12, ETA ~21:40 (~14:05 UTC)

The estimate comes from the computed cells only (a cached cell is done at once and says nothing of the rest):
the remaining cells divided by the computed cells' rate, both since the first of them completed (so the
workers' start-up, a temporary Prefect server per worker process, does not count as cell time) and over the last
``RECENT`` of them; when the two disagree by more than a quarter the line gives both ends (``ETA 18:00-24:30``),
since the matrix's tracks differ in cost per cell and the recent rate follows a change of track. No estimate
before ``MIN_COMPUTED`` cells are computed. The remaining cells are counted as computed: ones that turn out
cached make the end come sooner. The flow (``mergecal.pipeline.flow``) feeds it completions and clocks.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from mergecal.errors import ParameterError

INTERVAL_ENV = "MERGECAL_PROGRESS_SECONDS"
DEFAULT_INTERVAL = 30.0
MIN_COMPUTED = 5  # the first cells finish together, one per worker: their rate alone says little
RECENT = 20
AGREE = 1.25  # the two estimates within this factor: one "~" figure


def progress_interval(environ: Mapping[str, str]) -> float:
    """Seconds between progress lines: ``MERGECAL_PROGRESS_SECONDS``, else 30."""
    given = environ.get(INTERVAL_ENV)
    if given is None or not given.strip():
        return DEFAULT_INTERVAL
    try:
        seconds = float(given)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0 or seconds == float("inf"):
        raise ParameterError(f"{INTERVAL_ENV}={given!r}: expected a number of seconds greater than 0")
    return seconds


@dataclass
class Progress:
    """The flow's tally; ``started`` and every ``now`` are readings of one monotonic clock (seconds)."""

    total: int
    started: float
    done: int = 0
    cached: int = 0
    failed: int = 0
    computed_at: list[float] = field(default_factory=list)  # when each computed (not cached) cell completed
    last_line: float | None = None

    def record(self, now: float, *, cached: bool, failed: bool) -> None:
        self.done += 1
        self.cached += cached
        self.failed += failed
        if not cached:
            self.computed_at.append(now)

    def due(self, now: float, interval: float) -> bool:
        """A line is due when none was given for ``interval`` seconds since the start or the last line."""
        return now - (self.started if self.last_line is None else self.last_line) >= interval

    def line(self, now: float, wall: float, running: int | None = None) -> str:
        """The progress line at ``now`` (``wall``: the same moment in seconds since the epoch, for the end's UTC
        time); ``running``: the cells running now, when the task runner tells (None: left out)."""
        counts = f"cells {self.done}/{self.total} done ({self.cached} cached, {self.failed} failed)"
        parts = [counts] + ([f"{running} running"] if running is not None else [])
        parts.append(f"elapsed {clock(now - self.started)}")
        if self.done < self.total:
            parts.append(eta_text(eta_range(self.computed_at, self.started, now, self.total - self.done), wall))
        return ", ".join(parts)


def running_cells(futures: Sequence) -> int | None:
    """How many of the flow's cells (Prefect futures) run now, where the task runner tells: a thread pool marks a
    future running as a worker takes it; a process pool's futures (Prefect's wrappers) and Dask's do not tell
    running from queued (None)."""
    wrapped = [getattr(future, "wrapped_future", None) for future in futures]
    if not all(type(future) is concurrent.futures.Future for future in wrapped):
        return None
    return sum(future.running() for future in wrapped)


def eta_range(computed_at: list[float], started: float, now: float, remaining: int) -> tuple[float, float] | None:
    """Seconds left, as (shorter, longer) of the two rates' estimates; None before ``MIN_COMPUTED`` computed
    cells."""
    n = len(computed_at)
    if n < MIN_COMPUTED or remaining <= 0:
        return None
    rates = [(n - 1) / max(now - computed_at[0], 1e-9)]
    if n > RECENT:
        rates.append(RECENT / max(now - computed_at[-RECENT - 1], 1e-9))
    estimates = sorted(remaining / rate for rate in rates)
    return estimates[0], estimates[-1]


def eta_text(eta: tuple[float, float] | None, wall: float) -> str:
    if eta is None:
        return f"ETA after {MIN_COMPUTED} computed cells"
    low, high = eta
    if high <= low * AGREE:
        middle = (low + high) / 2
        return f"ETA ~{clock(middle)} (~{utc(wall + middle)} UTC)"
    return f"ETA {clock(low)}-{clock(high)} ({utc(wall + low)}-{utc(wall + high)} UTC)"


def clock(seconds: float) -> str:
    """``m:ss``, or ``h:mm:ss`` from an hour on."""
    whole = max(int(round(seconds)), 0)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def utc(wall: float) -> str:
    """``HH:MM`` UTC, to the nearest minute."""
    return time.strftime("%H:%M", time.gmtime(round(wall / 60) * 60))
