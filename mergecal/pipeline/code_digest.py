"""A cell's code digest: the sources of the modules its result depends on (``pipeline.cells``, its track's
``cells`` module, its recipe's steps and what they import), hashed into its id, so that an edited method
recomputes its own cells and no other."""

from __future__ import annotations

import hashlib
import os
from functools import lru_cache
from pathlib import Path

from ..calibrations import registry
from ..methods import MERGE_METHODS
from ..recipe import Recipe
from .hashing import file_digest_at
from .imports import import_closure, import_graph, module_files
from . import track_registry

#: the module that runs every cell (its closure is every cell's)
CELLS_MODULE = f"{__package__}.cells"

PACKAGE_DIR = Path(__file__).resolve().parents[1]
# parts of the package that never change a cell's result: reports, speed benchmarks, the command line
NOT_CELL_CODE = ("reports", "perf", "cli", "ui")


def _not_cell_code(module: str) -> bool:
    parts = module.split(".")
    return len(parts) > 1 and parts[1] in NOT_CELL_CODE


@lru_cache(maxsize=1024)
def recipe_steps(recipe_id: str) -> tuple[str, ...]:
    """The step names of a canonical recipe id (() for the reference cells, which have none)."""
    return tuple(step.name for step in Recipe.parse(recipe_id).steps) if recipe_id else ()


def step_modules() -> dict[str, str]:
    """Recipe step name -> the module that defines it, as the registries say: each merge method's class, each
    calibration's registering module (a composite's parts are the recipe's steps: ``Recipe`` expands it)."""
    calibrations = registry.__name__.rpartition(".")[0]
    return {**{name: cls.__module__ for name, cls in MERGE_METHODS.items()},
            **{name: f"{calibrations}.{module}" for name, module in registry.MODULES.items()}}


def track_modules() -> dict[str, str]:
    """``Cell.track`` (before any ``:``) -> the module implementing it (its track package's ``cells``)."""
    return {name: f"{track_registry.PACKAGE}.{module}" for name, module in track_registry.MODULES.items()}


def track_package_modules(graph) -> frozenset[str]:
    """Every module of every registered model family's package (``tracks/<family>/``): one plug-in family, so a
    track's modules come into a cell's closure only from its own source and family (``family.py`` and what it
    imports), never from another source's (the registry imports them all)."""
    packages = {f"{track_registry.PACKAGE}.{module.split('.')[0]}" for module in track_registry.MODULES.values()}
    return frozenset(m for m in graph if any(m == p or m.startswith(p + ".") for p in packages))


def cell_code_modules(track: str, recipe: str, graph) -> set[str]:
    """The modules a cell's result depends on: those that ``pipeline.cells``, the cell's track's ``cells``
    module and the modules of its recipe's steps import (``mergecal.pipeline.imports``). Methods, calibrations
    and tracks the cell does not name stay out, though their registries import them all; the reports, speed
    benchmarks and command line (``NOT_CELL_CODE``) too."""
    steps = step_modules()
    named = {track_modules()[track.split(":", 1)[0]]} | {steps[name] for name in recipe_steps(recipe)}
    # a step registered from a module outside the package has no source here to hash
    return import_closure(graph, {CELLS_MODULE, *(named & graph.keys())},
                          plugins=(frozenset(steps.values()), track_package_modules(graph)), leave_out=_not_cell_code)


@lru_cache(maxsize=8)
def _package_sources(package_dir: Path) -> tuple[dict[str, frozenset[str]], dict[str, tuple[str, str]]]:
    """The package's import graph and each module's source (path relative to the package, absolute path), read
    once a process."""
    files = module_files(package_dir.parent, (package_dir.name,))
    return (import_graph(package_dir.parent, (package_dir.name,)),
            {module: (path.relative_to(package_dir).as_posix(), str(path)) for module, path in files.items()})


@lru_cache(maxsize=None)
def cell_code_digest(track: str, recipe: str, package_dir: Path = PACKAGE_DIR) -> str:
    """SHA-256 over the sources (path relative to the package, sha256 of its bytes) of ``cell_code_modules``;
    computed once per (track, recipe) and process (an edit is seen by the next process: the next ``dvc repro``)."""
    graph, sources = _package_sources(package_dir)
    h = hashlib.sha256()
    for relative, path in sorted(sources[module] for module in cell_code_modules(track, recipe, graph)):
        stat = os.stat(path)  # the bytes are read again only if size or mtime changed
        h.update(f"{relative}\0{file_digest_at(path, stat.st_size, stat.st_mtime_ns)}\0".encode())
    return h.hexdigest()
