"""The seq2seq family's ``built`` source, the seq2seq track (``seq2seq`` in params.yaml): a tiny T5 pretrained by
the papers' profile and its experts per regime (``standard``: full fine-tunes, the SVC paper's T5 rows; ``ia3``: IA³
adapters merged in vector form, the SVC and MAGIC papers' T0 rows), merged and scored T0-style, by rank
classification, on the suite's tasks (the family's cells: ``..family``). What its stages build: ``.stages``."""

from __future__ import annotations

import json
from pathlib import Path

from .....recipe import Recipe
from ....cells import Cell, CellResult, model_files, per_seed, per_seed_skipped
from ....config import Params
from .. import family
from ..family import DATA_SKIP, VECTOR_SKIP, why_not  # noqa: F401  (the track's reasons, as before)
from .stages import base_dir, expert_dir, manifest_path, references_path, scorer, split_path, work_dir

NAME = "seq2seq"
PRELOAD = family.PRELOAD  # imported by the flow before the cells fan out


def enabled(params: Params) -> bool:
    return params.seq2seq.enabled


def cells(params: Params) -> list[Cell]:
    """Per regime: the references, then every chain of the matrix the regime can run."""
    track = params.seq2seq
    return per_seed(family.cells(params, NAME, track.backbone, track.task_set, track.tasks, track.regimes),
                    params.seeds)


def skipped(params: Params) -> list[tuple[Cell, str]]:
    track = params.seq2seq
    return per_seed_skipped(family.skipped(params, NAME, track.backbone, track.task_set, track.tasks,
                                           track.regimes), params.seeds)


def unbuilt(params: Params, root: str | Path) -> str | None:
    """Why the default run cannot compute the track's cells (None: it can): ``seq2seq.regimes`` puts them in its
    matrix, but its stages build no seq2seq model; the papers' profile does (the stage ``benchmark`` refuses in this
    one line before any cell runs)."""
    for regime in params.seq2seq.regimes:
        for seed in params.seeds:
            path = references_path(params, root, regime, seed)
            if not path.is_file():
                return (f"{path}: not built; seq2seq.regimes {params.seq2seq.regimes} needs the seq2seq models, "
                        "which the papers' profile builds: run `make paper` (dvc repro papers/dvc.yaml) first")
    return None


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    files = {"data_manifest": manifest_path(root),
             "reference": references_path(params, root, cell.regime, cell.seed)}
    files.update({f"data.{t}.{s}": split_path(root, t, s) for t in cell.tasks for s in ("validation", "test")})
    models = {"base": base_dir(params, root)}
    if cell.merge != "zeroshot":
        models.update({f"expert.{t}": expert_dir(params, root, cell.regime, t, cell.seed) for t in cell.tasks})
    return {**files, **model_files(models)}


def cell_fingerprint(cell: Cell, params: Params):
    return {"evaluation": params.seq2seq.evaluation.model_dump()}


def models(cell: Cell, params: Params, root: Path) -> family.Models:
    reference = json.loads(references_path(params, root, cell.regime, cell.seed).read_text())
    return family.Models(reference, base_dir(params, root),
                         [expert_dir(params, root, cell.regime, t, cell.seed) for t in cell.tasks],
                         scorer(params, root), work_dir(root))


def reference(cell: Cell, params: Params, root: str | Path, *, device: str = "cpu") -> CellResult:
    return family.reference(cell, models(cell, params, Path(root)), device=device)


def session(cell: Cell, recipe: Recipe, grid: tuple[float, ...], params: Params, root: str | Path, *,
            device: str = "cpu"):
    return family.session(cell, recipe, models(cell, params, Path(root)), device=device)
