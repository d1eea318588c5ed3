"""SVC, Singular Value Calibration (data-free), after Li et al., arXiv:2602.05536
(Algorithm 1) and the authors' code (docs/references.md).

Per calibrated 2-D key, with dW_m the merged update and dW_i the task matrices:
  1. thin SVD dW_m = U S V^T;
  2. a_i^r = u_r^T dW_i and a_m^r = u_r^T dW_m, both with the MERGED left singular vectors;
  3. s_i^r = <a_m^r, a_i^r> / max(||a_i^r||^2, 1e-12);
  4. gamma_r = K / sum_i max(alpha, s_i^r);   sigma~_r = gamma_r sigma_r;   dW~ = U diag(sigma~) V^T.
alpha defaults to 1/K; alpha = 1 (suppression only: gamma <= 1) is the authors' setting after TSV-M.

``calibrate_at`` (the protocol): ``"unit_scaling"`` (default, the paper: "we keep lambda = 1 throughout") computes
the coefficients on the merge at scaling 1; the merge method's scaling multiplies the calibrated update after SVC
(``mergecal.merge.iter_weight_space``), so a validation search over the scaling runs with SVC in place.
``"chosen_scaling"`` calibrates lambda * dW_m instead: every s_i^r is multiplied by lambda, and at a small lambda
(0.1) no s exceeds 1, the alpha floor binds in every direction and SVC amplifies (gamma ~ K) instead of shrinking.

Solvers (step 1): ``"gram"`` (default since 2026-11-25) takes U, sigma, V from the float64 eigendecomposition of
the merged update's smaller Gram matrix (mergecal.linalg.svd_gram: exact, no randomized step; on ViT-B/32-shaped
updates ~7e-8 from a float64 SVD where the float32 SVD is 3e-6 to 9e-6 away); ``"svd"`` is the full thin SVD
(float32, or float64 with ``float64``), as the authors compute it. On tensors off the CPU (CUDA) the "gram"
solver runs torch-only, in float64 (mergecal.linalg's backends), and the projections run where the tensors are.

Options: ``targeted_task`` (the paper's preference calibration: gamma_r = 1/max(alpha, s_t^r), and 1
where s_t^r <= 0); ``space="row"`` (the paper's row-space ablation, a_i^r = dW_i v_r); ``float64``;
``key_rule`` ("svc_authors": 2-D keys without 'text_projection'/'embedding', nor Llama's embed_tokens/lm_head;
"matrices": every 2-D key, as FusionBench); ``calibrate_vectors`` (the appendix's 1-D form for biases /
IA3-style vectors: the same rule on the 1 x n matrix, i.e. s_i = <t_m, t_i>/<t_i, t_i>,
gamma = K / sum_i max(alpha, s_i); the alpha floor, which the appendix's formula omits, keeps gamma finite
and positive when sum_i s_i <= 0).

``roundoff_guard`` (default on): a task whose response ||a_i^r|| is below 100 eps ||dW_i||_F has no
component along u_r beyond round-off, and gets s_i^r = 0. Without it (the authors' code) such a response
of ~1e-7 meets the absolute 1e-12 floor and yields s_i^r of order 1e4 with a random sign, e.g. when tasks
touch disjoint rows. Non-degenerate inputs are unaffected; ``roundoff_guard=False`` reproduces the authors.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from ..config_types import NonNegativeInt
from ..errors import ParameterError
from ..keys import get_key_rule
from ..linalg import svd, svd_gram
from .base import CalibrationParams, WeightCalibration
from .registry import register_calibration


#: the rank from which a_m is read off the decomposition instead of computed as a product (``svc_coefficients``)
MERGED_RESPONSE_FROM = 1024

#: the authors' alpha per merge method it follows, where it is not 1/K (docs/references.md): suppression only
#: after TSV-M. ``Recipe`` fills it in for an svc step without an explicit alpha, so the API and the pipeline agree.
AUTHORS_ALPHA = {"tsv_m": 1.0}


class SvcParams(CalibrationParams):
    alpha: float | None = Field(None, gt=0.0)  # None: 1/K
    targeted_task: NonNegativeInt | None = None
    space: Literal["column", "row"] = "column"
    key_rule: str = "svc_authors"
    calibrate_vectors: bool = False
    float64: bool = False  # the projections' precision, and the "svd" solver's ("gram" always works in float64)
    roundoff_guard: bool = True
    solver: Literal["gram", "svd"] = "gram"
    # the merge SVC reads: at scaling 1 (the paper), or after the merge method's scaling (module docstring)
    calibrate_at: Literal["unit_scaling", "chosen_scaling"] = "unit_scaling"


def svc_coefficients(merged: torch.Tensor, taus: list[torch.Tensor], alpha: float, *, targeted_task: int | None = None,
                     space: str = "column", float64: bool = False,
                     roundoff_guard: bool = True, solver: str = "gram",
                     backend: str = "auto") -> dict[str, torch.Tensor]:
    """U, sigma, V^T of the merged update, the projection coefficients s [K, R] and gamma [R]. ``backend``: the
    "gram" solver's implementation (mergecal.linalg: numpy/scipy on the CPU by default, torch-only off it)."""
    K = len(taus)
    dtype = torch.float64 if float64 else torch.float32
    if solver == "gram":
        exact = svd_gram(merged, backend=backend)  # float64
        U, S, Vh = (x.float() for x in exact)
    elif solver == "svd":
        U, S, Vh = exact = svd(merged, float64=float64)
    else:
        raise ValueError(f"unknown solver {solver!r}")
    basis_u, basis_v = U.to(dtype), Vh.to(dtype)
    stacked = torch.stack([t.to(dtype) for t in taus])  # [K, rows, cols]
    # the merged update's own responses: u_r^T dW_m = sigma_r v_r^T and dW_m v_r = sigma_r u_r exactly, so from
    # rank MERGED_RESPONSE_FROM on they are read off the decomposition (one product of the key's size fewer: 1.5 s
    # of a Llama-2-7B attention key, 4 s of an MLP key, on one thread); below, the product every committed result
    # was computed with (the default benchmark's keys are at most 384 wide)
    from_decomposition = min(merged.shape) >= MERGED_RESPONSE_FROM
    if space == "column":
        # [R, cols]: row r is u_r^T dW_m
        a_m = (exact[1].unsqueeze(1) * exact[2]).to(dtype) if from_decomposition else basis_u.T @ merged.to(dtype)
        a_i = torch.einsum("pr,kpc->krc", basis_u, stacked)  # [K, R, cols]
    else:
        # [R, rows]: row r is (dW_m v_r)^T
        a_m = (exact[0] * exact[1]).T.to(dtype) if from_decomposition else (merged.to(dtype) @ basis_v.T).T
        a_i = torch.einsum("kpc,rc->krp", stacked, basis_v)
    response_sq = (a_i * a_i).sum(-1)  # [K, R]
    s = (a_i * a_m.unsqueeze(0)).sum(-1) / response_sq.clamp(min=1e-12)
    if roundoff_guard:
        tolerance = 100 * torch.finfo(dtype).eps * stacked.flatten(1).norm(dim=1, keepdim=True)  # [K, 1]
        s = torch.where(response_sq.sqrt() <= tolerance, torch.zeros_like(s), s)
    if targeted_task is None:
        gamma = K / s.clamp(min=alpha).sum(0)
    else:
        s_t = s[targeted_task]
        gamma = torch.where(s_t > 0, 1.0 / s_t.clamp(min=alpha), torch.ones_like(s_t))
    return {"U": U, "sigma": S, "Vh": Vh, "s": s.float(), "gamma": gamma.float()}


@register_calibration("svc", phase="weight", needs_data=False)
class Svc(WeightCalibration):
    name = "svc"
    Params = SvcParams

    def __init__(self, params=None, **values):
        super().__init__(params, **values)
        self._rule = get_key_rule(self.params.key_rule)

    def covers(self, key, shape, dtype):
        if self.params.calibrate_vectors and len(shape) == 1 and dtype.is_floating_point:
            return True
        return self._rule.matches(key, shape, dtype)

    def calibrate(self, key, merged, taus):
        p = self.params
        if p.targeted_task is not None and p.targeted_task >= len(taus):
            raise ParameterError(f"svc: parameter 'targeted_task'={p.targeted_task} "
                                 f"but there are only {len(taus)} tasks")
        alpha = p.alpha if p.alpha is not None else 1.0 / len(taus)
        as_matrix = merged.dim() == 1
        m = merged.unsqueeze(0) if as_matrix else merged
        ts = [t.unsqueeze(0) for t in taus] if as_matrix else taus
        c = svc_coefficients(m, ts, alpha, targeted_task=p.targeted_task, space=p.space, float64=p.float64,
                             roundoff_guard=p.roundoff_guard, solver=p.solver)
        sigma_new = c["gamma"] * c["sigma"]
        calibrated = (c["U"] * sigma_new) @ c["Vh"]
        calibrated = calibrated.reshape(merged.shape).to(merged.dtype)
        return calibrated, {"sigma": c["sigma"], "sigma_calibrated": sigma_new, "gamma": c["gamma"], "s": c["s"],
                            "alpha": alpha}
