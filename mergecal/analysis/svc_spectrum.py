"""The data of the SVC paper's analysis figures: Figs. 2 and 4 (the merged singular values beside their projection-
optimal values) and Fig. 3 (cross terms between tasks), after Li et al., "When Shared Knowledge Hurts: Spectral
Over-Accumulation in Model Merging", arXiv:2602.05536 (Sections 3.2-3.3 and 4; the authors' conventions for SVC
itself: docs/references.md). No plotting here: the functions return numbers, the driver JSON-able dicts.

Per 2-D key, with dW_i the K task matrices and dW_m their merged update (equation numbers of the paper):

    dW_m = U diag(sigma) V^T                                                  (2), (17)
    a_i^r = u_r^T dW_i,   a_m^r = u_r^T dW_m = sigma_r v_r^T                  (4), (6), (10), (18)
    s_i^r = <a_m^r, a_i^r> / ||a_i^r||^2                                      (8), (19)
    (gamma_i^r)* = 1 / s_i^r  if s_i^r > 0,  else 0 (the boundary optimum)    (12), Theorem 3.3
    (sigma_i^r)* = (gamma_i^r)* sigma_r                                       (13)
    sigma*_r = mean of (sigma_i^r)* over the tasks that respond in subspace r  (Figs. 2 and 4: "the subspace-wise
               average of the task-wise optimal scalings")
    gamma_r = K / sum_i max(alpha, s_i^r),  gamma_r sigma_r                   (20), (21): SVC's calibrated values
    C^r_ij = <a_i^r, a_j^r>,  r = 1..top                                      Fig. 3

The responses a_i^r are the column-space projections of the paper's Eqs. (4) and (18) (left singular vectors of the
MERGED update, applied to each task's own matrix dW_i, also for merges that are not sums: TIES, TSV-M, Iso-C...).
U, sigma, s and gamma come from the library's SVC (``mergecal.calibrations.svc.svc_coefficients``), so gamma sigma is
bit for bit what the ``svc`` calibration writes (its ``sigma_calibrated``); the responses are recomputed here in
float64 on SVC's basis U, for the cross terms and to tell which tasks respond.

"Respond": Theorem 3.3 assumes ||a_i^r|| > 0; a task with no response in subspace r has no optimal scaling there
(the projection onto a zero vector is undefined), so it is left out of subspace r's average. Counting it as 0 would
put sigma* at sigma / K for a direction that one task owns alone, a gap with no over-counting behind it. A response
counts as none when ||a_i^r|| <= 100 eps ||dW_i||_F, SVC's own round-off guard (eps of float32, or of float64 with
``float64``). Where no task responds, sigma*_r is undefined: NaN (None in the driver's JSON).

What follows from the definitions (tests/test_analysis_svc.py checks each):
  * Lemma 3.2 (9): under weight addition (dW_m = sum_i dW_i) s_i^r = sum_j C^r_ij / C^r_ii, and the C^r of a key sum
    to sigma_r^2 (a_m^r = sum_i a_i^r, Eq. 6, and Eq. 10).
  * C^r_ij = u_r^T dW_i dW_j^T u_r: if the task matrices' ROW spaces are mutually orthogonal (dW_i dW_j^T = 0), every
    cross term vanishes in every subspace, whatever the merged basis; under weight addition then s_i^r = 1 for every
    responding task and sigma* = sigma, even where the column spaces overlap. Conversely, disjoint column spaces with a
    shared row (input) direction give positive cross terms: the responses a_i^r live in the input space.
  * A direction u v^T shared by all K tasks with weight c (and nothing else along u): sigma = K c, s_i = K,
    (gamma_i)* = 1/K, sigma* = c.
  * Scaling the merge by lambda > 0 multiplies sigma and every s by lambda and leaves sigma* unchanged (1 / (lambda s)
    times lambda sigma where s > 0, 0 where s <= 0): the gap depends on lambda. The driver reads every merge at
    scaling 1, as the paper does ("we keep lambda = 1") and as SVC's ``calibrate_at="unit_scaling"`` protocol
    calibrates it; the method's ``scaling`` parameter is not applied.

Aggregation in the driver (``figure_data``), over the keys of a key class (the open_clip ViT's attention in-projection,
attention out-projection, MLP fc and MLP proj by default, ``OPEN_CLIP_CLASSES``; a class's keys share one shape, so
subspace r means the same rank in every layer):
  * Figs. 2/4, ``spectrum``: per r, the mean over the class's keys of sigma_r, sigma*_r, gamma_r sigma_r and the gap
    sigma_r - sigma*_r (in the update's units: the mean gap is the gap of the means), and of the scale-free ratios
    gamma*_r = sigma*_r / sigma_r and gamma_r. NaNs (no responding task) are left out of a mean. The paper plots one
    spectrum per merge method without naming the layer; ``per_key`` gives the exact spectrum of chosen keys (one
    layer, as a figure of one matrix shows), the class means the same shape of curve without picking a layer.
  * Fig. 3, ``cross_terms``: per r <= top, C^r of each key divided by sigma_r^2 (``cross_normalize="sigma_sq"``), then
    the mean over the class's keys. Layers' updates differ in size from layer to layer, so a raw mean would mostly be
    that of the largest; sigma_r^2 = ||a_m^r||^2 (10) is the subspace's own scale, and under weight addition the
    normalised C^r sums to exactly 1: each entry is the share of sigma_r^2 that a pair of tasks contributes, the
    diagonal the tasks' own energy, the off-diagonal the cross terms (positive: over-counting). For other merges
    (a_m^r not the sum of the a_i^r) the entries stay scale-free but need not sum to 1. ``"cosine"`` (C_ij /
    sqrt(C_ii C_jj), the alignment alone) and ``"none"`` (raw inner products) are the alternatives. ``per_key``
    entries carry the raw C^r.

Cost: one SVC decomposition per key (``svc_coefficients``, the full spectrum, which Figs. 2/4 plot) and one float64
product of the K task matrices with U; the cross terms reuse its first ``top`` ranks. The merge is the library's own
(``mergecal.merge.iter_merge`` over the analysed keys only), with the method's global statistics (TIES's top-k
threshold over the whole model) fitted on every key, as a merge of the whole model fits them.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from ..calibrations.svc import AUTHORS_ALPHA, svc_coefficients
from ..errors import ParameterError
from ..linalg import stack64, top_svd
from ..merge import iter_merge
from ..methods import get_merge_method
from ..methods.base import MergeMethod
from ..task_vectors import SourceLike, TaskVectorSet

PAPER = "Li et al., When Shared Knowledge Hurts: Spectral Over-Accumulation in Model Merging, arXiv:2602.05536"

#: key classes of an open_clip ViT (either tower), by a regular expression searched in the key's name
OPEN_CLIP_CLASSES: dict[str, str] = {
    "attn_in_proj": r"\.attn\.in_proj_weight$",
    "attn_out_proj": r"\.attn\.out_proj\.weight$",
    "mlp_fc": r"\.mlp\.c_fc\.weight$",
    "mlp_proj": r"\.mlp\.c_proj\.weight$",
}

CROSS_NORMALIZATIONS = ("sigma_sq", "cosine", "none")

_LAYER = re.compile(r"\.resblocks\.(\d+)\.")


def _check_inputs(merged_delta: torch.Tensor, taus: Sequence[torch.Tensor]) -> None:
    if merged_delta.dim() != 2:
        raise ParameterError(f"merged_delta: expected a 2-D matrix, got shape {tuple(merged_delta.shape)}")
    if len(taus) == 0:
        raise ParameterError("taus: at least one task matrix is required")
    for i, tau in enumerate(taus):
        if tuple(tau.shape) != tuple(merged_delta.shape):
            raise ParameterError(f"taus[{i}]: shape {tuple(tau.shape)}, the merged update's is "
                                 f"{tuple(merged_delta.shape)}")


def _check_top(top: int, minimum: int) -> None:
    if isinstance(top, bool) or not isinstance(top, int) or top < minimum:
        raise ParameterError(f"top: expected an integer >= {minimum}, got {top!r}")


def _responses(basis: torch.Tensor, taus: Sequence[torch.Tensor]) -> torch.Tensor:
    """a_i^r = u_r^T dW_i (Eqs. 4, 18) for the columns u_r of ``basis`` [m, R]: [K, R, n], float64."""
    stacked = stack64(list(taus))
    return torch.einsum("pr,kpc->krc", basis.to(device=stacked.device, dtype=torch.float64), stacked)


def _inner_products(a: torch.Tensor) -> torch.Tensor:
    """C^r_ij = <a_i^r, a_j^r> of responses [K, R, n]: [R, K, K]."""
    return torch.einsum("krc,jrc->rkj", a, a)


def cross_terms(merged_delta: torch.Tensor, taus: Sequence[torch.Tensor], top: int, *,
                basis: torch.Tensor | None = None) -> torch.Tensor:
    """The cross terms C^r_ij = <a_i^r, a_j^r> of the paper's Fig. 3 (Lemma 3.2) for the top ``top`` subspaces of
    ``merged_delta``: a float64 tensor [top, K, K] (``top`` capped at min(m, n)), a_i^r = u_r^T dW_i (Eq. 4). The
    diagonal is ||a_i^r||^2. ``basis``: the merged update's left singular vectors [m, >= top] when already computed
    (the driver passes SVC's); else only the top ``top`` are computed (``mergecal.linalg.top_svd``). C^r does not
    depend on the sign of u_r."""
    _check_inputs(merged_delta, taus)
    _check_top(top, 1)
    top = min(top, min(merged_delta.shape))
    if basis is None:
        basis = top_svd(merged_delta, top)[0]
    elif basis.dim() != 2 or basis.shape[0] != merged_delta.shape[0] or basis.shape[1] < top:
        raise ParameterError(f"basis: expected [{merged_delta.shape[0]}, >= {top}], got {tuple(basis.shape)}")
    return _inner_products(_responses(basis[:, :top], taus))


def normalize_cross_terms(cross: torch.Tensor, sigma: torch.Tensor, how: str = "sigma_sq") -> torch.Tensor:
    """Cross terms [top, K, K] made comparable across keys (module docstring): ``"sigma_sq"`` C^r / sigma_r^2,
    ``"cosine"`` C^r_ij / sqrt(C^r_ii C^r_jj), ``"none"`` unchanged. A zero denominator gives NaN."""
    if how not in CROSS_NORMALIZATIONS:
        raise ParameterError(f"cross_normalize={how!r}: expected one of {', '.join(CROSS_NORMALIZATIONS)}")
    cross = cross.to(torch.float64)
    if how == "none":
        return cross.clone()
    if how == "sigma_sq":
        scale = sigma[:cross.shape[0]].to(device=cross.device, dtype=torch.float64).square()[:, None, None]
    else:
        norms = torch.diagonal(cross, dim1=-2, dim2=-1).clamp(min=0).sqrt()  # [top, K]
        scale = norms[:, :, None] * norms[:, None, :]
    return torch.where(scale > 0, cross / scale, torch.full_like(cross, math.nan))


def _analyse(merged_delta: torch.Tensor, taus: Sequence[torch.Tensor], alpha: float | None, top: int, *,
             solver: str, float64: bool, roundoff_guard: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """Figs. 2/4's quantities of one key as tensors, and its raw cross terms [min(top, R), K, K]."""
    _check_inputs(merged_delta, taus)
    K = len(taus)
    alpha = 1.0 / K if alpha is None else float(alpha)
    if not alpha > 0:
        raise ParameterError(f"alpha: expected a positive number, got {alpha!r}")
    c = svc_coefficients(merged_delta, list(taus), alpha, solver=solver, float64=float64,
                         roundoff_guard=roundoff_guard)
    a = _responses(c["U"], taus)  # on SVC's own basis U
    response = (a * a).sum(-1).sqrt()  # [K, R]
    eps = torch.finfo(torch.float64 if float64 else torch.float32).eps
    floor = torch.stack([100 * eps * tau.to(torch.float64).norm() for tau in taus]).to(response.device)
    responding = response > floor[:, None]  # [K, R]
    s = c["s"].to(device=response.device, dtype=torch.float64)
    gamma_i = torch.where(s > 0, 1.0 / s, torch.zeros_like(s))  # Eq. (12) and its boundary case
    n_responding = responding.sum(0)
    gamma_star = torch.where(responding, gamma_i, torch.zeros_like(gamma_i)).sum(0) / n_responding  # 0/0: NaN
    sigma = c["sigma"]
    sigma64 = sigma.to(device=response.device, dtype=torch.float64)
    sigma_star = gamma_star * sigma64  # Eq. (13), averaged over the responding tasks
    gap = {
        "sigma": sigma,
        "sigma_star": sigma_star,
        "gamma_sigma": c["gamma"] * c["sigma"],  # as mergecal.calibrations.svc.Svc.calibrate forms it (Eq. 21)
        "gap": sigma64 - sigma_star,
        "gamma": c["gamma"],
        "gamma_star": gamma_star,
        "s": c["s"],
        "responding": n_responding,
    }
    return gap, _inner_products(a[:, :top])


def _nan_to_none(value: Any) -> Any:
    if isinstance(value, list):
        return [_nan_to_none(v) for v in value]
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _json(tensor: torch.Tensor) -> list:
    """A tensor as nested lists of Python numbers, NaN as None (strict JSON)."""
    return _nan_to_none(tensor.detach().cpu().tolist())


def singular_value_gap(merged_delta: torch.Tensor, taus: Sequence[torch.Tensor], alpha: float | None = None, *,
                       solver: str = "gram", float64: bool = False, roundoff_guard: bool = True) -> dict[str, Any]:
    """Figs. 2/4 of one key: the merged update's singular values beside their projection-optimal and SVC-calibrated
    values (module docstring), as lists over r = 1..R (R = min(m, n), descending sigma):

    ``sigma`` (Eq. 2), ``sigma_star`` (Eq. 13 averaged over the responding tasks; None where none responds),
    ``gamma_sigma`` (Eq. 21, SVC's calibrated values), ``gap`` = sigma - sigma_star, ``gamma`` (Eq. 20),
    ``gamma_star`` = sigma_star / sigma (the mean task-wise optimal scaling, Eq. 12), ``responding`` (how many tasks
    respond in subspace r), ``s`` [K][R] (Eq. 19) and ``alpha`` (default 1/K). ``solver``, ``float64`` and
    ``roundoff_guard`` are SVC's options (``mergecal.calibrations.svc``)."""
    K = len(taus)
    gap, _ = _analyse(merged_delta, taus, alpha, 0, solver=solver, float64=float64, roundoff_guard=roundoff_guard)
    out: dict[str, Any] = {name: _json(value) for name, value in gap.items()}
    out["alpha"] = 1.0 / K if alpha is None else float(alpha)
    return out


# ------------------------------------------------------------------------------------------------------------------
# the driver over a model
# ------------------------------------------------------------------------------------------------------------------


def _method(method: str | MergeMethod, params: Mapping[str, Any] | None) -> MergeMethod:
    """A fresh instance (its ``fit`` state is the driver's own, a caller's instance is never modified)."""
    if isinstance(method, MergeMethod):
        if params:
            raise ParameterError(f"{method.name}: parameters given twice (instance and method_params)")
        return type(method)(method.params)
    return get_merge_method(method, **dict(params or {}))


def _merged_updates(tvs: TaskVectorSet, method: MergeMethod,
                    keys: Sequence[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``iter_merge`` of ``keys`` at scaling 1, with the method's global statistics fitted on every key of the model
    (what ``iter_merge`` over the whole model fits them on: TIES's global top-k threshold depends on every key)."""
    method.fit(tvs, [k for k in tvs.keys if math.prod(tvs.shape(k)) != 0])
    method.fit = lambda task_vectors, keys: None  # type: ignore[method-assign]  # fitted above, on the whole model
    return iter_merge(tvs, method, keys=list(keys), scaled=False)


def _select(tvs: TaskVectorSet, classes: Mapping[str, str], keys: Sequence[str] | None) -> dict[str, str]:
    """``{key: class}``: the 2-D float keys that a class's pattern matches (the first match), in model order; or the
    given ``keys`` (2-D float keys), each in the class it matches or a class of its own name."""
    patterns = [(name, re.compile(pattern)) for name, pattern in classes.items()]

    def class_of(key: str) -> str | None:
        return next((name for name, pattern in patterns if pattern.search(key)), None)

    if keys is None:
        selected = {k: cls for k in tvs.keys if len(tvs.shape(k)) == 2 and (cls := class_of(k)) is not None}
        if not selected:
            raise ParameterError("no 2-D key matches a key class (" + ", ".join(f"{n}: {p}" for n, p in classes.items())
                                 + "); pass key_classes= or keys=")
        return selected
    float_keys = set(tvs.keys)
    selected = {}
    for key in keys:
        if key not in float_keys or len(tvs.shape(key)) != 2:
            raise ParameterError(f"keys: {key!r} is not a 2-D floating-point key of these models")
        selected[key] = class_of(key) or key
    return selected


def _layer(key: str) -> int | None:
    match = _LAYER.search(key)
    return int(match.group(1)) if match else None


def _class_summary(entries: list[dict[str, Any]], how: str) -> dict[str, Any]:
    """Per r, the means over a class's keys (module docstring, "Aggregation")."""

    def stacked(name: str) -> torch.Tensor:
        return torch.stack([entry["gap"][name].to(torch.float64).cpu() for entry in entries])

    sigma, sigma_star = stacked("sigma"), stacked("sigma_star")
    R = sigma.shape[1]
    cross = torch.stack([normalize_cross_terms(e["cross"], e["gap"]["sigma"], how).cpu() for e in entries])
    return {
        "keys": [entry["key"] for entry in entries],
        "layers": [_layer(entry["key"]) for entry in entries],
        "shape": list(entries[0]["shape"]),
        "spectrum": {
            "r": list(range(1, R + 1)),
            "sigma": _json(sigma.mean(0)),
            "sigma_star": _json(sigma_star.nanmean(0)),
            "gamma_sigma": _json(stacked("gamma_sigma").mean(0)),
            "gap": _json((sigma - sigma_star).nanmean(0)),
            "gamma": _json(stacked("gamma").mean(0)),
            "gamma_star": _json(stacked("gamma_star").nanmean(0)),
        },
        "cross_terms": _json(cross.nanmean(0)),
    }


def figure_data(task_vectors: TaskVectorSet | Sequence[SourceLike], method: str | MergeMethod = "task_arithmetic", *,
                method_params: Mapping[str, Any] | None = None, alpha: float | None = None, top: int = 3,
                key_classes: Mapping[str, str] | None = None, keys: Sequence[str] | None = None,
                per_key: Sequence[str] | str = (), cross_normalize: str = "sigma_sq", solver: str = "gram",
                float64: bool = False, roundoff_guard: bool = True) -> dict[str, Any]:
    """The data of the SVC paper's Figs. 2/4 and 3 for a merge of ``task_vectors`` (a ``TaskVectorSet``, or task
    vectors as state dicts / checkpoint paths) by ``method`` (a name of ``mergecal.methods.MERGE_METHODS`` with
    ``method_params``, or an instance), merged by the library at scaling 1 (module docstring).

    Keys: the 2-D keys matched by ``key_classes`` (``{class: regular expression}``, default ``OPEN_CLIP_CLASSES``;
    embeddings, conv1, projections and 1-D keys match none), or exactly ``keys``. Keys whose merged update is zero
    (a tower no task moved) are listed under ``skipped``. ``alpha``: SVC's, default the authors' for the method
    (``AUTHORS_ALPHA``: 1 after TSV-M) else 1/K. ``top``: the subspaces r = 1..top of Fig. 3. ``per_key``: keys (or
    ``"all"``) whose own spectrum, s and raw cross terms are reported too.

    Returns (JSON-able; NaN as None)::

        {"paper": str, "method": str, "method_id": str, "merge_scaling": 1.0, "alpha": float, "K": int,
         "tasks": [K names], "top": int, "cross_normalize": str,
         "classes": {class: {"keys": [str], "layers": [int | None], "shape": [m, n],
                             "spectrum": {"r": [1..R], "sigma": [R], "sigma_star": [R], "gamma_sigma": [R],
                                          "gap": [R], "gamma": [R], "gamma_star": [R]},
                             "cross_terms": [min(top, R)][K][K]}},
         "keys": {key: {"class": str, "layer": int | None, "shape": [m, n], "sigma": [R], "sigma_star": [R],
                        "gamma_sigma": [R], "gap": [R], "gamma": [R], "gamma_star": [R], "responding": [R],
                        "s": [K][R], "cross_terms": [min(top, R)][K][K] (raw)}},
         "skipped": [str]}
    """
    _check_top(top, 1)
    if cross_normalize not in CROSS_NORMALIZATIONS:
        raise ParameterError(f"cross_normalize={cross_normalize!r}: expected one of {', '.join(CROSS_NORMALIZATIONS)}")
    tvs = task_vectors if isinstance(task_vectors, TaskVectorSet) else TaskVectorSet.from_task_vectors(task_vectors)
    merger = _method(method, method_params)
    K = tvs.K
    alpha = AUTHORS_ALPHA.get(merger.name, 1.0 / K) if alpha is None else float(alpha)
    selected = _select(tvs, OPEN_CLIP_CLASSES if key_classes is None else key_classes, keys)
    detailed = set(selected) if per_key == "all" else set([per_key] if isinstance(per_key, str) else per_key)
    if unknown := sorted(detailed - set(selected)):
        raise ParameterError(f"per_key: {unknown[0]!r} is not one of the analysed keys")
    by_class: dict[str, list[dict[str, Any]]] = {}
    out_keys: dict[str, Any] = {}
    skipped: list[str] = []
    for key, merged in _merged_updates(tvs, merger, list(selected)):
        if not bool(merged.any()):
            skipped.append(key)
            continue
        gap, cross = _analyse(merged, tvs.load(key), alpha, top, solver=solver, float64=float64,
                              roundoff_guard=roundoff_guard)
        entry = {"key": key, "shape": tuple(merged.shape), "gap": gap, "cross": cross}
        group = by_class.setdefault(selected[key], [])
        if group and group[0]["shape"] != entry["shape"]:
            raise ParameterError(f"key class {selected[key]!r}: {group[0]['key']!r} is {list(group[0]['shape'])} but "
                                 f"{key!r} is {list(entry['shape'])}; restrict keys= or split key_classes=")
        group.append(entry)
        if key in detailed:
            out_keys[key] = {"class": selected[key], "layer": _layer(key), "shape": list(merged.shape),
                             **{name: _json(value) for name, value in gap.items()}, "cross_terms": _json(cross)}
    return {
        "paper": PAPER,
        "method": merger.name,
        "method_id": merger.id,
        "merge_scaling": 1.0,
        "alpha": alpha,
        "K": K,
        "tasks": list(tvs.names),
        "top": top,
        "cross_normalize": cross_normalize,
        "classes": {name: _class_summary(entries, cross_normalize) for name, entries in by_class.items()},
        "keys": out_keys,
        "skipped": skipped,
    }


def figure_data_from_models(pretrained: SourceLike, finetuned: Sequence[SourceLike],
                            method: str | MergeMethod = "task_arithmetic", *, names: Sequence[str] | None = None,
                            device: str | None = None, **options: Any) -> dict[str, Any]:
    """``figure_data`` for fine-tuned models and their pretrained model (state dicts or checkpoint paths)."""
    tvs = TaskVectorSet.from_models(pretrained, finetuned, names=names, device=device)
    return figure_data(tvs, method, **options)


__all__ = ["CROSS_NORMALIZATIONS", "OPEN_CLIP_CLASSES", "cross_terms", "figure_data", "figure_data_from_models",
           "normalize_cross_terms", "singular_value_gap"]
