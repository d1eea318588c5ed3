"""DisTaC's protocol on the default vision testbed: the testbed's setting against the paper's (issue #29).

    .venv/bin/python scripts/perf_distac_protocol.py --root <a run's checkout> --out /tmp/distac_protocol.json
    .venv/bin/python scripts/perf_distac_protocol.py --root <...> --regime low_confidence --settings paper

Reads (never writes) a full run's pretrained CLIP, heads, fine-tuned models and data under ``--root``, builds the
task models and the unlabeled data exactly as the `distac` stage does
(``mergecal.pipeline.tracks.vision.stages.distac``), and distils ONE task per regime preset: under ``norm_mismatch``
the task with the longest task vector (the one norm matching shrinks), under ``low_confidence``
``--low-confidence-task`` (default `digits`). Settings:

- ``testbed``: 50 steps, batch 64, lr 1e-4, constant (params.yaml's `distac` section before issue #29);
- ``paper``: 500 steps, batch 128, lr 1e-5, constant (Appendix B and the authors' code);
- ``paper_cosine``: the same with ``schedule="cosine"`` (10 % warm-up);
- ``batch128_lr1e-4``: 150 steps, batch 128, lr 1e-4, constant (a cheaper candidate).

A constant-lr run's first k steps ARE the k-step run (same seed, same batches, Adam's state does not depend on the
total), so every constant setting is also evaluated after each ``--prefix`` below its steps (``paper@150`` ...)
at no extra cost; their seconds are the per-step time times k. Per setting: wall seconds and the median
per-step time (one torch thread; on a shared machine both vary), the mean training KL of the last 10 steps, the
KL on the whole unlabeled set (the preset's temperatures, T_tcr T_stu KL as in the loss), ||tau|| / ||kappa tau_t||
(image encoder), test accuracy with a bootstrap 95 % interval over test images, and the mean prediction entropy
on the test split.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal.calibrations.confidence import prediction_entropy  # noqa: E402
from mergecal.calibrations.distac import (  # noqa: E402
    DistacParams,
    distill_task_vector,
    distillation_loss,
    norm_matching_kappas,
    task_vector_norm,
)
from mergecal.evaluation.zeroshot import predict_logits  # noqa: E402
from mergecal.pipeline.config import load_params  # noqa: E402
from mergecal.pipeline.tracks.vision.stages import (  # noqa: E402
    TaskHeadModel,
    VisionModels,
    is_visual,
    preprocessed,
    task_split,
)
from mergecal.task_vectors import task_vector  # noqa: E402

SETTINGS = {
    "testbed": {"steps": 50, "batch_size": 64, "lr": 1e-4, "schedule": "constant"},
    "paper": {"steps": 500, "batch_size": 128, "lr": 1e-5, "schedule": "constant"},
    "paper_cosine": {"steps": 500, "batch_size": 128, "lr": 1e-5, "schedule": "cosine"},
    # candidates for a cheaper match of `paper`: its batch at the testbed's lr (prefixes 50 and 100 come free)
    "batch128_lr1e-4": {"steps": 150, "batch_size": 128, "lr": 1e-4, "schedule": "constant"},
}


def bootstrap_accuracy(correct: np.ndarray, seed: int = 0) -> tuple[float, float]:
    from scipy.stats import bootstrap

    result = bootstrap((correct.astype(float),), np.mean, confidence_level=0.95, n_resamples=2000,
                       random_state=np.random.default_rng(seed), method="percentile")
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


class StepClock:
    """Wraps the student (build_model's second call): times each step (one student forward per step) and keeps a
    copy of the image encoder after the steps in ``snapshot_after``."""

    def __init__(self, build, snapshot_after: set[int]):
        self.build, self.snapshot_after, self.calls = build, snapshot_after, 0
        self.stamps: list[float] = []
        self.snapshots: dict[int, dict[str, torch.Tensor]] = {}

    def __call__(self, state):
        model = self.build(state)
        self.calls += 1
        if self.calls == 2:  # the student
            model.register_forward_pre_hook(self._hook)
        return model

    def _hook(self, module, args):
        done = len(self.stamps)  # steps finished before this forward
        self.stamps.append(time.perf_counter())
        if done in self.snapshot_after:
            self.snapshots[done] = {k: v.detach().clone() for k, v in module.state_dict().items() if is_visual(k)}


def scores(models: VisionModels, head, state, pretrained_visual, anchor_norm, test, unlabeled_logits_teacher,
           unlabeled_images, preset) -> dict:
    model = models.model(state)
    z_test = predict_logits(model, head, test[0])
    correct = (z_test.argmax(-1).numpy() == np.asarray(test[1]))
    low, high = bootstrap_accuracy(correct)
    z_unlabeled = predict_logits(model, head, unlabeled_images)
    kl = float(distillation_loss(z_unlabeled, unlabeled_logits_teacher, preset.t_teacher, preset.t_student))
    tau = {k: state[k].float() - pretrained_visual[k].float() for k in pretrained_visual}
    return {"accuracy": float(correct.mean()), "accuracy_ci95": [low, high], "entropy": prediction_entropy(z_test),
            "kl_unlabeled": kl, "norm_ratio": task_vector_norm(tau) / anchor_norm}


def run_regime(params, root: Path, regime: str, low_confidence_task: str, settings: list[str],
               prefixes: list[int]) -> dict:
    track, models = params.vision, VisionModels(params, root)
    pre_visual = models.visual_pretrained()
    finetuned = models.finetuned(regime)
    if regime == "norm_mismatch":
        taus = [task_vector(s, pre_visual) for s in finetuned]
        kappas = norm_matching_kappas(taus)
        index = min(range(len(kappas)), key=lambda i: kappas[i])  # the one norm matching shrinks
        del taus
        preset_name = "norm_mismatch"
    else:
        index, preset_name = track.tasks.index(low_confidence_task), "low_confidence"
        kappas = [1.0] * len(finetuned)
    task, kappa, head = track.tasks[index], kappas[index], models.heads[track.tasks[index]]
    samples = params.benchmark.evaluation.distac_samples
    raw_unlabeled = task_split(models.paths.data, task, "train", max_items=samples)[0]
    unlabeled = preprocessed(raw_unlabeled, track.arch)  # what the stage feeds DisTaC
    test = task_split(models.paths.data, task, "test")
    teacher_state = models.full_state(finetuned[index])
    anchor_visual = {k: pre_visual[k] + kappa * (finetuned[index][k].float() - pre_visual[k]) for k in pre_visual}
    anchor_norm = task_vector_norm({k: anchor_visual[k] - pre_visual[k] for k in pre_visual})
    preset = DistacParams.preset(preset_name, kappa=kappa)
    teacher_logits = predict_logits(models.model(finetuned[index]), head, raw_unlabeled)

    def evaluate(visual):
        return scores(models, head, visual, pre_visual, anchor_norm, test, teacher_logits, raw_unlabeled, preset)

    out = {"regime": regime, "preset": preset_name, "task": task, "kappa": kappa, "unlabeled": len(unlabeled),
           "test_images": len(test[1]), "teacher": evaluate(finetuned[index]), "anchor": evaluate(anchor_visual),
           "settings": {}}
    print(f"{regime}/{task}: kappa {kappa:.4f}; teacher {out['teacher']}; anchor {out['anchor']}", flush=True)
    for name in settings:
        step_params = DistacParams.preset(preset_name, kappa=kappa, **SETTINGS[name])
        build = StepClock(lambda sd: TaskHeadModel(models.model({k: v for k, v in sd.items() if is_visual(k)}),
                                                   head),
                          {k for k in prefixes if k < step_params.steps} if step_params.schedule == "constant"
                          else set())
        start = time.perf_counter()
        conditioned, history = distill_task_vector(build, models.pretrained, teacher_state, unlabeled, step_params,
                                                   trainable=is_visual, progress=False)
        seconds = time.perf_counter() - start
        steps = np.diff(build.stamps)
        per_step = float(statistics.median(steps)) if len(steps) else float("nan")
        visual = {k: v for k, v in conditioned.items() if is_visual(k)}
        result = {"params": step_params.model_dump(), "seconds": seconds, "per_step_s": per_step,
                  "kl_train_last10": float(np.mean([h["kl"] for h in history[-10:]])),
                  "kl_curve": [round(h["kl"], 5) for h in history], **evaluate(visual)}
        out["settings"][name] = result
        print(f"  {name}: {json.dumps({k: v for k, v in result.items() if k not in ('kl_curve', 'params')})}",
              flush=True)
        for k, snapshot in sorted(build.snapshots.items()):
            prefix = {"steps": k, "seconds": per_step * k, "per_step_s": per_step,
                      "kl_train_last10": float(np.mean([h["kl"] for h in history[k - 10:k]])), **evaluate(snapshot)}
            out["settings"][f"{name}@{k}"] = prefix
            print(f"  {name}@{k}: {json.dumps(prefix)}", flush=True)
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", required=True, help="a full run's checkout (its models/ and data/ are read)")
    parser.add_argument("--out", required=True, help="JSON file to write the figures to")
    parser.add_argument("--regime", action="append", choices=["norm_mismatch", "low_confidence"])
    parser.add_argument("--settings", action="append", choices=sorted(SETTINGS))
    parser.add_argument("--prefix", type=int, action="append",
                        help="steps after which a constant setting is evaluated too")
    parser.add_argument("--low-confidence-task", default="digits")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    root = Path(args.root)
    params = load_params(root / "params.yaml")
    report = {"threads": torch.get_num_threads(), "results": []}
    for regime in args.regime or ["norm_mismatch", "low_confidence"]:
        report["results"].append(run_regime(params, root, regime, args.low_confidence_task,
                                            args.settings or list(SETTINGS), args.prefix or [100, 150, 200, 300]))
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
