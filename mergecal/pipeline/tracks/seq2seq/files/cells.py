"""Seq2seq tracks from local directories (``local_seq2seq:`` in params.yaml), one configured track each: cells
named ``local_seq2seq:<name>``, the seq2seq family's ``files`` source: the same cells, merges and rank-classification
scoring as the ``built`` one (``..family``), on the lab's own base and experts of the track's regime, read in place
(never copied). What the stages record: ``.stages``.

A cell's inputs are the files the loaders read of the directories it reads (the base; the experts unless it is the
``zeroshot`` row), the task files and its track's references.json, each hashed by content (cached by path, size and
mtime). A model that failed its checks in the ``local_tracks`` stage fails the cells that need it with the stage's
one-line error; the other cells, and the other tracks, go on.
"""

from __future__ import annotations

from pathlib import Path

from .....recipe import Recipe
from ....cells import Cell, CellResult, per_seed, per_seed_skipped
from ....config import Params
from ....own_models import checked_reference, role_files
from ....track_registry import cell_track, configured_track, configured_tracks
from .. import family
from .params import LocalSeq2SeqTrack
from .stages import (base_path, check_base, check_expert, expert_files, expert_path, model_files, references_path,
                     scorer, task_files, work_dir)

NAME = "local_seq2seq"
PRELOAD = family.PRELOAD  # imported by the flow before the cells fan out


def enabled(params: Params) -> bool:
    return bool(configured_tracks(params, NAME))


def cells(params: Params) -> list[Cell]:
    # a lab's own checkpoints are not fine-tuned here: their cells run once, under the first seed
    return per_seed([cell for t in configured_tracks(params, NAME)
                     for cell in family.cells(params, cell_track(NAME, t), t.name, t.task_set, t.task_names,
                                              [t.regime])],
                    params.seeds[:1])


def skipped(params: Params) -> list[tuple[Cell, str]]:
    return per_seed_skipped([item for t in configured_tracks(params, NAME)
                             for item in family.skipped(params, cell_track(NAME, t), t.name, t.task_set,
                                                        t.task_names, [t.regime])], params.seeds[:1])


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    """references.json, the task files and the files the loaders read of the directories the cell reads; a
    directory that is missing contributes nothing (references.json then holds its error, and the cell fails with
    it)."""
    track = configured_track(cell, params)
    files = {"reference": references_path(track, root), **task_files(track, root)}
    files.update(role_files("base", base_path(track, root), model_files(base_path(track, root))))
    if cell.merge != "zeroshot":
        for task in cell.tasks:
            directory = expert_path(track, task, root)
            files.update(role_files(f"expert.{task}", directory, expert_files(directory)))
    return files


def cell_fingerprint(cell: Cell, params: Params):
    """The cell's own track's settings (another track's edit changes none of its ids)."""
    return {"track": configured_track(cell, params).model_dump(mode="json")}


def models(cell: Cell, track: LocalSeq2SeqTrack, root: Path) -> family.Models:
    """The cell's models, checked again (a directory may have changed since the stage ran), the track's scorer and
    its references (or the stage's recorded error of what this cell needs)."""
    reference = checked_reference(references_path(track, root), f"local_seq2seq track {track.name!r}", cell.tasks)
    base = base_path(track, root)
    check_base(base)
    experts = [expert_path(track, task, root) for task in cell.tasks]
    if cell.merge != "zeroshot":
        for expert in experts:
            check_expert(base, expert, track.regime)
    return family.Models(reference, base, experts, scorer(track, root), work_dir(root) / "merged")


def reference(cell: Cell, params: Params, root: str | Path, *, device: str = "cpu") -> CellResult:
    return family.reference(cell, models(cell, configured_track(cell, params), Path(root)), device=device)


def session(cell: Cell, recipe: Recipe, grid: tuple[float, ...], params: Params, root: str | Path, *,
            device: str = "cpu"):
    return family.session(cell, recipe, models(cell, configured_track(cell, params), Path(root)), device=device)
