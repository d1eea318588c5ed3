"""Tracks of the benchmark: a backbone × task set with its own models, inputs and evaluation, one package each
(``tracks/<name>/``: ``params.py`` its params.yaml section, ``stages.py`` what its DVC stages build, ``cells.py``
its cells), behind one small interface, so that the cells, the flow and the reports stay generic and a new track
(the LLM track, a lab's own checkpoints) is one package plus its registry line and its DVC stages.

A track package's ``cells`` module provides (``Track``, checked for every registered one by tests/test_pipeline.py):

* ``NAME``: the value of ``Cell.track`` (and of the ``mergecal.track`` tag); a module of several configured
  tracks (``local_llm``, ``local_clip``: the entries of ``params.<NAME>``) names its cells ``NAME:<track name>``
  (``configured_tracks``, ``cell_track``, ``configured_track``);
* ``enabled(params) -> bool``: whether its cells are in the matrix;
* ``cells(params) -> list[Cell]``: its cells, references first;
* ``inputs(cell, params, root) -> {role: path}``: the files a cell reads (their bytes go into the cell's id);
* ``cell_fingerprint(cell, params)``: settings beside those files that a cell's result depends on (also hashed
  into the id; a module of several configured tracks gives the cell's own track's);
* ``reference(cell, params, root, *, device) -> CellResult``: a ``zeroshot`` or ``finetuned`` row;
* ``session(cell, recipe, grid, params, root, *, device)``: a context manager of the recipe cell's ``Session``
  (its models and data loaded once; ``contextlib.nullcontext(Session(...))`` when nothing needs cleaning up):
  ``merged(scaling)`` the recipe's merged model at a scaling of ``grid``, ``validate(merged)`` its validation
  score, ``result(merged, scaling, curve)`` the chosen one evaluated on test into a ``CellResult``.
  ``cells.run_cell`` runs the scaling search over them (``select_scaling``), the same for every track;
* ``skipped(params) -> [(Cell, reason)]``: chains of the matrix the track cannot run (``[]``: none), which the
  flow records as skipped (with the reason) so that the leaderboard says so instead of leaving them out.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from ...errors import MergecalError

if TYPE_CHECKING:  # annotations only: the cells import this registry
    from ..cells import Cell, CellResult
    from ..config import Params
    from ...recipe import Recipe


@dataclass(frozen=True)
class Session:
    """A recipe cell's models and data, loaded once by ``Track.session``: what ``cells.run_cell`` searches the
    scaling grid with (``select_scaling``: each scaling's ``merged``, scored by ``validate``, the best kept)."""

    merged: Callable[[float], Any]  # the recipe's merged (and calibrated) model at a scaling of the grid
    validate: Callable[[Any], tuple[float, float]]  # its (avg accuracy, avg normalized accuracy) on validation
    result: Callable[[Any, float, list], CellResult]  # (chosen model, its scaling, the curve) scored on test


@runtime_checkable
class Track(Protocol):
    """The interface of a track (its package's ``cells`` module; see the module docstring); the registry below
    maps ``Cell.track`` to it."""

    NAME: str

    def enabled(self, params: Params) -> bool: ...

    def cells(self, params: Params) -> list[Cell]: ...

    def skipped(self, params: Params) -> list[tuple[Cell, str]]: ...

    def inputs(self, cell: Cell, params: Params, root: str | Path) -> dict[str, Path]: ...

    def cell_fingerprint(self, cell: Cell, params: Params) -> Any: ...

    def reference(self, cell: Cell, params: Params, root: str | Path, *, device: str = "cpu") -> CellResult: ...

    def session(self, cell: Cell, recipe: Recipe, grid: tuple[float, ...], params: Params, root: str | Path, *,
                device: str = "cpu") -> AbstractContextManager[Session]: ...


#: the registered tracks, in matrix order: Cell.track (before any ``:``) -> its package's module implementing
#: ``Track`` (imported on first use: a track may pull in heavy libraries)
MODULES = {"vision": "vision.cells", "text": "text.cells", "llm": "llm.cells", "local_llm": "local_llm.cells",
           "local_clip": "local_clip.cells"}
#: and its params.yaml section, keyed by the track's name: the package's ``params.SECTION`` (pydantic models
#: only, so that loading params.yaml imports no torch; ``mergecal.pipeline.config`` composes them)
SECTIONS = {"vision": "vision.params", "text": "text.params", "llm": "llm.params", "local_llm": "local_llm.params",
            "local_clip": "local_clip.params"}


def get_track(name: str) -> Track:
    name = name.split(":", 1)[0]  # "local_llm:<track name>", "local_clip:<...>": one package, several tracks
    if name not in MODULES:
        raise KeyError(f"unknown track {name!r}; tracks: {', '.join(MODULES)}")
    return importlib.import_module(f"{__name__}.{MODULES[name]}")


def param_sections() -> dict[str, tuple]:
    """params.yaml key -> (type, default) of every registered track's section, in matrix order."""
    return {name: importlib.import_module(f"{__name__}.{module}").SECTION for name, module in SECTIONS.items()}


def track_of(cell) -> Track:
    return get_track(cell.track)


def enabled_tracks(params) -> list[Track]:
    return [track for track in map(get_track, MODULES) if track.enabled(params)]


def skipped_cells(params) -> list:
    """(cell, reason) of every chain an enabled track cannot run."""
    return [item for track in enabled_tracks(params) for item in track.skipped(params)]


def configured_tracks(params, name: str) -> list:
    """The enabled tracks of the module of several configured tracks named ``name`` (``params.<name>``)."""
    return [t for t in getattr(params, name) if t.enabled]


def cell_track(name: str, track) -> str:
    """``Cell.track`` of a configured track of the module named ``name``."""
    return f"{name}:{track.name}"


def configured_track(cell, params):
    """The configured track of a ``<module NAME>:<track name>`` cell; one MergecalError if params.yaml has none."""
    module, name = cell.track.split(":", 1)
    for track in getattr(params, module):
        if track.name == name:
            return track
    raise MergecalError(f"{module}: no track named {name!r} in params.yaml")
