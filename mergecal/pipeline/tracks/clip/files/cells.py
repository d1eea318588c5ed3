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

The cell holds one model: the pretrained CLIP whose image encoder is overwritten, key by key, with each
merge of the scaling grid as it streams out of ``iter_weight_space`` (K fine-tuned slices of one key at a
time); the chosen merge is streamed again before the test split. An FSC step (``dsc``) adds three: the
pretrained CLIP, one fine-tuned CLIP reloaded per task, and the calibrated copy of the merge.
"""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path

from .....calibrations.fsc import calibrate_fsc
from .....calibrations.probing import SensitivityRanking
from .....checkpoint import SafetensorsSource, load_state_dict
from .....errors import CheckpointError, MergecalError
from .....merge import iter_weight_space
from .....recipe import Recipe
from .....task_vectors import TaskVectorSet
from ....cells import (REFERENCES, Cell, CellResult, base_params, finetuned_reference, flat_params,
                     jsonable_diagnostics, matrix_chains, per_example_results, per_seed, recipe_cell, summaries,
                     uses_sensitivity, validation_averages)
from ....config import Params
from .params import LocalClipTrack
from .....backbones.clip_checkpoints import (VisualView, build_model, checkpoint_files, finetuned_visual, load_visual,
                                             open_checkpoint, pretrained_visual, visual_keys)
from .stages import TaskData, arch_of, finetuned_path, heads_path, model_paths, pretrained_path, references_path
from .calibration import distac_dir, read_recorded, sensitivity_path, train_sample
from ....own_models import checked_reference, role_files
from ..family import check_distac_file
from ...protocol import Session
from ...registry import cell_track, configured_track, configured_tracks

NAME = "local_clip"


def enabled(params: Params) -> bool:
    return bool(configured_tracks(params, NAME))


def cells(params: Params) -> list[Cell]:
    """References, then every chain around every merge method (a DisTaC step is the track's, ``distac_step``)."""
    out = []
    for t in configured_tracks(params, NAME):
        name = cell_track(NAME, t)
        out += [Cell(name, t.name, t.task_set, tuple(t.task_names), "standard", ref, "") for ref in REFERENCES]
        for merge, chain, values, grid, recipe in matrix_chains(params):
            steps = [(s.name, values if s.phase == "merge" else
                      t.distac_step().model_dump() if s.name == "distac" else s.params.model_dump())
                     for s in recipe.steps]
            out.append(recipe_cell(params, name, t.name, t.task_set, t.task_names, "standard", merge, chain,
                                   steps, grid))
    return per_seed(out, params.seeds[:1])  # a lab's own checkpoints are not fine-tuned here: the first seed's


def skipped(params: Params) -> list[tuple[Cell, str]]:
    return []  # every chain runs


def inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, Path]:
    """references.json, the heads and the files ``open_checkpoint`` reads of the checkpoints the cell reads (a
    missing or unusable one contributes nothing: references.json then holds its error, and the cell fails
    with it)."""
    track = configured_track(cell, params)
    files = {"reference": references_path(track, root)}
    for role, path in model_paths(track, root).items():
        if role != "pretrained" and cell.merge == "zeroshot":
            continue
        try:
            found = checkpoint_files(path, with_config=role == "pretrained" and track.model.arch is None)
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


class _ReloadedModels:
    """FSC's fine-tuned models as a lazy sequence: one CLIP, its image encoder reloaded for task t when FSC
    reads item t (``measure_fsc`` reads each once, in order), so one fine-tuned model is held at a time."""

    def __init__(self, model, views):
        self.model, self.views = model, views

    def __len__(self) -> int:
        return len(self.views)

    def __getitem__(self, t: int):
        view = self.views[t]
        load_visual(self.model, ((k, view.get(k)) for k in view.keys()))
        return self.model


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
    """A recipe cell: DisTaC-conditioned encoders (read from the stage's files) replace their checkpoints, the
    merge and weight-space steps stream into the model, an FSC step hooks a copy of it."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import image_size

    root = Path(root)
    track = configured_track(cell, params)
    reference = _reference(track, cell, root)
    tasks, per_task = list(cell.tasks), reference["tasks"]
    logged = _logged(cell, reference)

    pre = open_checkpoint(pretrained_path(track, root), allow_unsafe_pickle=track.allow_unsafe_pickle)
    pre_visual = pretrained_visual(pre)
    finetuned = [finetuned_visual(pre, finetuned_path(track, t, root), allow_unsafe_pickle=track.allow_unsafe_pickle)
                 for t in tasks]  # checked again here: a file may have changed since the stage ran
    pre_steps = recipe.phase("pre")
    conditioned = _distac_views(track, root, pre, pre_steps[0], tasks) if pre_steps else {}
    finetuned = [conditioned.get(t, view) for t, view in zip(tasks, finetuned)]
    sensitive, sensitivity_file = None, None
    if uses_sensitivity(cell.recipe):
        sensitivity_file = sensitivity_path(track, root)
        read_recorded(sensitivity_file, f"sensitivity ranking of local_clip track {track.name!r}")
        sensitive = SensitivityRanking.load(sensitivity_file).sensitive
    tvs = TaskVectorSet(finetuned, pre_visual, names=tasks, device=device)
    arch = arch_of(track, root)
    model = build_model(arch, pre)
    heads = load_state_dict(heads_path(track, root))
    data = TaskData(track, root, image_size(model), params.seed)

    feature = recipe.phase("feature")
    if feature:  # FSC's pretrained and (reloaded) fine-tuned models, and its samples
        fsc_params = feature[0].params
        if fsc_params.sensitive is None and sensitive is not None:
            fsc_params = fsc_params.model_copy(update={"sensitive": list(sensitive)})
        model = model.to(device)
        pre_model = build_model(arch, pre).to(device)
        task_models = _ReloadedModels(build_model(arch, pre).to(device), finetuned)
        fsc_data = _fsc_data(params, track, root, tasks, image_size(model), fsc_params)

    loaded: list = [None, model]  # the scaling whose merge the model holds, and the model scored

    def merged(value: float):
        diagnostics: dict = {}
        updates = iter_weight_space(recipe.with_scaling(value), tvs, sensitive=sensitive, diagnostics=diagnostics)
        load_visual(model, ((k, tvs.load_pretrained(k) + u) for k, u in updates))
        loaded[:] = [value, model]
        if feature:  # MAGIC: FSC measured on the weight-space result, applied to a copy (the model is reloaded)
            calibrated = calibrate_fsc(model, pre_model, task_models, fsc_data, params=fsc_params, progress=False)
            diagnostics["fsc"] = {"ratios": calibrated.ratios, "folded": calibrated.folded,
                                  "hooked": calibrated.hooked, "identity": calibrated.identity}
            loaded[1] = calibrated
        return value, diagnostics

    def validate(outcome) -> tuple[float, float]:
        val = {t: data.score(loaded[1], heads[t], t, "validation", device) for t in tasks}
        return validation_averages(val, per_task, tasks)

    def result(outcome, scaling: float, curve: list) -> CellResult:
        _, diagnostics = outcome
        if loaded[0] != scaling:  # the model holds the grid's last merge: stream the chosen one again
            _, diagnostics = merged(scaling)
        test = {t: data.score(loaded[1], heads[t], t, "test", device, per_example=True) for t in tasks}
        metrics = {**summaries(tasks, test, per_task), "selected_scaling": float(scaling)}
        cell_logged = {**logged, "grid": json.dumps(list(cell.grid)),
                       f"{recipe.merge.name}.scaling": json.dumps(scaling),
                       "scaling_from": cell.scaling_from or "own grid"}
        for step in recipe.steps:
            cell_logged.update(flat_params(step.name, step.params.model_dump(mode="json")))
        artifacts = jsonable_diagnostics(diagnostics, sensitivity_file)
        if curve:
            artifacts["scaling_curve"] = curve
        norms = {t: per_task[t]["norm"] for t in tasks}
        if conditioned:
            info = json.loads((distac_dir(track, root) / "distac.json").read_text())
            artifacts["distac"] = {"kappas": info["kappas"], "conditioned": list(conditioned)}
            norms.update({t: info["norms"][t]["after"] for t in conditioned})
        artifacts["task_vectors"] = {t: {"norm": norms[t], "entropy": per_task[t]["entropy"]} for t in tasks}
        return CellResult(metrics, cell_logged, artifacts, per_example_results(tasks, test))

    return nullcontext(Session(merged, validate, result))
