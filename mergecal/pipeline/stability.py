"""Is a track measuring the methods or round-off? Its task-arithmetic row re-evaluated under tiny weight noise.

For each track (vision: the standard regime) the task-arithmetic merge at the scaling the benchmark chose is
evaluated on its test split as is, then with every float tensor of the merged weights perturbed,
w -> w + ``RELATIVE_SIZE`` * rms(w) * N(0, 1), once per seed of ``SEEDS``. The track is stable when the largest
move of the average accuracy is at most the half-width of the unperturbed row's 95 % interval
(``mergecal.intervals``): a row that round-off moves by more than its own sampling uncertainty says more
about the machine than about the method (issue #30: the same commit moved LLM rows by 19 points across CPUs).

Each track is evaluated by its own code (``vision.evaluate_tasks``, ``TextModels.evaluate``, ``LmEval.score``);
the figures are ``move_summary``'s, a pure function of the per-example outcomes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from ..errors import MergecalError
from ..methods.task_arithmetic import TaskArithmetic
from ..intervals import stratified_interval, weighted_means
from .config import Params
from .stability_inputs import MERGE
from .track_registry import diagnosed_tracks

RELATIVE_SIZE = 1e-6  # float32 round-off is ~6e-8 relative: a few ulps, what another CPU or thread count changes
SEEDS = (0, 1, 2)
REGIME = "standard"

Examples = dict[str, list]  # {task: each test example's outcome (0/1 or the metric's per-document score)}


def _key_seed(seed: int, key: str) -> int:
    """A generator seed per (seed, tensor name): the noise of a tensor does not depend on the order or the files
    (shards) the tensors come in."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{key}".encode()).digest()[:8], "big") & (2**63 - 1)


def perturbed(state: Mapping[str, torch.Tensor], seed: int,
              relative: float = RELATIVE_SIZE) -> dict[str, torch.Tensor]:
    """``state`` with every float tensor w replaced by w + relative * rms(w) * N(0, 1) (seeded); other tensors
    (integer buffers) as they are."""
    out = {}
    for key, value in state.items():
        if not value.is_floating_point():
            out[key] = value
            continue
        # rms per tensor: round-off is relative to each tensor's own scale (an ulp is ~1e-7 of the value), so each
        # tensor moves by a fixed fraction of its typical entry, not of the model's largest
        wide = value.detach().cpu().double()
        rms = wide.pow(2).mean().sqrt() if wide.numel() else wide.new_zeros(())
        noise = torch.randn(wide.shape, generator=torch.Generator().manual_seed(_key_seed(seed, key)),
                            dtype=torch.float64)
        out[key] = (wide + relative * rms * noise).to(dtype=value.dtype, device=value.device)
    return out


def _average(examples: Mapping[str, Sequence[float]], tasks: list[str]) -> float:
    """The average accuracy in points: the mean over tasks of each task's mean outcome (the leaderboard's avg)."""
    return 100.0 * weighted_means([np.asarray(examples[t], dtype=np.float64) for t in tasks],
                                  [1.0 / len(tasks)] * len(tasks))


def move_summary(baseline: Examples, perturbations: Sequence[Examples]) -> dict:
    """How far the perturbations move the row: the largest move of the average accuracy and of a task's accuracy
    (points), the fraction of test examples whose outcome changed under at least one perturbation, the
    unperturbed row's average and its 95 % interval half-width (points), and ``stable`` (largest average move <=
    half-width)."""
    tasks = list(baseline)
    if not tasks or not perturbations:
        raise ValueError("move_summary: a baseline with tasks and at least one perturbation")
    if any(len(p[t]) != len(baseline[t]) for p in perturbations for t in tasks):
        raise ValueError("move_summary: every perturbation scores the baseline's examples")
    average = _average(baseline, tasks)
    low, high = stratified_interval([np.asarray(baseline[t], dtype=np.float64) for t in tasks],
                                    [1.0 / len(tasks)] * len(tasks))
    half_width = 100.0 * (high - low) / 2
    avg_moves = [abs(_average(p, tasks) - average) for p in perturbations]
    task_moves = {t: max(abs(100.0 * (np.mean(p[t]) - np.mean(baseline[t]))) for p in perturbations) for t in tasks}
    worst = max(tasks, key=lambda t: task_moves[t])
    changed = sum(int(np.any([np.asarray(p[t]) != np.asarray(baseline[t]) for p in perturbations], axis=0).sum())
                  for t in tasks)
    total = sum(len(baseline[t]) for t in tasks)
    return {"avg_acc": _round(average), "half_width": _round(half_width),
            "avg_acc_per_seed": [_round(_average(p, tasks)) for p in perturbations],
            "largest_avg_move": _round(max(avg_moves)),
            "largest_task_move": {"task": worst, "points": _round(task_moves[worst])},
            "changed_fraction": _round(changed / total), "n_examples": total,
            "stable": bool(max(avg_moves) <= half_width)}


def _round(value: float) -> float:
    return round(float(value), 6) + 0.0


def track_stability(evaluate: Callable[[int | None], Examples], seeds: Sequence[int] = SEEDS) -> dict:
    """``move_summary`` of ``evaluate(None)`` (the merge as is) against ``evaluate(seed)`` (perturbed) per seed."""
    baseline = evaluate(None)
    return move_summary(baseline, [evaluate(seed) for seed in seeds])


def chosen_scaling(results: dict, track: str, label: str = MERGE, regime: str = REGIME,
                   seed: int = 0) -> float | None:
    """The scaling the benchmark chose for the ``label`` row of ``track`` with fine-tuning seed ``seed``
    (``results``: benchmark.json; a row written before seeds were recorded is seed 0's)."""
    for row in results.get("rows", []):
        if (row.get("track"), row.get("regime"), row.get("label"), row.get("seed", 0)) == (track, regime, label, seed):
            return row.get("selected_scaling")
    return None


def task_arithmetic(params: Params, scaling: float) -> TaskArithmetic:
    """The benchmark's task-arithmetic merge (params.yaml's settings) at ``scaling``: what both diagnostics
    re-measure."""
    return TaskArithmetic(**{**params.benchmark.merges.get(MERGE, {}), "scaling": scaling})


def measure(params: Params, root: str | Path, results: dict, *, device: str = "cpu") -> dict:
    """The stability document (``reports/stability.json``) of every enabled track with diagnostics (the
    registry's ``DIAGNOSTICS``), on the models
    of the first fine-tuning seed (``params.seeds``; the document names it when there are several)."""
    root = Path(root)
    entries = []
    for track, diagnostics in diagnosed_tracks(params):
        settings = getattr(params, track)
        entry = {"track": track, "backbone": settings.backbone, "task_set": settings.task_set, "recipe": MERGE,
                 "regime": REGIME}
        scaling = chosen_scaling(results, track, seed=params.seeds[0])
        if scaling is None:
            entries.append({**entry, "stable": None, "not_measured": f"results/benchmark.json has no {MERGE} row "
                            f"with a chosen scaling for the {REGIME} regime"})
            continue
        with diagnostics.noise_evaluation(params, root, scaling, device) as evaluate:
            figures = track_stability(evaluate)
        entries.append({**entry, "scaling": scaling, **figures})
    document = {"relative_size": RELATIVE_SIZE, "seeds": list(SEEDS), "tracks": entries}
    if len(params.seeds) > 1:  # one seed's models measure the pipeline's stability; the others are not measured
        document["fine_tuning_seed"] = params.seeds[0]
    return document


def read_results(path: Path) -> dict:
    """benchmark.json, or one MergecalError naming it."""
    try:
        results = json.loads(path.read_text())
    except FileNotFoundError:
        raise MergecalError(f"{path}: not found; the benchmark stage writes it (run it first)") from None
    except (OSError, ValueError) as err:
        raise MergecalError(f"{path}: expected the benchmark's JSON summary ({type(err).__name__})") from None
    if not isinstance(results, dict) or not isinstance(results.get("rows"), list):
        raise MergecalError(f"{path}: expected a JSON object with a `rows` list (the benchmark's summary)")
    return results
