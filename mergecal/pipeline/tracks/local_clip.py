"""CLIP tracks from local files (``local_clip:`` in params.yaml), one configured track each: cells named
``local_clip:<name>``: the references, then every merge method in every weight-space chain (``{merge}``,
``{merge}>svc``, ``{merge}>wsc``, ...), the image encoders merged key by key from the lab's checkpoints in
place (never copied) and every task scored with its frozen zero-shot head. What the stages record:
``mergecal.pipeline.local_clip``.

A cell's inputs are its track's references.json (which holds each dataset's digest) and heads, and every file
of the checkpoints it reads (the pretrained model; the fine-tuned ones unless it is the ``zeroshot`` row), each
hashed by content (cached by path, size and mtime). A checkpoint or dataset that failed in the
``local_tracks`` stage fails the track's cells with the stage's one-line error; other tracks go on.

The cell holds one model: the pretrained CLIP whose image encoder is overwritten, key by key, with each
merge of the scaling grid as it streams out of ``iter_weight_space`` (K fine-tuned slices of one key at a
time); the chosen merge is streamed again before the test split.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..cells import Cell, CellResult, base_params, cell_grid, finetuned_reference, flat_params, jsonable_diagnostics, \
    select_scaling, summaries, validation_averages
from ..config import LocalClipTrack, Params
from . import llm

NAME = "local_clip"
SKIP_REASON = ("needs models and data: DisTaC and MAGIC's feature-space steps (FSC, DSC) are not run on local "
               "CLIP tracks yet (they would hold and train K full models on the real datasets inside a cell); the "
               "track runs weight-space chains (merge, svc, wsc)")


def track_name(track: LocalClipTrack) -> str:
    return f"{NAME}:{track.name}"


def _enabled(params: Params) -> list[LocalClipTrack]:
    return [t for t in params.local_clip if t.enabled]


def _config(cell: Cell, params: Params) -> LocalClipTrack:
    from ..local_clip import get_track

    return get_track(params, cell.track.split(":", 1)[1])


def enabled(params: Params) -> bool:
    return bool(_enabled(params))


def cells(params: Params) -> list[Cell]:
    # the same matrix as an LLM family: references, then each weight-space chain around each merge method
    return [cell for t in _enabled(params)
            for cell in llm.family_cells(params, track_name(t), t.name, t.task_set, t.task_names)]


def skipped(params: Params) -> list[tuple[Cell, str]]:
    return [item for t in _enabled(params)
            for item in llm.family_skipped(params, track_name(t), t.name, t.task_set, t.task_names, SKIP_REASON)]


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    """references.json, the heads and every file of the checkpoints the cell reads (a missing one contributes
    nothing: references.json then holds its error, and the cell fails with it)."""
    from ..local_clip import heads_path, model_paths, references_path

    track = _config(cell, params)
    models = {role: path for role, path in model_paths(track, root).items()
              if path.exists() and (role == "pretrained" or cell.merge != "zeroshot")}
    files = {"reference": references_path(track, root), **llm.model_files(models)}
    if heads_path(track, root).is_file():
        files["heads"] = heads_path(track, root)
    return files


def _open_clip_version() -> str:
    from importlib.metadata import version

    return version("open_clip_torch")


def fingerprint(params: Params):
    return {"open_clip": _open_clip_version()}


def cell_fingerprint(cell: Cell, params: Params):
    """The cell's own track's settings (another track's edit changes none of its ids)."""
    return {"track": _config(cell, params).model_dump(mode="json"), "open_clip": _open_clip_version()}


def _reference(track: LocalClipTrack, cell: Cell, root: Path) -> dict:
    """The track's references, or the stage's recorded error of what this cell needs."""
    from ..local_clip import references_path
    from .local_llm import checked_reference

    return checked_reference(references_path(track, root), f"local_clip track {track.name!r}", cell.tasks)


def run(cell: Cell, params: Params, root: str | Path, *, device: str = "cpu",
        scaling: float | None = None) -> CellResult:
    from ...backbones.open_clip_vit import image_size
    from ...checkpoint import load_state_dict
    from ...recipe import Recipe, iter_weight_space
    from ...task_vectors import TaskVectorSet
    from ..local_clip import (TaskData, arch_of, build_model, finetuned_path, finetuned_visual, heads_path,
                              load_visual, open_checkpoint, pretrained_path, pretrained_visual)

    root = Path(root)
    track = _config(cell, params)
    reference = _reference(track, cell, root)
    tasks, per_task = list(cell.tasks), reference["tasks"]
    logged = {**base_params(cell), "arch": reference["arch"], "open_clip_version": _open_clip_version()}
    for task in tasks:
        logged[f"data.{task}"] = per_task[task]["data_digest"][:16]
    if cell.merge == "zeroshot":  # the references are scored by the stage, on the cells' rows
        return CellResult(summaries(tasks, {t: per_task[t]["zeroshot"]["test"] for t in tasks}, per_task), logged)
    if cell.merge == "finetuned":
        return finetuned_reference(tasks, {t: per_task[t] for t in tasks}, logged)

    pre = open_checkpoint(pretrained_path(track, root), allow_unsafe_pickle=track.allow_unsafe_pickle)
    pre_visual = pretrained_visual(pre)
    finetuned = [finetuned_visual(pre, finetuned_path(track, t, root), allow_unsafe_pickle=track.allow_unsafe_pickle)
                 for t in tasks]  # checked again here: a file may have changed since the stage ran
    tvs = TaskVectorSet(finetuned, pre_visual, names=tasks, device=device)
    model = build_model(arch_of(track, root), pre)
    heads = load_state_dict(heads_path(track, root))
    data = TaskData(track, root, image_size(model), params.seed)

    recipe = Recipe.parse(cell.recipe)
    steps = [(s.name, s.params.model_dump()) for s in recipe.steps]
    index = next(i for i, s in enumerate(recipe.steps) if s.phase == "merge")
    grid = cell_grid(cell, steps[index][1]["scaling"], scaling)
    loaded: list = [None]  # the scaling whose merge the model holds

    def trial(value: float):
        chosen = list(steps)
        chosen[index] = (chosen[index][0], {**chosen[index][1], "scaling": value})
        diagnostics: dict = {}
        updates = iter_weight_space(Recipe(chosen), tvs, diagnostics=diagnostics)
        load_visual(model, ((k, tvs.load_pretrained(k) + u) for k, u in updates))
        loaded[0] = value
        return value, diagnostics

    def validate(outcome) -> tuple[float, float]:
        val = {t: data.score(model, heads[t], t, "validation", device) for t in tasks}
        return validation_averages(val, per_task, tasks)

    chosen_scaling, (_, diagnostics), curve = select_scaling(grid, trial, validate)
    if loaded[0] != chosen_scaling:  # the model holds the grid's last merge: stream the chosen one again
        _, diagnostics = trial(chosen_scaling)
    test = {t: data.score(model, heads[t], t, "test", device) for t in tasks}
    metrics = {**summaries(tasks, test, per_task), "selected_scaling": float(chosen_scaling)}
    logged = {**logged, "grid": json.dumps(list(cell.grid)), f"{recipe.merge.name}.scaling": json.dumps(chosen_scaling),
              "scaling_from": cell.scaling_from or "own grid"}
    for step in recipe.steps:
        logged.update(flat_params(step.name, step.params.model_dump(mode="json")))
    artifacts = jsonable_diagnostics(diagnostics, None)
    if curve:
        artifacts["scaling_curve"] = curve
    artifacts["task_vectors"] = {t: {"norm": per_task[t]["norm"], "entropy": per_task[t]["entropy"]} for t in tasks}
    return CellResult(metrics, logged, artifacts)
