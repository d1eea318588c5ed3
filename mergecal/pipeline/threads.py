"""torch's thread count, from params.yaml's ``threads``.

A model's bits depend on it: a float sum split over more threads is summed in another order, so 20 fine-tuning
steps at 1 and at 2 threads give different weights. torch's own default is the machine's core count, so without
a pin a lab with more cores would train other models than the committed ``dvc.lock``. Every stage that trains or
evaluates with torch pins ``threads`` at start (``stages/_common.py``; dvc.yaml lists ``threads`` in its
params), and each benchmark cell pins its share of them (``worker_threads``, ``mergecal/pipeline/flow.py``).
"""

from __future__ import annotations


def worker_threads(threads: int, max_workers: int) -> int:
    """torch's threads for one benchmark cell: ``threads`` divided among the cells that run at once
    (``runner.max_workers``), at least 1, so that the workers' thread pools do not oversubscribe the cores."""
    return max(1, threads // max_workers)


def pin_threads(threads: int, *, interop: bool = False) -> None:
    """Set torch's intra-op thread count (MKL's and OpenMP's) to ``threads``; with ``interop``, its inter-op pool
    too, which torch accepts only before the process's first parallel work (a stage's start)."""
    import torch

    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    if interop and torch.get_num_interop_threads() != threads:
        try:
            torch.set_num_interop_threads(threads)
        except RuntimeError:  # too late in this process; inter-op threads change no eager model's bits
            pass
