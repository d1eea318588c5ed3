"""Is a track's training stable? One fine-tune refit at another thread count, the merge's rows re-measured.

The weight-noise diagnostic (``mergecal.pipeline.stability``) perturbs a merge that is already trained: it says
whether the evaluation flips on near-ties. It cannot see what another CPU or thread count does to training, where
round-off in step 1 can grow over hundreds of steps (issue #30: a threads-1 refit of the default moved
norm-mismatch rows by up to 7.9 points, standard ones by up to 2.0). This diagnostic measures that part directly
and cheaply, for each enabled track (vision, text, LLM) and each of its regimes:

1. the fine-tune with the largest task vector (the one that moved furthest from the pretrained weights: the
   norm-mismatch regime's 10x-lr model, by construction) is trained again, with the hyperparameters and seed its
   file records, at ``other_threads(params.threads)`` threads instead of ``params.threads``;
2. the regime's uncalibrated task-arithmetic rows the leaderboard shows (the chosen scaling's and each fixed one,
   read from ``results/benchmark.json``) are evaluated on the test split with the stored and with the refit model
   (a bit-identical refit gives the stored rows: scored once);
3. the regime is stable when no row moves by more than the half-width of its own 95 % interval
   (``stability.move_summary``: the same figures and verdict as the weight-noise diagnostic).

Only the first fine-tuning seed is measured (``params.seeds[0]``). One refit per regime, not all K: the largest
task vector is where round-off grows most; a stable verdict is therefore evidence, not proof, that the other
fine-tunes are stable too.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from ..backbones.hf_causal_lm_merge import merge_causal_lms
from ..backbones.hf_text import load_encoder
from ..checkpoint import load_state_dict
from ..data.llm import load_records
from ..errors import MergecalError
from ..merge import merge_models
from ..methods.task_arithmetic import TaskArithmetic
from ..train.finetune import FinetuneConfig
from ..train.finetune import finetune as finetune_clip
from ..train.finetune_text import TextFinetuneConfig, finetune_text_task
from ..train.lm import LmTrainConfig, finetune_lm
from .cells import per_example_results
from .config import Params
from .stability import MERGE, Examples, enabled_tracks, move_summary
from .threads import pin_threads
from .tracks.llm.stages import base_dir, data_root, expert_dir, lm_eval_setup, work_dir
from .tracks.text.stages import TextModels, finetuned_path, n_classes, split
from .tracks.vision.stages import VisionModels, evaluate_tasks, is_visual, paths_for, regime_variants, task_split

States = dict[str, torch.Tensor]


def other_threads(threads: int) -> int:
    """The thread count a refit trains at: 1, or 2 where the pipeline already trains at 1."""
    return 2 if threads == 1 else 1


@contextmanager
def threads_pinned(threads: int) -> Iterator[None]:
    """torch at ``threads`` threads inside, the process's count restored after."""
    before = torch.get_num_threads()
    pin_threads(threads)
    try:
        yield
    finally:
        pin_threads(before)


def distance(state: Mapping[str, torch.Tensor], pretrained: Mapping[str, torch.Tensor]) -> float:
    """L2 norm of ``state - pretrained`` over the float tensors both hold (a task vector's norm)."""
    return sum(float((state[k].double() - pretrained[k].double()).pow(2).sum())
               for k in state if k in pretrained and state[k].is_floating_point()) ** 0.5


def largest_task_vector(pretrained: Mapping[str, torch.Tensor], finetuned: Mapping[object, States]):
    """The name (a key of ``finetuned``) of the state that lies furthest from ``pretrained``."""
    return max(finetuned, key=lambda name: distance(finetuned[name], pretrained))


def identical(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def recorded(path: Path, key: str) -> dict:
    """``key`` of the JSON record a fine-tune wrote beside its weights, or one MergecalError naming it."""
    try:
        value = json.loads(path.read_text())[key]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise MergecalError(f"{path}: expected the fine-tune's record with its `{key}` ({type(err).__name__}); "
                            "run its fine-tuning stage first") from None
    if not isinstance(value, dict):
        raise MergecalError(f"{path}: expected `{key}` to be a mapping of hyperparameters")
    return value


def task_arithmetic_rows(results: dict, track: str, regime: str, seed: int) -> list[tuple[str, float]]:
    """(label, scaling) of every uncalibrated task-arithmetic row of ``track`` x ``regime`` the benchmark scored
    with fine-tuning seed ``seed``: the chosen scaling's row and each fixed-scaling one."""
    rows = [(row["label"], float(row["selected_scaling"])) for row in results.get("rows", [])
            if row.get("track") == track and row.get("regime") == regime and row.get("seed", 0) == seed
            and row.get("merge") == MERGE and ">" not in row.get("label", ">")
            and row.get("selected_scaling") is not None]
    return sorted(rows)


def regime_stability(stored: Callable[[float], Examples], refitted: Callable[[float], Examples] | None,
                     rows: list[tuple[str, float]]) -> dict:
    """Each row's ``move_summary`` (the merge of the stored models against the merge with the refit one, at the
    row's scaling; ``refitted`` None: the refit is bit-identical, its rows are the stored ones), and the regime's
    verdict: stable when every row is."""
    if not rows:
        raise ValueError("regime_stability: at least one row")
    measured = []
    for label, scaling in rows:
        baseline = stored(scaling)
        moved = baseline if refitted is None else refitted(scaling)
        measured.append({"label": label, "scaling": scaling, **move_summary(baseline, [moved])})
    worst = max(measured, key=lambda r: r["largest_avg_move"] - r["half_width"])
    return {"rows": measured, "largest_avg_move": max(r["largest_avg_move"] for r in measured),
            "worst_row": {"label": worst["label"], "move": worst["largest_avg_move"],
                          "half_width": worst["half_width"]},
            "stable": all(r["stable"] for r in measured)}


def _task_arithmetic(params: Params, scaling: float) -> TaskArithmetic:
    return TaskArithmetic(**{**params.benchmark.merges.get(MERGE, {}), "scaling": scaling})


# --- each track's refit and evaluation ----------------------------------------------------------------------------

def vision_refit(params: Params, root, task: str, variant: str, *, threads: int, device: str = "cpu",
                 seed: int | None = None) -> States:
    """The image-encoder state of ``task``'s ``variant`` fine-tune trained again at ``threads`` threads, with the
    hyperparameters and seed its stored file records (at the pipeline's own thread count: that file, bit for bit;
    a test checks it)."""
    # open_clip (and torchvision) take seconds to import: loaded only when a CLIP is used
    from ..backbones.open_clip_vit import load_clip

    paths = paths_for(params, root, seed)
    config = FinetuneConfig(**recorded(paths.finetuned(variant, task).with_suffix(".json"), "hyperparameters"))
    model = load_clip(params.vision.arch, paths.pretrained)
    head = load_state_dict(paths.heads)[task]
    images, labels = task_split(paths.data, task, "train")
    with threads_pinned(threads):  # validation as the stage passed it: the same calls, so the same random streams
        state, _ = finetune_clip(model, head, images, labels, config,
                                 validation=task_split(paths.data, task, "validation"), device=device, progress=False)
    return {k: v.contiguous() for k, v in state.items() if is_visual(k)}


def vision_regimes(params: Params, root, rows_of, *, threads: int, device: str, seed: int) -> Iterator[tuple]:
    """Per vision regime: (regime, None) when it has no row to measure, else (regime, (refit task, variant,
    bit-identical, the stored models' scorer, the refit's scorer or None when bit-identical)); a scorer maps a
    scaling to the task-arithmetic merge's per-example test outcomes."""
    models, tasks = VisionModels(params, root, seed), list(params.vision.tasks)
    pretrained = models.visual_pretrained()

    def scorer(finetuned: list[States]) -> Callable[[float], Examples]:
        def score(scaling: float) -> Examples:
            merged = merge_models(pretrained, finetuned, _task_arithmetic(params, scaling))
            test = evaluate_tasks(models.model(merged), models.heads, models.paths.data, tasks, "test",
                                  batch_size=params.benchmark.evaluation.batch_size, device=device, per_example=True)
            return per_example_results(tasks, test)
        return score

    for regime in params.vision.regimes:
        if not rows_of(regime):
            yield regime, None
            continue
        names = list(regime_variants(params.vision, regime).items())  # (task, variant) in task order
        stored = [load_state_dict(models.paths.finetuned(variant, task)) for task, variant in names]
        task, variant = largest_task_vector(pretrained, dict(zip(names, stored)))
        index = names.index((task, variant))
        refitted = list(stored)
        refitted[index] = vision_refit(params, root, task, variant, threads=threads, device=device, seed=seed)
        same = identical(refitted[index], stored[index])
        yield regime, (task, variant, same, scorer(stored), None if same else scorer(refitted))


def text_refit(params: Params, root, task: str, *, threads: int, device: str = "cpu",
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


def text_regimes(params: Params, root, rows_of, *, threads: int, device: str, seed: int) -> Iterator[tuple]:
    """``vision_regimes``' tuples for the text track's regimes (the refit model with its own head)."""
    models, tasks = TextModels(params, root, seed), list(params.text.tasks)

    def scorer(evaluator: TextModels, encoders: list[States]) -> Callable[[float], Examples]:
        def score(scaling: float) -> Examples:
            merged = merge_models(evaluator.pretrained, encoders, _task_arithmetic(params, scaling))
            return per_example_results(tasks, evaluator.evaluate(merged, tasks, "test", device=device,
                                                                 per_example=True))
        return score

    for regime in params.text.regimes:
        if not rows_of(regime):
            yield regime, None
            continue
        stored = {task: models.finetuned(task) for task in tasks}  # (full encoder, head)
        task = largest_task_vector(models.pretrained, {t: encoder for t, (encoder, _) in stored.items()})
        state, head = text_refit(params, root, task, threads=threads, device=device, seed=seed)
        encoder = {k: state[k] for k in models.pretrained}  # the float tensors a stored model holds
        same = identical(encoder, stored[task][0]) and identical(head, stored[task][1])
        encoders = [stored[t][0] for t in tasks]
        refitted = [encoder if t == task else stored[t][0] for t in tasks]
        yield regime, (task, "standard", same, scorer(models, encoders),
                       None if same else scorer(RefitHeadTextModels(params, root, seed, task, head), refitted))


def llm_regimes(params: Params, root, rows_of, *, threads: int, device: str, seed: int,
                scratch: Path) -> Iterator[tuple]:
    """``vision_regimes``' tuple for the LLM track's one regime: the refit expert written under ``scratch``, each
    scored merge written there and deleted after its lm-eval scoring."""
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
            merged = merge_causal_lms(base, directories, _task_arithmetic(params, scaling), scratch / "merged",
                                      device=device, overwrite=True)
            examples: Examples = {}
            scorer_setup.score(merged, tasks, "test", device=device, cache=False, examples=examples)
            shutil.rmtree(merged)
            return examples
        return score

    refitted = [refit_dir if t == task else experts[t] for t in tasks]
    yield "standard", (task, "standard", same, scorer([experts[t] for t in tasks]),
                       None if same else scorer(refitted))


def measure_refits(params: Params, root, results: dict, *, device: str = "cpu") -> list[dict]:
    """One entry per enabled track and regime (``reports/stability.json``'s ``refits``)."""
    root = Path(root)
    seed, threads = params.seeds[0], other_threads(params.threads)
    entries = []
    for track, settings in enabled_tracks(params):
        base = {"track": track, "backbone": settings.backbone, "task_set": settings.task_set, "recipe": MERGE,
                "threads": params.threads, "refit_threads": threads}
        if len(params.seeds) > 1:
            base["fine_tuning_seed"] = seed

        def rows_of(regime: str, track: str = track) -> list[tuple[str, float]]:
            return task_arithmetic_rows(results, track, regime, seed)

        scratch = None
        if track == "llm":
            work_dir(root).mkdir(parents=True, exist_ok=True)
            scratch = Path(tempfile.mkdtemp(prefix="refit-", dir=work_dir(root)))
        try:
            options = {"threads": threads, "device": device, "seed": seed}
            regimes = (vision_regimes(params, root, rows_of, **options) if track == "vision"
                       else text_regimes(params, root, rows_of, **options) if track == "text"
                       else llm_regimes(params, root, rows_of, scratch=scratch, **options))
            for regime, measured in regimes:
                entry = {**base, "regime": regime}
                if measured is None:
                    entries.append({**entry, "stable": None, "not_measured": f"results/benchmark.json has no "
                                    f"{MERGE} row of the {regime} regime"})
                    continue
                task, variant, same, stored, refitted = measured
                entries.append({**entry, "refit": {"task": task, "variant": variant, "identical": same},
                                **regime_stability(stored, refitted, rows_of(regime))})
        finally:
            if scratch is not None:
                shutil.rmtree(scratch, ignore_errors=True)
    return entries
