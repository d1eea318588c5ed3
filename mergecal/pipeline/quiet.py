"""What the benchmark's cells keep out of its output while they run (#62); their real warnings and errors stay.

* The inner libraries' progress bars (lm-eval's, transformers', datasets', huggingface_hub's: all tqdm), which
  buried the flow's own lines. ``TQDM_DISABLE=1`` does not do it with the installed tqdm (4.70): tqdm reads the
  variable once, when it is imported, long before a cell runs, and only as a default, which lm-eval's ``HFLM``
  overrides by passing ``disable=(disable_tqdm or self.rank != 0)`` itself (False in a cell). So while a cell
  runs, each tqdm bar of the process is made with tqdm's own ``disable=True``: the loop runs, nothing is drawn.
* open_clip's "No pretrained weights loaded for model ... Model initialized randomly.", logged with
  ``logging.warning`` (the root logger) whenever a model is built with ``pretrained=None``. The testbed builds
  its architectures that way on purpose and at once loads into them its own weights, trained locally by the DVC
  stages (``mergecal.backbones.open_clip_vit.load_clip``, strict): no cell evaluates a randomly initialised
  model. One filter on the root logger drops that message for the testbed's architectures only.
* ``create_clip`` hides the same message with ``logging.disable(logging.WARNING)`` and restores the level it
  found; two cells building models at once (the thread runner) each find the other's level, and the last to
  finish leaves logging disabled up to WARNING in the whole process: every later info and warning line, the
  flow's and Prefect's included, is lost. ``restore_logging`` undoes that; a cell calls it when it ends, the
  flow while it waits. (The fix itself, saving and restoring under the construction lock, is cell code: it
  lands with the next change that recomputes every cell, and then this repair can go.)

All of it applies while at least one cell of the process runs (a count: the thread runner's cells overlap).
"""

from __future__ import annotations

import functools
import inspect
import logging
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mergecal.backbones.architectures import ARCHITECTURES

RANDOM_INIT_NOTICES = frozenset(f"No pretrained weights loaded for model '{name}'. Model initialized randomly."
                                for name in ARCHITECTURES)


class RandomInitNotice(logging.Filter):
    """Drops open_clip's "initialized randomly" notice for the testbed's own architectures, nothing else."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.levelno == logging.WARNING and record.getMessage() in RANDOM_INIT_NOTICES)


_LOCK = threading.Lock()
_STATE: dict = {"cells": 0, "level": logging.NOTSET, "tqdm_init": None, "filter": RandomInitNotice()}


def restore_logging(level: int) -> None:
    """Undo a ``logging.disable`` above ``level`` that a cell left behind (create_clip's, above)."""
    if logging.root.manager.disable > level:
        logging.disable(level)


@contextmanager
def quiet_cell() -> Iterator[None]:
    """Run a cell without inner progress bars or the random-initialisation notice; logging's disable level as
    it was before the process's first running cell began."""
    with _LOCK:
        if _STATE["cells"] == 0:
            _STATE["level"] = logging.root.manager.disable
            _STATE["tqdm_init"] = _disable_tqdm()
            logging.getLogger().addFilter(_STATE["filter"])
        _STATE["cells"] += 1
    try:
        yield
    finally:
        with _LOCK:
            _STATE["cells"] -= 1
            if _STATE["cells"] == 0:
                logging.getLogger().removeFilter(_STATE["filter"])
                _restore_tqdm(_STATE["tqdm_init"])
            restore_logging(_STATE["level"])


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
