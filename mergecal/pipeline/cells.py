"""Cells of the benchmark matrix: what they are, their content hash, and how one is computed.

A cell is (track, regime, merge method, calibration chain), plus two reference cells per (track, regime):
``zeroshot`` (the pretrained model) and ``finetuned`` (each task scored by its own fine-tuned model; the
denominator of normalized accuracy). A cell's id hashes everything its result depends on: the canonical
recipe (every hyperparameter), the scaling grid, the evaluation settings, the bytes of every input file
(checkpoints, heads, DisTaC-conditioned models, sensitivity ranking, data manifest) and the source of the
library that computes it (``cell_code_digest``). Equal ids, equal results: an edited method recomputes its
cells instead of reusing results of the old code.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..errors import CheckpointError, MergecalError
from .chains import calibration_name, scaling_source
from .config import Params

REFERENCES = ("zeroshot", "finetuned")


@dataclass(frozen=True)
class Cell:
    track: str  # "vision" | "text"
    backbone: str
    task_set: str
    tasks: tuple[str, ...]
    regime: str
    merge: str  # a merge method, or "zeroshot" / "finetuned"
    chain: str  # the chain template, e.g. "{merge}>svc"; "" for references
    recipe: str = ""  # canonical recipe id at the grid's first scaling
    grid: tuple[float, ...] = ()  # scalings tried on validation (empty: the method's own value)
    calibration: str = "none"  # the chain without the merge, e.g. "svc", "distac>svc>dsc"
    # calibrated_scaling 'selected': the chain whose cell (same track, regime, merge) chooses the scaling this
    # cell calibrates; "" when the cell searches its own grid
    scaling_from: str = ""

    @property
    def label(self) -> str:
        if self.merge in REFERENCES:
            return self.merge
        return self.chain.replace("{merge}", self.merge)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _scaling_from(chain: str, params: Params, grid: tuple[float, ...]) -> str:
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


def enumerate_cells(params: Params) -> list[Cell]:
    from ..recipe import Recipe
    from .vision import distac_params

    cells = []
    track = params.vision
    for regime in track.regimes if track.enabled else ():
        for ref in REFERENCES:
            cells.append(Cell("vision", track.backbone, track.task_set, tuple(track.tasks), regime, ref, ""))
        for merge, values in params.benchmark.merges.items():
            values, grid = merge_values(values)
            for chain in params.benchmark.chains:
                recipe = Recipe.parse(chain.replace("{merge}", merge))
                steps = []
                for step in recipe.steps:
                    if step.phase == "merge":
                        steps.append((step.name, values))
                    elif step.name == "distac":
                        steps.append(("distac", distac_params(params, regime).model_dump()))
                    else:
                        steps.append((step.name, step.params.model_dump()))
                canonical = Recipe(steps).id
                cells.append(Cell("vision", track.backbone, track.task_set, tuple(track.tasks), regime, merge, chain,
                                  canonical, grid, calibration_name(chain), _scaling_from(chain, params, grid)))
    if params.text.enabled:
        cells.extend(_text_cells(params))
    return cells


def _text_cells(params: Params) -> list[Cell]:
    """Text track: the weight-space chains only (see mergecal.pipeline.text)."""
    from ..recipe import Recipe

    track, out = params.text, []
    for ref in REFERENCES:
        out.append(Cell("text", track.backbone, track.task_set, tuple(track.tasks), "standard", ref, ""))
    for merge, values in params.benchmark.merges.items():
        values, grid = merge_values(values)
        for chain in params.benchmark.chains:
            recipe = Recipe.parse(chain.replace("{merge}", merge))
            if any(s.needs_data for s in recipe.steps):  # no text adapter for DisTaC / FSC yet (see .text)
                continue
            steps = [(s.name, values if s.phase == "merge" else s.params.model_dump()) for s in recipe.steps]
            out.append(Cell("text", track.backbone, track.task_set, tuple(track.tasks), "standard", merge, chain,
                            Recipe(steps).id, grid, calibration_name(chain), _scaling_from(chain, params, grid)))
    return out


@lru_cache(maxsize=4096)
def _file_digest(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def file_digest(path: str | Path) -> str:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: input of the benchmark not found (run `dvc repro` to build it)")
    stat = path.stat()
    return _file_digest(str(path.resolve()), stat.st_size, stat.st_mtime_ns)


PACKAGE_DIR = Path(__file__).resolve().parents[1]
# parts of the package that never change a cell's result: reports, speed benchmarks, the command line
NOT_CELL_CODE = ("reports", "perf", "cli.py", "ui.py")


@lru_cache(maxsize=8)
def cell_code_digest(package_dir: Path = PACKAGE_DIR) -> str:
    """SHA-256 over the package's Python sources (relative path and bytes) that compute cells."""
    h = hashlib.sha256()
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir).as_posix()
        if relative.split("/")[0] in NOT_CELL_CODE:
            continue
        h.update(relative.encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


@lru_cache(maxsize=1024)
def _uses_sensitivity(recipe_id: str) -> bool:
    """Whether a step of the recipe takes the probed sensitivity ranking (the calibration registry's word:
    WSC and FSC, whose ``sensitive`` parameter it fills in)."""
    from ..calibrations.registry import get_calibration
    from ..recipe import Recipe

    return any(s.phase != "merge" and get_calibration(s.name).uses_sensitivity for s in Recipe.parse(recipe_id).steps)


def cell_inputs(cell: Cell, params: Params, root: str | Path) -> dict[str, str]:
    """The files a cell reads, by role."""
    from .vision import paths_for, regime_variants

    if cell.track == "text":
        from .text import data_root, finetuned_path, models_root

        files = {"data_manifest": data_root(root) / "manifest.json",
                 "reference": models_root(params, root) / "references.json"}
        for task in cell.tasks:
            files[f"finetuned.{task}"] = finetuned_path(params, root, task)
        return {k: str(v) for k, v in files.items()}

    paths = paths_for(params, root)
    files = {"pretrained": paths.pretrained, "heads": paths.heads, "data_manifest": paths.data / "manifest.json",
             "reference": paths.task_vectors(cell.regime) / "diagnostics.json"}
    if cell.merge == "zeroshot":
        return {k: str(v) for k, v in files.items()}
    for task, variant in regime_variants(params.vision, cell.regime).items():
        files[f"finetuned.{task}"] = paths.finetuned(variant, task)
    if cell.recipe.startswith("distac"):
        for task in cell.tasks:
            files[f"distac.{task}"] = paths.distac(cell.regime) / f"{task}.safetensors"
    if cell.recipe and _uses_sensitivity(cell.recipe):
        files["sensitivity"] = paths.sensitivity(cell.regime)
    return {k: str(v) for k, v in files.items()}


def cell_id(cell: Cell, params: Params, root: str | Path, source_id: str | None = None) -> str:
    """Content hash of everything the cell's result depends on; ``source_id`` is the id of the cell that
    chooses its scaling (``Cell.scaling_from``), whose result is a function of that id."""
    if bool(cell.scaling_from) != (source_id is not None):
        raise MergecalError(f"cell {cell.label!r}: the id of its scaling source is "
                            f"{'missing' if cell.scaling_from else 'unexpected'}")
    digests = {role: file_digest(path) for role, path in cell_inputs(cell, params, root).items()}
    payload = {"cell": cell.to_dict(), "inputs": digests, "evaluation": params.benchmark.evaluation.model_dump(),
               "arch": params.vision.arch if cell.track == "vision" else params.text.finetune,
               "code": cell_code_digest(), "scaling_source": source_id}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:20]


def source_index(cells: list[Cell]) -> list[int | None]:
    """For each cell, the index of the cell that chooses its scaling (None: it chooses its own)."""
    where = {(c.track, c.regime, c.merge, c.chain): i for i, c in enumerate(cells)}
    out = []
    for cell in cells:
        if not cell.scaling_from:
            out.append(None)
            continue
        index = where.get((cell.track, cell.regime, cell.merge, cell.scaling_from))
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


def _summaries(tasks, test: dict[str, dict[str, float]], reference: dict[str, dict[str, float]]) -> dict[str, float]:
    metrics: dict[str, float] = {}
    for task in tasks:
        metrics[f"acc.{task}"] = test[task]["accuracy"]
        metrics[f"norm_acc.{task}"] = test[task]["accuracy"] / max(reference[task]["test_accuracy"], 1e-12)
        metrics[f"entropy.{task}"] = test[task]["entropy"]
        metrics[f"ece.{task}"] = test[task]["ece"]
    for name in ("acc", "norm_acc", "entropy", "ece"):
        metrics[f"avg_{name}"] = sum(metrics[f"{name}.{t}"] for t in tasks) / len(tasks)
    return metrics


def _finetuned_reference(tasks, reference: dict, base_params: dict[str, str]) -> CellResult:
    """The ``finetuned`` row: each task scored by its own fine-tuned model (from the references file)."""
    test = {t: {"accuracy": r["test_accuracy"], "entropy": r["entropy"], "ece": r["ece"]} for t, r in reference.items()}
    diagnostics = {"task_vectors": {t: {"norm": r["norm"], "entropy": r["entropy"]} for t, r in reference.items()}}
    return CellResult(_summaries(tasks, test, reference), base_params, diagnostics)


def _flat_params(prefix: str, values: dict[str, Any]) -> dict[str, str]:
    return {f"{prefix}.{k}": json.dumps(v) if not isinstance(v, str) else v for k, v in values.items()}


def _jsonable_diagnostics(diagnostics: dict, sensitivity_path: Path | None) -> dict[str, Any]:
    """The logged artifacts (see mergecal.reports): SVC spectra, MAGIC coefficients, sensitivity."""
    out: dict[str, Any] = {}
    if "svc" in diagnostics:
        out["svc_spectra"] = {k: {"before": [float(x) for x in v["sigma"]],
                                  "after": [float(x) for x in v["sigma_calibrated"]]}
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
        out["sensitivity"] = {"metric": "probe_accuracy", "baseline": data["baseline"],
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


def recipe_trials(steps: list[tuple[str, dict]], merge_index: int, pretrained, states, inputs, grid):
    """``value -> RecipeResult`` of the recipe with its merge at that scaling. A recipe that is only a merge and
    is tried at several values is merged once, at scaling 1, then rescaled: the scaling multiplies the merged
    task vector (``mergecal/merge.py``), so every state equals the merge at that value bit for bit."""
    from ..recipe import Recipe, iter_weight_space
    from ..run_recipe import RecipeResult, run_recipe
    from ..task_vectors import COMPUTE_DTYPE, TaskVectorSet

    def at(value: float) -> Recipe:
        chosen = list(steps)
        chosen[merge_index] = (chosen[merge_index][0], {**chosen[merge_index][1], "scaling": value})
        return Recipe(chosen)

    if len(steps) > 1 or len(grid) == 1:
        return lambda value: run_recipe(at(value), pretrained, states, inputs)
    tvs = TaskVectorSet.from_models(pretrained, states, device=inputs.device)
    unit = dict(iter_weight_space(at(1.0), tvs))

    def rescaled(value: float):
        state = {}
        for key, tensor in pretrained.items():
            if key in unit:  # as run_recipe adds the merged update
                merged = tensor.to(device=inputs.device, dtype=COMPUTE_DTYPE) + unit[key] * value
                state[key] = merged.to(tensor.dtype).cpu()
            else:
                state[key] = tensor.clone()
        return RecipeResult(recipe=at(value), state_dict=state)

    return rescaled


def _validation_averages(val: dict[str, dict[str, float]], reference: dict, tasks: list[str]) -> tuple[float, float]:
    avg_acc = sum(val[t]["accuracy"] for t in tasks) / len(tasks)
    avg_norm = sum(val[t]["accuracy"] / max(reference[t]["val_accuracy"], 1e-12) for t in tasks) / len(tasks)
    return avg_acc, avg_norm


def _cell_grid(cell: Cell, default: float, scaling: float | None) -> tuple[float, ...]:
    if cell.scaling_from and scaling is None:
        raise MergecalError(f"cell {cell.label!r}: needs the scaling chosen by its source cell {cell.scaling_from!r}")
    if scaling is not None:
        return (float(scaling),)
    return cell.grid or (default,)


def run_text_cell(cell: Cell, params: Params, root: str | Path, *, device: str = "cpu",
                  scaling: float | None = None) -> CellResult:
    """Text track: merge the task encoders (weight-space chain), score every task with its own head."""
    from ..recipe import Recipe
    from ..run_recipe import RecipeInputs
    from .text import TextModels, models_root

    models, tasks = TextModels(params, root), list(cell.tasks)
    evaluation = params.benchmark.evaluation
    reference = json.loads((models_root(params, root) / "references.json").read_text())
    base_params = {"track": cell.track, "backbone": cell.backbone, "regime": cell.regime, "recipe": cell.recipe,
                   "mergecal_version": __version__, "mergecal_code": cell_code_digest()[:16]}
    if cell.merge == "zeroshot":  # the pretrained encoder with each task's head (no zero-shot head exists)
        test = models.evaluate(models.pretrained, tasks, "test", device=device)
        return CellResult(_summaries(tasks, test, reference), base_params)
    if cell.merge == "finetuned":
        return _finetuned_reference(tasks, reference, base_params)
    recipe = Recipe.parse(cell.recipe)
    states = [models.finetuned(t)[0] for t in tasks]
    steps = [(s.name, s.params.model_dump()) for s in recipe.steps]
    index = next(i for i, s in enumerate(recipe.steps) if s.phase == "merge")
    grid = _cell_grid(cell, steps[index][1]["scaling"], scaling)

    trial = recipe_trials(steps, index, models.pretrained, states, RecipeInputs(progress=False, device=device), grid)

    def validate(result) -> tuple[float, float]:
        val = models.evaluate(result.state_dict, tasks, "validation", max_items=evaluation.max_validation,
                              device=device)
        return _validation_averages(val, reference, tasks)

    scaling, result, curve = select_scaling(grid, trial, validate)
    test = models.evaluate(result.state_dict, tasks, "test", device=device)
    metrics = {**_summaries(tasks, test, reference), "selected_scaling": float(scaling)}
    logged = {**base_params, "grid": json.dumps(list(cell.grid)), f"{recipe.merge.name}.scaling": json.dumps(scaling),
              "scaling_from": cell.scaling_from or "own grid"}
    for step in recipe.steps:
        logged.update(_flat_params(step.name, step.params.model_dump(mode="json")))
    artifacts = _jsonable_diagnostics(result.diagnostics, None)
    if curve:
        artifacts["scaling_curve"] = curve
    artifacts["task_vectors"] = {t: {"norm": reference[t]["norm"], "entropy": reference[t]["entropy"]} for t in tasks}
    return CellResult(metrics, logged, artifacts)


def run_cell(cell: Cell, params: Params, root: str | Path = ".", *, device: str = "cpu",
             scaling: float | None = None) -> CellResult:
    """Merge → calibrate → evaluate one cell. ``scaling``: the value chosen by the cell's scaling source
    (required exactly when ``cell.scaling_from`` is set); otherwise the cell searches its own grid."""
    if cell.track == "text":
        return run_text_cell(cell, params, root, device=device, scaling=scaling)
    from ..calibrations.probing import SensitivityRanking
    from ..recipe import Recipe
    from ..run_recipe import RecipeInputs
    from ..task_vectors import task_vector
    from .vision import VisionModels, evaluate_tasks, preprocessed, task_split

    root = Path(root)
    models = VisionModels(params, root)
    paths, tasks = models.paths, list(cell.tasks)
    evaluation = params.benchmark.evaluation
    reference = json.loads((paths.task_vectors(cell.regime) / "diagnostics.json").read_text())
    base_params = {"track": cell.track, "backbone": cell.backbone, "regime": cell.regime, "recipe": cell.recipe,
                   "mergecal_version": __version__, "mergecal_code": cell_code_digest()[:16]}

    if cell.merge == "zeroshot":
        test = evaluate_tasks(models.model({}), models.heads, paths.data, tasks, "test",
                              batch_size=evaluation.batch_size, device=device)
        return CellResult(_summaries(tasks, test, reference), base_params)
    if cell.merge == "finetuned":
        return _finetuned_reference(tasks, reference, base_params)

    recipe = Recipe.parse(cell.recipe)
    pre_steps = recipe.phase("pre")
    if pre_steps:  # DisTaC ran once in its DVC stage with exactly these parameters (checked here)
        states = []
        for task in tasks:
            path = paths.distac(cell.regime) / f"{task}.safetensors"
            from safetensors import SafetensorError, safe_open

            try:
                with safe_open(str(path), framework="pt") as fh:
                    stored = json.loads((fh.metadata() or {}).get("distac", "null"))
            except (OSError, SafetensorError, json.JSONDecodeError) as err:
                raise CheckpointError(f"{path}: not a readable DisTaC checkpoint ({err})") from None
            if stored != pre_steps[0].params.model_dump(mode="json"):
                raise CheckpointError(f"{path}: DisTaC parameters differ from the cell's recipe (rerun `dvc repro`)")
            from ..checkpoint import load_state_dict

            states.append(load_state_dict(path))
    else:
        states = models.finetuned(cell.regime)
    rest = [(s.name, s.params.model_dump()) for s in recipe.steps if s.phase != "pre"]
    needs_sensitive = _uses_sensitivity(cell.recipe)
    sensitivity_path = paths.sensitivity(cell.regime) if needs_sensitive else None
    sensitive = SensitivityRanking.load(sensitivity_path).sensitive if sensitivity_path else None

    pre_visual = models.visual_pretrained()
    fsc_data, agnostic = None, None
    if recipe.phase("feature"):
        n = evaluation.fsc_samples_per_task
        fsc_data = [preprocessed(task_split(paths.data, t, "train", max_items=n)[0], params.vision.arch) for t in tasks]
        from ..data.vision import load_split

        mixed = load_split(paths.data, "mixed", "train")["images"][: n * len(tasks)]
        agnostic = preprocessed(mixed, params.vision.arch)
    inputs = RecipeInputs(build_model=models.model, fsc_data=fsc_data, fsc_agnostic_data=agnostic, sensitive=sensitive,
                          progress=False, device=device)

    merge_index = next(i for i, (name, _) in enumerate(rest) if recipe.merge.name == name)
    grid = _cell_grid(cell, rest[merge_index][1]["scaling"], scaling)

    run_trial = recipe_trials(rest, merge_index, pre_visual, states, inputs, grid)

    def trial(value: float):
        result = run_trial(value)
        return (result.model if result.model is not None else models.model(result.state_dict)), result.diagnostics

    def validate(outcome) -> tuple[float, float]:
        val = evaluate_tasks(outcome[0], models.heads, paths.data, tasks, "validation",
                             max_items=evaluation.max_validation, batch_size=evaluation.batch_size, device=device)
        return _validation_averages(val, reference, tasks)

    scaling, (model, diagnostics), curve = select_scaling(grid, trial, validate)
    test = evaluate_tasks(model, models.heads, paths.data, tasks, "test", batch_size=evaluation.batch_size,
                          device=device)
    metrics = _summaries(tasks, test, reference)
    metrics["selected_scaling"] = float(scaling)
    logged = {**base_params, "grid": json.dumps(list(cell.grid)), "scaling_from": cell.scaling_from or "own grid"}
    for step in recipe.steps:
        logged.update(_flat_params(step.name, step.params.model_dump(mode="json")))
    logged[f"{recipe.merge.name}.scaling"] = json.dumps(scaling)
    artifacts = _jsonable_diagnostics(diagnostics, sensitivity_path)
    if curve:
        artifacts["scaling_curve"] = curve
    if pre_steps:
        info = json.loads((paths.distac(cell.regime) / "distac.json").read_text())
        artifacts["distac"] = {"kappas": info["kappas"], "conditioned": info["conditioned"]}
    norms = {t: float(sum(v.double().pow(2).sum() for v in task_vector(s, pre_visual).values()) ** 0.5)
             for t, s in zip(tasks, states)}
    artifacts["task_vectors"] = {t: {"norm": norms[t], "entropy": reference[t]["entropy"]} for t in tasks}
    return CellResult(metrics, logged, artifacts)


def measure(fn, *args, **kwargs) -> tuple[Any, float, float]:
    """(result, seconds, peak resident MiB of the process during the call)."""
    from ..perf.memory import peak_memory

    start = time.perf_counter()
    with peak_memory() as peak:
        result = fn(*args, **kwargs)
    return result, time.perf_counter() - start, peak.peak_mb


def threads_from_env() -> None:
    """Respect OMP_NUM_THREADS-style limits when several cells run at once."""
    n = os.environ.get("MERGECAL_TORCH_THREADS")
    if n:
        torch.set_num_threads(int(n))
