"""The LLM track's part of the stability diagnostics (``mergecal.pipeline.stability``,
``mergecal.pipeline.refit_stability``; the vision track's ``diagnostics`` says what each function gives). Merged,
perturbed and refit models are written under a scratch folder in the track's work directory, gone after."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from .....merge_causal_lm import merge_causal_lms
from .....checkpoint import load_state_dict, save_state_dict
from .....data.llm import load_records
from .....train.lm import LmTrainConfig, finetune_lm
from ....config import Params
from ....refit_stability import identical, largest_task_vector, recorded, threads_pinned
from ....stability import Examples, perturbed, task_arithmetic
from .stages import base_dir, data_root, expert_dir, lm_eval_setup, work_dir


def training_threads(params: Params, device: str) -> int:
    """The torch threads this track's fine-tune stages train at: params.yaml's ``threads``. The refit trains at
    another count."""
    return params.threads


@contextmanager
def scratch_dir(root: Path, prefix: str) -> Iterator[Path]:
    work_dir(root).mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=prefix, dir=work_dir(root)))
    try:
        yield scratch
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def perturbed_model_dir(source: Path, out: Path, seed: int) -> Path:
    """A copy of the model directory ``source`` at ``out`` whose safetensors weights are ``perturbed``."""
    from safetensors import safe_open

    shutil.copytree(source, out)
    for path in sorted(out.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
        save_state_dict(perturbed(load_state_dict(path), seed), path, metadata)
    return out


@contextmanager
def noise_evaluation(params: Params, root: Path, scaling: float, device: str) -> Iterator[Callable]:
    """The LLM's merge written once under the scratch folder; each perturbation a perturbed copy, scored and
    deleted."""
    tasks = list(params.llm.tasks)
    with scratch_dir(root, "stability-") as scratch:
        merged = merge_causal_lms(base_dir(params, root), [expert_dir(params, root, t) for t in tasks],
                                  task_arithmetic(params, scaling), scratch / "merged", device=device)
        scorer = lm_eval_setup(params, root)

        def evaluate(seed: int | None) -> Examples:
            directory = merged if seed is None else perturbed_model_dir(merged, scratch / f"seed-{seed}", seed)
            examples: Examples = {}
            scorer.score(directory, tasks, "test", device=device, cache=False, examples=examples)
            if seed is not None:
                shutil.rmtree(directory)
            return examples

        yield evaluate


@contextmanager
def refit_regimes(params: Params, root, rows_of, *, threads: int, device: str, seed: int) -> Iterator[Iterator]:
    """The LLM track's one regime: the refit expert written under the scratch folder, each scored merge written
    there and deleted after its lm-eval scoring."""
    with scratch_dir(Path(root), "refit-") as scratch:
        yield _regimes(params, root, rows_of, threads=threads, device=device, seed=seed, scratch=scratch)


def _regimes(params: Params, root, rows_of, *, threads: int, device: str, seed: int, scratch: Path) -> Iterator:
    if not rows_of("standard"):
        yield "standard", None
        return
    tasks, base = list(params.llm.tasks), base_dir(params, root)
    experts = {t: expert_dir(params, root, t, seed) for t in tasks}
    pretrained = load_state_dict(base / "model.safetensors")
    stored = {t: load_state_dict(d / "model.safetensors") for t, d in experts.items()}
    task = largest_task_vector(pretrained, stored)
    config = LmTrainConfig(**recorded(experts[task] / "training.json", "config"))
    with threads_pinned(threads):
        refit_dir = finetune_lm(base, load_records(data_root(root), task, "train"), scratch / f"refit-{task}",
                                task=task, config=config, progress=False, device=device)
    same = identical(load_state_dict(refit_dir / "model.safetensors"), stored[task])
    scorer_setup = lm_eval_setup(params, root)

    def scorer(directories: list[Path]) -> Callable[[float], Examples]:
        def score(scaling: float) -> Examples:
            merged = merge_causal_lms(base, directories, task_arithmetic(params, scaling), scratch / "merged",
                                      device=device, overwrite=True)
            examples: Examples = {}
            scorer_setup.score(merged, tasks, "test", device=device, cache=False, examples=examples)
            shutil.rmtree(merged)
            return examples
        return score

    refitted = [refit_dir if t == task else experts[t] for t in tasks]
    yield "standard", (task, "standard", same, scorer([experts[t] for t in tasks]),
                       None if same else scorer(refitted))
