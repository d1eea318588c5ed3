"""The data of DisTaC's analysis figures, after Yoshida et al., "DisTaC: Conditioning Task Vectors via Distillation
for Robust Model Merging", arXiv:2508.01148: Fig. 2 (DisTaC over its steps, ``trajectory_summary``), Fig. 3 (single-
task accuracy of theta_pre + kappa tau, ``kappa_sweep_summary``), Figs. 5 and 6 (layer-wise task-vector norms of the
weights and of the biases, ``layer_norms`` and ``layer_norm_comparison``) and the reliability diagrams and their
average over tasks (``reliability``, ``average_reliability``, ``confidence_gap_interval``). No plotting, no model
evaluation, no files: the functions take numbers (tensors, arrays, per-step records) and return JSON-able dicts
(plain floats, ints, strings and lists; a non-finite number is written as None). Bad input raises
``mergecal.errors.ParameterError`` with a one-line message naming the parameter.

Conventions.

Key classification (``classify_key``), on open_clip names under ``prefix`` (default ``"visual."``, the image
encoder; ``""`` for an encoder saved on its own or for the text tower's blocks), by the regular expressions
``_BLOCK_PATTERNS`` / ``_TOP_PATTERNS`` below:

    {prefix}transformer.resblocks.{i}.ln_1|ln_2.{weight,bias}           panel "layernorm", module "ln_1" / "ln_2"
    {prefix}transformer.resblocks.{i}.attn.in_proj_{weight,bias}        panel "attention", module "in_proj"
    {prefix}transformer.resblocks.{i}.attn.out_proj.{weight,bias}       panel "attention", module "out_proj"
    {prefix}transformer.resblocks.{i}.mlp.c_fc|c_proj.{weight,bias}     panel "mlp", module "c_fc" / "c_proj"
    {prefix}ln_pre|ln_post.{weight,bias}                                panel "layernorm", layer "pre" / "post"
    {prefix}conv1.weight, class_embedding, positional_embedding, proj   panel "other", layer None

Any other key is panel "other" (never an error): layer i when it lies under ``{prefix}transformer.resblocks.{i}.``,
else None; its module is the rest of its name without a trailing ``.weight`` / ``_weight`` / ``.bias`` / ``_bias``.
``kind`` is "bias" for a name ending in ``bias`` and "weight" for every other parameter (embeddings and ``proj``
included).

Row order (``layer_norms``, ``layer_norm_comparison``), the forward order of the encoder, not alphabetical: the stem
(conv1, class_embedding, positional_embedding), "pre" (ln_pre), blocks 0, 1, ..., "post" (ln_post), ``proj``, then
unrecognised keys outside the blocks in input order. Within a block: ln_1, in_proj, out_proj, ln_2, c_fc, c_proj,
then the block's unrecognised keys in input order; weight before bias.

Norms are L2 norms accumulated in float64. A spread over layers (``ratio_cv``) is the population coefficient of
variation sd/mean (ddof=0: the rows are all the layers, not a sample of them); a spread over tasks (Fig. 2's band)
is the sample sd (ddof=1; None with one task).

Reliability diagrams follow Guo et al. (2017), "On Calibration of Modern Neural Networks": B equal-width bins with
edges ``numpy.linspace(0, 1, B + 1)``; bin i holds the confidences c with edges[i] < c <= edges[i + 1] (a confidence of
exactly 1 falls in the last bin), and a confidence of exactly 0 falls in the first. ECE = sum_i n_i/N |acc_i -
conf_i|; gap = mean confidence - accuracy (positive: over-confident). The interval of the gap is the library's 95 %
percentile bootstrap (``mergecal.intervals``), stratified by task.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from ..errors import ParameterError
from ..intervals import LEVEL, METHOD, N_RESAMPLES, SEED, stratified_interval, weighted_means

PAPER = ("Yoshida et al., DisTaC: Conditioning Task Vectors via Distillation for Robust Model Merging, "
         "arXiv:2508.01148")

PANELS = ("mlp", "attention", "layernorm", "other")
KINDS = ("weight", "bias")

#: a block's keys after ``{prefix}transformer.resblocks.{i}.``: (pattern, panel, module)
_BLOCK_PATTERNS: tuple[tuple[re.Pattern[str], str, str], ...] = (
    (re.compile(r"^ln_1\.(weight|bias)$"), "layernorm", "ln_1"),
    (re.compile(r"^attn\.in_proj_(weight|bias)$"), "attention", "in_proj"),
    (re.compile(r"^attn\.out_proj\.(weight|bias)$"), "attention", "out_proj"),
    (re.compile(r"^ln_2\.(weight|bias)$"), "layernorm", "ln_2"),
    (re.compile(r"^mlp\.c_fc\.(weight|bias)$"), "mlp", "c_fc"),
    (re.compile(r"^mlp\.c_proj\.(weight|bias)$"), "mlp", "c_proj"),
)
#: keys outside the blocks after ``{prefix}``: (pattern, panel, module, layer, section); the section orders rows
_TOP_PATTERNS: tuple[tuple[re.Pattern[str], str, str, str | None, int], ...] = (
    (re.compile(r"^conv1\.(weight|bias)$"), "other", "conv1", None, 0),
    (re.compile(r"^class_embedding$"), "other", "class_embedding", None, 0),
    (re.compile(r"^positional_embedding$"), "other", "positional_embedding", None, 0),
    (re.compile(r"^ln_pre\.(weight|bias)$"), "layernorm", "ln_pre", "pre", 1),
    (re.compile(r"^ln_post\.(weight|bias)$"), "layernorm", "ln_post", "post", 3),
    (re.compile(r"^proj$"), "other", "proj", None, 4),
)
_BLOCK = re.compile(r"^transformer\.resblocks\.(\d+)\.(.+)$")
_SUFFIX = re.compile(r"[._](weight|bias)$")
_SECTION_BLOCKS, _SECTION_UNKNOWN = 2, 5


# --- helpers ----------------------------------------------------------------------------------------------------------


def _finite(value: Any) -> float | None:
    value = float(value)
    return value if math.isfinite(value) else None


def _number(value: Any, what: str) -> float:
    if isinstance(value, bool):
        raise ParameterError(f"{what}: expected a number, got {value!r}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ParameterError(f"{what}: expected a number, got {value!r}") from None


def _positive(value: Any, what: str) -> float:
    number = _number(value, what)
    if not (math.isfinite(number) and number > 0):
        raise ParameterError(f"{what}: expected a finite number > 0, got {value!r}")
    return number


def _array(value: Any, what: str) -> np.ndarray:
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    try:
        return np.asarray(value)
    except (TypeError, ValueError):
        raise ParameterError(f"{what}: expected a 1-d array of numbers") from None


def _mean_sd(rows: np.ndarray) -> tuple[list, list]:
    """Per column of ``rows`` [T, S]: the mean and the sample sd (ddof=1; None for one task), non-finite as None."""
    mean = rows.mean(axis=0)
    sd = rows.std(axis=0, ddof=1) if rows.shape[0] > 1 else np.full(rows.shape[1], np.nan)
    return [_finite(v) for v in mean], [_finite(v) for v in sd]


# --- Figs. 5 and 6: layer-wise norms ----------------------------------------------------------------------------------


def classify_key(key: str, prefix: str = "visual.") -> dict[str, Any]:
    """``{"panel", "kind", "layer", "module"}`` of a state-dict key (module docstring); never raises on a name."""
    kind = "bias" if key.endswith("bias") else "weight"
    rest = key[len(prefix):] if key.startswith(prefix) else None
    if rest is not None:
        block = _BLOCK.match(rest)
        if block:
            layer, inner = int(block.group(1)), block.group(2)
            for pattern, panel, module in _BLOCK_PATTERNS:
                if pattern.match(inner):
                    return {"panel": panel, "kind": kind, "layer": layer, "module": module}
            return {"panel": "other", "kind": kind, "layer": layer, "module": _SUFFIX.sub("", inner)}
        for pattern, panel, module, layer, _ in _TOP_PATTERNS:
            if pattern.match(rest):
                return {"panel": panel, "kind": kind, "layer": layer, "module": module}
    return {"panel": "other", "kind": kind, "layer": None, "module": _SUFFIX.sub("", key if rest is None else rest)}


def _order(key: str, prefix: str) -> tuple:
    """The sort key of a row (module docstring); ties (unrecognised keys) keep their input order (a stable sort)."""
    info = classify_key(key, prefix)
    kind = KINDS.index(info["kind"])
    rest = key[len(prefix):] if key.startswith(prefix) else None
    if isinstance(info["layer"], int):
        modules = [module for _, _, module in _BLOCK_PATTERNS]
        if info["module"] not in modules:  # an unrecognised key of the block: after the known ones, input order
            return (_SECTION_BLOCKS, info["layer"], len(modules), 0)
        return (_SECTION_BLOCKS, info["layer"], modules.index(info["module"]), kind)
    if rest is not None:
        for position, (pattern, _, _, _, section) in enumerate(_TOP_PATTERNS):
            if pattern.match(rest):
                return (section, 0, position, kind)
    return (_SECTION_UNKNOWN, 0, 0, 0)


def _norm(tensor: Any, what: str) -> float | None:
    if not isinstance(tensor, torch.Tensor):
        raise ParameterError(f"{what}: expected a tensor, got {type(tensor).__name__}")
    return _finite(torch.linalg.vector_norm(tensor.detach().to(torch.float64).reshape(-1)))


def _check_state(task_vector: Any, what: str) -> Mapping[str, torch.Tensor]:
    if not isinstance(task_vector, Mapping) or len(task_vector) == 0:
        raise ParameterError(f"{what}: expected a non-empty mapping of key names to tensors")
    return task_vector


def layer_norms(task_vector: Mapping[str, torch.Tensor], *, prefix: str = "visual.") -> list[dict[str, Any]]:
    """Figs. 5 and 6: one row per key of ``task_vector`` in the encoder's forward order (module docstring)::

        {"key": str, "panel": "mlp" | "attention" | "layernorm" | "other", "kind": "weight" | "bias",
         "layer": int | "pre" | "post" | None, "module": str, "norm": float (L2, float64; None if not finite)}
    """
    _check_state(task_vector, "task_vector")
    keys = sorted(task_vector, key=lambda k: _order(k, prefix))
    return [{"key": key, **classify_key(key, prefix), "norm": _norm(task_vector[key], f"task_vector[{key!r}]")}
            for key in keys]


def _task_names(task_names: Sequence[str], k: int) -> list[str]:
    if isinstance(task_names, str):
        raise ParameterError("task_names: expected a sequence of names, got a string")
    names = [str(n) for n in task_names]
    if len(names) != k:
        raise ParameterError(f"task_names: expected {k} names (one per task vector), got {len(names)}")
    if len(set(names)) != len(names):
        raise ParameterError(f"task_names: names must be distinct, got {names!r}")
    return names


def _ratio_stats(ratios: list[float]) -> dict[str, Any]:
    values = np.asarray(ratios, dtype=np.float64)
    if values.size == 0:
        return {"ratio_mean": None, "ratio_min": None, "ratio_max": None, "ratio_median": None, "ratio_cv": None}
    mean = float(values.mean())
    return {"ratio_mean": _finite(mean), "ratio_min": _finite(values.min()), "ratio_max": _finite(values.max()),
            "ratio_median": _finite(np.median(values)),
            "ratio_cv": _finite(values.std(ddof=0) / mean) if mean != 0 else None}


def layer_norm_comparison(standard: Sequence[Mapping[str, torch.Tensor]],
                          lengthened: Sequence[Mapping[str, torch.Tensor]], task_names: Sequence[str], *,
                          prefix: str = "visual.") -> dict[str, Any]:
    """Figs. 5 and 6, standard against lengthened task vectors (a larger learning rate; same tasks, same order):
    per key the mean over tasks of its norm in each set, and ratio = lengthened mean / standard mean (None where the
    standard mean is 0). Returns::

        {"paper": str, "tasks": [K names],
         "rows": [{"key", "panel", "kind", "layer", "module", "standard", "lengthened", "ratio"}]  (forward order),
         "summary": [{"panel", "kind", "ratio_mean", "ratio_min", "ratio_max", "ratio_cv"}]  (present (panel, kind)
                     pairs, panels in the order mlp, attention, layernorm, other; weight before bias),
         "overall": {"weight" | "bias": {"ratio_median", "ratio_cv", "rows_above_one", "rows", "rows_undefined"}}}

    Spreads are over the rows with a defined ratio (``rows``; ``rows_undefined`` have none): cv = population sd /
    mean (module docstring), so ratios all equal give cv 0. ``overall`` takes every row of a kind, "other" included.
    "A larger learning rate stretches every layer almost uniformly" reads as a small ``ratio_cv`` with every row above
    one; the caller words it."""
    for what, vectors in (("standard", standard), ("lengthened", lengthened)):
        if isinstance(vectors, Mapping) or not isinstance(vectors, Sequence) or len(vectors) == 0:
            raise ParameterError(f"{what}: expected a non-empty list of task vectors (state dicts)")
    if len(lengthened) != len(standard):
        raise ParameterError(f"lengthened: expected {len(standard)} task vectors (one per standard one), "
                             f"got {len(lengthened)}")
    names = _task_names(task_names, len(standard))
    keys = [row["key"] for row in layer_norms(_check_state(standard[0], "standard[0]"), prefix=prefix)]
    norms: dict[str, np.ndarray] = {}
    for what, vectors in (("standard", standard), ("lengthened", lengthened)):
        table = np.empty((len(vectors), len(keys)))
        for t, vector in enumerate(vectors):
            vector = _check_state(vector, f"{what}[{t}]")
            if set(vector) != set(keys):
                odd = sorted(set(vector) ^ set(keys))[0]
                side = "lacks" if odd in keys else "has the extra key"
                raise ParameterError(f"{what}[{t}] ({names[t]}): {side} {odd!r} (keys must match standard[0]'s)")
            for j, key in enumerate(keys):
                if what == "lengthened" and tuple(vector[key].shape) != tuple(standard[t][key].shape):
                    raise ParameterError(f"lengthened[{t}][{key!r}]: shape {tuple(vector[key].shape)}, the standard "
                                         f"one's is {tuple(standard[t][key].shape)}")
                norm = _norm(vector[key], f"{what}[{t}][{key!r}]")
                table[t, j] = math.nan if norm is None else norm
        norms[what] = table.mean(axis=0)
    rows = []
    for j, key in enumerate(keys):
        s, length = float(norms["standard"][j]), float(norms["lengthened"][j])
        ratio = _finite(length / s) if s != 0 and math.isfinite(s) else None
        rows.append({"key": key, **classify_key(key, prefix), "standard": _finite(s), "lengthened": _finite(length),
                     "ratio": ratio})
    summary = []
    for panel in PANELS:
        for kind in KINDS:
            group = [r for r in rows if r["panel"] == panel and r["kind"] == kind]
            if group:
                stats = _ratio_stats([r["ratio"] for r in group if r["ratio"] is not None])
                summary.append({"panel": panel, "kind": kind, **{name: stats[name] for name in
                                                                 ("ratio_mean", "ratio_min", "ratio_max", "ratio_cv")}})
    overall = {}
    for kind in KINDS:
        group = [r for r in rows if r["kind"] == kind]
        ratios = [r["ratio"] for r in group if r["ratio"] is not None]
        stats = _ratio_stats(ratios)
        overall[kind] = {"ratio_median": stats["ratio_median"], "ratio_cv": stats["ratio_cv"],
                         "rows_above_one": sum(r > 1 for r in ratios), "rows": len(ratios),
                         "rows_undefined": len(group) - len(ratios)}
    return {"paper": PAPER, "tasks": names, "rows": rows, "summary": summary, "overall": overall}


# --- reliability diagrams ---------------------------------------------------------------------------------------------


def _check_bins(bins: Any) -> int:
    if isinstance(bins, bool) or not isinstance(bins, (int, np.integer)) or bins < 1:
        raise ParameterError(f"bins: expected an integer >= 1, got {bins!r}")
    return int(bins)


def _check_outcomes(confidence: Any, correct: Any, conf_what: str = "confidence",
                    correct_what: str = "correct") -> tuple[np.ndarray, np.ndarray]:
    """Validated float64 confidences in [0, 1] and 0/1 outcomes, both 1-d of one length >= 1."""
    conf = _array(confidence, conf_what)
    right = _array(correct, correct_what)
    if conf.ndim != 1 or conf.size == 0:
        raise ParameterError(f"{conf_what}: expected a non-empty 1-d array, got shape {conf.shape}")
    if right.ndim != 1 or right.size != conf.size:
        raise ParameterError(f"{correct_what}: expected a 1-d array of {conf.size} outcomes (one per confidence), "
                             f"got shape {right.shape}")
    if conf.dtype == bool or not np.issubdtype(conf.dtype, np.number):
        raise ParameterError(f"{conf_what}: expected numbers, got dtype {conf.dtype}")
    conf = conf.astype(np.float64)
    if not np.all(np.isfinite(conf)) or conf.min() < 0 or conf.max() > 1:
        bad = conf[~(np.isfinite(conf) & (conf >= 0) & (conf <= 1))][0]
        raise ParameterError(f"{conf_what}: expected finite values in [0, 1], got {float(bad)!r}")
    if right.dtype != bool:
        if not np.issubdtype(right.dtype, np.number) or not np.all((right == 0) | (right == 1)):
            raise ParameterError(f"{correct_what}: expected booleans or 0/1 values")
    return conf, right.astype(np.float64)


def reliability(confidence: Any, correct: Any, bins: int = 10) -> dict[str, Any]:
    """A reliability diagram of N predictions (Guo et al. 2017 binning, module docstring). ``confidence``: [N] in
    [0, 1] (e.g. the maximum softmax probability, ``reliability_from_probabilities``); ``correct``: [N] booleans or
    0/1. Returns::

        {"bins": [{"lower", "upper", "count", "confidence": mean or None (empty), "accuracy": mean or None}],
         "ece": sum_i count_i/N |accuracy_i - confidence_i|, "gap": mean confidence - accuracy (positive: over-
         confident), "confidence": mean confidence, "accuracy": accuracy, "count": N}
    """
    bins = _check_bins(bins)
    conf, right = _check_outcomes(confidence, correct)
    edges = np.linspace(0.0, 1.0, bins + 1)
    index = np.clip(np.searchsorted(edges, conf, side="left") - 1, 0, bins - 1)  # (edges[i], edges[i+1]], 0 in bin 0
    n = conf.size
    out_bins, ece = [], 0.0
    for i in range(bins):
        members = index == i
        count = int(members.sum())
        mean_conf = float(conf[members].mean()) if count else None
        mean_acc = float(right[members].mean()) if count else None
        if count:
            ece += count / n * abs(mean_acc - mean_conf)
        out_bins.append({"lower": float(edges[i]), "upper": float(edges[i + 1]), "count": count,
                         "confidence": mean_conf, "accuracy": mean_acc})
    return {"bins": out_bins, "ece": float(ece), "gap": float(conf.mean() - right.mean()),
            "confidence": float(conf.mean()), "accuracy": float(right.mean()), "count": int(n)}


def average_reliability(per_task: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The average reliability diagram across tasks of ``reliability`` outputs (same bins): per bin the mean over
    the tasks whose bin is not empty of the bin's accuracy and confidence (None where every task's is empty),
    ``tasks`` how many tasks that is and ``count`` their examples; ``ece`` and ``gap`` the means over tasks::

        {"bins": [{"lower", "upper", "tasks", "count", "confidence", "accuracy"}], "ece": float, "gap": float,
         "tasks": T}
    """
    if isinstance(per_task, Mapping) or not isinstance(per_task, Sequence) or len(per_task) == 0:
        raise ParameterError("per_task: expected a non-empty list of reliability diagrams")
    edges = None
    for t, diagram in enumerate(per_task):
        if not isinstance(diagram, Mapping) or not all(k in diagram for k in ("bins", "ece", "gap")):
            raise ParameterError(f"per_task[{t}]: expected a reliability() result with 'bins', 'ece' and 'gap'")
        try:
            own = [(float(b["lower"]), float(b["upper"])) for b in diagram["bins"]]
        except (KeyError, TypeError, ValueError):
            raise ParameterError(f"per_task[{t}]: each bin needs numeric 'lower' and 'upper'") from None
        if edges is None:
            edges = own
        elif own != edges:
            raise ParameterError(f"per_task[{t}]: its {len(own)} bins differ from per_task[0]'s {len(edges)}")
    out_bins = []
    for i, (lower, upper) in enumerate(edges):
        used = [d["bins"][i] for d in per_task if d["bins"][i].get("count", 0) and
                d["bins"][i].get("accuracy") is not None and d["bins"][i].get("confidence") is not None]
        out_bins.append({
            "lower": lower, "upper": upper, "tasks": len(used), "count": int(sum(b["count"] for b in used)),
            "confidence": _finite(np.mean([b["confidence"] for b in used])) if used else None,
            "accuracy": _finite(np.mean([b["accuracy"] for b in used])) if used else None,
        })
    ece = [_number(d["ece"], f"per_task[{t}]['ece']") for t, d in enumerate(per_task)]
    gap = [_number(d["gap"], f"per_task[{t}]['gap']") for t, d in enumerate(per_task)]
    return {"bins": out_bins, "ece": _finite(np.mean(ece)), "gap": _finite(np.mean(gap)), "tasks": len(per_task)}


def _scipy_interval(differences: Sequence[np.ndarray], weights: Sequence[float], samples: int,
                    seed: int) -> tuple[float, float]:
    """``mergecal.intervals.stratified_interval``'s interval for another number of resamples or seed: the same
    stratified percentile bootstrap, by ``scipy.stats.bootstrap`` (whose draws ``mergecal.intervals`` reproduces)."""
    from scipy.stats import bootstrap

    def statistic(*resampled: np.ndarray, axis: int = -1) -> np.ndarray:
        return sum(w * np.mean(s, axis=axis) for s, w in zip(resampled, weights))

    result = bootstrap(tuple(differences), statistic, n_resamples=samples, confidence_level=LEVEL, method=METHOD,
                       paired=False, vectorized=True, rng=np.random.default_rng(seed))
    return float(result.confidence_interval.low), float(result.confidence_interval.high)


def confidence_gap_interval(confidence_per_task: Sequence[Any], correct_per_task: Sequence[Any], *,
                            samples: int = N_RESAMPLES, seed: int = SEED) -> dict[str, Any]:
    """The mean over tasks of (mean confidence - accuracy) with its 95 % percentile bootstrap interval, examples
    resampled within each task (stratified): the statistic is a mean of per-task means of the per-example
    differences confidence - correct, which is ``mergecal.intervals.stratified_interval`` with weights 1/T (used as
    is at its defaults ``samples=N_RESAMPLES``, ``seed=SEED``; other values run the same bootstrap through
    ``scipy.stats.bootstrap``). The same inputs and seed give the same numbers; differences without spread give the
    point as both ends. Returns ``{"gap", "low", "high", "tasks", "samples", "seed", "level"}``; "over-confident" is
    sayable when ``low > 0``."""
    if isinstance(samples, bool) or not isinstance(samples, (int, np.integer)) or samples < 1:
        raise ParameterError(f"samples: expected an integer >= 1, got {samples!r}")
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ParameterError(f"seed: expected an integer >= 0, got {seed!r}")
    for what, value in (("confidence_per_task", confidence_per_task), ("correct_per_task", correct_per_task)):
        if isinstance(value, (Mapping, str, np.ndarray, torch.Tensor)) or not isinstance(value, Sequence) \
                or len(value) == 0:
            raise ParameterError(f"{what}: expected a non-empty list with one 1-d array per task")
    if len(correct_per_task) != len(confidence_per_task):
        raise ParameterError(f"correct_per_task: expected {len(confidence_per_task)} arrays (one per task), "
                             f"got {len(correct_per_task)}")
    differences = []
    for t, (conf, right) in enumerate(zip(confidence_per_task, correct_per_task)):
        conf, right = _check_outcomes(conf, right, f"confidence_per_task[{t}]", f"correct_per_task[{t}]")
        differences.append(conf - right)
    weights = [1.0 / len(differences)] * len(differences)
    gap = weighted_means(differences, weights)
    if (int(samples), int(seed)) == (N_RESAMPLES, SEED) or all(np.all(d == d[0]) for d in differences):
        low, high = stratified_interval(differences, weights)
    else:
        low, high = _scipy_interval(differences, weights, int(samples), int(seed))
    return {"gap": _finite(gap), "low": _finite(low), "high": _finite(high), "tasks": len(differences),
            "samples": int(samples), "seed": int(seed), "level": LEVEL}


def reliability_from_probabilities(probabilities: Any, labels: Any) -> tuple[np.ndarray, np.ndarray]:
    """(confidence, correct) of a classifier's outputs: the maximum probability of each row of ``probabilities``
    [N, C] (softmax outputs: rows in [0, 1] summing to 1 within 1e-3, so logits are refused) and whether its argmax
    (the first on a tie) equals ``labels`` [N] (integers in [0, C)). float64 and bool numpy arrays of length N."""
    probs = torch.as_tensor(probabilities.detach() if isinstance(probabilities, torch.Tensor) else
                            np.asarray(probabilities)).cpu()
    if probs.dim() != 2 or probs.shape[0] == 0 or probs.shape[1] == 0:
        raise ParameterError(f"probabilities: expected a non-empty [N, C] array, got shape {tuple(probs.shape)}")
    if not probs.is_floating_point():
        raise ParameterError(f"probabilities: expected floating-point values, got dtype {probs.dtype}")
    probs = probs.to(torch.float64)
    if not bool(torch.isfinite(probs).all()) or probs.min() < 0 or probs.max() > 1:
        raise ParameterError("probabilities: expected finite values in [0, 1] (softmax outputs, not logits)")
    if not bool(torch.allclose(probs.sum(dim=1), torch.ones(probs.shape[0], dtype=torch.float64), atol=1e-3, rtol=0)):
        raise ParameterError("probabilities: rows must sum to 1 (softmax outputs, not logits)")
    target = torch.as_tensor(labels.detach() if isinstance(labels, torch.Tensor) else np.asarray(labels)).cpu()
    if target.dim() != 1 or target.shape[0] != probs.shape[0]:
        raise ParameterError(f"labels: expected a 1-d array of {probs.shape[0]} labels, got shape "
                             f"{tuple(target.shape)}")
    if target.is_floating_point() or target.dtype == torch.bool or target.is_complex():
        raise ParameterError(f"labels: expected integer class indices, got dtype {target.dtype}")
    if target.min() < 0 or target.max() >= probs.shape[1]:
        raise ParameterError(f"labels: expected class indices in [0, {probs.shape[1]}), got range "
                             f"[{int(target.min())}, {int(target.max())}]")
    confidence = probs.max(dim=1).values
    predicted = probs.argmax(dim=1)  # the first maximal index on a tie
    return confidence.numpy(), (predicted == target.to(torch.int64)).numpy()


# --- Fig. 2: DisTaC over its steps ------------------------------------------------------------------------------------


_RECORD_FIELDS = ("step", "accuracy", "entropy", "tau_norm")


def _history(task: str, records: Any) -> tuple[list[int], np.ndarray]:
    """The steps (ascending) and a [S, 3] float64 table of accuracy, entropy and tau_norm of one task."""
    what = f"histories[{task!r}]"
    if isinstance(records, (Mapping, str)) or not isinstance(records, Sequence) or len(records) == 0:
        raise ParameterError(f"{what}: expected a non-empty list of records {{step, accuracy, entropy, tau_norm}}")
    parsed = []
    for i, record in enumerate(records):
        if not isinstance(record, Mapping):
            raise ParameterError(f"{what}[{i}]: expected a record (dict), got {type(record).__name__}")
        missing = [f for f in _RECORD_FIELDS if f not in record]
        if missing:
            raise ParameterError(f"{what}[{i}]: missing {missing[0]!r}")
        step = record["step"]
        if isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise ParameterError(f"{what}[{i}]['step']: expected an integer >= 0, got {step!r}")
        parsed.append((int(step), [_number(record[f], f"{what}[{i}][{f!r}]") for f in _RECORD_FIELDS[1:]]))
    parsed.sort(key=lambda item: item[0])
    steps = [step for step, _ in parsed]
    if len(set(steps)) != len(steps):
        raise ParameterError(f"{what}: step {next(s for s in steps if steps.count(s) > 1)} is recorded twice")
    return steps, np.asarray([values for _, values in parsed], dtype=np.float64)


def trajectory_summary(histories: Mapping[str, Sequence[Mapping[str, Any]]], teacher_accuracy: Mapping[str, float],
                       initial_norm: Mapping[str, float]) -> dict[str, Any]:
    """Fig. 2: DisTaC over its steps, mean over tasks with a band of one sd. ``histories``: per task, records
    ``{"step", "accuracy", "entropy", "tau_norm"}`` (any order; sorted by step; step 0 the DisTaC initialisation),
    the same steps for every task; ``teacher_accuracy``: per task the teacher's accuracy in the records' units;
    ``initial_norm``: per task the norm of the task vector DisTaC starts from. Per task and step::

        relative_accuracy   = 100 * accuracy / teacher_accuracy            (percent of the teacher)
        norm_change_percent = 100 * (tau_norm / initial_norm - 1)          (change from the initialisation)
        entropy             = the record's prediction entropy

    Returns ``{"steps": [S], "relative_accuracy" | "norm_change_percent" | "entropy": {"mean": [S], "sd": [S]},
    "tasks": [T names, in ``histories``' order], "per_task": {task: {the three: [S]}}}``; sd is the sample sd over
    tasks (ddof=1), None for one task; non-finite values as None."""
    if not isinstance(histories, Mapping) or len(histories) == 0:
        raise ParameterError("histories: expected a non-empty mapping of task names to lists of records")
    for what, values in (("teacher_accuracy", teacher_accuracy), ("initial_norm", initial_norm)):
        if not isinstance(values, Mapping):
            raise ParameterError(f"{what}: expected a mapping of task names to numbers")
        missing = [t for t in histories if t not in values]
        if missing:
            raise ParameterError(f"{what}: no value for task {missing[0]!r}")
    tasks = [str(t) for t in histories]
    steps = None
    series: dict[str, list[np.ndarray]] = {"relative_accuracy": [], "norm_change_percent": [], "entropy": []}
    per_task = {}
    for task, name in zip(histories, tasks):
        own_steps, table = _history(name, histories[task])
        if steps is None:
            steps, first = own_steps, name
        elif own_steps != steps:
            raise ParameterError(f"histories[{name!r}]: steps {own_steps} differ from task {first!r}'s {steps}")
        teacher = _positive(teacher_accuracy[task], f"teacher_accuracy[{name!r}]")
        start = _positive(initial_norm[task], f"initial_norm[{name!r}]")
        values = {"relative_accuracy": 100.0 * table[:, 0] / teacher,
                  "norm_change_percent": 100.0 * (table[:, 2] / start - 1.0),
                  "entropy": table[:, 1]}
        for field, column in values.items():
            series[field].append(column)
        per_task[name] = {field: [_finite(v) for v in column] for field, column in values.items()}
    out: dict[str, Any] = {"paper": PAPER, "steps": steps}
    for field, columns in series.items():
        mean, sd = _mean_sd(np.vstack(columns))
        out[field] = {"mean": mean, "sd": sd}
    out["tasks"] = tasks
    out["per_task"] = per_task
    return out


# --- Fig. 3: accuracy along theta_pre + kappa tau ---------------------------------------------------------------------


_KAPPA_TOLERANCE = 1e-9


def _at(curve: Mapping[float, float], kappa: float, what: str, why: str) -> float:
    for k, value in curve.items():
        if abs(k - kappa) <= _KAPPA_TOLERANCE:
            return value
    raise ParameterError(f"{what}: no accuracy at kappa={kappa:g} ({why})")


def kappa_sweep_summary(accuracy: Mapping[str, Mapping[float, float]], *,
                        shrink_stretch: float = 0.5) -> dict[str, Any]:
    """Fig. 3: single-task accuracy of theta_pre + kappa tau over a sweep of kappa (the paper's 0 to 3), per task.
    ``accuracy``: per task, accuracy per kappa; kappa 0 (the zero-shot model), 1 (the fine-tuned one) and 1 -/+
    ``shrink_stretch`` are required (matched within 1e-9). Returns::

        {"per_task": {task: {"kappas": [ascending], "accuracy": [...], "zero_shot": acc at 0, "finetuned": acc at 1,
                             "at_max": acc at the largest kappa, "below_zero_shot_at_max": at_max < zero_shot,
                             "shrunk": acc at 1 - s, "stretched": acc at 1 + s, "shrink_better": shrunk >= stretched}},
         "counts": {"tasks": n, "below_zero_shot_at_max": n, "shrink_better": n}, "shrink_stretch": s}
    """
    s = _positive(shrink_stretch, "shrink_stretch")
    if not isinstance(accuracy, Mapping) or len(accuracy) == 0:
        raise ParameterError("accuracy: expected a non-empty mapping of task names to {kappa: accuracy}")
    per_task = {}
    for task, sweep in accuracy.items():
        what = f"accuracy[{str(task)!r}]"
        if not isinstance(sweep, Mapping) or len(sweep) == 0:
            raise ParameterError(f"{what}: expected a non-empty mapping of kappa to accuracy")
        curve: dict[float, float] = {}
        for k, value in sweep.items():
            kappa = _number(k, f"{what}: kappa")
            if not math.isfinite(kappa):
                raise ParameterError(f"{what}: kappa must be finite, got {k!r}")
            if any(abs(kappa - other) <= _KAPPA_TOLERANCE for other in curve):
                raise ParameterError(f"{what}: kappa={kappa:g} given twice")
            acc = _number(value, f"{what}[{k!r}]")
            if not math.isfinite(acc):
                raise ParameterError(f"{what}[{k!r}]: expected a finite accuracy, got {value!r}")
            curve[kappa] = acc
        kappas = sorted(curve)
        zero_shot = _at(curve, 0.0, what, "the zero-shot model is required")
        finetuned = _at(curve, 1.0, what, "the fine-tuned model is required")
        shrunk = _at(curve, 1.0 - s, what, f"shrink_stretch={s:g} needs it")
        stretched = _at(curve, 1.0 + s, what, f"shrink_stretch={s:g} needs it")
        at_max = curve[kappas[-1]]
        per_task[str(task)] = {"kappas": kappas, "accuracy": [curve[k] for k in kappas], "zero_shot": zero_shot,
                               "finetuned": finetuned, "at_max": at_max, "below_zero_shot_at_max": at_max < zero_shot,
                               "shrunk": shrunk, "stretched": stretched, "shrink_better": shrunk >= stretched}
    counts = {"tasks": len(per_task),
              "below_zero_shot_at_max": sum(v["below_zero_shot_at_max"] for v in per_task.values()),
              "shrink_better": sum(v["shrink_better"] for v in per_task.values())}
    return {"paper": PAPER, "per_task": per_task, "counts": counts, "shrink_stretch": s}


__all__ = ["KINDS", "PANELS", "PAPER", "average_reliability", "classify_key", "confidence_gap_interval",
           "kappa_sweep_summary", "layer_norm_comparison", "layer_norms", "reliability",
           "reliability_from_probabilities", "trajectory_summary"]
