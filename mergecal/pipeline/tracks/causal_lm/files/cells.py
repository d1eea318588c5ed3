"""LLM tracks from local directories (``local_llm:`` in params.yaml), one configured track each: cells named
``local_llm:<name>``: the causal-LM family's ``files`` source, the same cells, merges and lm-eval scoring as the
``built`` one (``..family``), on the lab's own base and experts, read in place (never copied). What the stages
record: ``.stages``.

A cell's inputs are the files of the model directories it reads (the base; the experts unless it is the
``zeroshot`` row), the files defining its tasks and its track's references.json, each hashed by content (cached
by path, size and mtime). A model that failed its checks in the ``local_tracks`` stage fails the cells that
need it with the stage's one-line error; the other cells, and the other tracks, go on.
"""

from __future__ import annotations

from pathlib import Path

from .....backbones.hf_causal_lm import model_dir_files
from .....errors import MergecalError
from .....recipe import Recipe
from ....cells import REFERENCES, Cell, CellResult, per_seed, per_seed_skipped, published_protocols
from ....config import Params
from .params import LocalLlmTrack
from .stages import (base_path, check_expert, check_model_dir, expert_files, expert_model_dirs, expert_path,
                     references_path, scorer, task_files, work_dir)
from ....own_models import checked_reference, role_files
from ....track_registry import cell_track, configured_track, configured_tracks
from .. import family

NAME = "local_llm"
PRELOAD = family.PRELOAD  # imported by the flow before the cells fan out


def enabled(params: Params) -> bool:
    return bool(configured_tracks(params, NAME))


def cells(params: Params) -> list[Cell]:
    # a lab's own checkpoints are not fine-tuned here: their cells run once, under the first seed
    return per_seed([cell for t in configured_tracks(params, NAME)
                     for cell in family.cells(params, cell_track(NAME, t), t.name, t.task_set, t.task_names,
                                              published_protocols(params, t))],
                    params.seeds[:1])


def skipped(params: Params) -> list[tuple[Cell, str]]:
    return per_seed_skipped([item for t in configured_tracks(params, NAME)
                             for item in family.skipped(params, cell_track(NAME, t), t.name, t.task_set,
                                                            t.task_names)], params.seeds[:1])


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    """references.json, the task files and the files the loaders read of the model directories the cell
    reads (of a PEFT adapter expert, its adapter files: its model is the base's and these); a directory that is
    missing or unusable contributes nothing (references.json then holds its error, and the cell fails with it)."""
    track = configured_track(cell, params)
    models = {"base": base_path(track, root)}
    if cell.merge != "zeroshot":
        models.update({f"expert.{t}": expert_path(track, t, root) for t in cell.tasks})
    if cell.merge not in REFERENCES:  # the merges read the unscored experts too
        models.update({f"unscored.{n}": expert_path(track, n, root) for n in track.unscored})
    files = {"reference": references_path(track, root), **task_files(track, root)}
    for role, directory in models.items():
        try:
            files.update(role_files(role, directory, (model_dir_files if role == "base" else expert_files)(directory)))
        except MergecalError:
            continue
    return files


def fingerprint(params: Params):
    return {"lm_eval": family.lm_eval_version()}


def cell_fingerprint(cell: Cell, params: Params):
    """The cell's own track's settings (another track's edit changes none of its ids)."""
    track = configured_track(cell, params)
    return {"track": track.model_dump(mode="json"), "lm_eval": family.lm_eval_version()}


def _reference(track: LocalLlmTrack, cell: Cell, root: Path) -> dict:
    """The track's references, or the stage's recorded error of a model this cell needs."""
    return checked_reference(references_path(track, root), f"local_llm track {track.name!r}", cell.tasks)


def _checked_models(cell: Cell, track: LocalLlmTrack, root: Path) -> tuple[Path, list[Path]]:
    """The base and the experts' model directories, checked again here (a directory may have changed since the
    stage ran); the experts only when the cell reads them (all but the ``zeroshot`` row). A PEFT adapter expert is
    its full model (``stages.expert_model_dir``: the base with the adapter applied, written once)."""
    base = base_path(track, root)
    check_model_dir(base, allow_unsafe_pickle=track.allow_unsafe_pickle)
    names = list(cell.tasks) if cell.merge in REFERENCES else [*cell.tasks, *track.unscored]
    if cell.merge == "zeroshot":
        return base, [expert_path(track, name, root) for name in names]
    for name in names:
        check_expert(base, expert_path(track, name, root), allow_unsafe_pickle=track.allow_unsafe_pickle,
                     align_vocabulary=track.align_vocabulary)
    return base, expert_model_dirs(track, names, root)


def models(cell: Cell, track: LocalLlmTrack, root: Path) -> family.Models:
    """The cell's models, checked (``_checked_models``), the track's scorer and its references (or the stage's
    recorded error of what this cell needs)."""
    reference = _reference(track, cell, root)
    base, experts = _checked_models(cell, track, root)
    return family.Models(reference, base, experts, scorer(track, root), work_dir(root) / "merged",
                         track.align_vocabulary)


def reference(cell: Cell, params: Params, root: str | Path, *, device: str = "cpu") -> CellResult:
    return family.reference(cell, models(cell, configured_track(cell, params), Path(root)), device=device)


def session(cell: Cell, recipe: Recipe, grid: tuple[float, ...], params: Params, root: str | Path, *,
            device: str = "cpu"):
    return family.session(cell, recipe, models(cell, configured_track(cell, params), Path(root)),
                                 device=device)
