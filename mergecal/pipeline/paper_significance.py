"""MAGIC's all-subsets significance test on the testbed's models: what ``stages/paper_significance.py`` computes
for the ``significance:`` entries of ``mergecal/experiments/<paper>.yaml``.

A test names a merge, a fixed scaling (the paper's protocol, no search) and a calibrated chain. Every subset of at
least ``min_size`` of the vision track's experts (its first fine-tuning seed, the test's regime) is merged with and
without the calibration as the benchmark's own cells: the track's cells of the params narrowed to the test (its
merge, scaling, chains and regime; ``experiments.narrowed_params``) and then to the subset's tasks, each run by
``cells.run_cell`` (merge, calibrate, score every task of the subset on its test split), nothing copied. A
subset's value is its average accuracy over its own tasks (in %, as the papers print it); beside it the paired 95 %
interval of the change over the subset's test examples (``mergecal.intervals``). Over the subsets:
``mergecal.analysis.significance.summary`` (each side's mean, the paired t-test, the share improved).

What a subset shares with the full set: the regime's probed sensitivity ranking (WSC and FSC's magnitude-sensitive
layers, probed once per regime on the weight average of all K models) and, for a chain that starts with DisTaC, its
stage's conditioned models (in a norm-mismatch regime the lengthened task's kappa is the full set's: the mean norm of
all K - 1 others, where the subset's own would take its own others'). FSC's samples are the subset's own tasks'.
``with_lengthened``: only the subsets holding a norm-mismatch regime's lengthened task (DisTaC conditions that task
alone there, so without it both merges are the same model).

The cells run as the benchmark's do: ``runner.max_workers`` at once, each on its share of ``threads``
(``threads.worker_threads``), each a process of its own here. The document is rounded to six significant digits,
with no time or date, so the same models give the same bytes."""

from __future__ import annotations

import multiprocessing
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, model_validator

from ..analysis.significance import subsets, summary
from ..config_types import PositiveReal, Real
from ..errors import MergecalError
from ..experiments import PAPERS
from ..intervals import paired_interval
from ..regimes import lengthened_task
from .cells import REFERENCES, Cell, run_cell
from .chains import fixed_chain
from .config import Params
from .experiments import MERGE_ALONE, Experiment, _check_variants, _entries, narrowed_params
from .params_base import Strict
from .rounding import rounded
from .threads import pin_threads, worker_threads
from .track_registry import get_track

CALIBRATED = "calibrated"  # the calibrated chain's variant name in the test's experiment
PRINTED = ("t", "p", "subsets")  # what the papers print of their test


class SignificanceClaim(Strict):
    """A statement of the paper checked on the subsets (``mergecal.reports.papers``): ``subsets``, the calibration
    improves each subset's merge (a subset agrees where its paired interval lies above 0); ``t_test``, the
    improvement over the subsets is significant (the paired t-test's two-sided p below 0.05, t above 0)."""

    kind: Literal["subsets", "t_test"]
    text: str


class SignificanceTest(Strict):
    """MAGIC's test of one calibration: ``merge`` at ``scaling`` (fixed, no search) against ``calibrated`` (a
    chain around it) on every subset of at least ``min_size`` experts of the track, in ``regime``."""

    id: str
    item: str
    shows: str
    track: Literal["vision"] = "vision"  # the subsets narrow the vision track's tasks
    regime: str = "standard"
    merge: str
    scaling: PositiveReal
    calibrated: str
    min_size: int = Field(2, ge=1)
    with_lengthened: bool = False  # only the subsets that hold the regime's lengthened task (a norm mismatch)
    claims: list[SignificanceClaim] = Field(default_factory=list)
    printed: dict[str, Real] = Field(default_factory=dict)  # the paper's own t, p and number of subsets
    printed_where: str = ""

    @model_validator(mode="after")
    def _printed(self) -> "SignificanceTest":
        unknown = [k for k in self.printed if k not in PRINTED]
        if unknown:
            raise ValueError(f"printed: {unknown[0]!r} is none of {', '.join(PRINTED)}")
        if self.with_lengthened and lengthened_task(self.regime, "?") is None:  # "?": any task; None: no norm mismatch
            raise ValueError(f"with_lengthened: regime {self.regime!r} lengthens no task (a norm_mismatch one does)")
        return self

    def subsets(self, params: Params) -> list[tuple[str, ...]]:
        """The subsets of the track's tasks the test merges: every one of at least ``min_size``, or with
        ``with_lengthened`` those that hold the regime's lengthened task."""
        tasks = tuple(getattr(params, self.track).tasks)
        found = subsets(tasks, self.min_size)
        if not self.with_lengthened:
            return found
        task = self.includes(params)[0]
        if task not in tasks:
            raise MergecalError(f"significance {self.id}: the lengthened task {task!r} is not one of the tasks")
        return [s for s in found if task in s]

    def includes(self, params: Params) -> list[str]:
        """The tasks every subset holds: the lengthened one with ``with_lengthened``, else none."""
        if not self.with_lengthened:
            return []
        return [lengthened_task(self.regime, getattr(params, self.track).norm_mismatch_task)]  # type: ignore[list-item]

    def as_experiment(self) -> Experiment:
        """The test's cells as an experiment: the merge at its scaling as the base, the calibrated chain beside."""
        return Experiment(id=self.id, item=self.item, shows=self.shows, track=self.track, regimes=[self.regime],
                          scaling=self.scaling, merges=[self.merge], variants={CALIBRATED: self.calibrated})

    @property
    def chains(self) -> tuple[str, str]:
        """The base's and the calibrated chain's labels, as the board writes them."""
        return tuple(fixed_chain(c, self.scaling).replace(MERGE_ALONE, self.merge)  # type: ignore[return-value]
                     for c in (MERGE_ALONE, self.calibrated))


def load_significance(papers: tuple[str, ...] = PAPERS) -> dict[str, list[SignificanceTest]]:
    """Every paper's significance tests (``significance:``), validated, their chains too."""
    return _entries(papers, "significance", SignificanceTest, lambda t: _check_variants(t.as_experiment()))


def narrowed_for(params: Params, test: SignificanceTest) -> Params:
    """The params whose matrix is the test's two chains, in its regime, for the first fine-tuning seed."""
    return narrowed_params(params.model_copy(update={"seeds": list(params.seeds[:1])}), test.as_experiment())


def subset_params(narrowed: Params, test: SignificanceTest, subset: tuple[str, ...]) -> Params:
    """``narrowed`` (``narrowed_for``) with the track's tasks those of ``subset``: its cells merge the subset."""
    section = getattr(narrowed, test.track)
    return narrowed.model_copy(update={test.track: section.model_copy(update={"tasks": list(subset)})})


def subset_cells(params: Params, test: SignificanceTest) -> tuple[Cell, Cell]:
    """The base and the calibrated cell of ``params`` (``subset_params``): the track's own cells."""
    wanted = [fixed_chain(c, test.scaling) for c in (MERGE_ALONE, test.calibrated)]
    found = {c.chain: c for c in get_track(test.track).cells(params) if c.merge not in REFERENCES}
    missing = [c for c in wanted if c not in found]
    if missing:
        raise MergecalError(f"significance {test.id}: the track made no cell of {missing[0]!r}")
    return found[wanted[0]], found[wanted[1]]


def compare_subset(params: Params, root: str | Path, test: SignificanceTest, device: str = "cpu") -> dict[str, Any]:
    """One subset (``params``: ``subset_params``): both cells run, each side's average accuracy over the subset's
    tasks (%) and the paired 95 % interval of the calibration's change (points)."""
    base_cell, calibrated_cell = subset_cells(params, test)
    base = run_cell(base_cell, params, root, device=device)
    calibrated = run_cell(calibrated_cell, params, root, device=device)
    tasks = base_cell.tasks
    if any(t not in r.examples for r in (base, calibrated) for t in tasks):
        raise MergecalError(f"significance {test.id}: a cell of {', '.join(tasks)} kept no per-example scores")
    low, high = paired_interval([calibrated.examples[t] for t in tasks], [base.examples[t] for t in tasks],
                                [1.0 / len(tasks)] * len(tasks))
    return {"tasks": list(tasks), "base": 100 * base.metrics["avg_acc"],
            "calibrated": 100 * calibrated.metrics["avg_acc"], "interval": [100 * low, 100 * high]}


# A worker's params, root and tests, set once per process (``_start``): each job then names a test and a subset.
_WORKER: dict[str, Any] = {}


def _start(threads: int, narrowed: list[Params], root: str, tests: list[SignificanceTest], device: str) -> None:
    pin_threads(threads)
    _WORKER.update(narrowed=narrowed, root=root, tests=tests, device=device)


def _job(job: tuple[int, tuple[str, ...]]) -> dict[str, Any]:
    index, subset = job
    test = _WORKER["tests"][index]
    return compare_subset(subset_params(_WORKER["narrowed"][index], test, subset), _WORKER["root"], test,
                          _WORKER["device"])


def _run_jobs(jobs: list[tuple[int, tuple[str, ...]]], workers: int, threads: int, start_args: tuple,
              log: Callable[[str], None]) -> list[dict[str, Any]]:
    """Every job's comparison, in ``jobs``' order. With several workers each is a fresh interpreter (no torch
    thread pool inherited) and the largest subsets go first, so no long one is left for the end."""
    out: list[dict[str, Any] | None] = [None] * len(jobs)
    step = max(1, len(jobs) // 10)
    if workers == 1:
        _start(threads, *start_args)
        for i, job in enumerate(jobs):
            out[i] = _job(job)
            if (i + 1) % step == 0:
                log(f"  [{i + 1}/{len(jobs)}] subsets compared")
        return out  # type: ignore[return-value]
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=spawn, initializer=_start, initargs=(threads, *start_args)) as pool:
        order = sorted(range(len(jobs)), key=lambda i: -len(jobs[i][1]))
        futures = {pool.submit(_job, jobs[i]): i for i in order}
        try:
            for done, future in enumerate(as_completed(futures), 1):
                out[futures[future]] = future.result()
                if done % step == 0:
                    log(f"  [{done}/{len(jobs)}] subsets compared")
        except BaseException:  # a failed cell (or ^C) stops the rest at once, not after every queued subset
            pool.shutdown(wait=False, cancel_futures=True)
            raise
    return out  # type: ignore[return-value]


def significance_document(params: Params, root: str | Path, tests: list[SignificanceTest], *, device: str = "cpu",
                          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Every test's subsets and summary by its id, rounded (``rounding.DIGITS``); the cells on ``device``."""
    if not params.vision.enabled:
        raise MergecalError("the significance tests merge the vision track's models: vision.enabled is false")
    narrowed = [narrowed_for(params, test) for test in tests]
    tasks = tuple(params.vision.tasks)
    jobs = [(i, subset) for i, test in enumerate(tests) for subset in test.subsets(params)]
    workers = min(params.runner.max_workers, max(1, len(jobs)))
    threads = worker_threads(params.threads, params.runner.max_workers)
    log(f"{len(tests)} test(s), {len(jobs)} subsets of {len(tasks)} experts, {workers} at once on {threads} "
        "thread(s) each")
    rows = _run_jobs(jobs, workers, threads, (narrowed, str(root), tests, device), log)
    out = {}
    for i, test in enumerate(tests):
        found = [row for (j, _), row in zip(jobs, rows) if j == i]
        base, calibrated = test.chains
        out[test.id] = {"track": test.track, "regime": test.regime, "seed": params.seeds[0], "merge": test.merge,
                        "scaling": test.scaling, "base": base, "calibrated": calibrated, "tasks": list(tasks),
                        "min_size": test.min_size, "includes": test.includes(params),
                        "value": "average accuracy over the subset's tasks (%)",
                        "subsets": found, "summary": summary([r["calibrated"] for r in found],
                                                             [r["base"] for r in found])}
    return rounded(out)
