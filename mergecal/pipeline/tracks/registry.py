"""The registry of tracks: ``Cell.track`` -> the module implementing ``protocol.Track``, each track's params.yaml
section and its stability diagnostics. A track is a source of a model family (``tracks/<family>/<source>/``:
``clip/built`` is the ``vision`` track, ``clip/files`` the ``local_clip`` tracks, ...); the track names are the
ones params.yaml and the leaderboard use. Below the interface and the cells (it imports neither), so that
``config`` and ``cells`` read it without an import circle."""

from __future__ import annotations

import importlib
from types import ModuleType

from ...errors import MergecalError

#: the package of the families' packages (``tracks/<family>/<source>/``)
PACKAGE = __package__

#: the registered tracks, in matrix order: Cell.track (before any ``:``) -> its source's module implementing
#: ``Track`` (imported on first use: a track may pull in heavy libraries)
MODULES = {"vision": "clip.built.cells", "text": "text.built.cells", "llm": "causal_lm.built.cells",
           "local_llm": "causal_lm.files.cells", "local_clip": "clip.files.cells"}
#: and its params.yaml section, keyed by the track's name: the package's ``params.SECTION`` (pydantic models
#: only, so that loading params.yaml imports no torch; ``mergecal.pipeline.config`` composes them)
SECTIONS = {"vision": "clip.built.params", "text": "text.built.params", "llm": "causal_lm.built.params",
            "local_llm": "causal_lm.files.params", "local_clip": "clip.files.params"}

#: the tracks the stability diagnostics measure (``mergecal.pipeline.stability``, ``refit_stability``), keyed by
#: the track's name: its package's module giving ``noise_evaluation`` (its task-arithmetic merge under weight noise)
#: and ``refit_regimes`` (per regime, its largest fine-tune refit at another thread count). A track of a lab's own
#: checkpoints has none: nothing of it is trained here. Never imported by the cells: an edit there reruns the
#: stability stage only.
DIAGNOSTICS = {"vision": "clip.built.diagnostics", "text": "text.built.diagnostics",
               "llm": "causal_lm.built.diagnostics"}


def get_track(name: str) -> ModuleType:
    """The module implementing ``protocol.Track`` of ``Cell.track`` ``name``."""
    name = name.split(":", 1)[0]  # "local_llm:<track name>", "local_clip:<...>": one package, several tracks
    if name not in MODULES:
        raise KeyError(f"unknown track {name!r}; tracks: {', '.join(MODULES)}")
    return importlib.import_module(f"{PACKAGE}.{MODULES[name]}")


def param_sections() -> dict[str, tuple]:
    """params.yaml key -> (type, default) of every registered track's section, in matrix order."""
    return {name: importlib.import_module(f"{PACKAGE}.{module}").SECTION for name, module in SECTIONS.items()}


def track_of(cell) -> ModuleType:
    return get_track(cell.track)


def enabled_tracks(params) -> list[ModuleType]:
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


def diagnosed_tracks(params) -> list[tuple[str, ModuleType]]:
    """(name, its ``DIAGNOSTICS`` module) of every track with diagnostics whose params.yaml section is enabled, in
    matrix order."""
    return [(name, importlib.import_module(f"{PACKAGE}.{DIAGNOSTICS[name]}")) for name in MODULES
            if name in DIAGNOSTICS and getattr(params, name).enabled]
