"""Is a regime's training stable? One fine-tune refit at another thread count, the merge's rows re-measured.

The weight-noise diagnostic (``mergecal.pipeline.stability``) perturbs a merge that is already trained: it says
whether the evaluation flips on near-ties. It cannot see what another CPU or thread count does to training, where
round-off in step 1 can grow over 250 steps (issue #30: a threads-1 refit of the default moved norm-mismatch rows
by up to 7.9 points, standard ones by up to 2.0). This diagnostic measures that part directly and cheaply, for the
vision track (the one that fine-tunes its own models; the LLM's experts refit at 1 thread were byte-identical):

1. per regime, the fine-tune with the largest task vector (the one that moved furthest from the pretrained
   weights: the norm-mismatch regime's 10x-lr model, by construction) is trained again, with the hyperparameters
   its file records, at ``other_threads(params.threads)`` threads instead of ``params.threads``;
2. the task-arithmetic rows of that regime that the leaderboard shows (the chosen scaling and each fixed one, read
   from ``results/benchmark.json``) are evaluated on the test split with the stored and with the refit model;
3. the regime is stable when no row moves by more than the half-width of its own 95 % interval
   (``stability.move_summary``: the same figures and verdict as the weight-noise diagnostic).

Only the first fine-tuning seed is measured (``params.seeds[0]``). One refit per regime, not all K: the largest
task vector is where round-off grows most; a stable verdict is therefore evidence, not proof, that the other
fine-tunes are stable too.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import torch

from ..checkpoint import load_state_dict
from ..errors import MergecalError
from ..merge import merge_models
from ..methods.task_arithmetic import TaskArithmetic
from ..train.finetune import FinetuneConfig
from ..train.finetune import finetune as finetune_clip
from .cells import per_example_results
from .config import Params
from .stability import Examples, move_summary
from .threads import pin_threads
from .tracks.vision.stages import VisionModels, evaluate_tasks, is_visual, paths_for, regime_variants, task_split

MERGE = "task_arithmetic"


def other_threads(threads: int) -> int:
    """The thread count a refit trains at: 1, or 2 where the pipeline already trains at 1."""
    return 2 if threads == 1 else 1


def largest_task_vector(pretrained: dict[str, torch.Tensor],
                        finetuned: dict[tuple[str, str], dict[str, torch.Tensor]]) -> tuple[str, str]:
    """The (task, variant) whose image-encoder state lies furthest (L2 over all its tensors) from ``pretrained``."""
    def norm(state: dict[str, torch.Tensor]) -> float:
        return sum(float((state[k].double() - pretrained[k].double()).pow(2).sum()) for k in state) ** 0.5

    return max(finetuned, key=lambda name: norm(finetuned[name]))


def refit(params: Params, root, task: str, variant: str, *, threads: int, device: str = "cpu",
          seed: int | None = None) -> dict[str, torch.Tensor]:
    """The image-encoder state of ``task``'s ``variant`` fine-tune trained again at ``threads`` threads, with the
    hyperparameters and seed its stored file records (so at the pipeline's own thread count it is that file, bit
    for bit: a test checks it). The process's thread count is restored afterwards."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from ..backbones.open_clip_vit import load_clip

    paths = paths_for(params, root, seed)
    record = paths.finetuned(variant, task).with_suffix(".json")
    try:
        config = FinetuneConfig(**json.loads(record.read_text())["hyperparameters"])
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MergecalError(f"{record}: expected the finetune stage's record with its `hyperparameters` "
                            f"({type(err).__name__}); run the finetune stage first") from None
    model = load_clip(params.vision.arch, paths.pretrained)
    head = load_state_dict(paths.heads)[task]
    images, labels = task_split(paths.data, task, "train")
    before = torch.get_num_threads()
    pin_threads(threads)
    try:  # validation as the stage passed it: the same calls, so the same random streams
        state, _ = finetune_clip(model, head, images, labels, config,
                                 validation=task_split(paths.data, task, "validation"), device=device, progress=False)
    finally:
        pin_threads(before)
    return {k: v.contiguous() for k, v in state.items() if is_visual(k)}


def task_arithmetic_rows(results: dict, regime: str, seed: int) -> list[tuple[str, float]]:
    """(label, scaling) of every uncalibrated task-arithmetic row of ``regime`` the benchmark scored for the vision
    track with fine-tuning seed ``seed``: the chosen scaling's row and each fixed-scaling one."""
    rows = [(row["label"], float(row["selected_scaling"])) for row in results.get("rows", [])
            if row.get("track") == "vision" and row.get("regime") == regime and row.get("seed", 0) == seed
            and row.get("merge") == MERGE and ">" not in row.get("label", ">")
            and row.get("selected_scaling") is not None]
    return sorted(rows)


def regime_stability(evaluate: Callable[[list[dict[str, torch.Tensor]], float], Examples],
                     stored: list[dict[str, torch.Tensor]], refitted: list[dict[str, torch.Tensor]],
                     rows: list[tuple[str, float]]) -> dict:
    """Each row's ``move_summary`` (stored models against the refit ones, at the row's scaling), and the regime's
    verdict: stable when every row is."""
    if not rows:
        raise ValueError("regime_stability: at least one row")
    measured = [{"label": label, "scaling": scaling,
                 **move_summary(evaluate(stored, scaling), [evaluate(refitted, scaling)])} for label, scaling in rows]
    worst = max(measured, key=lambda r: r["largest_avg_move"] - r["half_width"])
    return {"rows": measured, "largest_avg_move": max(r["largest_avg_move"] for r in measured),
            "worst_row": {"label": worst["label"], "move": worst["largest_avg_move"],
                          "half_width": worst["half_width"]},
            "stable": all(r["stable"] for r in measured)}


def measure_refits(params: Params, root, results: dict, *, device: str = "cpu") -> list[dict]:
    """One entry per vision regime (``reports/stability.json``'s ``refits``); [] when the vision track is off."""
    if not params.vision.enabled:
        return []
    seed, threads = params.seeds[0], other_threads(params.threads)
    models, tasks = VisionModels(params, root, seed), list(params.vision.tasks)
    pretrained = models.visual_pretrained()
    base = {"track": "vision", "backbone": params.vision.backbone, "task_set": params.vision.task_set,
            "recipe": MERGE, "threads": params.threads, "refit_threads": threads}
    if len(params.seeds) > 1:
        base["fine_tuning_seed"] = seed

    def evaluate(finetuned: list[dict[str, torch.Tensor]], scaling: float) -> Examples:
        merged = merge_models(pretrained, finetuned,
                              TaskArithmetic(**{**params.benchmark.merges.get(MERGE, {}), "scaling": scaling}))
        test = evaluate_tasks(models.model(merged), models.heads, models.paths.data, tasks, "test",
                              batch_size=params.benchmark.evaluation.batch_size, device=device, per_example=True)
        return per_example_results(tasks, test)

    entries = []
    for regime in params.vision.regimes:
        entry = {**base, "regime": regime}
        rows = task_arithmetic_rows(results, regime, seed)
        if not rows:
            entries.append({**entry, "stable": None,
                            "not_measured": f"results/benchmark.json has no {MERGE} row of the {regime} regime"})
            continue
        names = list(regime_variants(params.vision, regime).items())  # (task, variant) in task order
        stored = [load_state_dict(models.paths.finetuned(variant, task)) for task, variant in names]
        task, variant = largest_task_vector(pretrained, dict(zip(names, stored)))
        index = names.index((task, variant))
        refitted = list(stored)
        refitted[index] = refit(params, root, task, variant, threads=threads, device=device, seed=seed)
        identical = all(torch.equal(refitted[index][k], stored[index][k]) for k in stored[index])
        entries.append({**entry, "refit": {"task": task, "variant": variant, "identical": identical},
                        **regime_stability(evaluate, stored, refitted, rows)})
    return entries
