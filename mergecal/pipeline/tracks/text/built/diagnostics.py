"""The text track's part of the stability diagnostics (``mergecal.pipeline.stability``,
``mergecal.pipeline.refit_stability``; the vision track's ``diagnostics`` says what each function gives)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .....backbones.hf_text import load_encoder
from .....merge import merge_models
from .....train.finetune_text import TextFinetuneConfig, finetune_text_task
from ....cells import per_example_results
from ....config import Params
from ....refit_stability import States, identical, largest_task_vector, recorded, threads_pinned
from ....stability import Examples, perturbed, task_arithmetic
from .stages import TextModels, finetuned_path, n_classes, split


def training_threads(params: Params, device: str) -> int:
    """The torch threads this track's fine-tune stages train at: params.yaml's ``threads``. The refit trains at
    another count."""
    return params.threads


@contextmanager
def noise_evaluation(params: Params, root: Path, scaling: float, device: str) -> Iterator[Callable]:
    models, tasks = TextModels(params, root), list(params.text.tasks)
    merged = merge_models(models.pretrained, [models.finetuned(t)[0] for t in tasks],
                          task_arithmetic(params, scaling))

    def evaluate(seed: int | None) -> Examples:
        state = merged if seed is None else perturbed(merged, seed)
        return per_example_results(tasks, models.evaluate(state, tasks, "test", device=device, per_example=True))

    yield evaluate


def refit(params: Params, root, task: str, *, threads: int, device: str = "cpu",
          seed: int | None = None) -> tuple[States, States]:
    """(encoder state, head state) of ``task``'s text fine-tune trained again at ``threads`` threads, with the
    hyperparameters and seed its stored file records."""
    config = TextFinetuneConfig(**recorded(finetuned_path(params, root, task, seed).with_suffix(".json"),
                                           "hyperparameters"))
    encoder, _ = load_encoder()
    pretrained = {k: v.detach().clone() for k, v in encoder.state_dict().items()}
    texts, labels = split(root, task, "train")
    with threads_pinned(threads):
        state, head, _ = finetune_text_task(pretrained, texts, labels, n_classes(root, task), config,
                                            progress=False, device=device)
    return state, head


class RefitHeadTextModels(TextModels):
    """``TextModels`` whose ``task`` classifies with the refit model's head instead of the stored one."""

    def __init__(self, params: Params, root, seed: int, task: str, head: States):
        super().__init__(params, root, seed)
        self.refit_task, self.refit_head = task, head

    def head(self, task: str) -> States:
        return self.refit_head if task == self.refit_task else super().head(task)


@contextmanager
def refit_regimes(params: Params, root, rows_of, *, threads: int, device: str, seed: int) -> Iterator[Iterator]:
    """The text track's regimes (the refit model with its own head)."""
    models, tasks = TextModels(params, root, seed), list(params.text.tasks)

    def scorer(evaluator: TextModels, encoders: list[States]) -> Callable[[float], Examples]:
        def score(scaling: float) -> Examples:
            merged = merge_models(evaluator.pretrained, encoders, task_arithmetic(params, scaling))
            return per_example_results(tasks, evaluator.evaluate(merged, tasks, "test", device=device,
                                                                 per_example=True))
        return score

    def regimes():
        for regime in params.text.regimes:
            if not rows_of(regime):
                yield regime, None
                continue
            stored = {task: models.finetuned(task) for task in tasks}  # (full encoder, head)
            task = largest_task_vector(models.pretrained, {t: encoder for t, (encoder, _) in stored.items()})
            state, head = refit(params, root, task, threads=threads, device=device, seed=seed)
            encoder = {k: state[k] for k in models.pretrained}  # the float tensors a stored model holds
            same = identical(encoder, stored[task][0]) and identical(head, stored[task][1])
            encoders = [stored[t][0] for t in tasks]
            refitted = [encoder if t == task else stored[t][0] for t in tasks]
            yield regime, (task, "standard", same, scorer(models, encoders),
                           None if same else scorer(RefitHeadTextModels(params, root, seed, task, head), refitted))

    yield regimes()
