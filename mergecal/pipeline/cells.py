"""Cells of the benchmark matrix: what they are, their content hash, and the steps every track computes them with.

Each track (``mergecal.pipeline.tracks``) contributes its cells, names their input files and runs them; this
module is generic. A cell is (track, regime, merge method, calibration chain), plus the reference cells of each
(track, regime): ``zeroshot`` (the pretrained model) and ``finetuned`` (each task scored by its own fine-tuned model;
the denominator of normalized accuracy) in every track (``COMMON_REFERENCES``), and ``multitask`` (one model
fine-tuned on all the tasks jointly, the papers' "traditional MTL" ceiling) where a track has such a model. A
cell's id hashes everything its result depends on: the canonical recipe (every hyperparameter), the scaling grid,
the evaluation settings, the bytes of every input file (checkpoints, heads, DisTaC-conditioned models, sensitivity
ranking, data manifest) and the source of the modules that compute it (``code_digest.cell_code_digest``: the shared
core, the cell's track and its recipe's steps). Equal ids, equal results: an edited method recomputes its own cells
instead of reusing results of the old code, and no other cell.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from collections.abc import Sequence
from typing import Any

import torch

from .. import __version__
from ..calibrations.registry import get_calibration
from ..errors import MergecalError
from ..perf.memory import peak_memory
from ..published import of_track
from ..recipe import Recipe
from .chains import calibration_name, chain_scaling, fixed_chain, scaling_source
from ..methods import MERGE_METHODS
from ..methods.base import build_params
from .config import FixedScaling, Params
from .code_digest import cell_code_digest
from .hashing import HASH_CACHE, file_digest
from .track_registry import enabled_tracks, track_of

REFERENCES = ("zeroshot", "finetuned", "multitask")  # every reference row a track may have
COMMON_REFERENCES = ("zeroshot", "finetuned")  # those every track has


@dataclass(frozen=True)
class Cell:
    track: str  # "vision" | "text" | "llm" | "local_llm:<name>" (a package of pipeline.tracks[:its entry])
    backbone: str
    task_set: str
    tasks: tuple[str, ...]
    regime: str
    merge: str  # a merge method, or a reference ("zeroshot" / "finetuned" / "multitask")
    chain: str  # the chain template, e.g. "{merge}>svc"; "" for references
    recipe: str = ""  # canonical recipe id at the grid's first scaling
    grid: tuple[float, ...] = ()  # scalings tried on validation (empty: the method's own value)
    calibration: str = "none"  # the chain without the merge, e.g. "svc", "distac>svc>dsc"
    # calibrated_scaling 'selected': the chain whose cell (same track, regime, merge, seed) chooses the scaling
    # this cell calibrates; "" when the cell searches its own grid
    scaling_from: str = ""
    seed: int = 0  # the fine-tuning seed of the models it merges (``seeds`` in params.yaml)

    @property
    def label(self) -> str:
        if self.merge in REFERENCES:
            return self.merge
        return self.chain.replace("{merge}", self.merge)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def scaling_from(chain: str, params: Params, grid: tuple[float, ...]) -> str:
    """``Cell.scaling_from`` of a chain with this grid ("": the cell searches its own grid)."""
    if params.benchmark.calibrated_scaling != "selected" or not grid:
        return ""
    return scaling_source(chain, params.benchmark.chains) or ""


def merge_values(values: dict[str, Any] | None) -> tuple[dict[str, Any], tuple[float, ...]]:
    """A method's params.yaml entry -> (parameters at the grid's first scaling, the scaling grid or ())."""
    values = dict(values or {})
    grid = values.get("scaling")
    grid = tuple(float(g) for g in grid) if isinstance(grid, list) else ()
    if grid:
        values["scaling"] = grid[0]
    return values, grid


def matrix_chains(params: Params, protocols: Sequence[FixedScaling] = ()):
    """``(merge, chain, merge values, grid, recipe)`` of every calibrated or plain merge of a track's matrix: each
    chain around each merge with the merge's grid, then the fixed-scaling protocols (``benchmark.fixed_scaling``,
    then a track's own ``protocols``: those its preset's published rows run, ``published_protocols``) at their
    scaling and settings, without a search (grid ``()``); ``recipe``: the chain's steps around the merge as written
    (each track fills in the merge's values and its own DisTaC step: ``recipe_cell``). The one loop over the
    matrix."""
    for merge, values in params.benchmark.merges.items():
        values, grid = merge_values(values)
        chains = [(chain, values, grid) for chain in params.benchmark.chains]
        for protocol in [*params.benchmark.fixed_scaling, *protocols]:
            if not protocol.merges or merge in protocol.merges:
                chains += [(fixed_chain(chain, protocol.scaling, protocol.settings),
                            {**values, **protocol.settings, "scaling": protocol.scaling}, ())
                           for chain in protocol.chains]
        for chain, chain_values, chain_grid in chains:
            yield merge, chain, chain_values, chain_grid, Recipe.parse(chain.replace("{merge}", merge))


def published_protocols(params: Params, track) -> list[FixedScaling]:
    """The fixed-scaling protocols that the published rows of a track's preset run (those of its own pool and task
    set: ``mergecal.published.of_track``) and the matrix does not: a row at a fixed scaling whose stated settings
    differ from the matrix's merge (FusionBench's TIES at 0.3 with disjoint sum, beside the matrix's mean) or whose
    chain the matrix leaves out. Each comes with its merge alone (the calibrated rows' base)."""
    have = {chain.replace("{merge}", merge) for merge, chain, *_ in matrix_chains(params)}
    found: dict[tuple, FixedScaling] = {}
    for row in (row for paper in of_track(track) for row in paper):
        if row.recipe in (None, *REFERENCES) or row.unlike:
            continue
        method = row.recipe.partition(">")[0].partition("(")[0]
        chain = "{merge}" + row.recipe[len(method):]
        scaling = chain_scaling(chain)
        if scaling is None or method not in params.benchmark.merges:
            continue
        own = merge_values(params.benchmark.merges[method])[0]
        built = build_params(MERGE_METHODS[method].Params, method, {**own, "scaling": scaling}).model_dump()
        settings = {k: v for k, v in row.params if built.get(k) != v}
        plain = "{merge}" + "".join(">" + p for p in chain.split(">")[1:])
        label = fixed_chain(plain, scaling, settings).replace("{merge}", method)
        if label in have:
            continue
        key = (scaling, method, tuple(sorted(settings.items())))
        protocol = found.setdefault(key, FixedScaling(scaling=scaling, merges=[method], chains=["{merge}"],
                                                      settings=settings))
        if plain not in protocol.chains:
            protocol.chains.append(plain)
    return list(found.values())


def per_seed(cells: list[Cell], seeds) -> list[Cell]:
    """A track's cells once per fine-tuning seed, seed by seed: every seed has the same matrix."""
    return [replace(cell, seed=seed) for seed in seeds for cell in cells]


def per_seed_skipped(skipped: list[tuple[Cell, str]], seeds) -> list[tuple[Cell, str]]:
    """``per_seed`` of a track's skipped chains (each with its reason)."""
    return [(replace(cell, seed=seed), reason) for seed in seeds for cell, reason in skipped]


def enumerate_cells(params: Params) -> list[Cell]:
    """Every cell of the matrix: each enabled track's cells, in track order (``mergecal.pipeline.tracks``)."""
    return [cell for track in enabled_tracks(params) for cell in track.cells(params)]


def cell_inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, str]:
    """The files a cell reads, by role (its track says which)."""
    return {role: str(path) for role, path in track_of(cell).inputs(cell, params, root).items()}


@lru_cache(maxsize=1024)
def uses_sensitivity(recipe_id: str) -> bool:
    """Whether a step of the recipe takes the probed sensitivity ranking (the calibration registry's word:
    WSC and FSC, whose ``sensitive`` parameter it fills in)."""
    return any(s.phase != "merge" and get_calibration(s.name).uses_sensitivity for s in Recipe.parse(recipe_id).steps)


def cell_id(cell: Cell, params: Params, root: str | Path, source_id: str | None = None) -> str:
    """Content hash of everything the cell's result depends on; ``source_id`` is the id of the cell that
    chooses its scaling (``Cell.scaling_from``), whose result is a function of that id."""
    if bool(cell.scaling_from) != (source_id is not None):
        raise MergecalError(f"cell {cell.label!r}: the id of its scaling source is "
                            f"{'missing' if cell.scaling_from else 'unexpected'}")

    track = track_of(cell)
    cache = Path(root) / HASH_CACHE
    digests = {role: file_digest(path, cache) for role, path in cell_inputs(cell, params, root).items()}
    # a track of several configured families (local_llm) fingerprints each cell's own family
    fingerprint = track.cell_fingerprint(cell, params)
    payload = {"cell": cell.to_dict(), "inputs": digests, "evaluation": params.benchmark.evaluation.model_dump(),
               "track": fingerprint,
               "code": cell_code_digest(cell.track, cell.recipe), "scaling_source": source_id}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def source_index(cells: list[Cell]) -> list[int | None]:
    """For each cell, the index of the cell that chooses its scaling (None: it chooses its own)."""
    where = {(c.track, c.regime, c.merge, c.chain, c.seed): i for i, c in enumerate(cells)}
    out = []
    for cell in cells:
        if not cell.scaling_from:
            out.append(None)
            continue
        index = where.get((cell.track, cell.regime, cell.merge, cell.scaling_from, cell.seed))
        if index is None:
            raise MergecalError(f"cell {cell.label!r} ({cell.regime}): its scaling source {cell.scaling_from!r} "
                                "is not in the matrix")
        out.append(index)
    return out


def matrix_ids(cells: list[Cell], params: Params, root: str | Path) -> list[str]:
    """Every cell's id; sources are hashed before the cells that take their scaling."""
    sources = source_index(cells)
    ids: list[str | None] = [None] * len(cells)
    for i in [i for i, s in enumerate(sources) if s is None] + [i for i, s in enumerate(sources) if s is not None]:
        ids[i] = cell_id(cells[i], params, root, None if sources[i] is None else ids[sources[i]])
    return ids  # type: ignore[return-value]


# ------------------------------------------------------------------------------------------------- computation

@dataclass
class CellResult:
    metrics: dict[str, float]
    params: dict[str, str]
    diagnostics: dict[str, Any] = field(default_factory=dict)
    # {task: each test example's score (0/1 for accuracy), in the split's order}: the leaderboard's intervals
    examples: dict[str, list] = field(default_factory=dict)


def model_files(models: dict[str, Path]) -> dict[str, Path]:
    """A cell's inputs of model directories the pipeline built: {role/file name: path} of every file of each (config,
    tokenizer, weights, an adapter's files); a directory not built yet is itself, which the cell's id then reports
    missing, naming it."""
    return {f"{role}/{p.name}": p for role, d in models.items()
            for p in (sorted(p for p in d.iterdir() if p.is_file()) if d.is_dir() else [d])}


def per_example_results(tasks, test: dict[str, dict[str, Any]], key: str = "correct") -> dict[str, list]:
    """The per-example test outcomes of an evaluation run with ``per_example`` (``{}`` where it was not), or, with
    ``key="test_correct"``, those a references file kept for the ``finetuned`` row (``{}`` for a file written
    before it kept them: the row then has no interval)."""
    return {t: test[t][key] for t in tasks} if all(key in test[t] for t in tasks) else {}


def summaries(tasks, test: dict[str, dict[str, float]], reference: dict[str, dict[str, float]]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for task in tasks:
        metrics[f"acc.{task}"] = test[task]["accuracy"]
        metrics[f"norm_acc.{task}"] = test[task]["accuracy"] / max(reference[task]["test_accuracy"], 1e-12)
        metrics[f"entropy.{task}"] = test[task]["entropy"]
        metrics[f"ece.{task}"] = test[task]["ece"]
    for name in ("acc", "norm_acc", "entropy", "ece"):
        metrics[f"avg_{name}"] = sum(metrics[f"{name}.{t}"] for t in tasks) / len(tasks)
    return metrics


def finetuned_reference(tasks, reference: dict, logged: dict[str, str]) -> CellResult:
    """The ``finetuned`` row: each task scored by its own fine-tuned model (from the references file)."""
    test = {t: {"accuracy": r["test_accuracy"], "entropy": r["entropy"], "ece": r["ece"]} for t, r in reference.items()}
    diagnostics = {"task_vectors": {t: {"norm": r["norm"], "entropy": r["entropy"]} for t, r in reference.items()}}
    return CellResult(summaries(tasks, test, reference), logged, diagnostics,
                      per_example_results(tasks, reference, "test_correct"))


def flat_params(prefix: str, values: dict[str, Any]) -> dict[str, str]:
    return {f"{prefix}.{k}": json.dumps(v) if not isinstance(v, str) else v for k, v in values.items()}


def recipe_params(cell: Cell, recipe: Recipe, scaling: float, base: dict[str, str]) -> dict[str, str]:
    """The MLflow params of a recipe cell: ``base`` (the track's), the grid and where the scaling came from, every
    step's parameters, then the merge's chosen scaling (after the steps: the merge step's own, nominal scaling
    must not overwrite it)."""
    logged = {**base, "grid": json.dumps(list(cell.grid)), "scaling_from": cell.scaling_from or "own grid"}
    for step in recipe.steps:
        logged.update(flat_params(step.name, step.params.model_dump(mode="json")))
    logged[f"{recipe.merge.name}.scaling"] = json.dumps(scaling)
    return logged


def jsonable_diagnostics(diagnostics: dict, sensitivity_path: Path | None) -> dict[str, Any]:
    """The logged artifacts (see mergecal.reports): SVC spectra, MAGIC coefficients, sensitivity."""
    out: dict[str, Any] = {}
    if "svc" in diagnostics:
        # s_top: each task's projection coefficient s_i^1 on the key's top direction (above 1: over-counted there)
        out["svc_spectra"] = {k: {"before": [float(x) for x in v["sigma"]],
                                  "after": [float(x) for x in v["sigma_calibrated"]],
                                  "s_top": [float(x) for x in torch.as_tensor(v["s"])[:, 0]]}
                              for k, v in diagnostics["svc"].items()}
    coefficients: dict[str, dict[str, float]] = {}
    if "wsc" in diagnostics:
        coefficients["weight"] = {k: float(torch.as_tensor(v["xi"]).float().mean())
                                  for k, v in diagnostics["wsc"].items()}
    if "fsc" in diagnostics:
        coefficients["feature"] = {k: float(torch.as_tensor(v).float().mean())
                                   for k, v in diagnostics["fsc"]["ratios"].items()}
    if coefficients:
        out["magic_coefficients"] = coefficients
    if sensitivity_path is not None and sensitivity_path.is_file():
        data = json.loads(sensitivity_path.read_text())
        # the probe's score: accuracy (MAGIC's) or the true class's mean log-probability (``probing.metric``)
        metric = {"nll": "probe_log_likelihood"}.get(data.get("metadata", {}).get("metric"), "probe_accuracy")
        out["sensitivity"] = {"metric": metric, "baseline": data["baseline"],
                              "scores": {k: v for k, v in data["scores"]}}
    return out


def select_scaling(grid: tuple[float, ...], trial, validate) -> tuple[float, Any, list[dict[str, float]]]:
    """Run ``trial(scaling)`` for each grid value and keep the best by ``validate(result)`` -> (avg accuracy,
    avg normalized accuracy) on the validation split. A single value is taken as is: no validation spent.
    Returns (scaling, its trial's result, the curve)."""
    if len(grid) == 1:
        return grid[0], trial(grid[0]), []
    curve, best = [], None
    for scaling in grid:
        result = trial(scaling)
        avg_acc, avg_norm = validate(result)
        curve.append({"scaling": scaling, "avg_acc": avg_acc, "avg_norm_acc": avg_norm})
        if best is None or avg_norm > best[0]:
            best = (avg_norm, scaling, result)
    return best[1], best[2], curve


def validation_averages(val: dict[str, dict[str, float]], reference: dict, tasks: list[str]) -> tuple[float, float]:
    avg_acc = sum(val[t]["accuracy"] for t in tasks) / len(tasks)
    avg_norm = sum(val[t]["accuracy"] / max(reference[t]["val_accuracy"], 1e-12) for t in tasks) / len(tasks)
    return avg_acc, avg_norm


def cell_grid(cell: Cell, recipe: Recipe, scaling: float | None) -> tuple[float, ...]:
    """The scalings a cell tries: the one its source cell chose (``scaling``), else its grid, else its recipe's."""
    if cell.scaling_from and scaling is None:
        raise MergecalError(f"cell {cell.label!r}: needs the scaling chosen by its source cell {cell.scaling_from!r}")
    if scaling is not None:
        return (float(scaling),)
    return cell.grid or (recipe.merge.params.scaling,)


def run_cell(cell: Cell, params: Params, root: str | Path = ".", *, device: str = "cpu",
             scaling: float | None = None) -> CellResult:
    """Merge → calibrate → evaluate one cell. A reference row is its track's (``Track.reference``); a recipe cell's
    scaling search runs here, the same for every track, on what its track loaded once (``Track.session``): the
    merged model at each scaling of the cell's grid, its validation score, and the chosen one evaluated on test.
    ``scaling``: the value chosen by the cell's scaling source (required exactly when ``cell.scaling_from`` is
    set); otherwise the cell searches its own grid."""
    track = track_of(cell)
    if cell.merge in REFERENCES:
        return track.reference(cell, params, root, device=device)
    recipe = Recipe.parse(cell.recipe)
    grid = cell_grid(cell, recipe, scaling)
    with track.session(cell, recipe, grid, params, root, device=device) as session:
        chosen, merged, curve = select_scaling(grid, session.merged, session.validate)
        return session.result(merged, chosen, curve)


def base_params(cell: Cell) -> dict[str, str]:
    """The MLflow params every cell of any track logs."""
    return {"track": cell.track, "backbone": cell.backbone, "regime": cell.regime, "recipe": cell.recipe,
            "mergecal_version": __version__, "mergecal_code": cell_code_digest(cell.track, cell.recipe)[:16],
            "seed": str(cell.seed)}


def recipe_cell(params: Params, track: str, backbone: str, task_set: str, tasks, regime: str, merge: str, chain: str,
                steps: list[tuple[str, dict]], grid: tuple[float, ...]) -> Cell:
    """A cell of ``chain`` around ``merge`` with the canonical recipe of ``steps`` (every hyperparameter)."""
    return Cell(track, backbone, task_set, tuple(tasks), regime, merge, chain, Recipe(steps).id, grid,
                calibration_name(chain), scaling_from(chain, params, grid))


def measure(fn, *args, **kwargs) -> tuple[Any, float, float]:
    """(result, seconds, peak resident MiB of the process during the call)."""
    start = time.perf_counter()
    with peak_memory() as peak:
        result = fn(*args, **kwargs)
    return result, time.perf_counter() - start, peak.peak_mb
