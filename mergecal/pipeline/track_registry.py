"""The registry of tracks: ``Cell.track`` -> the module implementing ``protocol.Track``, each track's params.yaml
section and its stability diagnostics. A track is a source of a model family (``tracks/<family>/<source>/``:
``clip/built`` is the ``vision`` track, ``clip/files`` the ``local_clip`` tracks, ...) whose ``__init__.py`` names it
(``TRACK = "vision"``); the registry finds the sources by reading those files (``mergecal.plugins``: nothing is
imported), so a new source is its package and no list here names it. The track names are the ones params.yaml and
the leaderboard use. Beneath the track packages and the interface (it imports neither), so that ``config`` and
``cells`` read it without an import circle.

A source package holds ``cells`` (its ``Track``), ``params`` (its params.yaml ``SECTION``: pydantic models only, so
that loading params.yaml imports no torch; ``mergecal.pipeline.config`` composes them), optionally ``diagnostics``
(the stability diagnostics: ``noise_evaluation``, its task-arithmetic merge under weight noise, and
``refit_regimes``, per regime its largest fine-tune refit at another thread count; never imported by the cells, so
an edit there reruns the stability stage only; a track of a lab's own checkpoints has none, nothing of it is
trained here) and ``stages`` (what its DVC stages build; a source named ``files``, a lab's own files, gives there
what the stages ``local_inputs`` and ``local_tracks`` call: ``mergecal.pipeline.tracks.lab_files``)."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

from ..errors import MergecalError
from ..plugins import declaring_packages

#: the package of the families' packages (``tracks/<family>/<source>/``)
PACKAGE = f"{__package__}.tracks"
_DIR = Path(__file__).parent / "tracks"

#: the matrix order of the built-in tracks (the leaderboard's); a track not named here follows them, by name
ORDER = ("vision", "text", "llm", "local_llm", "local_clip")
#: the source of a lab's own files in each family: its ``stages`` module serves ``lab_files``
FILES_SOURCE = "files"



def registered(tracks_dir: Path) -> dict[str, dict[str, str]]:
    """What the sources under ``tracks_dir`` register, by kind: ``modules`` (their ``cells``), ``sections``
    (``params``), ``diagnostics`` (where the source has one) and ``lab_files`` (the ``stages`` of a ``files``
    source), each ``{track name: module relative to the tracks package}`` in matrix order. Read from the sources
    (the import graph reads the same: ``mergecal.pipeline.imports``)."""
    sources = declaring_packages(tracks_dir, "TRACK")  # track name -> "<family>.<source>"
    names = sorted(sources, key=lambda name: (ORDER.index(name) if name in ORDER else len(ORDER), name))
    return {"modules": {name: f"{sources[name]}.cells" for name in names},
            "sections": {name: f"{sources[name]}.params" for name in names},
            "diagnostics": {name: f"{sources[name]}.diagnostics" for name in names
                            if Path(tracks_dir).joinpath(*sources[name].split("."), "diagnostics.py").is_file()},
            "lab_files": {name: f"{sources[name]}.stages" for name in names
                          if sources[name].endswith(f".{FILES_SOURCE}")}}


_REGISTERED = registered(_DIR)
#: the registered tracks, in matrix order: Cell.track (before any ``:``) -> its source's module implementing
#: ``Track`` (imported on first use: a track may pull in heavy libraries)
MODULES = _REGISTERED["modules"]
#: and its params.yaml section's module (``params.SECTION``), keyed by the track's name
SECTIONS = _REGISTERED["sections"]
#: the tracks the stability diagnostics measure (``mergecal.pipeline.stability``, ``refit_stability``)
DIAGNOSTICS = _REGISTERED["diagnostics"]
#: the sources of a lab's own files, by track name: their ``stages`` modules
LAB_FILES = _REGISTERED["lab_files"]
#: the tracks the pipeline builds (every source but a lab's files), in matrix order: one params.yaml section each,
#: switched by its ``enabled``
BUILT = [name for name in MODULES if name not in LAB_FILES]

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


def lab_tracks(params) -> list:
    """Every configured track of every source of a lab's files (enabled or not), in matrix order."""
    return [track for name in LAB_FILES for track in getattr(params, name)]


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


def lab_file_sources() -> list[ModuleType]:
    """The ``stages`` module of every source of a lab's files, in matrix order (``lab_files``)."""
    return [importlib.import_module(f"{PACKAGE}.{module}") for module in LAB_FILES.values()]
