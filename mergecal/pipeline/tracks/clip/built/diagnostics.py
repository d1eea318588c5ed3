"""The vision track's part of the stability diagnostics (``mergecal.pipeline.stability``: its task-arithmetic merge
under weight noise; ``mergecal.pipeline.refit_stability``: per regime, its largest fine-tune refit at another
thread count). Reached through the registry's ``DIAGNOSTICS``, never from the cells: an edit here reruns the
stability stage, not the benchmark's cells."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .....checkpoint import load_state_dict
from .....merge import merge_models
from .....train.finetune import FinetuneConfig
from .....train.finetune import finetune as finetune_clip
from ....cells import per_example_results
from ....config import Params
from ....refit_stability import States, identical, largest_task_vector, recorded, threads_pinned
from ....stability import REGIME, Examples, perturbed, task_arithmetic
from .stages import VisionModels, evaluate_tasks, is_visual, paths_for, regime_variants, task_split


def training_threads(params: Params, device: str) -> int:
    """The torch threads the finetune stage trains each model at: one on the CPU (``stages.finetune_all``, whatever
    ``threads`` is), ``threads`` elsewhere. The refit trains at another count."""
    return 1 if device == "cpu" else params.threads


@contextmanager
def noise_evaluation(params: Params, root: Path, scaling: float, device: str) -> Iterator[Callable]:
    """``evaluate(seed)``: the standard regime's task-arithmetic merge at ``scaling`` scored on test, as is (seed
    None) or perturbed."""
    models, tasks = VisionModels(params, root), list(params.vision.tasks)
    merged = merge_models(models.visual_pretrained(), models.finetuned(REGIME), task_arithmetic(params, scaling))

    def evaluate(seed: int | None) -> Examples:
        state = merged if seed is None else perturbed(merged, seed)
        test = evaluate_tasks(models.model(state), models.heads, models.paths.data, tasks, "test",
                              batch_size=params.benchmark.evaluation.batch_size, device=device, per_example=True)
        return per_example_results(tasks, test)

    yield evaluate


def refit(params: Params, root, task: str, variant: str, *, threads: int, device: str = "cpu",
          seed: int | None = None) -> States:
    """The image-encoder state of ``task``'s ``variant`` fine-tune trained again at ``threads`` threads, with the
    hyperparameters and seed its stored file records (at the pipeline's own thread count: that file, bit for bit;
    a test checks it)."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from .....backbones.open_clip_vit import load_clip

    paths = paths_for(params, root, seed)
    config = FinetuneConfig(**recorded(paths.finetuned(variant, task).with_suffix(".json"), "hyperparameters"))
    model = load_clip(params.vision.arch, paths.pretrained)
    head = load_state_dict(paths.heads)[task]
    images, labels = task_split(paths.data, task, "train")
    with threads_pinned(threads):  # validation as the stage passed it: the same calls, so the same random streams
        state, _ = finetune_clip(model, head, images, labels, config,
                                 validation=task_split(paths.data, task, "validation"), device=device, progress=False)
    return {k: v.contiguous() for k, v in state.items() if is_visual(k)}


@contextmanager
def refit_regimes(params: Params, root, rows_of, *, threads: int, device: str, seed: int) -> Iterator[Iterator]:
    """Per regime: (regime, None) when it has no row to measure, else (regime, (refit task, variant,
    bit-identical, the stored models' scorer, the refit's scorer or None when bit-identical)); a scorer maps a
    scaling to the task-arithmetic merge's per-example test outcomes."""
    models, tasks = VisionModels(params, root, seed), list(params.vision.tasks)
    pretrained = models.visual_pretrained()

    def scorer(finetuned: list[States]) -> Callable[[float], Examples]:
        def score(scaling: float) -> Examples:
            merged = merge_models(pretrained, finetuned, task_arithmetic(params, scaling))
            test = evaluate_tasks(models.model(merged), models.heads, models.paths.data, tasks, "test",
                                  batch_size=params.benchmark.evaluation.batch_size, device=device, per_example=True)
            return per_example_results(tasks, test)
        return score

    def regimes():
        for regime in params.vision.regimes:
            if not rows_of(regime):
                yield regime, None
                continue
            names = list(regime_variants(params.vision, regime).items())  # (task, variant) in task order
            stored = [load_state_dict(models.paths.finetuned(variant, task)) for task, variant in names]
            task, variant = largest_task_vector(pretrained, dict(zip(names, stored)))
            index = names.index((task, variant))
            refitted = list(stored)
            refitted[index] = refit(params, root, task, variant, threads=threads, device=device, seed=seed)
            same = identical(refitted[index], stored[index])
            yield regime, (task, variant, same, scorer(stored), None if same else scorer(refitted))

    yield regimes()
