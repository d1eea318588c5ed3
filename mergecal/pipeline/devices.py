"""One cell per GPU: a cell that runs on CUDA leases one device for as long as it runs.

A lease is an exclusive ``flock`` on ``<lock_dir>/cuda-<host>-<i>.lock``: keyed by host and device, so that
workers of several hosts sharing one checkout (a network file system) never take each other's GPU 0. Locks on
separately opened files exclude each other between threads of one process as well as between processes, so the
same lease works for the thread, process and Dask runners. The operating system drops a lock when its holder dies, so a
killed cell never leaves a GPU taken.

``device`` as resolved from params.yaml: ``cpu`` needs no lease; ``cuda`` leases any free device of the
machine; ``cuda:N`` leases device N (cells asking for the same device take turns).
"""

from __future__ import annotations

import fcntl
import os
import socket
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from ..errors import MergecalError


def _candidates(device: str, count: int) -> list[int]:
    if device == "cuda":
        if count < 1:
            raise MergecalError("device='cuda': no CUDA device is visible to this process")
        return list(range(count))
    index = device.split(":", 1)[1]
    if not index.isdigit() or int(index) >= count:
        raise MergecalError(f"device={device!r}: this machine has {count} CUDA device(s)")
    return [int(index)]


@contextmanager
def device_lease(device: str, lock_dir: str | os.PathLike, *, count: int | None = None,
                 poll_seconds: float = 0.2, host: str | None = None) -> Iterator[str]:
    """Yield the device a cell runs on (``cuda:<i>``, held exclusively until the block ends), waiting for a
    free one; ``count`` overrides ``torch.cuda.device_count()``, ``host`` this machine's name (tests)."""
    if not device.startswith("cuda"):
        yield device
        return
    if count is None:
        import torch

        count = torch.cuda.device_count()
    candidates = _candidates(device, count)
    host = host or socket.gethostname()
    lock_dir = Path(lock_dir)
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for index in candidates:
            handle = open(lock_dir / f"cuda-{host}-{index}.lock", "a+")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            try:
                handle.seek(0)
                handle.truncate()
                handle.write(f"{os.getpid()}\n")  # who holds it, for a person looking
                handle.flush()
                yield f"cuda:{index}"
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)
                handle.close()
            return
        time.sleep(poll_seconds)
