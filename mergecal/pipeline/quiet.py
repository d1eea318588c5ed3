"""What the benchmark's cells keep out of its output while they run (#62); their real warnings and errors stay.

* The inner libraries' progress bars (lm-eval's, transformers', datasets', huggingface_hub's: all tqdm), which
  buried the flow's own lines. ``TQDM_DISABLE=1`` does not do it with the installed tqdm (4.70): tqdm reads the
  variable once, when it is imported, long before a cell runs, and only as a default, which lm-eval's ``HFLM``
  overrides by passing ``disable=(disable_tqdm or self.rank != 0)`` itself (False in a cell). So while a cell
  runs, each tqdm bar of the process is made with tqdm's own ``disable=True``: the loop runs, nothing is drawn.
* open_clip's "No pretrained weights loaded for model ... Model initialized randomly." is dropped where the
  testbed builds its architectures (``mergecal.backbones.open_clip_vit.create_clip``, a filter for that message
  alone, under the model-construction lock): no cell evaluates a randomly initialised model.

The bars are off while at least one cell of the process runs (a count: the thread runner's cells overlap).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_LOCK = threading.Lock()
_STATE: dict = {"cells": 0, "tqdm_init": None}


@contextmanager
def quiet_cell() -> Iterator[None]:
    """Run a cell without inner progress bars."""
    with _LOCK:
        if _STATE["cells"] == 0:
            _STATE["tqdm_init"] = _disable_tqdm()
        _STATE["cells"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["cells"] -= 1
            if _STATE["cells"] == 0:
                _restore_tqdm(_STATE["tqdm_init"])


def quietly(fn: Callable) -> Callable:
    """``fn`` run under ``quiet_cell`` (the flow's cell task: below Prefect's ``@task``, which sees ``fn``'s
    signature)."""

    @functools.wraps(fn)
    def quiet(*args, **kwargs):
        with quiet_cell():
            return fn(*args, **kwargs)

    return quiet


def _disable_tqdm():
    """Make every tqdm bar disabled, whatever its caller passes; returns what ``_restore_tqdm`` puts back."""
    try:
        from tqdm import std
    except ImportError:  # no library of this environment draws tqdm bars
        return None
    saved = vars(std.tqdm)["__init__"]  # as tqdm defines it (a partialmethod holding TQDM_* variables)
    init = std.tqdm.__init__
    position = list(inspect.signature(init).parameters).index("disable") - 1  # among the arguments after self

    def disabled_init(self, *args, **kwargs):
        if len(args) > position:
            args = args[:position] + (True,) + args[position + 1:]
        else:
            kwargs["disable"] = True
        init(self, *args, **kwargs)

    std.tqdm.__init__ = disabled_init
    return saved


def _restore_tqdm(saved) -> None:
    if saved is not None:
        from tqdm import std

        std.tqdm.__init__ = saved
