"""The open_clip vision track of the pipeline: what each DVC stage builds, and the adapter a benchmark cell uses.

Layout under the repository root (every file is a DVC output, written atomically):

    data/vision/                                  procedural suite (mergecal.data.vision)
    models/<backbone>/pretrained.safetensors      contrastively pretrained CLIP (+ pretrained.json)
    models/<backbone>/heads.safetensors           zero-shot heads, one per task and the probe task
    models/<backbone>/seeds/<s>/                  one fine-tuning seed's models (``seeds`` in params.yaml):
      finetuned/<variant>/<task>.safetensors (+ .json metadata)
        variants: standard, low_confidence (every task), norm_mismatch (one task at the lr multiple)
      finetuned/multitask.safetensors (+ .json)   the multi-task reference: one encoder on the K tasks jointly
      finetuned.json                              every fine-tune's metadata (committed; the models are not)
        Image encoder keys only, as task_vectors' ImageEncoder checkpoints: the text tower is not trained.
      task_vectors/<regime>/diagnostics.json      norms and reference accuracies (no tau files)
      distac/<regime>/<task>.safetensors, distac.json
      sensitivity/<regime>.json
    models/<backbone>/papers/seeds/<s>/<regime>/  a regime of the papers' profile (``vision.paper_regimes``, `make
      finetuned/<task>.safetensors (+ .json)      paper`): the fine-tunes the default run has not made,
      task_vectors/diagnostics.json, distac/      its diagnostics and DisTaC (each step's trajectory in distac.json)

A regime is the set of K fine-tuned models merged together: ``standard`` and ``low_confidence`` use their
variant for every task; ``norm_mismatch`` uses ``standard`` except its one task fine-tuned at
its multiple of the lr (``vision.norm_mismatch_lr_multiplier``); the papers' regimes are named in
``mergecal.regimes``.
"""

from __future__ import annotations

import json
import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
import torch

from .....calibrations.distac import DistacStepParams, condition_models
from .....calibrations.probing import make_accuracy_probe, make_probe, probe_sensitivity
from .....checkpoint import atomic_write_text, load_state_dict, save_state_dict
from .....data.vision import PROBE_TASK, TASKS, SuiteConfig, build_vision_suite, load_split, validation_indices
from .....errors import CheckpointError
from .....methods.base import build_params
from .....regimes import distac_preset, finetune_overrides
from .....regimes import variants as variants_of_regime
from .....task_vectors import relative_norms, task_vector
from .....train.finetune import FinetuneConfig
from .....train.finetune import finetune as finetune_clip
from .....train.multitask import finetune_multitask
from .....train.pretrain_clip import PretrainConfig, pretrain_clip
from ....config import Params, fine_tuning_seed, seed_dir
from ....threads import pin_threads
from ..family import TaskHeadModel
from .params import VisionTrack

VISUAL_PREFIX = "visual."


def is_visual(key: str) -> bool:
    return key.startswith(VISUAL_PREFIX)


@dataclass(frozen=True)
class VisionPaths:
    root: Path
    backbone: str
    seed: int = 0  # the fine-tuning seed whose models (and what is built from them) these paths name
    profile: tuple[str, ...] = ()  # the papers' profile's regimes (their files under papers/seeds/<s>/<regime>/)
    built: frozenset = frozenset()  # the (task, variant) fine-tunes of the default run (under finetuned/)

    @property
    def data(self) -> Path:
        return self.root / "data" / "vision"

    @property
    def models(self) -> Path:
        return self.root / "models" / self.backbone

    @property
    def pretrained(self) -> Path:
        return self.models / "pretrained.safetensors"

    @property
    def heads(self) -> Path:
        return self.models / "heads.safetensors"

    @property
    def seeded(self) -> Path:
        return seed_dir(self.models, self.seed)

    def finetuned(self, variant: str, task: str) -> Path:
        """A fine-tune of the default run."""
        return self.seeded / "finetuned" / variant / f"{task}.safetensors"

    @property
    def multitask(self) -> Path:
        """The multi-task reference of the default run (the ``standard`` regime's tasks, ``finetune_multitask``)."""
        return self.seeded / "finetuned" / "multitask.safetensors"

    def regime_dir(self, regime: str) -> Path:
        """Where a regime of the papers' profile keeps what it builds: outside ``seeds/``, which the default run's
        benchmark reads whole (a profile's output there would put its stage upstream of the default run)."""
        return seed_dir(self.models / "papers", self.seed) / regime

    def model(self, regime: str, task: str, variant: str) -> Path:
        """Task ``task``'s model in ``regime`` (fine-tuned as ``variant``): the default run's fine-tune where it
        made one, else the profile regime's own."""
        if (task, variant) in self.built or regime not in self.profile:
            return self.finetuned(variant, task)
        return self.regime_dir(regime) / "finetuned" / f"{task}.safetensors"

    def task_vectors(self, regime: str) -> Path:
        if regime in self.profile:
            return self.regime_dir(regime) / "task_vectors"
        return self.seeded / "task_vectors" / regime

    def distac(self, regime: str) -> Path:
        if regime in self.profile:
            return self.regime_dir(regime) / "distac"
        return self.seeded / "distac" / regime

    def sensitivity(self, regime: str) -> Path:
        if regime in self.profile:  # the profile probes none: a cell that reads it finds no file
            return self.regime_dir(regime) / "sensitivity.json"
        return self.seeded / "sensitivity" / f"{regime}.json"


def paths_for(params: Params, root: str | Path = ".", seed: int | None = None) -> VisionPaths:
    """The track's paths, with the models of fine-tuning seed ``seed`` (None: the first of ``params.seeds``)."""
    track = params.vision
    return VisionPaths(Path(root), track.backbone, fine_tuning_seed(params, seed), tuple(track.paper_regimes),
                       frozenset(finetune_runs(track)))


def regime_variants(track: VisionTrack, regime: str) -> dict[str, str]:
    """Which fine-tuned variant each task contributes to a regime (``mergecal.regimes.variants``)."""
    return variants_of_regime(regime, track.tasks, track.norm_mismatch_task)


def regime_files(paths: VisionPaths, track: VisionTrack, regime: str) -> dict[str, Path]:
    """Each task's model file in a regime, in task order."""
    return {task: paths.model(regime, task, variant) for task, variant in regime_variants(track, regime).items()}


# ---------------------------------------------------------------------------------------------- data and models

def task_split(data_root: Path, task: str, split: str, *, max_items: int | None = None):
    """(uint8 images, labels) of a task. ``validation`` is the held-out part of train (never trained on)."""
    spec = TASKS[task] if task in TASKS else PROBE_TASK
    arrays = load_split(data_root, spec.dataset, "train" if split in ("train", "validation") else split)
    images, labels = arrays["images"], arrays[spec.label]
    if split == "validation":
        idx = validation_indices(len(labels))
        images, labels = images[idx], labels[idx]
    elif split == "train":
        keep = np.ones(len(labels), dtype=bool)
        keep[validation_indices(len(labels))] = False
        images, labels = images[keep], labels[keep]
    if max_items is not None:
        images, labels = images[:max_items], labels[:max_items]
    return images, labels


def build_data(params: Params, root: str | Path = ".", progress: bool = True) -> dict:
    config = SuiteConfig(**{"seed": params.seed, "task_set": params.vision.task_set, **params.vision.data})
    return build_vision_suite(paths_for(params, root).data, config, progress=progress)


def pretrain(params: Params, root: str | Path = ".", *, device: str = "cpu", progress: bool = True) -> dict:
    """Pretrain the CLIP, then cache every task's zero-shot head (the text tower is never fine-tuned, so the
    heads hold for every fine-tuned and merged model) and score the zero-shot model."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import get_tokenizer, save_clip, zero_shot_head

    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....evaluation.zeroshot import evaluate

    track, paths = params.vision, paths_for(params, root)
    config = PretrainConfig(**{"seed": params.seed, **track.pretrain, "arch": track.arch})
    data = load_split(paths.data, "pretrain", "train")
    model, history = pretrain_clip(data["images"], [str(c) for c in data["captions"]], config, device=device,
                                   progress=progress)
    model = model.cpu().eval()
    tokenizer = get_tokenizer(track.arch)
    heads = {}
    for spec in [*(TASKS[t] for t in track.tasks), PROBE_TASK]:
        heads[spec.name] = zero_shot_head(model, tokenizer, spec.classnames, spec.templates).contiguous()
    zeroshot = {}
    for task in track.tasks:
        for split in ("validation", "test"):
            images, labels = task_split(paths.data, task, split)
            zeroshot.setdefault(task, {})[split] = evaluate(model, heads[task], images, labels)
    save_clip(model, paths.pretrained, {"arch": track.arch, "backbone": track.backbone})
    save_state_dict(heads, paths.heads, {"backbone": track.backbone, "tasks": json.dumps(list(heads))})
    # no wall-clock figure here: this file is a DVC output committed to git, so it must be the same on every run
    report = {"arch": track.arch, "config": asdict(config), "final_loss": history["loss"][-1],
              "loss": history["loss"][:: max(1, len(history["loss"]) // 50)], "zeroshot": zeroshot}
    atomic_write_text(paths.models / "pretrained.json", json.dumps(report, indent=2))
    return report


def finetune(params: Params, task: str, variant: str, root: str | Path = ".", *, seed: int | None = None,
             device: str = "cpu", progress: bool = True, out: Path | None = None) -> dict:
    """Fine-tune one task in one variant (Ilharco et al.: image encoder only, frozen zero-shot head;
    ``mergecal.regimes.finetune_overrides``) with fine-tuning seed ``seed`` (None: the first of ``params.seeds``),
    written to ``out`` (default: the default run's ``finetuned/<variant>/<task>``)."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import load_clip

    track, paths = params.vision, paths_for(params, root, seed)
    if task not in track.tasks:
        raise CheckpointError(f"finetune: task {task!r} is not in vision.tasks ({', '.join(track.tasks)})")
    values = {"seed": paths.seed, **track.finetune}
    values.update(finetune_overrides(variant, FinetuneConfig(**values).lr, track.lr_multiplier(task)))
    config = FinetuneConfig(**values)
    model = load_clip(track.arch, paths.pretrained)
    head = load_state_dict(paths.heads)[task]
    images, labels = task_split(paths.data, task, "train")
    state, history = finetune_clip(model, head, images, labels, config,
                                   validation=task_split(paths.data, task, "validation"),
                                   device=device, progress=progress)
    visual = {k: v.contiguous() for k, v in state.items() if is_visual(k)}
    manifest = json.loads((paths.data / "manifest.json").read_text())
    dataset = TASKS[task].dataset
    metadata = {"backbone": track.backbone, "arch": track.arch, "task": task, "variant": variant,
                "hyperparameters": asdict(config), "data_digest": manifest["digests"].get(f"{dataset}/train", dataset),
                "final_loss": history["loss"][-1],
                "val_accuracy": history.get("val_accuracy", [None])[-1],
                "layout": "open_clip state dict, image encoder keys only (the rest equals pretrained)"}
    out = out or paths.finetuned(variant, task)
    save_state_dict(visual, out, {"mergecal": json.dumps(metadata)})
    atomic_write_text(out.with_suffix(".json"), json.dumps(metadata, indent=2))
    return metadata


def multitask(params: Params, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu",
              progress: bool = True) -> dict:
    """The multi-task reference (``mergecal.train.multitask``): the pretrained image encoder fine-tuned on every
    task of the track jointly, with the ``standard`` fine-tunes' recipe and, by the default ``sum`` budget, their
    steps added up (each task as many steps as its own fine-tune), written to ``paths.multitask``."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import load_clip

    track, paths = params.vision, paths_for(params, root, seed)
    config = FinetuneConfig(**{"seed": paths.seed, **track.finetune, "regime": "standard"})
    model = load_clip(track.arch, paths.pretrained)
    heads = load_state_dict(paths.heads)
    budget = "sum"
    state, history = finetune_multitask(model, [heads[t] for t in track.tasks],
                                        [task_split(paths.data, t, "train") for t in track.tasks], config,
                                        budget=budget, validation=[task_split(paths.data, t, "validation")
                                                                   for t in track.tasks],
                                        device=device, progress=progress)
    visual = {k: v.contiguous() for k, v in state.items() if is_visual(k)}
    digests = json.loads((paths.data / "manifest.json").read_text())["digests"]
    metadata = {"backbone": track.backbone, "arch": track.arch, "tasks": list(track.tasks), "variant": "multitask",
                "regime": "standard", "budget": budget, "steps": len(history["loss"]),
                "hyperparameters": asdict(config),
                "data_digests": {t: digests.get(f"{TASKS[t].dataset}/train", TASKS[t].dataset) for t in track.tasks},
                "final_loss": history["loss"][-1],
                "val_accuracy": dict(zip(track.tasks, history["val_accuracy"])),
                "layout": "open_clip state dict, image encoder keys only (the rest equals pretrained)"}
    save_state_dict(visual, paths.multitask, {"mergecal": json.dumps(metadata)})
    atomic_write_text(paths.multitask.with_suffix(".json"), json.dumps(metadata, indent=2))
    return metadata


def finetune_runs(track: VisionTrack) -> list[tuple[str, str]]:
    """Every (task, variant) the default run fine-tunes: each task in each variant, plus the norm-mismatch task."""
    return [*((t, v) for v in track.finetune_variants for t in track.tasks),
            (track.norm_mismatch_task, "norm_mismatch")]


def regime_runs(track: VisionTrack, regime: str) -> list[tuple[str, str]]:
    """The (task, variant) fine-tunes a regime of the papers' profile adds to the default run's."""
    built = set(finetune_runs(track))
    return [(t, v) for t, v in regime_variants(track, regime).items() if (t, v) not in built]


def finetune_all(params: Params, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu",
                 workers: int = 1, progress: bool = True, log=print, regime: str | None = None) -> dict:
    """Every fine-tune of the default run, then ``finetuned.json``: each model's metadata, the figures a reader of
    the repository wants; with ``regime`` (one of ``vision.paper_regimes``), the fine-tunes that regime adds, in
    its own directory. The default run also trains the multi-task reference (``multitask``; ``finetuned.json``'s
    ``multitask`` entry), first: it is the longest. On the CPU each fine-tune runs on one torch thread, so its bits
    do not depend on the machine's cores, and ``workers`` of them run at once, each worker a process of its own (one
    start-up and one import of open_clip per worker; two one-thread fine-tunes side by side train ~1.5x faster than
    one on two threads). On a GPU they run one after another in this process."""
    paths = paths_for(params, root, seed)
    runs = finetune_runs(params.vision) if regime is None else regime_runs(params.vision, regime)
    joint = regime is None  # the multi-task reference belongs to the default run
    total = len(runs) + joint
    outs = {(t, v): (paths.finetuned(v, t) if regime is None else paths.model(regime, t, v)) for t, v in runs}
    metadata: dict[tuple[str, str], dict] = {}

    def done(task: str, variant: str, meta: dict, seconds: float) -> None:
        metadata[task, variant] = meta
        accuracy = np.mean(list(meta["val_accuracy"].values())) if variant == "multitask" else meta["val_accuracy"]
        log(f"[{len(metadata)}/{total}] {task} ({variant}): validation accuracy {accuracy:.3f} in {seconds:.0f} s")

    if device == "cpu" and workers > 1 and total > 1:
        spawn = multiprocessing.get_context("spawn")  # a fresh interpreter: no torch thread pool inherited
        with ProcessPoolExecutor(min(workers, total), mp_context=spawn, initializer=pin_threads,
                                 initargs=(1,)) as pool:
            futures = {pool.submit(_timed_multitask, params, str(root), seed, device): ("all", "multitask")} \
                if joint else {}
            futures.update({pool.submit(_timed_finetune, params, task, variant, str(root), seed, device,
                                        out=outs[task, variant]): (task, variant) for task, variant in runs})
            for future in as_completed(futures):
                done(*futures[future], *future.result())
    else:
        if device == "cpu":
            pin_threads(1)
        if joint:
            done("all", "multitask", *_timed_multitask(params, str(root), seed, device, progress))
        for task, variant in runs:
            done(task, variant, *_timed_finetune(params, task, variant, str(root), seed, device, progress,
                                                 out=outs[task, variant]))
    summary: dict[str, dict] = {}
    for task, variant in runs:  # the runs' order, whichever finished first
        summary.setdefault(variant, {})[task] = metadata[task, variant]
    if joint:
        summary["multitask"] = metadata["all", "multitask"]
        atomic_write_text(paths.seeded / "finetuned.json", json.dumps(summary, indent=2))
    return summary


def _timed_finetune(params: Params, task: str, variant: str, root: str, seed: int | None, device: str,
                    progress: bool = False, out: Path | None = None) -> tuple[dict, float]:
    start = time.perf_counter()
    meta = finetune(params, task, variant, root, seed=seed, device=device, progress=progress, out=out)
    return meta, time.perf_counter() - start


def _timed_multitask(params: Params, root: str, seed: int | None, device: str,
                     progress: bool = False) -> tuple[dict, float]:
    start = time.perf_counter()
    meta = multitask(params, root, seed=seed, device=device, progress=progress)
    return meta, time.perf_counter() - start


class VisionModels:
    """Loads what a regime's cells need: pretrained state, zero-shot heads, the K fine-tuned states (of
    fine-tuning seed ``seed``; None: the first of ``params.seeds``)."""

    def __init__(self, params: Params, root: str | Path = ".", seed: int | None = None):
        self.params, self.track, self.paths = params, params.vision, paths_for(params, root, seed)

    @cached_property
    def pretrained(self) -> dict[str, torch.Tensor]:
        return load_state_dict(self.paths.pretrained)

    @cached_property
    def heads(self) -> dict[str, torch.Tensor]:
        return load_state_dict(self.paths.heads)

    def full_state(self, visual: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {**self.pretrained, **visual}

    def finetuned(self, regime: str) -> list[dict[str, torch.Tensor]]:
        """Image-encoder states of the regime's K models (task order of the track)."""
        return [load_state_dict(path) for path in regime_files(self.paths, self.track, regime).values()]

    def model(self, state: dict[str, torch.Tensor]) -> torch.nn.Module:
        # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
        from .....backbones.open_clip_vit import load_clip

        return load_clip(self.track.arch, self.full_state(state))

    def visual_pretrained(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.pretrained.items() if is_visual(k)}


def preprocessed(images: np.ndarray, arch: str) -> torch.Tensor:
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import ARCHITECTURES, preprocess

    size = ARCHITECTURES[arch]["vision_cfg"]["image_size"] if arch in ARCHITECTURES else None
    return preprocess(images, size)


def evaluate_tasks(model: torch.nn.Module, heads: dict[str, torch.Tensor], data_root: Path, tasks: list[str],
                   split: str, *, max_items: int | None = None, batch_size: int = 256,
                   device: str = "cpu", per_example: bool = False) -> dict[str, dict[str, float]]:
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....evaluation.zeroshot import evaluate

    out = {}
    for task in tasks:
        images, labels = task_split(data_root, task, split, max_items=max_items)
        out[task] = evaluate(model, heads[task], images, labels, batch_size=batch_size, device=device,
                             per_example=per_example)
    return out


def task_vectors(params: Params, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu",
                 regimes: list[str] | None = None) -> dict:
    """Per regime (``regimes``, default the track's), ``diagnostics.json``: each task vector's norms (tau =
    theta_ft - theta_0, image encoder; the vectors themselves are not written, since cells, DisTaC and probing
    compute them from the checkpoints as they stream), and the reference figures every cell is normalised by:
    the task's own fine-tuned accuracy (validation and test), prediction entropy and ECE."""
    track, models = params.vision, VisionModels(params, root, seed)
    pre_visual = models.visual_pretrained()
    batch = params.benchmark.evaluation.batch_size
    report = {}
    for regime in track.regimes if regimes is None else regimes:
        out_dir = models.paths.task_vectors(regime)
        diagnostics = {}
        for task, state in zip(track.tasks, models.finetuned(regime)):
            tau = task_vector(state, pre_visual)  # measured here, not written: every consumer streams its own
            norm = float(sum(v.double().pow(2).sum() for v in tau.values()) ** 0.5)
            model = models.model(state)
            scores = evaluate_tasks(model, models.heads, models.paths.data, [task], "validation", batch_size=batch,
                                    device=device)[task]
            test = evaluate_tasks(model, models.heads, models.paths.data, [task], "test", batch_size=batch,
                                  device=device, per_example=True)[task]
            diagnostics[task] = {"norm": norm, "relative_norms": relative_norms(tau, pre_visual),
                                 "entropy": test["entropy"], "ece": test["ece"],
                                 "val_accuracy": scores["accuracy"], "test_accuracy": test["accuracy"],
                                 "test_correct": test["correct"]}  # the finetuned row's per-example results
        atomic_write_text(out_dir / "diagnostics.json", json.dumps(diagnostics, indent=2))
        report[regime] = diagnostics
    return report


def distac_params(params: Params, regime: str):
    """The DisTaC step of a regime: the paper's preset for it (``mergecal.regimes.distac_preset``) unless
    ``distac.preset`` names one, with the shared overrides of params.yaml's ``distac`` section."""
    values = dict(params.distac)
    values.setdefault("preset", distac_preset(regime))
    return build_params(DistacStepParams, "distac", values)


def trajectory_observer(models: "VisionModels", tasks: list[str], device: str):
    """DisTaC's ``observe``: the student's test accuracy and mean prediction entropy on task t (the paper's
    Fig. 2)."""
    splits = [task_split(models.paths.data, task, "test") for task in tasks]
    inputs = [(preprocessed(images, models.track.arch), torch.as_tensor(labels, dtype=torch.long))
              for images, labels in splits]

    def observe(t: int, student: torch.nn.Module) -> dict[str, float]:
        x, y = inputs[t]
        logits = torch.cat([student(x[i:i + 256].to(device)).float().cpu() for i in range(0, len(y), 256)])
        log_p = torch.log_softmax(logits, dim=-1)
        entropy = float(-(log_p.exp() * log_p).sum(-1).mean())
        return {"accuracy": float((logits.argmax(-1) == y).float().mean()), "entropy": entropy}

    return observe


def _condition_regime(params: Params, models: "VisionModels", regime: str, *, device: str, progress: bool,
                      observe=None) -> tuple:
    """DisTaC over one regime's K models: (the step, the K states, conditioned where chosen, its report)."""
    track, samples = params.vision, params.benchmark.evaluation.distac_samples
    step = distac_params(params, regime)
    states = [models.full_state(s) for s in models.finetuned(regime)]
    data = [preprocessed(task_split(models.paths.data, task, "train", max_items=samples)[0], track.arch)
            for task in track.tasks]
    heads = [models.heads[task] for task in track.tasks]
    conditioned, done = condition_models(
        step, models.pretrained, states,
        lambda t, sd: TaskHeadModel(models.model({k: v for k, v in sd.items() if is_visual(k)}), heads[t]),
        data, trainable=is_visual, progress=progress, device=device, observe=observe)
    return step, conditioned, done


def _trajectories(tasks: list[str], done: dict) -> dict:
    """Step 0 and every norm_every-th record (those with a tau_norm) of each conditioned model."""
    return {tasks[t]: [r for r in h if "tau_norm" in r] for t, h in done["history"].items()}


def distac(params: Params, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu",
           progress: bool = True, regimes: list[str] | None = None, trajectory: bool = False) -> dict:
    """DisTaC-condition each regime's fine-tuned models (unlabeled train images of each task) once, for every
    cell whose chain starts with ``distac``. Unconditioned tasks are written unchanged, so a cell reads K files.
    ``regimes``: default the track's. ``trajectory``: distac.json keeps every 10th step of each conditioned
    model, with its test accuracy and entropy (``trajectory_observer``), beside the last step."""
    track, models = params.vision, VisionModels(params, root, seed)
    observe = trajectory_observer(models, track.tasks, device) if trajectory else None
    report = {}
    for regime in track.regimes if regimes is None else regimes:
        step, conditioned, done = _condition_regime(params, models, regime, device=device, progress=progress,
                                                    observe=observe)
        out_dir = models.paths.distac(regime)
        info = {"params": step.model_dump(), "kappas": done["kappas"],
                "conditioned": [track.tasks[t] for t in done["conditioned"]],
                "history": {track.tasks[t]: h[-1] if h else {} for t, h in done["history"].items()}}
        if trajectory:
            info["trajectory"] = _trajectories(track.tasks, done)
        for task, state in zip(track.tasks, conditioned):
            visual = {k: v.contiguous() for k, v in state.items() if is_visual(k)}
            save_state_dict(visual, out_dir / f"{task}.safetensors", {"distac": step.model_dump_json()})
        atomic_write_text(out_dir / "distac.json", json.dumps(info, indent=2, default=str))
        report[regime] = info
    return report


def distac_trajectories(params: Params, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu",
                        regimes: list[str]) -> dict:
    """The trajectories of DisTaC as the default run's ``distac`` stage ran it (which keeps the last step alone):
    each regime conditioned again with ``trajectory_observer``, and every conditioned model checked against the
    stage's file, bit for bit (the observer changes nothing). Returns {regime: {"kappas", "conditioned",
    "trajectory"}}."""
    track, models = params.vision, VisionModels(params, root, seed)
    observe = trajectory_observer(models, track.tasks, device)
    out = {}
    for regime in regimes:
        _, conditioned, done = _condition_regime(params, models, regime, device=device, progress=False,
                                                 observe=observe)
        for t in done["conditioned"]:
            path = models.paths.distac(regime) / f"{track.tasks[t]}.safetensors"
            stored = load_state_dict(path)
            if any(not torch.equal(stored[k], conditioned[t][k]) for k in stored):
                raise CheckpointError(f"{path}: DisTaC run again with its trajectory differs from the distac stage's "
                                      "model (rerun `dvc repro distac` on this machine's threads)")
        out[regime] = {"kappas": done["kappas"], "conditioned": [track.tasks[t] for t in done["conditioned"]],
                       "trajectory": _trajectories(track.tasks, done)}
    return out


def probe(params: Params, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu",
          progress: bool = True) -> dict:
    """MAGIC's magnitude-sensitivity probe, per regime: on the weight-averaged model, scale each candidate
    image-encoder key's slice of the averaged task vector and rank keys by ``probing.metric`` on the probe task
    (none of the tasks), each drop with its bootstrap interval over the probe images."""
    track, models, probing = params.vision, VisionModels(params, root, seed), params.probing
    images, labels = task_split(models.paths.data, "letters", "test", max_items=probing.max_samples)
    head = models.heads["letters"]
    x, y = preprocessed(images, track.arch), torch.as_tensor(labels, dtype=torch.long)
    batches = [(x[i:i + 256], y[i:i + 256]) for i in range(0, len(y), 256)]
    report = {}
    for regime in track.regimes:
        states = models.finetuned(regime)
        averaged = {k: torch.stack([s[k].float() for s in states]).mean(0) for k in states[0]}
        model = TaskHeadModel(models.model(averaged), head)
        accuracy = make_accuracy_probe(batches, device=device)(model)  # the testbed's probe-signal criterion
        ranking = probe_sensitivity(model, models.pretrained, make_probe(batches, probing.metric, device=device),
                                    scale=probing.scale, top=probing.top, key_rule=probing.key_rule,
                                    key_pattern=probing.key_pattern or r"^visual\.", seed=models.paths.seed,
                                    progress=progress, metadata={"regime": regime, "probe": "letters",
                                                                 "samples": len(y), "metric": probing.metric,
                                                                 "candidates": probing.candidates,
                                                                 "baseline_accuracy": accuracy})
        ranking.save(models.paths.sensitivity(regime))
        report[regime] = ranking.sensitive
    return report
