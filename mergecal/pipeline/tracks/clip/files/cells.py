"""CLIP tracks from local files (``local_clip:`` in params.yaml), one configured track each: cells named
``local_clip:<name>``: the references, then every merge method in every chain of the matrix (``{merge}``,
``{merge}>svc``, ``{merge}>wsc``, ``{merge}>dsc``, ``distac>{merge}``, ...), the image encoders merged key by key
from the lab's checkpoints in place (never copied) and every task scored with its frozen zero-shot head. What
the stages record: ``.stages`` and, for the data chains, ``.calibration``.

A cell's inputs are its track's references.json (which holds each dataset's digest) and heads, every file
of the checkpoints it reads (the pretrained model; the fine-tuned ones unless it is the ``zeroshot`` row), each
hashed by content (cached by path, size and mtime), and what its steps read: the sensitivity ranking (WSC,
FSC), the DisTaC-conditioned encoders. A checkpoint or dataset that failed in a stage fails the track's cells
with the stage's one-line error; other tracks go on.

A recipe cell runs in the family's session (``clip.session.session``: one CLIP, its image encoder overwritten
with each merge of the grid, the K fine-tuned encoders read key by key from their files; an FSC step adds the
pretrained CLIP, one fine-tuned CLIP reloaded per task and the calibrated copy of the merge).
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

from .....calibrations.probing import SensitivityRanking
from .....checkpoint import SafetensorsSource, load_state_dict
from .....errors import CheckpointError, MergecalError
from .....recipe import Recipe
from ....cells import (Cell, CellResult, base_params, finetuned_reference, per_example_results, per_seed,
                       per_seed_skipped,
                       published_protocols, summaries, uses_sensitivity)
from ....chains import DATA_MERGE_SKIP, merge_needs_data
from ....config import Params
from .params import LocalClipTrack
from .....backbones.clip_checkpoints import VisualView, build_model, open_checkpoint, pretrained_visual, visual_keys
from .stages import (TaskData, arch_of, expert_files, finetuned_path, finetuned_view, heads_path, model_paths,
                     pretrained_path, references_path)
from .calibration import distac_dir, read_recorded, sensitivity_path, train_sample
from ....own_models import checked_reference, role_files
from ..family import check_distac_file
from ..session import CellModels, recipe_cells
from ..session import session as family_session
from ...protocol import Session
from ....track_registry import cell_track, configured_track, configured_tracks

NAME = "local_clip"


def enabled(params: Params) -> bool:
    return bool(configured_tracks(params, NAME))


def _matrix(params: Params) -> list[Cell]:
    """References, then every chain around every merge method (a DisTaC step is the track's, ``distac_step``)."""
    return [cell for t in configured_tracks(params, NAME)
            for cell in recipe_cells(params, cell_track(NAME, t), t.name, t.task_set, t.task_names, "standard",
                                     t.distac_step().model_dump(), published_protocols(params, t))]


def _runs_here(cell: Cell) -> bool:
    """Whether the track runs the cell's pre-merge steps: a first ``distac`` (its stage's models) and nothing else
    (a data-free pre step such as ``rescale`` runs in the vision track's cells only)."""
    pre = Recipe.parse(cell.recipe).phase("pre") if cell.recipe else []
    return all(index == 0 and step.name == "distac" for index, step in enumerate(pre))


def cells(params: Params) -> list[Cell]:
    # a lab's own checkpoints are not fine-tuned here: the first seed's
    return per_seed([c for c in _matrix(params) if _runs_here(c) and not _data_merge(c)], params.seeds[:1])


def _data_merge(cell: Cell) -> bool:
    """Whether the cell's merge learns on data (AdaMerging): the vision track's only, this track gives it none."""
    return bool(cell.recipe) and merge_needs_data(Recipe.parse(cell.recipe))


def skipped(params: Params) -> list[tuple[Cell, str]]:
    reason = "a pre-merge step other than a first distac runs on the vision track only"
    return per_seed_skipped([(c, DATA_MERGE_SKIP if _data_merge(c) else reason) for c in _matrix(params)
                             if not _runs_here(c) or _data_merge(c)], params.seeds[:1])


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    """references.json, the heads and the files ``open_checkpoint`` reads of the checkpoints the cell reads (of a
    PEFT adapter, its two adapter files: its model is the pretrained one's and these; a missing or unusable one
    contributes nothing: references.json then holds its error, and the cell fails with it)."""
    track = configured_track(cell, params)
    files = {"reference": references_path(track, root)}
    for role, path in model_paths(track, root).items():
        if role != "pretrained" and cell.merge == "zeroshot":
            continue
        try:
            found = expert_files(path, with_config=role == "pretrained" and track.model.arch is None)
        except MergecalError:
            continue
        files.update(role_files(role, path, found))
    if heads_path(track, root).is_file():
        files["heads"] = heads_path(track, root)
    steps = {}  # what the data chains' stages wrote (a missing file contributes nothing: the cell fails on it)
    if cell.recipe and uses_sensitivity(cell.recipe):
        steps["sensitivity"] = sensitivity_path(track, root)
    if cell.recipe.startswith("distac"):
        info = distac_dir(track, root) / "distac.json"
        steps["distac"] = info
        for task in _conditioned(info):
            steps[f"distac.{task}"] = distac_dir(track, root) / f"{task}.safetensors"
    return {**files, **{role: path for role, path in steps.items() if path.is_file()}}


def _conditioned(info: Path) -> list[str]:
    """The tasks whose conditioned encoder the DisTaC stage wrote (none when it recorded an error)."""
    return json.loads(info.read_text()).get("conditioned", []) if info.is_file() else []


def _open_clip_version() -> str:
    from importlib.metadata import version

    return version("open_clip_torch")


def fingerprint(params: Params):
    return {"open_clip": _open_clip_version()}


def cell_fingerprint(cell: Cell, params: Params):
    """The cell's own track's settings (another track's edit changes none of its ids)."""
    return {"track": configured_track(cell, params).model_dump(mode="json"), "open_clip": _open_clip_version()}


def _reference(track: LocalClipTrack, cell: Cell, root: Path) -> dict:
    """The track's references, or the stage's recorded error of what this cell needs."""
    return checked_reference(references_path(track, root), f"local_clip track {track.name!r}", cell.tasks)


def _distac_views(track: LocalClipTrack, root: Path, pre, step, tasks: list[str]) -> dict:
    """The DisTaC-conditioned image encoders of ``tasks`` the stage wrote, checked against the cell's step."""
    info = read_recorded(distac_dir(track, root) / "distac.json", f"DisTaC models of local_clip track {track.name!r}")
    if info["params"] != step.params.model_dump(mode="json"):
        raise CheckpointError(f"{distac_dir(track, root)}: DisTaC parameters differ from the cell's recipe "
                              "(rerun `dvc repro`)")
    views = {}
    for task in (t for t in info["conditioned"] if t in tasks):
        path = distac_dir(track, root) / f"{task}.safetensors"
        check_distac_file(path, info["params"], "distac.json")
        views[task] = VisualView(SafetensorsSource(path), visual_keys(pre))
    return views


def _fsc_data(params: Params, track: LocalClipTrack, root: Path, tasks: list[str], size: int, fsc_params):
    """FSC's unlabeled samples: the FSC step's ``n_samples_per_task`` seeded train images per task; for
    task-agnostic FSC (DSC-A) one shared batch, the same images shuffled across tasks, so no chunk is its task's
    own data."""
    import torch

    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import preprocess

    n = fsc_params.n_samples_per_task
    data = [preprocess(train_sample(params, track, t, root, n, "the FSC step's n_samples_per_task", size,
                                    params.seed + 3)[0], size) for t in tasks]
    if fsc_params.data != "task_agnostic":
        return data
    mixed = torch.cat(data)
    return [mixed[torch.randperm(len(mixed), generator=torch.Generator().manual_seed(params.seed))]]


def _logged(cell: Cell, reference: dict) -> dict[str, str]:
    """The params every cell of the track logs: the architecture, open_clip's version, each dataset's digest."""
    logged = {**base_params(cell), "arch": reference["arch"], "open_clip_version": _open_clip_version()}
    for task in cell.tasks:
        logged[f"data.{task}"] = reference["tasks"][task]["data_digest"][:16]
    return logged


def reference(cell: Cell, params: Params, root: str | Path, *, device: str = "cpu") -> CellResult:
    """The ``zeroshot`` and ``finetuned`` rows: scored by the stage, read from the references."""
    track = configured_track(cell, params)
    reference = _reference(track, cell, Path(root))
    tasks, per_task = list(cell.tasks), reference["tasks"]
    logged = _logged(cell, reference)
    if cell.merge == "zeroshot":
        test = {t: per_task[t]["zeroshot"]["test"] for t in tasks}
        return CellResult(summaries(tasks, test, per_task), logged, examples=per_example_results(tasks, test))
    return finetuned_reference(tasks, {t: per_task[t] for t in tasks}, logged)


def session(cell: Cell, recipe: Recipe, grid: tuple[float, ...], params: Params, root: str | Path, *,
            device: str = "cpu") -> nullcontext[Session]:
    """A recipe cell (the family's ``session.session``) over the lab's checkpoints read in place, key by key: the
    DisTaC-conditioned encoders (read from the stage's files) replace their checkpoints; FSC's samples are seeded
    train images of each task."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import image_size

    root = Path(root)
    track = configured_track(cell, params)
    reference = _reference(track, cell, root)
    tasks, per_task = list(cell.tasks), reference["tasks"]

    pre = open_checkpoint(pretrained_path(track, root), allow_unsafe_pickle=track.allow_unsafe_pickle)
    finetuned = [finetuned_view(pre, finetuned_path(track, t, root), allow_unsafe_pickle=track.allow_unsafe_pickle)
                 for t in tasks]  # checked again here: a file may have changed since the stage ran
    pre_steps = recipe.phase("pre")
    conditioned = _distac_views(track, root, pre, pre_steps[0], tasks) if pre_steps else {}
    finetuned = [conditioned.get(t, view) for t, view in zip(tasks, finetuned)]
    norms, distac = {t: per_task[t]["norm"] for t in tasks}, None
    if conditioned:
        info = json.loads((distac_dir(track, root) / "distac.json").read_text())
        distac = {"kappas": info["kappas"], "conditioned": list(conditioned)}
        norms.update({t: info["norms"][t]["after"] for t in conditioned})
    sensitive, sensitivity_file = None, None
    if uses_sensitivity(cell.recipe):
        sensitivity_file = sensitivity_path(track, root)
        read_recorded(sensitivity_file, f"sensitivity ranking of local_clip track {track.name!r}")
        sensitive = SensitivityRanking.load(sensitivity_file).sensitive
    arch = arch_of(track, root)
    heads = load_state_dict(heads_path(track, root))
    model = build_model(arch, pre)
    size = image_size(model)
    data = TaskData(track, root, size, params.seed)

    def score(model, task: str, split: str, per_example: bool) -> dict:
        return data.score(model, heads[task], task, split, device, per_example=per_example)

    def fsc_data(fsc_params) -> list:
        return _fsc_data(params, track, root, tasks, size, fsc_params)

    return family_session(CellModels(tasks, per_task, _logged(cell, reference), pretrained_visual(pre), finetuned,
                                     norms, model, lambda: build_model(arch, pre), score,
                                     fsc_data,
                                     sensitive=sensitive, sensitivity_file=sensitivity_file, distac=distac),
                          cell, recipe, grid, device=device)
