"""Peak resident memory of a block of code, measured on Linux via VmHWM (reset through clear_refs),
with a sampling thread as fallback where clear_refs is not writable."""

from __future__ import annotations

import os
import threading
import time
from contextlib import contextmanager

import psutil


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise OSError(field)


def _release_free_heap() -> None:
    """Return freed heap pages to the OS (glibc malloc_trim), so that a baseline taken next is not inflated by
    memory that an earlier measurement freed but the allocator kept."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


class PeakMemory:
    baseline_mb: float = 0.0
    peak_mb: float = 0.0
    method: str = ""

    @property
    def extra_mb(self) -> float:
        """Peak resident memory above what the process held when the block started."""
        return max(0.0, self.peak_mb - self.baseline_mb)


@contextmanager
def _sampled_peak(result: PeakMemory, read_mb, sample_interval: float):
    """Fill ``result.peak_mb`` with the largest of ``read_mb()`` sampled while the block runs."""
    stop = threading.Event()
    peak = [result.baseline_mb]

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], read_mb())
            time.sleep(sample_interval)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    try:
        yield result
    finally:
        stop.set()
        thread.join()
        result.peak_mb = max(peak[0], read_mb())


@contextmanager
def peak_memory(sample_interval: float = 0.002):
    """Peak resident memory: exact (VmHWM, reset through clear_refs) where the kernel allows, else sampled."""
    result = PeakMemory()
    process = psutil.Process(os.getpid())
    _release_free_heap()
    result.baseline_mb = process.memory_info().rss / 2**20
    if _reset_peak():
        result.method = "VmHWM"
        yield result
        result.peak_mb = _status_kb("VmHWM") / 1024
        return
    result.method = "sampled"
    with _sampled_peak(result, lambda: process.memory_info().rss / 2**20, sample_interval):
        yield result


def _rss_anon_mb() -> float:
    return _status_kb("RssAnon") / 1024


@contextmanager
def peak_anonymous_memory(sample_interval: float = 0.005):
    """Peak anonymous resident memory (heap; excludes file-backed pages such as mmap'd checkpoints,
    which the kernel can drop), sampled. ``extra_mb`` is the peak above the value at entry."""
    result = PeakMemory()
    result.method = "RssAnon sampled"
    _release_free_heap()
    result.baseline_mb = _rss_anon_mb()
    with _sampled_peak(result, _rss_anon_mb, sample_interval):
        yield result
