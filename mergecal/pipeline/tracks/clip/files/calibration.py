"""What the data chains of a ``local_clip`` track read, computed once per track by their DVC stages:

    models/local/sensitivity/<name>/sensitivity.json  stage ``local_sensitivity``: MAGIC's magnitude-sensitivity
                                                   ranking (WSC and FSC steps, so ``{merge}>wsc`` and ``dsc``)
    models/local/distac/<name>/<Task>.safetensors  stage ``local_distac``: each DisTaC-conditioned image encoder
    models/local/distac/<name>/distac.json         the step, kappas, conditioned tasks and their norms

Either JSON holds ``{"error": ...}`` when the track cannot be calibrated (its cells fail with that line).

The probe (MAGIC Sec. III-A) ranks image-encoder keys (``probing.candidates``) on the weight-averaged model by the
``probing.metric`` score lost when the key's task-vector slice is scaled by ``probing.scale``. The paper probes
on CIFAR-100, a dataset that is none of the tasks; a local track has no such dataset, so it probes on a seeded
sample of the tasks' own train splits (``probing.max_samples`` in all, each task scored with its zero-shot head,
the score averaged over the tasks).

DisTaC (the paper's preset for fine-tuned models without a known failure mode, ``norm_mismatch``, with the
track's own ``distac`` overrides: ``LocalClipTrack.distac_step``) takes its kappas from the
task-vector norms ``local_tracks`` measured key by key, and distils one model at a time on
``benchmark.evaluation.distac_samples`` unlabeled train images of its task; only conditioned models are written
(the others are the lab's checkpoints, read in place).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from .....calibrations.distac import condition_model, distac_plan
from .....calibrations.probing import make_probe, probe_sensitivity
from .....checkpoint import atomic_write_text, load_state_dict, save_state_dict
from .....errors import CheckpointError, ParameterError
from ....config import Params
from .params import LocalClipTrack
from .....backbones.clip_checkpoints import VISUAL, build_model, load_visual, open_checkpoint, pretrained_visual
from .stages import (TaskData, arch_of, check_labels, finetuned_path, finetuned_view, heads_path, pretrained_path,
                     references_path, sample)
from ....own_models import checked_reference, local_root
from ....results import one_line
from ..family import TaskHeadModel


def sensitivity_path(track: LocalClipTrack, root: str | Path) -> Path:
    return local_root(root) / "sensitivity" / track.name / "sensitivity.json"


def distac_dir(track: LocalClipTrack, root: str | Path) -> Path:
    return local_root(root) / "distac" / track.name


def track_index(params: Params, track: LocalClipTrack) -> int:
    return next(i for i, t in enumerate(params.local_clip) if t.name == track.name)


def train_sample(params: Params, track: LocalClipTrack, task: str, root: str | Path, n: int, what: str,
                 image_size: int, seed: int, head: torch.Tensor | None = None) -> tuple[np.ndarray, np.ndarray]:
    """A seeded sample of ``n`` (uint8 image, label) rows of the task's train split, its labels checked against
    ``head``; too few rows is one line naming the track's dataset key and ``what`` (the setting asking for n)."""
    data = TaskData(track, root, image_size, params.seed).split(task, "train")[0]
    if len(data) < n:
        raise ParameterError(f"params.yaml: local_clip.{track_index(params, track)}.datasets.{task}: the train split "
                             f"at {data.location} holds {len(data)} images; {what} needs {n}")
    rows = sample(len(data), n, seed)
    if head is not None:
        check_labels(task, data, rows, head)
    return data.images(rows, image_size, track.evaluation.center_crop), data.labels[rows]


def _checked_references(track: LocalClipTrack, root: Path) -> dict:
    return checked_reference(references_path(track, root), f"local_clip track {track.name!r}", list(track.finetuned))


def _open(track: LocalClipTrack, root: Path):
    pre = open_checkpoint(pretrained_path(track, root), allow_unsafe_pickle=track.allow_unsafe_pickle)
    views = {t: finetuned_view(pre, finetuned_path(track, t, root), allow_unsafe_pickle=track.allow_unsafe_pickle)
             for t in track.finetuned}
    return pre, pretrained_visual(pre), views


def probe(params: Params, track: LocalClipTrack, root: str | Path = ".", *, device: str = "cpu",
          progress: bool = False) -> dict:
    """The track's sensitivity ranking (module docstring), written to ``sensitivity_path``."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import image_size, preprocess

    root, probing = Path(root), params.probing
    _checked_references(track, root)
    pre, pre_visual, views = _open(track, root)
    tasks = list(track.finetuned)
    model = build_model(arch_of(track, root), pre)
    # theta_0 + mean tau, one key at a time (K slices of one key in memory)
    load_visual(model, ((k, torch.stack([views[t].get(k) for t in tasks]).mean(0)) for k in pre_visual.keys()))
    model = model.to(device)
    heads, size = load_state_dict(heads_path(track, root)), image_size(model)
    per_task = max(1, probing.max_samples // len(tasks))
    scorers = []
    for task in tasks:
        images, labels = train_sample(params, track, task, root, per_task, "probing.max_samples / tasks", size,
                                      params.seed + 1, heads[task])
        x, y = preprocess(images, size), torch.as_tensor(labels, dtype=torch.long)
        batches = [(x[i:i + 256], y[i:i + 256]) for i in range(0, len(y), 256)]
        scorers.append((make_probe(batches, probing.metric, device=device),
                        TaskHeadModel(model, heads[task]).to(device)))

    def evaluate(_model) -> torch.Tensor:  # the wrappers share ``model``'s modules, which the probe scales in place
        # every task's examples, each task weighted by its share (per_task each: the mean over the tasks' means)
        return torch.cat([score(wrapped) for score, wrapped in scorers])

    pretrained = {k: pre_visual.get(k) for k in pre_visual.keys()}
    ranking = probe_sensitivity(model, pretrained, evaluate, scale=probing.scale, top=probing.top,
                                key_rule=probing.key_rule, key_pattern=probing.key_pattern or r"^visual\.",
                                progress=progress, seed=params.seed,
                                metadata={"track": track.name, "probe": "train splits of the tasks",
                                          "samples_per_task": per_task, "metric": probing.metric,
                                          "candidates": probing.candidates})
    ranking.save(sensitivity_path(track, root))
    return {"sensitive": ranking.sensitive, "baseline": ranking.baseline}


def distac(params: Params, track: LocalClipTrack, root: str | Path = ".", *, device: str = "cpu",
           progress: bool = False) -> dict:
    """DisTaC-condition the track's models (module docstring): one model in memory at a time, each conditioned
    image encoder written atomically, then ``distac.json``."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import image_size, preprocess

    root = Path(root)
    reference = _checked_references(track, root)
    step = track.distac_step()
    tasks = list(track.finetuned)
    norms = [float(reference["tasks"][t]["norm"]) for t in tasks]
    kappas, targets = distac_plan(step, norms)
    pre, pre_visual, views = _open(track, root)
    arch, heads = arch_of(track, root), load_state_dict(heads_path(track, root))
    pretrained = {k: pre_visual.get(k) for k in pre_visual.keys()}
    size = image_size(build_model(arch, pre))  # the models are built by ``build``: teacher, then student
    out_dir = distac_dir(track, root)
    (out_dir / "distac.json").unlink(missing_ok=True)  # no earlier record beside the encoders written now
    info: dict = {"params": step.model_dump(mode="json"), "kappas": dict(zip(tasks, kappas)), "conditioned": [],
                  "norms": {}, "history": {}}

    for t in targets:
        task = tasks[t]
        head = heads[task]

        def build(state, head=head):
            clip = build_model(arch, pre)
            load_visual(clip, state.items())
            return TaskHeadModel(clip, head)

        data = preprocess(train_sample(params, track, task, root, params.benchmark.evaluation.distac_samples,
                                       "benchmark.evaluation.distac_samples", size, params.seed + 2)[0], size)
        finetuned = {k: views[task].get(k) for k in pre_visual.keys()}
        conditioned, history = condition_model(step, kappas[t], build, pretrained, finetuned, data,
                                               trainable=lambda name: name.startswith(VISUAL), progress=progress,
                                               device=device)
        del finetuned, data
        save_state_dict({k: v.contiguous() for k, v in conditioned.items()}, out_dir / f"{task}.safetensors",
                        {"distac": step.model_dump_json()})
        norm = sum(float((conditioned[k].double() - pretrained[k].double()).pow(2).sum()) for k in pretrained) ** 0.5
        info["conditioned"].append(task)
        info["norms"][task] = {"before": norms[t], "target": kappas[t] * norms[t], "after": norm}
        info["history"][task] = history[-1] if history else {}
        del conditioned
    atomic_write_text(out_dir / "distac.json", json.dumps(info, indent=2, default=str))
    return info


def record_error(path: Path, error: str) -> None:
    """A track that cannot be calibrated: its one-line error where the cells read the result."""
    atomic_write_text(path, json.dumps({"error": error}, indent=2))


def read_recorded(path: Path, what: str) -> dict:
    """A stage's JSON for a cell, or the error it recorded."""
    if not path.is_file():
        raise CheckpointError(f"{path}: {what} not found (run `dvc repro`)")
    data = json.loads(path.read_text())
    if "error" in data:
        raise CheckpointError(data["error"])
    return data


def all_tracks(params: Params, root: str | Path, which: str, *, device: str = "cpu", log=print) -> dict:
    """The stage ``local_sensitivity`` (``which="probe"``) or ``local_distac``: every enabled CLIP track, a failing
    one recorded with its one-line error (the others go on)."""
    root, out = Path(root), {}
    for track in params.local_clip:
        if not track.enabled:
            continue
        try:
            out[track.name] = (probe if which == "probe" else distac)(params, track, root, device=device)
        except Exception as err:  # noqa: BLE001 - recorded: this track's data chains fail with it
            out[track.name] = {"error": one_line(err)}
            path = sensitivity_path(track, root) if which == "probe" else distac_dir(track, root) / "distac.json"
            record_error(path, out[track.name]["error"])
        log(f"{track.name}: {json.dumps(out[track.name], default=str)[:300]}")
    # an index beside, so that the DVC output exists when no track is configured
    atomic_write_text(local_root(root) / ("sensitivity" if which == "probe" else "distac") / "index.json",
                      json.dumps(sorted(out), indent=2))
    return out
