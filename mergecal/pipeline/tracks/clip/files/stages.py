"""CLIP tracks from local files (``local_clip:`` in params.yaml): a lab's own pretrained CLIP, fine-tuned
checkpoints and datasets, benchmarked as the embedded vision track is, without copying a checkpoint or an image.

    models/local/inputs.json                       stage ``local_inputs`` (shared with ``local_llm``): size and
                                                   sha256 of each file read of the checkpoints
                                                   (``checkpoint_files``) and of each task's dataset
                                                   (``real_vision.dataset_files``), and of no other file
    models/local/tracks/<name>/heads.safetensors   stage ``local_tracks``: the zero-shot heads (class names and
                                                   templates of each task, encoded by the pretrained text tower)
    models/local/tracks/<name>/references.json     zero-shot and fine-tuned accuracy (validation, test), entropy
                                                   and ECE per task, task-vector norms read key by key, the
                                                   datasets' digests; or the one-line error of what is unusable

Checkpoints are read in open_clip's layout whatever their own (``OpenClipLayoutSource``: HF CLIP directories,
open_clip and task_vectors state dicts), key by key from safetensors; a pickled file (``.pt``, ``.pth``,
``.bin``, ``.ckpt``) is refused before it is opened unless the track sets ``allow_unsafe_pickle`` (it is then
loaded whole, the warning naming it). Only the image encoder is merged (``visual.*``): the text tower gives the
frozen heads. A fine-tuned checkpoint must hold the pretrained image encoder's keys with its shapes; a Hugging
Face CLIPVisionModel has no projection (``visual.proj``), which is then the pretrained one, as in FusionBench.

A fine-tuned model may be a PEFT adapter directory trained on the pretrained CLIP (``mergecal.adapters``: LoRA on its
image tower's Linear layers, IA³): ``local_inputs`` records its adapter_config.json and adapter_model.safetensors and
refuses, in one line naming the params key and the file, what the adapters package does not read and an adapter that
does not fit the pretrained model; it is read key by key as the pretrained weights plus the adapter, as peft's
``merge_and_unload`` computes them (``adapter_source``), and otherwise like any fine-tuned checkpoint.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import torch

from .....adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, IA3Expert, LoraExpert, adapter_from_tensors,
                           is_adapter_dir, read_adapter)
from .....adapters.read import PEFT_PREFIX
from .....backbones.clip_checkpoints import (CHECKPOINT_FILES, VisualView, build_model, checkpoint_files,
                                             finetuned_visual, load_visual, open_checkpoint, pretrained_visual,
                                             register_hf_arch, visual_keys)
from .....backbones.clip_layouts import OpenClipLayoutSource
from .....checkpoint import atomic_write_text, save_state_dict
from .....data.real_vision import (DatasetError, canonical_task, expected_layouts, find_layout, load_real_split,
                                task_metadata)
from .....data.real_vision import dataset_files as split_files
from .....errors import CheckpointError, MergecalError, ParameterError
from ....hashing import HASH_CACHE, file_digest
from .params import LocalClipTrack
from ....config import Params
from ....own_models import check_test_counts, content_records, loaded_files, name_under, resolve, tracks_dir
from ....results import one_line


def track_dir(track: LocalClipTrack, root: str | Path) -> Path:
    return tracks_dir(root) / track.name


def references_path(track: LocalClipTrack, root: str | Path) -> Path:
    return track_dir(track, root) / "references.json"


def heads_path(track: LocalClipTrack, root: str | Path) -> Path:
    return track_dir(track, root) / "heads.safetensors"


def pretrained_path(track: LocalClipTrack, root: str | Path) -> Path:
    return resolve(track.model.pretrained, root)


def finetuned_path(track: LocalClipTrack, task: str, root: str | Path) -> Path:
    return resolve(track.finetuned[task], root)


def dataset_root(track: LocalClipTrack, task: str, root: str | Path) -> Path:
    return resolve(track.datasets[task], root, repo_type="dataset")


# ----------------------------------------------------------------------------------------------- checkpoints

def arch_of(track: LocalClipTrack, root: str | Path) -> str:
    return track.model.arch or register_hf_arch(pretrained_path(track, root))


# ------------------------------------------------------------------------------------- PEFT adapter experts

# the keys of the image encoder in a pretrained checkpoint's own layout: open_clip's, Hugging Face CLIP's
IMAGE_TOWER = ("visual.", "model.visual.", "vision_model.", "visual_projection.")


class _UnderVisual:
    """An adapter's saved tensors renamed as if peft had wrapped the whole CLIP: ``base_model.model.<m>`` read as
    ``base_model.model.visual.<m>``."""

    def __init__(self, tensors):
        self.tensors, self.name = tensors, tensors.name
        self._own = {PEFT_PREFIX + "visual." + k.removeprefix(PEFT_PREFIX): k for k in tensors.keys()}

    def keys(self) -> list[str]:
        return list(self._own)

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors.shape(self._own[key])

    def dtype(self, key: str):
        return self.tensors.dtype(self._own[key])

    def get(self, key: str) -> torch.Tensor:
        return self.tensors.get(self._own[key])


def tower_adapter(adapter):
    """The adapter named as the CLIP's checkpoint names its keys: one peft made on open_clip's image tower alone
    (``get_peft_model(model.visual, ...)``, which peft records in ``auto_mapping``) lacks the ``visual.`` prefix,
    and its module names would otherwise read as the text tower's (``transformer.resblocks.*``)."""
    mapping = adapter.config.get("auto_mapping") or {}
    if not (mapping.get("base_model_class") == "VisionTransformer"
            and str(mapping.get("parent_library", "")).startswith("open_clip")):
        return adapter
    return adapter_from_tensors(adapter.config, _UnderVisual(adapter.tensors), adapter.where, path=adapter.path)


def adapter_source(pre, adapter_dir: Path) -> OpenClipLayoutSource:
    """A PEFT adapter over the pretrained CLIP ``pre`` (``open_checkpoint``) as a ``TensorSource`` in open_clip's
    layout: the adapter applied to the pretrained checkpoint in its own layout, whose names its modules follow (LoRA
    as base + delta, IA³ as the scaled base: ``mergecal.adapters``, bit for bit peft's ``merge_and_unload``), then
    mapped as any checkpoint is. Refused in one line naming the adapter's file: what the adapters package does not
    read (DoRA, LoRA variants, another peft_type, adapter_model.bin), a target the pretrained model lacks or whose
    shape differs (an adapter of another base), LoRA on nn.MultiheadAttention, and a target outside the image
    encoder (the text tower gives the frozen heads: a change to it would be silently dropped)."""
    adapter = tower_adapter(read_adapter(adapter_dir))
    raw = pre.source  # the pretrained checkpoint in its own layout (HF CLIP or open_clip)
    keys = set(raw.keys())
    for module in adapter.modules.values():
        # peft wraps open_clip's attn (nn.MultiheadAttention) as lora.MultiheadAttention: its in_proj delta and the
        # nested out_proj (".base_layer.") are not modules the adapters package merges
        if f"{module.module}.in_proj_weight" in keys or ".base_layer." in f".{module.module}.":
            attn = module.module.split(".base_layer.")[0]
            raise CheckpointError(f"{adapter.weights_path}: module {attn!r} is LoRA on nn.MultiheadAttention "
                                  "(open_clip's attn), which is not read; target the Linear layers (mlp.c_fc, "
                                  "mlp.c_proj, attn.out_proj)")
    for key in [*adapter.modules, *adapter.replacements]:
        if key in keys and not key.startswith(IMAGE_TOWER):
            raise CheckpointError(f"{adapter.weights_path}: key {key!r} is not of the image encoder, the only part "
                                  "of the CLIP merged (the text tower gives the frozen zero-shot heads)")
    expert = (LoraExpert if adapter.kind == "lora" else IA3Expert)(raw, adapter, f"PEFT adapter {adapter_dir}")
    return OpenClipLayoutSource(expert, str(adapter_dir))


def finetuned_view(pre, path: Path, *, allow_unsafe_pickle: bool = False) -> VisualView:
    """A fine-tuned model's image encoder over the pretrained one's keys: a PEFT adapter directory applied to the
    pretrained CLIP (``adapter_source``), else the checkpoint (``finetuned_visual``: its keys and shapes checked)."""
    if is_adapter_dir(path):
        return VisualView(adapter_source(pre, path), visual_keys(pre))
    return finetuned_visual(pre, path, allow_unsafe_pickle=allow_unsafe_pickle)


def expert_files(path: Path, *, with_config: bool = False) -> list[Path]:
    """The files a model is read from: a PEFT adapter directory's config and safetensors weights (nothing else of
    it), else a checkpoint's (``checkpoint_files``)."""
    if is_adapter_dir(path):
        return [path / name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if (path / name).is_file()]
    return checkpoint_files(path, with_config=with_config)


def check_adapter_params(track: LocalClipTrack, role: str, path: Path, key: str, root: str | Path) -> None:
    """A PEFT adapter where the track names one, checked when the params are read (stage ``local_inputs``) and
    refused in one line naming its params key: as the pretrained model, or what ``adapter_source`` refuses. The
    fit to the pretrained model is checked here when it opens without unpickling (else by ``local_tracks``, which
    records the error for the task's cells)."""
    if not is_adapter_dir(path):
        return
    if role == "pretrained":
        raise ParameterError(f"{key}: {path} is a PEFT adapter; give the pretrained CLIP its adapters were trained "
                             "on")
    try:
        pre = open_checkpoint(pretrained_path(track, root))
    except MergecalError:  # missing, pickled or unreadable: the track's own error, recorded by local_tracks
        pre = None
    try:
        if pre is None:
            read_adapter(path)
        else:
            adapter_source(pre, path)
    except MergecalError as err:
        raise ParameterError(f"{key}: {one_line(err)}") from None


# --------------------------------------------------------------------------------------------------- data

def task_split(track: LocalClipTrack, task: str, split: str, root: str | Path, seed: int = 0):
    return load_real_split(dataset_root(track, task, root), task, split, seed=seed)


def sample(n: int, max_items: int | None, seed: int) -> np.ndarray:
    """The evaluated rows of a split: all of them, or a seeded subset of ``max_items`` (in file order)."""
    if max_items is None or n <= max_items:
        return np.arange(n)
    return np.sort(np.random.default_rng(seed).choice(n, size=max_items, replace=False))


def head_names(track: LocalClipTrack, task: str) -> tuple[list[str], list[str]]:
    classnames, templates = task_metadata(task)
    return track.class_names.get(task, classnames), track.templates.get(task, templates)


class TaskData:
    """A track's evaluation data: the sampled rows of each (task, split); validation images decoded once per
    cell (the grid scores them several times), test images streamed batch by batch."""

    def __init__(self, track: LocalClipTrack, root: str | Path, image_size: int, seed: int = 0):
        self.track, self.root, self.size, self.seed = track, Path(root), image_size, seed
        self.crop = track.evaluation.center_crop
        self._validation: dict[str, tuple[np.ndarray, np.ndarray]] = {}

    def split(self, task: str, split: str):
        data = task_split(self.track, task, split, self.root, self.seed)
        limit = self.track.evaluation.max_validation if split == "validation" else self.track.evaluation.max_test
        return data, sample(len(data), limit, self.seed)

    def score(self, model, head: torch.Tensor, task: str, split: str, device: str = "cpu", *,
              per_example: bool = False) -> dict[str, float]:
        # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
        from .....evaluation.zeroshot import logit_scores, predict_logits

        batch = self.track.evaluation.batch_size
        if split == "validation":
            if task not in self._validation:
                data, rows = self.split(task, split)
                check_labels(task, data, rows, head)
                self._validation[task] = (data.images(rows, self.size, self.crop), data.labels[rows])
            images, labels = self._validation[task]
            z = predict_logits(model, head, images, batch_size=batch, device=device)
            return logit_scores(z, labels)
        data, rows = self.split(task, split)
        check_labels(task, data, rows, head)
        z = torch.cat([predict_logits(model, head, images, batch_size=batch, device=device)
                       for images, _ in data.iter_batches(batch, self.size, rows, self.crop)])
        return logit_scores(z, data.labels[rows], per_example=per_example)


def check_labels(task: str, data, rows: np.ndarray, head: torch.Tensor) -> None:
    if len(rows) == 0:
        raise CheckpointError(f"{task}: the {data.split} split at {data.location} is empty")
    top = int(data.labels[rows].max())
    if top >= head.shape[1]:
        raise CheckpointError(f"{task}: dataset {data.location} has label {top}, but the zero-shot head has "
                              f"{head.shape[1]} classes")


# --------------------------------------------------------------------------------------------------- stages

def dataset_files(track: LocalClipTrack, task: str, root: str | Path) -> dict[str, Path]:
    """{dataset.<task>/<relative path>: file} of the files the task's splits are read from
    (``real_vision.dataset_files``); nothing when the dataset is not found (the references then hold that
    error)."""
    base = dataset_root(track, task, root)
    try:
        files = split_files(base, task)
    except MergecalError:
        return {}
    return {f"dataset.{task}/{name_under(p, base) or p.as_posix()}": p for p in files}


def model_paths(track: LocalClipTrack, root: str | Path) -> dict[str, Path]:
    return {"pretrained": pretrained_path(track, root),
            **{f"finetuned.{t}": finetuned_path(track, t, root) for t in track.finetuned}}


def model_keys(track: LocalClipTrack) -> dict[str, str]:
    """{role in inputs.json: the params key of its path}."""
    return {"pretrained": "model.pretrained", **{f"finetuned.{t}": f"finetuned.{t}" for t in track.finetuned}}


def input_files(track: LocalClipTrack, root: str | Path, where: str = "") -> dict[str, Path | dict]:
    """Every file the track reads, by role, and no other (``own_models.loaded_files``): its checkpoints'
    files and each task's dataset files. ``where``: the params prefix of the keys named in errors."""
    keys = model_keys(track)
    files: dict[str, Path | dict] = {}
    for role, path in model_paths(track, root).items():
        with_config = role == "pretrained" and track.model.arch is None
        check_adapter_params(track, role, path, where + keys[role], root)
        files.update(loaded_files(role, path, where + keys[role],
                                  lambda p, c=with_config: expert_files(p, with_config=c), CHECKPOINT_FILES))
    for task in track.finetuned:
        base = dataset_root(track, task, root)
        files.update(loaded_files(f"dataset.{task}", base, f"{where}datasets.{task}",
                                  lambda p, t=task: task_dataset_files(p, t),
                                  f"{task} dataset (expected {expected_layouts(base, task)})"))
    return files


def task_dataset_files(base: Path, task: str) -> list[Path]:
    """The files of the task's dataset under ``base`` (``real_vision.dataset_files``); none when no layout
    holds the task there. A layout that holds it but cannot be read raises (the track records the error)."""
    try:
        find_layout(base, canonical_task(task), "auto")
    except DatasetError:
        return []
    return split_files(base, task)


def data_digest(track: LocalClipTrack, task: str, root: str | Path) -> str:
    """sha256 over the task's dataset files (relative path and content hash, from the hash cache)."""
    h = hashlib.sha256()
    for name, path in dataset_files(track, task, root).items():
        h.update(f"{name}\0{file_digest(path, Path(root) / HASH_CACHE)}\n".encode())
    return h.hexdigest()


def check_test_size(track: LocalClipTrack, task: str, data: TaskData) -> None:
    """Refuse a task whose test images (those scored) are fewer than the track's ``min_test``."""
    check_test_counts(f"local_clip track {track.name!r}", {task: len(data.split(task, "test")[1])}, track.min_test,
                      "test images")


def _norms(pre_visual: VisualView, ft: VisualView) -> tuple[float, float]:
    """(|tau|, |tau| / |theta_0|) over the image encoder, read key by key."""
    tau = theta = 0.0
    for key in pre_visual.keys():
        base = pre_visual.get(key).double()
        tau += float((ft.get(key).double() - base).pow(2).sum())
        theta += float(base.pow(2).sum())
    return tau ** 0.5, tau ** 0.5 / max(theta ** 0.5, 1e-12)


def references(track: LocalClipTrack, root: str | Path = ".", *, seed: int = 0, device: str = "cpu") -> dict:
    """One CLIP track of the stage ``local_tracks``: the zero-shot heads, then per task the zero-shot and the
    fine-tuned model's scores on validation and test and the task vector's norm. An unusable pretrained model
    is the track's error; an unusable task (checkpoint, dataset) that task's; both one line, and the stage
    goes on with the other tasks and tracks."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import get_tokenizer, image_size, zero_shot_head

    root = Path(root)
    report: dict = {"name": track.name, "kind": "clip", "tasks": {}}
    heads = {}
    try:
        pre = open_checkpoint(pretrained_path(track, root), allow_unsafe_pickle=track.allow_unsafe_pickle)
        arch = report["arch"] = arch_of(track, root)
        pre_visual = pretrained_visual(pre)
        model = build_model(arch, pre).to(device)
        tokenizer = get_tokenizer(arch)
        for task in track.finetuned:
            classnames, templates = head_names(track, task)
            heads[task] = zero_shot_head(model, tokenizer, classnames, templates, device=device).cpu().contiguous()
        save_state_dict(heads, heads_path(track, root), {"arch": arch})
    except Exception as err:  # noqa: BLE001 - recorded: the track's cells fail with it, the others go on
        report["error"] = one_line(err)
        heads_path(track, root).unlink(missing_ok=True)
        atomic_write_text(references_path(track, root), json.dumps(report, indent=2, sort_keys=True))
        return report
    data = TaskData(track, root, image_size(model), seed)
    for task in track.finetuned:
        try:
            check_test_size(track, task, data)
            entry: dict = {"data_digest": data_digest(track, task, root), "zeroshot": {}}
            load_visual(model, ((k, pre_visual.get(k)) for k in pre_visual.keys()))
            for split in ("validation", "test"):
                # the test split's per-example results: the leaderboard's intervals of the zeroshot row
                entry["zeroshot"][split] = data.score(model, heads[task], task, split, device,
                                                      per_example=split == "test")
            ft = finetuned_view(pre, finetuned_path(track, task, root), allow_unsafe_pickle=track.allow_unsafe_pickle)
            load_visual(model, ((k, ft.get(k)) for k in ft.keys()))
            val = data.score(model, heads[task], task, "validation", device)
            test = data.score(model, heads[task], task, "test", device, per_example=True)
            entry["norm"], entry["relative_norm"] = _norms(pre_visual, ft)
            entry.update(val_accuracy=val["accuracy"], test_accuracy=test["accuracy"], entropy=test["entropy"],
                         ece=test["ece"], n={"validation": val["n"], "test": test["n"]}, test_correct=test["correct"])
            report["tasks"][task] = entry
        except Exception as err:  # noqa: BLE001 - as above, for this task's cells
            report["tasks"][task] = {"error": one_line(err)}
        data._validation.clear()
    atomic_write_text(references_path(track, root), json.dumps(report, indent=2, sort_keys=True))
    return report


def configured(params: Params) -> list:
    """This source's tracks in params.yaml (``local_clip:``)."""
    return params.local_clip


def input_records(params: Params, root: str | Path, cache: Path) -> dict:
    """This source's part of the stage ``local_inputs`` (``tracks.lab_files.record_inputs``): per track, size and
    sha256 of each file of its checkpoints and datasets that is read (``input_files``), and of no other file."""
    out = {}
    for index, track in enumerate(params.local_clip):
        found = input_files(track, root, f"params.yaml: local_clip.{index}.")
        out[track.name] = {"settings": track.model_dump(mode="json"), "files": content_records(found, cache)}
    return out


def task_line(report: dict, task: str, info: dict) -> str:
    """What the stage ``local_tracks`` prints of a task's references (``tracks.lab_files.report_lines``)."""
    return (f"fine-tuned {info['test_accuracy']:.3f}, zero-shot {info['zeroshot']['test']['accuracy']:.3f} "
            f"(test, {info['n']['test']} images); |tau| {info['norm']:.2f} ({info['relative_norm']:.4f} of |theta_0|)")
