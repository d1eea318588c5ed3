"""The interface every track implements (``Track``) and the session a recipe cell runs in (``Session``).

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

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ...recipe import Recipe
from ..cells import Cell, CellResult
from ..config import Params


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
