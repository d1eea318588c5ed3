"""The DisTaC paper's analysis figures on the testbed's models ("DisTaC: Conditioning Task Vectors via Distillation
for Robust Model Merging", arXiv:2508.01148): what ``mergecal.pipeline.paper_analysis`` computes for the
``distac_*`` analyses, from the vision track's files of its first fine-tuning seed (the default run's regimes and
the papers' profile's, ``vision.paper_regimes``) and results/papers/distac_trajectories.json.

* ``distac_norms`` (Fig. 1b): each task's task-vector norm at the base lr and at the lr multiple (the regime that
  lengthens that task);
* ``distac_entropy`` (Fig. 1c): each task's mean test prediction entropy, standard against low confidence;
* ``distac_trajectory`` (Fig. 2): DisTaC's steps, per conditioned model and their mean and sd, in the norm mismatch
  (each task lengthened in turn: its conditioned model) and the low-confidence regime;
* ``distac_kappa`` (Fig. 3): each task's test accuracy of theta_0 + kappa tau, kappa from 0 to 3;
* ``distac_reliability`` (Fig. 4a): reliability diagrams of the fine-tunes at each label-smoothing strength;
* ``distac_layer_norms`` (Figs. 5 and 6): per-layer norms of the task vectors, standard against lengthened.

The library computes the figures (``mergecal.analysis.distac_figures``); this module loads the models and scores
them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..analysis.distac_figures import (average_reliability, confidence_gap_interval, kappa_sweep_summary,
                                       layer_norm_comparison, reliability, reliability_from_probabilities,
                                       trajectory_summary)
from ..errors import MergecalError
from ..regimes import label_smoothing_of
from ..task_vectors import task_vector
from ..train.finetune import FinetuneConfig
from .config import Params
from .tracks.clip.built.stages import VisionModels, preprocessed, task_split

KAPPAS = (0.0, 0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0)  # Fig. 3's range, 0 to 3
TRAJECTORIES = "results/papers/distac_trajectories.json"


def _regimes(params: Params) -> list[str]:
    return [*params.vision.regimes, *params.vision.paper_regimes]


def lengthened_regime(params: Params, task: str) -> str:
    """The regime that fine-tunes ``task`` at the lr multiple (one of the track's or the profile's)."""
    track = params.vision
    name = "norm_mismatch" if task == track.norm_mismatch_task else f"norm_mismatch_{task}"
    if name not in _regimes(params):
        raise MergecalError(f"analysis: regime {name!r} is in neither vision.regimes nor vision.paper_regimes")
    return name


def _diagnostics(models: VisionModels, regime: str) -> dict[str, Any]:
    return json.loads((models.paths.task_vectors(regime) / "diagnostics.json").read_text())


def distac_norms(params: Params, models: VisionModels, merges, regime: str, root: Path) -> dict[str, Any]:
    """Per task: its task vector's norm in ``regime`` (the base lr) and when lengthened (at its lr multiple), their
    ratio, and each fine-tune's test accuracy."""
    base = _diagnostics(models, regime)
    out = {}
    for task in params.vision.tasks:
        longer = _diagnostics(models, lengthened_regime(params, task))[task]
        out[task] = {"standard": base[task]["norm"], "lengthened": longer["norm"],
                     "ratio": longer["norm"] / base[task]["norm"], "standard_accuracy": base[task]["test_accuracy"],
                     "lengthened_accuracy": longer["test_accuracy"], "lr_multiplier": params.vision.lr_multiplier(task)}
    return {"tasks": list(params.vision.tasks), "norms": out}


def distac_entropy(params: Params, models: VisionModels, merges, regime: str, root: Path) -> dict[str, Any]:
    """Per task: the mean test prediction entropy of its fine-tune in ``regime`` and in ``low_confidence``."""
    base, low = _diagnostics(models, regime), _diagnostics(models, "low_confidence")
    return {"tasks": list(params.vision.tasks),
            "entropy": {t: {"standard": base[t]["entropy"], "low_confidence": low[t]["entropy"]}
                        for t in params.vision.tasks}}


def distac_trajectory(params: Params, models: VisionModels, merges, regime: str, root: Path) -> dict[str, Any]:
    """DisTaC's steps in the norm mismatch (per task, the regime lengthening it; its conditioned model) and in the
    low-confidence regime, each relative to its teacher (the fine-tune it distils) and its start."""
    default = json.loads((Path(root) / TRAJECTORIES).read_text())

    def trajectory_of(name: str) -> dict[str, list]:
        if name in default:
            return default[name]["trajectory"]
        return json.loads((models.paths.distac(name) / "distac.json").read_text())["trajectory"]

    settings = {}
    for setting in ("norm_mismatch", "low_confidence"):
        histories, teacher, initial = {}, {}, {}
        names = ([lengthened_regime(params, t) for t in params.vision.tasks] if setting == "norm_mismatch"
                 else ["low_confidence"])
        for name in names:
            diagnostics = _diagnostics(models, name)
            for task, records in trajectory_of(name).items():
                if task in histories:  # norm matching shrank another regime's task too: not the paper's setting
                    raise MergecalError(f"analysis distac_trajectory: DisTaC conditioned {task!r} in two regimes of "
                                        f"{setting}")
                histories[task] = records
                teacher[task] = diagnostics[task]["test_accuracy"]
                initial[task] = records[0]["tau_norm"]
        settings[setting] = trajectory_summary(histories, teacher, initial)
    return settings


def _scores(model, head: torch.Tensor, images: torch.Tensor, labels: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Test-set (confidence, correct) of a CLIP with a zero-shot head."""
    from ..backbones.open_clip_vit import logits

    model.eval()
    with torch.no_grad():
        out = torch.cat([logits(model, head, images[i:i + 256]).float() for i in range(0, len(labels), 256)])
    return reliability_from_probabilities(out.softmax(-1), labels)


def _test_inputs(params: Params, models: VisionModels) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    out = {}
    for task in params.vision.tasks:
        images, labels = task_split(models.paths.data, task, "test")
        out[task] = (preprocessed(images, params.vision.arch), torch.as_tensor(labels, dtype=torch.long))
    return out


def distac_kappa(params: Params, models: VisionModels, merges, regime: str, root: Path) -> dict[str, Any]:
    """Per task: test accuracy of theta_0 + kappa tau_t for each of ``KAPPAS`` (the regime's fine-tune)."""
    pre, inputs = models.visual_pretrained(), _test_inputs(params, models)
    accuracy: dict[str, dict[float, float]] = {}
    for task, state in zip(params.vision.tasks, models.finetuned(regime)):
        tau = task_vector(state, pre)
        images, labels = inputs[task]
        accuracy[task] = {}
        for kappa in KAPPAS:
            scaled = {k: (pre[k].float() + kappa * tau[k]).to(pre[k].dtype) if k in tau else pre[k] for k in pre}
            _, correct = _scores(models.model(scaled), models.heads[task], images, labels)
            accuracy[task][kappa] = float(np.mean(correct))
    return kappa_sweep_summary(accuracy)


def _smoothing(params: Params, name: str) -> float | None:
    """The label smoothing a regime's fine-tunes trained with (None: another loss)."""
    if name == "standard":
        return 0.0
    if name == "low_confidence":
        config = FinetuneConfig(**params.vision.finetune)
        return config.label_smoothing if config.low_confidence_loss == "label_smoothing" else None
    return label_smoothing_of(name)


def distac_reliability(params: Params, models: VisionModels, merges, regime: str, root: Path) -> dict[str, Any]:
    """Per regime trained with label smoothing (``merges`` names them; alpha ascending): the test reliability
    diagram of each task's fine-tune, their average, and the confidence gap with its 95 % interval."""
    inputs, out = _test_inputs(params, models), {}
    for name in merges:
        alpha = _smoothing(params, name)
        if alpha is None or name not in _regimes(params):
            raise MergecalError(f"analysis distac_reliability: {name!r} is no regime trained with label smoothing")
        confidence, correct, per_task = [], [], []
        for task, state in zip(params.vision.tasks, models.finetuned(name)):
            conf, right = _scores(models.model(state), models.heads[task], *inputs[task])
            confidence.append(conf), correct.append(right), per_task.append(reliability(conf, right))
        out[name] = {"alpha": alpha, "average": average_reliability(per_task),
                     "gap": confidence_gap_interval(confidence, correct)}
    return {"regimes": list(merges), "tasks": list(params.vision.tasks), "diagrams": out}


def distac_layer_norms(params: Params, models: VisionModels, merges, regime: str, root: Path) -> dict[str, Any]:
    """Per image-encoder key: the task vectors' norm at the base lr and lengthened, averaged over the tasks."""
    cache = models.__dict__.setdefault("distac_layer_norms", {})
    if regime not in cache:
        pre = models.visual_pretrained()
        tasks = list(params.vision.tasks)
        standard = [task_vector(s, pre) for s in models.finetuned(regime)]
        lengthened = []
        for task in tasks:
            name = lengthened_regime(params, task)
            states = dict(zip(tasks, models.finetuned(name)))
            lengthened.append(task_vector(states[task], pre))
        cache[regime] = layer_norm_comparison(standard, lengthened, tasks)
    return cache[regime]


ANALYSES = {"distac_norms": distac_norms, "distac_entropy": distac_entropy, "distac_trajectory": distac_trajectory,
            "distac_kappa": distac_kappa, "distac_reliability": distac_reliability,
            "distac_layer_norms": distac_layer_norms}
