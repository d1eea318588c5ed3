"""Is a track's training stable? One fine-tune refit at another thread count, the merge's rows re-measured.

The weight-noise diagnostic (``mergecal.pipeline.stability``) perturbs a merge that is already trained: it says
whether the evaluation flips on near-ties. It cannot see what another CPU or thread count does to training, where
round-off in step 1 can grow over hundreds of steps (issue #30: a threads-1 refit of the default moved
norm-mismatch rows by up to 7.9 points, standard ones by up to 2.0). This diagnostic measures that part directly
and cheaply, for each enabled track that the registry's ``DIAGNOSTICS`` names (the track's ``diagnostics``
module: which model to refit, how to score a merge) and each of its regimes:

1. the fine-tune with the largest task vector (the one that moved furthest from the pretrained weights: the
   norm-mismatch regime's 10x-lr model, by construction) is trained again, with the hyperparameters and seed its
   file records, at ``other_threads`` of the count the track trains at (its diagnostics' ``training_threads``:
   ``params.threads``, or one for the vision fine-tunes, which train on one thread each);
2. the regime's uncalibrated task-arithmetic rows the leaderboard shows (the chosen scaling's and each fixed one,
   read from ``results/task_arithmetic_rows.json``) are evaluated on the test split with the stored and with the
   refit model (a bit-identical refit gives the stored rows: scored once);
3. the regime is stable when no row moves by more than the half-width of its own 95 % interval
   (``stability.move_summary``: the same figures and verdict as the weight-noise diagnostic).

Only the first fine-tuning seed is measured (``params.seeds[0]``). One refit per regime, not all K: the largest
task vector is where round-off grows most; a stable verdict is therefore evidence, not proof, that the other
fine-tunes are stable too.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import torch

from ..errors import MergecalError
from .config import Params
from .stability import Examples, move_summary
from .stability_inputs import MERGE
from .threads import pin_threads
from .track_registry import diagnosed_tracks

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


def regime_rows(results: dict, track: str, regime: str, seed: int) -> list[tuple[str, float]]:
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


def measure_refits(params: Params, root, results: dict, *, device: str = "cpu") -> list[dict]:
    """One entry per enabled track and regime (``reports/stability.json``'s ``refits``)."""
    root = Path(root)
    seed = params.seeds[0]
    entries = []
    for track, diagnostics in diagnosed_tracks(params):
        settings = getattr(params, track)
        trained = diagnostics.training_threads(params, device)  # the vision fine-tunes: one thread, not `threads`
        threads = other_threads(trained)
        base = {"track": track, "backbone": settings.backbone, "task_set": settings.task_set, "recipe": MERGE,
                "threads": trained, "refit_threads": threads}
        if len(params.seeds) > 1:
            base["fine_tuning_seed"] = seed

        def rows_of(regime: str, track: str = track) -> list[tuple[str, float]]:
            return regime_rows(results, track, regime, seed)

        with diagnostics.refit_regimes(params, root, rows_of, threads=threads, device=device, seed=seed) as regimes:
            for regime, measured in regimes:
                entry = {**base, "regime": regime}
                if measured is None:
                    entries.append({**entry, "stable": None, "not_measured": f"results/benchmark.json has no "
                                    f"{MERGE} row of the {regime} regime"})
                    continue
                task, variant, same, stored, refitted = measured
                entries.append({**entry, "refit": {"task": task, "variant": variant, "identical": same},
                                **regime_stability(stored, refitted, rows_of(regime))})
    return entries
