"""Independent float64 numpy references of eight model-merging methods, for cross-checking mergecal.

Written from the semantics of the authors' public code (not copied from it, and not from mergecal):

* TIES        -- prateeky2806/ties-merging ``src/utils/merge_utils.py`` (``topk_values_mask``,
                 ``resolve_sign``/``resolve_zero_signs``, ``disjoint_merge``); the same functions live in
                 nik-dim/tall_masks ``src/utils/utils.py`` + ``ties_utils.py`` and FusionBench
                 ``fusion_bench/method/ties_merging/ties_merging_utils.py``.
* DARE        -- FusionBench ``fusion_bench/method/dare/utils.py`` (drop, then divide by 1 - p) and MergeKit's
                 L1-preserving rescale.
* Consensus   -- nik-dim/tall_masks ``src/utils/tallmask_utils.py`` (``generate_task_masks``,
                 ``construct_consensus_mask``) and ``src/eval/aggregation.py``.
* TSV-M       -- AntoAndGar/task_singular_vectors ``src/utils/TSVM_utils.py``
                 (``compute_and_sum_svd_mem_reduction``).
* Iso-C/CTS   -- danielm1405/iso-merging ``src/utils/iso.py`` as ported to FusionBench
                 ``fusion_bench/method/isotropic_merging/iso_utils.py``.

Like the originals, TA / WA / TIES / DARE / Consensus work on one flattened vector per task (keys in sorted
order, as ``state_dict_to_vector`` does), and the SVD methods work matrix by matrix with the original's
zero-padded "place each task's block in a slot" layout. Everything is computed in float64.

Models are ``{key: array-like}``; results are ``{key: np.ndarray (float64)}`` with the merge's scaling
(lambda / alpha) already applied, i.e. the merged *task vector*.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

Model = Mapping[str, np.ndarray]


# --------------------------------------------------------------------------------------------------
# flattening (state_dict_to_vector / vector_to_state_dict)
# --------------------------------------------------------------------------------------------------
class Flattener:
    """Sorted-key flattening of a state dict into one vector, and back."""

    def __init__(self, template: Model):
        self.keys = sorted(template)
        self.shapes = {k: tuple(np.shape(template[k])) for k in self.keys}
        self.slices: dict[str, slice] = {}
        start = 0
        for k in self.keys:
            size = int(np.prod(self.shapes[k], dtype=np.int64))
            self.slices[k] = slice(start, start + size)
            start += size
        self.size = start

    def flatten(self, model: Model) -> np.ndarray:
        return np.concatenate([np.asarray(model[k], dtype=np.float64).reshape(-1) for k in self.keys])

    def stack(self, models: Sequence[Model]) -> np.ndarray:
        """[K, D] matrix, one row per task."""
        return np.stack([self.flatten(m) for m in models])

    def unflatten(self, vector: np.ndarray) -> dict[str, np.ndarray]:
        return {k: np.asarray(vector[self.slices[k]]).reshape(self.shapes[k]) for k in self.keys}


def _rows(models: Sequence[Model]) -> tuple[Flattener, np.ndarray]:
    flat = Flattener(models[0])
    return flat, flat.stack(models)


# --------------------------------------------------------------------------------------------------
# WA / TA
# --------------------------------------------------------------------------------------------------
def weight_averaging(models: Sequence[Model], scaling: float = 1.0) -> dict[str, np.ndarray]:
    flat, rows = _rows(models)
    return flat.unflatten(scaling * rows.mean(axis=0))


def task_arithmetic(models: Sequence[Model], scaling: float = 0.3) -> dict[str, np.ndarray]:
    flat, rows = _rows(models)
    return flat.unflatten(scaling * rows.sum(axis=0))


# --------------------------------------------------------------------------------------------------
# TIES
# --------------------------------------------------------------------------------------------------
def kept_per_row(d: int, top_k: float, rule: str) -> int:
    """How many entries per task vector the trim keeps (when magnitudes are distinct).

    ``"original"``: ``topk_values_mask`` takes the (d - int(d*K))-th *smallest* magnitude and keeps
    everything ``>=`` it, i.e. int(d*K) + 1 entries. ``"exact"``: int(d*K) entries (mergecal's count).
    """
    n = int(d * top_k)
    return n + 1 if rule == "original" else n


def magnitude_trim(rows: np.ndarray, top_k: float, rule: str = "exact") -> np.ndarray:
    """Zero all but the largest-magnitude entries of each row (ties at the threshold are kept)."""
    K, d = rows.shape
    mags = np.abs(rows)
    out = np.zeros_like(rows)
    for t in range(K):
        if rule == "original":
            position = d - int(d * top_k)  # 1-based rank from the bottom, as kthvalue(k) uses
            if position < 1:
                raise ValueError("the original topk_values_mask calls kthvalue(0) here (top_k = 1) and fails")
            threshold = np.partition(mags[t], position - 1)[position - 1]
        elif rule == "exact":
            keep = int(d * top_k)
            if keep == 0:
                continue
            threshold = np.partition(mags[t], d - keep)[d - keep]  # keep-th largest
        else:
            raise ValueError(rule)
        chosen = mags[t] >= threshold
        out[t, chosen] = rows[t, chosen]
    return out


def elect_sign(trimmed: np.ndarray, sign_vote: str = "mass") -> np.ndarray:
    """Per-coordinate elected sign, with zero votes replaced by the majority of the elected signs."""
    if sign_vote == "mass":
        elected = np.sign(trimmed.sum(axis=0))
    elif sign_vote == "count":
        elected = np.sign(np.sign(trimmed).sum(axis=0))
    else:
        raise ValueError(sign_vote)
    majority = np.sign(elected.sum())  # resolve_zero_signs(..., "majority")
    return np.where(elected == 0, majority, elected)


def disjoint_aggregate(trimmed: np.ndarray, signs: np.ndarray, how: str = "mean",
                       unsigned: str = "negative") -> np.ndarray:
    """Keep the entries that agree with the elected sign, then aggregate.

    A coordinate can still have sign 0 after zero-vote resolution when the majority itself is 0.
    ``unsigned="negative"``: the original's ``torch.where(sign > 0, T > 0, T < 0)`` then keeps the
    negative entries there; ``"none"``: keep nothing there (mergecal)."""
    agree = np.where(signs[None, :] > 0, trimmed > 0, trimmed < 0)
    if unsigned == "none":
        agree &= signs[None, :] != 0
    elif unsigned != "negative":
        raise ValueError(unsigned)
    picked = np.where(agree, trimmed, 0.0)
    if how == "mean":
        count = (picked != 0).sum(axis=0)
        return picked.sum(axis=0) / np.maximum(count, 1)
    if how == "sum":
        return picked.sum(axis=0)
    if how == "max":
        return np.abs(picked).max(axis=0) * signs
    raise ValueError(how)


def ties_rows(rows: np.ndarray, top_k: float = 0.2, sign_vote: str = "mass", disjoint: str = "mean",
              trim_rule: str = "exact", unsigned: str = "negative") -> np.ndarray:
    """TIES over one [K, D] block of flattened task vectors (unscaled)."""
    trimmed = magnitude_trim(rows, top_k, trim_rule)
    return disjoint_aggregate(trimmed, elect_sign(trimmed, sign_vote), disjoint, unsigned)


def ties(models: Sequence[Model], scaling: float = 1.0, top_k: float = 0.2, trim_scope: str = "global",
         sign_vote: str = "mass", disjoint: str = "mean", trim_rule: str = "exact",
         unsigned: str = "negative") -> dict[str, np.ndarray]:
    """TIES-Merging. ``trim_scope="global"``: one flattened vector per task, as the original;
    ``"per_tensor"``: the same pipeline run separately on each key's slice (MergeKit/PEFT-style trim;
    the zero-vote majority is then also per tensor). ``trim_rule`` -- see ``kept_per_row``;
    ``unsigned`` -- see ``disjoint_aggregate``."""
    flat, rows = _rows(models)
    if trim_scope == "global":
        merged = ties_rows(rows, top_k, sign_vote, disjoint, trim_rule, unsigned)
    elif trim_scope == "per_tensor":
        merged = np.zeros(flat.size)
        for k in flat.keys:
            s = flat.slices[k]
            merged[s] = ties_rows(rows[:, s], top_k, sign_vote, disjoint, trim_rule, unsigned)
    else:
        raise ValueError(trim_scope)
    return flat.unflatten(scaling * merged)


# --------------------------------------------------------------------------------------------------
# DARE
# --------------------------------------------------------------------------------------------------
def dare_rescale(tau: np.ndarray, keep: np.ndarray, drop_rate: float, rescale: str = "inverse_keep") -> np.ndarray:
    """Given which entries survive, the DARE-sparsified tensor."""
    tau = np.asarray(tau, dtype=np.float64)
    kept = np.where(keep, tau, 0.0)
    if rescale == "inverse_keep":
        return kept / (1.0 - drop_rate)
    if rescale == "l1":
        total, left = np.abs(tau).sum(), np.abs(kept).sum()
        return kept * (total / left) if left > 0 else kept
    raise ValueError(rescale)


def dare_drop(tau: np.ndarray, drop_rate: float, rng: np.random.Generator, rescale: str = "inverse_keep") -> np.ndarray:
    """One DARE draw with a numpy generator (entries survive with probability 1 - p)."""
    keep = rng.random(np.shape(tau)) >= drop_rate
    return dare_rescale(tau, keep, drop_rate, rescale)


def dare(dropped_models: Sequence[Model], scaling: float = 0.3, base: str = "task_arithmetic",
         **ties_params) -> dict[str, np.ndarray]:
    """DARE's second half: merge already-sparsified task vectors with TA or TIES."""
    if base == "task_arithmetic":
        return task_arithmetic(dropped_models, scaling)
    return ties(dropped_models, scaling=scaling, **ties_params)


# --------------------------------------------------------------------------------------------------
# TALL masks / Consensus
# --------------------------------------------------------------------------------------------------
def tall_masks_rows(rows: np.ndarray, mask_lambda: float | Sequence[float]) -> np.ndarray:
    """m_t = |theta_0 - theta_t| > lambda_t |theta_MTL - theta_t|, theta_MTL = theta_0 + sum_s tau_s.

    With theta_t = theta_0 + tau_t this is |tau_t| > lambda_t |sum_s tau_s - tau_t| (strict)."""
    K = rows.shape[0]
    lambdas = np.full(K, float(mask_lambda)) if np.isscalar(mask_lambda) else np.asarray(mask_lambda, float)
    if lambdas.shape != (K,):
        raise ValueError("one lambda per task")
    multi = rows.sum(axis=0)
    return np.abs(rows) > lambdas[:, None] * np.abs(multi[None, :] - rows)


def consensus(models: Sequence[Model], scaling: float = 0.3, mask_lambda: float | Sequence[float] = 0.4,
              min_agreement: int = 2) -> dict[str, np.ndarray]:
    flat, rows = _rows(models)
    votes = tall_masks_rows(rows, mask_lambda).sum(axis=0)
    merged = rows.sum(axis=0) * (votes >= min_agreement)
    return flat.unflatten(scaling * merged)


def consensus_margin(models: Sequence[Model], mask_lambda: float | Sequence[float]) -> dict[str, np.ndarray]:
    """Relative distance of each coordinate from flipping one of its TALL masks:
    min_t |a_t - b_t| / (a_t + b_t) with a_t = |tau_t|, b_t = lambda_t |tau_MTL - tau_t| (1 where both are 0)."""
    flat, rows = _rows(models)
    K = rows.shape[0]
    lambdas = np.full(K, float(mask_lambda)) if np.isscalar(mask_lambda) else np.asarray(mask_lambda, float)
    a = np.abs(rows)
    b = lambdas[:, None] * np.abs(rows.sum(axis=0)[None, :] - rows)
    denom = a + b
    rel = np.where(denom > 0, np.abs(a - b) / np.where(denom > 0, denom, 1.0), 1.0)
    return flat.unflatten(rel.min(axis=0))


# --------------------------------------------------------------------------------------------------
# SVD-based methods
# --------------------------------------------------------------------------------------------------
def svd_key(key: str, shape: tuple[int, ...]) -> bool:
    """Which keys the SVD methods decompose: 2-D and not text_projection (others are averaged)."""
    return len(shape) == 2 and "text_projection" not in key


def thin_svd(a: np.ndarray):
    return np.linalg.svd(np.asarray(a, dtype=np.float64), full_matrices=False)


def orthogonal_polar(a: np.ndarray) -> np.ndarray:
    """P Q^T from a = P diag(s) Q^T (what the originals do with a second SVD)."""
    p, _, qt = thin_svd(a)
    return p @ qt


def _per_key(models: Sequence[Model], matrix_fn, scaling: float) -> dict[str, np.ndarray]:
    out = {}
    for key in sorted(models[0]):
        mats = [np.asarray(m[key], dtype=np.float64) for m in models]
        merged = matrix_fn(mats) if svd_key(key, mats[0].shape) else None
        out[key] = scaling * (merged if merged is not None else np.mean(mats, axis=0))
    return out


def tsv_m_matrix(mats: Sequence[np.ndarray], zero_rank: str = "average") -> np.ndarray | None:
    """TSV-M of one key: each task's top int(r/K) triplets go to its slot of r-wide U / S / V buffers
    (unused slots stay zero, as in the original), U and V are replaced by their polar factors, rebuild.

    If int(r/K) == 0 the original produces an all-zero update (``zero_rank="zeros"``); mergecal averages
    the key instead (``"average"``: returns None so the caller averages)."""
    K = len(mats)
    m, n = mats[0].shape
    r = min(m, n)
    per_task = int(r * (1.0 / K))
    if per_task == 0:
        return np.zeros((m, n)) if zero_rank == "zeros" else None
    u_buf, s_buf, v_buf = np.zeros((m, r)), np.zeros(r), np.zeros((r, n))
    for i, a in enumerate(mats):
        u, s, vt = thin_svd(a)
        slot = slice(i * per_task, (i + 1) * per_task)
        u_buf[:, slot], s_buf[slot], v_buf[slot, :] = u[:, :per_task], s[:per_task], vt[:per_task, :]
    return orthogonal_polar(u_buf) @ np.diag(s_buf) @ orthogonal_polar(v_buf)


def tsv_m(models: Sequence[Model], scaling: float = 1.0, zero_rank: str = "average") -> dict[str, np.ndarray]:
    return _per_key(models, lambda mats: tsv_m_matrix(mats, zero_rank), scaling)


def iso_c_matrix(mats: Sequence[np.ndarray], center: str = "sum") -> np.ndarray:
    """Flat spectrum of the task-vector sum (iso-merging / FusionBench); ``center="mean"`` reproduces
    task_singular_vectors' src/utils/iso.py, which decomposes the mean instead (1/K the scale)."""
    total = np.sum(mats, axis=0) if center == "sum" else np.mean(mats, axis=0)
    u, s, vt = thin_svd(total)
    return (u * s.mean()) @ vt


def iso_c(models: Sequence[Model], scaling: float = 1.0, center: str = "sum") -> dict[str, np.ndarray]:
    return _per_key(models, lambda mats: iso_c_matrix(mats, center), scaling)


def iso_cts_ranks(r: int, K: int, common_space_fraction: float, rule: str = "original") -> tuple[int, int]:
    """(common rank, per-task rank).

    ``"original"`` (iso-merging): common = int(r f); task total = round((r - common) / K) * K (Python's
    round, half to even); common = r - task total.
    ``"floor_multiple"`` (an earlier mergecal rule): task total = round((1 - f) r), lowered to a multiple of K.
    """
    if rule == "original":
        common = int(r * common_space_fraction)
        task_total = round((r - common) / K) * K
    elif rule == "floor_multiple":
        task_total = round((1.0 - common_space_fraction) * r)
        task_total = (task_total // K) * K
    else:
        raise ValueError(rule)
    return r - task_total, task_total // K


def iso_cts_matrix(mats: Sequence[np.ndarray], common_space_fraction: float = 0.8,
                   rank_rule: str = "original") -> np.ndarray:
    K = len(mats)
    m, n = mats[0].shape
    r = min(m, n)
    common, per_task = iso_cts_ranks(r, K, common_space_fraction, rank_rule)
    u, s, vt = thin_svd(np.sum(mats, axis=0))
    u_c = u[:, :common]
    u_buf, s_buf, v_buf = np.zeros((m, r)), np.zeros(r), np.zeros((r, n))
    for i, a in enumerate(mats):
        residual = a - u_c @ (u_c.T @ a)  # remove the common (left) subspace only
        ut, st, vtt = thin_svd(residual)
        slot = slice(i * per_task, (i + 1) * per_task)
        u_buf[:, slot], s_buf[slot], v_buf[slot, :] = ut[:, :per_task], st[:per_task], vtt[:per_task, :]
    tail = slice(K * per_task, K * per_task + common)  # the common block goes after the task blocks
    u_buf[:, tail], s_buf[tail], v_buf[tail, :] = u_c, s[:common], vt[:common, :]
    flat_spectrum = np.full(r, s_buf.mean())
    return orthogonal_polar(u_buf) @ np.diag(flat_spectrum) @ orthogonal_polar(v_buf)


def iso_cts(models: Sequence[Model], scaling: float = 1.0, common_space_fraction: float = 0.8,
            rank_rule: str = "original") -> dict[str, np.ndarray]:
    return _per_key(models, lambda mats: iso_cts_matrix(mats, common_space_fraction, rank_rule), scaling)


def svc_matrix(mats: Sequence[np.ndarray], alpha: float | None = None) -> np.ndarray:
    """SVC (Algorithm 1 of the SVC paper, column space) of one key after task arithmetic with lambda = 1: the merged
    update M = sum_i tau_i = U diag(S) V^T, a_r^m = u_r^T M, a_r^i = u_r^T tau_i, s_ri = <a_r^m, a_r^i> / ||a_r^i||^2,
    gamma_r = K / sum_i max(alpha, s_ri) (alpha = 1/K by default), result U diag(gamma S) V^T. Vectorised over
    r and i (tests/test_svc.py's ``reference_gamma`` is the loop form)."""
    K = len(mats)
    alpha = 1.0 / K if alpha is None else alpha
    stacked = np.stack([np.asarray(a, dtype=np.float64) for a in mats])
    merged = stacked.sum(axis=0)
    u, s, vt = thin_svd(merged)
    a_m = u.T @ merged  # [R, n]
    a_i = u.T[None] @ stacked  # [K, R, n]
    coeff = (a_i * a_m[None]).sum(-1) / np.maximum((a_i * a_i).sum(-1), 1e-12)
    gamma = K / np.maximum(alpha, coeff).sum(0)
    return (u * (gamma * s)) @ vt


# --------------------------------------------------------------------------------------------------
# conditioning diagnostics (so a test can tell an ill-posed truncation from a wrong implementation)
# --------------------------------------------------------------------------------------------------
def _gap(s: np.ndarray, k: int) -> float:
    """Relative spectral gap at a rank-k truncation (inf when nothing is cut)."""
    if k <= 0 or k >= len(s) or s[0] == 0:
        return float("inf")
    return float((s[k - 1] - s[k]) / s[0])


def tsv_m_min_gap(mats: Sequence[np.ndarray]) -> float:
    per_task = min(mats[0].shape) // len(mats)
    return min(_gap(thin_svd(a)[1], per_task) for a in mats)


def iso_cts_min_gap(mats: Sequence[np.ndarray], common_space_fraction: float, rank_rule: str) -> float:
    K = len(mats)
    common, per_task = iso_cts_ranks(min(mats[0].shape), K, common_space_fraction, rank_rule)
    u, s, _ = thin_svd(np.sum(mats, axis=0))
    gaps = [_gap(s, common)]
    u_c = u[:, :common]
    for a in mats:
        gaps.append(_gap(thin_svd(a - u_c @ (u_c.T @ a))[1], per_task))
    return min(gaps)
