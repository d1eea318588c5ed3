"""The causal-LM family's ``built`` source, the LLM track (``llm`` in params.yaml): a tiny Llama pretrained by the
pipeline on its synthetic corpus and one expert per task (Hugging Face directories, per fine-tuning seed), scored
with lm-eval on the suite's local task YAMLs; in the papers' profile also the regime ``lora`` (each expert a peft
LoRA adapter of the base). Its cells and their computation are the family's (``..family``); what its DVC stages
build: ``.stages``."""

from __future__ import annotations

import json
from pathlib import Path

from .....recipe import Recipe
from ....cells import Cell, CellResult, model_files, per_seed, per_seed_skipped
from ....config import Params
from .. import family
from .stages import base_dir, data_root, diagnostics_path, expert_dir, lm_eval_setup, work_dir

NAME = "llm"
PRELOAD = family.PRELOAD  # imported by the flow before the cells fan out


def enabled(params: Params) -> bool:
    return params.llm.enabled


def cells(params: Params) -> list[Cell]:
    track = params.llm
    return per_seed([c for regime in track.regimes
                     for c in family.cells(params, NAME, track.backbone, track.task_set, track.tasks, regime=regime)],
                    params.seeds)


def skipped(params: Params) -> list[tuple[Cell, str]]:
    track = params.llm
    return per_seed_skipped([c for regime in track.regimes
                             for c in family.skipped(params, NAME, track.backbone, track.task_set, track.tasks,
                                                     regime=regime)], params.seeds)


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    files = {"data_manifest": data_root(root) / "manifest.json",
             "reference": diagnostics_path(params, root, cell.seed, cell.regime)}
    models = {"base": base_dir(params, root)}
    if cell.merge != "zeroshot":
        models.update({f"expert.{t}": expert_dir(params, root, t, cell.seed, cell.regime) for t in cell.tasks})
    return {**files, **model_files(models)}


def fingerprint(params: Params):
    return {"evaluation": params.llm.evaluation.model_dump(), "lm_eval": family.lm_eval_version()}


def cell_fingerprint(cell: Cell, params: Params):
    return fingerprint(params)


def models(cell: Cell, params: Params, root: Path) -> family.Models:
    """The cell's models: the base, the experts of its fine-tuning seed and regime, the suite's scorer, its
    references."""
    return family.Models(json.loads(diagnostics_path(params, root, cell.seed, cell.regime).read_text()),
                         base_dir(params, root), [expert_dir(params, root, t, cell.seed, cell.regime)
                                                  for t in cell.tasks],
                         lm_eval_setup(params, root), work_dir(root) / "merged", adapters=cell.regime == "lora")


def reference(cell: Cell, params: Params, root: str | Path, *, device: str = "cpu") -> CellResult:
    return family.reference(cell, models(cell, params, Path(root)), device=device)


def session(cell: Cell, recipe: Recipe, grid: tuple[float, ...], params: Params, root: str | Path, *,
            device: str = "cpu"):
    return family.session(cell, recipe, models(cell, params, Path(root)), device=device)
