"""DisTaC, Distillation for Task-vector Conditioning, after Yoshida et al., arXiv:2508.01148
(Algorithm 1, Sec. 4-5, Appendix B) and the authors' code (docs/references.md, "DisTaC").

DisTaC pre-conditions ONE task vector tau_t = theta_t - theta_pre before merging (Algorithm 1):

    theta_anchor = theta_pre + kappa * tau_t                     (line 3; the student starts there, line 4)
    repeat K steps over unlabeled batches B of the task's inputs (lines 5-17):
        z_tcr = f(x; theta_t)   (teacher: the original fine-tuned model, frozen)
        z_stu = f(x; theta)     (student)
        L = T_tcr T_stu / |B| * sum_x KL( softmax(z_tcr / T_tcr) || softmax(z_stu / T_stu) )
            + beta * ||theta - theta_anchor||^2
        step on L

Two uses (Sec. 5.1): norm mismatch -> shrink the longest task vector (kappa from ``norm_matching_kappas``) and
recover its accuracy with a neutral temperature pair (10, 10); low confidence -> kappa = 1 and (T_tcr, T_stu) =
(1, 10), so the student, fitted at a high temperature, is sharper than the teacher at temperature 1.

Choices where the paper is silent or disagrees with the code (see ``DistacParams``): Adam as in the authors'
code (Algorithm 1 line 16 writes plain gradient descent; Appendix B's "followed the fine-tuning settings" would
mean AdamW with weight decay 0.1 and a cosine schedule), no weight decay (it would pull towards zero instead of
towards the anchor); a constant learning rate by default, with the appendix's cosine reading as the option
``schedule="cosine"`` (see ``DistacParams``); beta = 0.5 from Appendix B (the code defaults to 1.0); the
regulariser is a SUM of squares over the trained parameters, as in line 15. The task's classification head
lives inside the model built by ``build_model`` and stays frozen, as in the paper (the CLIP zero-shot head).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator
from torch import nn
from tqdm.auto import tqdm

from ..checkpoint import DictSource
from ..config_types import Count, NonNegativeInt, Probability, Steps
from ..errors import ParameterError, UnknownNameError
from ..methods.base import HyperParams, build_params
from ..device import resolve_device
from ..task_vectors import check_finite, validate_compatible
from ..train.lr_schedule import cosine_lr, set_lr
from .registry import register_calibration

StateDict = Mapping[str, torch.Tensor]

#: The paper's two settings (Sec. 5.1). ``norm_mismatch`` leaves kappa to ``norm_matching_kappas``.
PRESETS: dict[str, dict[str, Any]] = {
    "norm_mismatch": {"t_teacher": 10.0, "t_student": 10.0},
    "low_confidence": {"kappa": 1.0, "t_teacher": 1.0, "t_student": 10.0},
}


#: the fine-tuning's warm-up share in the paper's Appendix B (200 of 2000 steps), the cosine schedule's default
COSINE_WARMUP_FRACTION = 0.1


class DistacParams(HyperParams):
    """Hyperparameters of DisTaC (Algorithm 1; defaults from Appendix B and the authors' code).

    ``kappa``: scaling of the task vector at the anchor; None means the caller must set it (e.g. from
    ``norm_matching_kappas``) before distilling. ``beta``: weight of ||theta - theta_anchor||^2; 0.5 as in the
    paper's Appendix B (the authors' code defaults to 1.0). ``batch_size`` is used only when ``unlabeled``
    is one tensor holding the whole unlabeled set; batches from an iterable are used as they come.
    ``grad_clip``: max global gradient norm (None: no clipping).

    ``schedule``: the learning rate over the run. ``constant`` (the default) keeps ``lr`` at every step, as the
    authors' code does (Adam at a fixed lr, no scheduler) and as Appendix B says ("the learning rate was fixed at
    1e-5": the one setting it names as an exception to the fine-tuning settings, so "fixed" reads as constant).
    ``cosine`` is the other reading of "generally followed the fine-tuning settings": linear warm-up, then cosine
    decay towards 0 at ``steps`` (``mergecal.train.lr_schedule``, the fine-tuning schedule). ``warmup_fraction``:
    the share of ``steps`` spent warming up linearly (int(fraction * steps) steps, as the trainers count them);
    unset, it is 0.1 under ``cosine`` (the fine-tuning's 200 warm-up steps of 2000, scaled to the run's length)
    and 0 under ``constant``, so that the recipe id always shows the value used.
    """

    OWNER: ClassVar[str] = "distac"

    kappa: float | None = Field(None, gt=0.0)
    t_teacher: float = Field(10.0, gt=0.0)
    t_student: float = Field(10.0, gt=0.0)
    beta: float = Field(0.5, ge=0.0)
    lr: float = Field(1e-5, gt=0.0)
    steps: Steps = 500
    batch_size: Count = 128
    grad_clip: float | None = Field(1.0, gt=0.0)
    seed: NonNegativeInt = 0
    optimizer: Literal["adam"] = "adam"
    schedule: Literal["constant", "cosine"] = "constant"
    warmup_fraction: Probability = 0.0

    @model_validator(mode="before")
    @classmethod
    def _schedule_warmup(cls, values: Any) -> Any:
        """An unset ``warmup_fraction`` is the schedule's own: 0.1 for cosine (the paper's 200 of 2000), else 0."""
        if isinstance(values, Mapping) and values.get("warmup_fraction") is None:
            values = {**values, "warmup_fraction": COSINE_WARMUP_FRACTION if values.get("schedule") == "cosine"
                      else 0.0}
        return values

    def warmup_steps(self) -> int:
        return int(self.warmup_fraction * self.steps)

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "DistacParams":
        """The paper's setting ``name`` (see ``PRESETS``), with ``overrides`` applied on top."""
        if name not in PRESETS:
            raise UnknownNameError(f"distac: unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}")
        return build_params(cls, f"distac preset {name!r}", {**PRESETS[name], **overrides})


def as_distac_params(params: DistacParams | Mapping[str, Any] | None) -> DistacParams:
    """``params`` itself, or a mapping validated into ``DistacParams`` (one-line error naming the parameter)."""
    if isinstance(params, DistacParams):
        return params
    return build_params(DistacParams, DistacParams.OWNER, dict(params or {}))


def task_vector_norm(task_vector: StateDict) -> float:
    """L2 norm of a task vector over all its floating-point keys (accumulated in float64)."""
    total = 0.0
    for value in task_vector.values():
        if value.is_floating_point():
            total += float(value.detach().double().pow(2).sum())
    return math.sqrt(total)


def norm_matching_kappas(task_vectors: Sequence[StateDict]) -> list[float]:
    """Per-task kappa for the norm-mismatch setting (Sec. 5.1 and Appendix C.4).

    The task vector with the largest L2 norm (over all its float keys; the first one on ties) gets
    kappa = mean norm of the others / its norm, so that after scaling its norm equals that mean; every
    other task gets 1.0 (the paper shrinks the longest vector rather than stretching the others, Sec. 6.1).
    With one task there is nothing to match: [1.0].
    """
    if len(task_vectors) == 0:
        raise ParameterError("distac: parameter 'task_vectors' is empty; give at least one task vector")
    return kappas_from_norms([task_vector_norm(tv) for tv in task_vectors])


def kappas_from_norms(norms: Sequence[float]) -> list[float]:
    """``norm_matching_kappas`` from the task vectors' norms (e.g. measured key by key from checkpoints)."""
    if len(norms) == 0:
        raise ParameterError("distac: no task vector norm given")
    kappas = [1.0] * len(norms)
    if len(norms) == 1:
        return kappas
    largest = max(range(len(norms)), key=lambda i: (norms[i], -i))  # first index among equal maxima
    if norms[largest] == 0.0:
        raise ParameterError("distac: parameter 'task_vectors': all task vectors have norm 0, no kappa is defined")
    others = [n for i, n in enumerate(norms) if i != largest]
    kappas[largest] = (sum(others) / len(others)) / norms[largest]
    return kappas


def learning_rate(params: DistacParams, step: int) -> float:
    """The learning rate of 0-based ``step`` under ``params.schedule`` (see ``DistacParams``)."""
    warmup = params.warmup_steps()
    if params.schedule == "cosine":
        return cosine_lr(step, params.steps, warmup, params.lr)
    return params.lr * (step + 1) / warmup if step < warmup else params.lr


def _input_batches(unlabeled: Any, params: DistacParams) -> Iterator[torch.Tensor]:
    """Endless stream of input batches: a tensor is shuffled and batched here (seeded), an iterable of
    batches is cycled. Labels in (inputs, labels) batches are dropped: DisTaC uses no labels."""
    if isinstance(unlabeled, torch.Tensor):
        n = unlabeled.shape[0] if unlabeled.dim() > 0 else 0
        if n == 0:
            raise ParameterError("distac: parameter 'unlabeled' is an empty tensor")
        generator = torch.Generator().manual_seed(params.seed)
        while True:  # a fresh seeded permutation per epoch
            order = torch.randperm(n, generator=generator)
            for start in range(0, n, params.batch_size):
                yield unlabeled[order[start:start + params.batch_size]]
    elif not isinstance(unlabeled, Iterable):
        raise ParameterError(f"distac: parameter 'unlabeled' must be a tensor or an iterable of batches, "
                             f"got {type(unlabeled).__name__}")
    passes = 0
    while True:
        seen = 0
        for batch in unlabeled:
            if isinstance(batch, (tuple, list)) and batch:
                batch = batch[0]
            if not isinstance(batch, torch.Tensor):
                raise ParameterError(f"distac: parameter 'unlabeled' must yield tensors or (inputs, labels) tuples, "
                                     f"got {type(batch).__name__}")
            if batch.dim() == 0 or batch.shape[0] == 0:
                raise ParameterError("distac: parameter 'unlabeled' yielded an empty batch")
            seen += 1
            yield batch
        if seen == 0:
            what = "yielded no batches" if passes == 0 else "was exhausted after one pass (a one-shot iterator?)"
            raise ParameterError(f"distac: parameter 'unlabeled' {what}; "
                                 "pass a tensor, a list of batches or a DataLoader")
        passes += 1


def distillation_loss(z_student: torch.Tensor, z_teacher: torch.Tensor, t_teacher: float,
                      t_student: float) -> torch.Tensor:
    """T_tcr T_stu KL(softmax(z_tcr / T_tcr) || softmax(z_stu / T_stu)), batch mean (Algorithm 1, lines 11-15)."""
    log_p_student = F.log_softmax(z_student.float() / t_student, dim=-1)
    log_p_teacher = F.log_softmax(z_teacher.float() / t_teacher, dim=-1)
    return t_teacher * t_student * F.kl_div(log_p_student, log_p_teacher, log_target=True, reduction="batchmean")


def _check_state_dicts(pretrained: StateDict, finetuned: StateDict) -> list[str]:
    """Same keys, shapes and dtypes, finite floats; returns the floating-point keys."""
    pre, ft = DictSource(pretrained, name="pretrained"), DictSource(finetuned, name="finetuned")
    keys = validate_compatible([pre, ft])
    float_keys = [k for k in keys if pretrained[k].is_floating_point()]
    for key in float_keys:
        check_finite(pretrained[key], key, "pretrained")
        check_finite(finetuned[key], key, "finetuned")
    return float_keys


def distill_task_vector(build_model: Callable[[dict[str, torch.Tensor]], nn.Module], pretrained: StateDict,
                        finetuned: StateDict, unlabeled: Any, params: DistacParams | Mapping[str, Any],
                        trainable: Callable[[str], bool] | None = None, progress: bool = True,
                        device: str | torch.device = "cpu", norm_every: int = 10,
                        observe: Callable[[nn.Module], Mapping[str, float]] | None = None
                        ) -> tuple[dict[str, torch.Tensor], list[dict[str, float]]]:
    """Condition the task vector ``finetuned - pretrained`` by distillation (DisTaC, Algorithm 1).

    ``build_model(state_dict)`` returns a module whose ``forward(inputs)`` gives class logits, with the task's
    head inside it (frozen); its ``state_dict()`` must contain every key of ``pretrained`` under the same name
    (the head may add keys of its own). It is called twice: for the teacher on ``finetuned`` (eval mode, no
    gradients) and for the student on the anchor theta_pre + kappa tau (float keys in float32; train mode).
    ``unlabeled``: one tensor of inputs (shuffled with ``params.seed`` and cut into ``params.batch_size``
    batches) or a re-iterable of batches (tensors, or (inputs, labels) tuples whose labels are ignored),
    cycled until ``params.steps`` steps are done. ``trainable(name)`` picks the student parameters to
    optimise (default: every floating parameter that requires grad after ``build_model``); the others are
    frozen. Runs are bit-identical on CPU for the same seed; the global RNG state is restored afterwards.

    Returns the conditioned state dict (the keys, dtypes and devices of ``finetuned``; integer buffers copied
    from it; float keys that were not trained keep their anchor value) and a history: one dict per step with
    ``step``, ``loss``, ``kl``, ``reg``, ``lr`` (the step's learning rate, ``learning_rate``), plus ``tau_norm`` =
    ||theta - theta_pre|| over the float keys every ``norm_every`` steps and at the last step. ``pretrained``
    and ``finetuned`` are never modified.

    ``observe(student)``, when given, measures the student (in eval mode, without gradients; e.g. its test accuracy
    and entropy: the paper's Fig. 2) at the anchor, as a record of step 0 first in the history, and at every step
    that records ``tau_norm``; its figures join that step's record. It draws no random numbers, so the result is the
    same bits with or without it.
    """
    params = as_distac_params(params)
    if params.kappa is None:
        raise ParameterError("distac: parameter 'kappa' is not set; give it (1.0 for low confidence) "
                             "or compute it with norm_matching_kappas")
    if norm_every < 1:
        raise ParameterError(f"distac: parameter 'norm_every' must be >= 1, got {norm_every}")
    device = torch.device(resolve_device(device))
    float_keys = _check_state_dicts(pretrained, finetuned)
    is_float = set(float_keys)
    kappa = params.kappa

    # Anchor theta_pre + kappa tau in float32 (Algorithm 1, line 3); integer buffers from the fine-tuned model.
    # kappa = 1 takes theta_t itself: pre + (ft - pre) is off by round-off, and the paper's student then starts
    # exactly at its teacher (Sec. 4.2).
    anchor_state = {}
    for key, value in finetuned.items():
        if key in is_float and kappa != 1.0:
            base = pretrained[key].detach().float()
            anchor_state[key] = base + kappa * (value.detach().float() - base)
        elif key in is_float:
            anchor_state[key] = value.detach().float().clone()
        else:
            anchor_state[key] = value.detach().clone()

    accelerator = device.type != "cpu"
    with torch.random.fork_rng(devices=[device] if accelerator else [],
                               device_type=device.type if accelerator else None):
        torch.manual_seed(params.seed)  # module construction, dropout and DataLoader shuffles: seeded, not leaked

        # Clones: build_model may wrap the given tensors as parameters, and training must not touch the inputs.
        teacher = build_model({k: v.detach().clone() for k, v in finetuned.items()}).to(device)
        teacher.eval()
        teacher.requires_grad_(False)
        student = build_model(anchor_state).to(device)
        student.train()

        student_state = student.state_dict(keep_vars=True)
        missing = [k for k in float_keys if k not in student_state]
        if missing:
            raise ParameterError(f"distac: parameter 'build_model': the model has no key {missing[0]!r} of the "
                                 "state dicts" + (f" ({len(missing)} missing in all)" if len(missing) > 1 else ""))

        named = [(n, p) for n, p in student.named_parameters() if p.is_floating_point()]
        chosen = [(n, p) for n, p in named if (trainable(n) if trainable is not None else p.requires_grad)]
        for _, p in named:
            p.requires_grad_(False)
        if not chosen:
            raise ParameterError("distac: parameter 'trainable' selects no floating parameter of the student")
        outside = [n for n, _ in chosen if n not in finetuned]
        if outside:
            raise ParameterError(f"distac: parameter 'trainable' selects {outside[0]!r}, which is not a key of the "
                                 "state dicts (its training would be lost); exclude it or freeze it in build_model")
        for _, p in chosen:
            p.requires_grad_(True)
        anchor = {n: p.detach().clone() for n, p in chosen}
        trained = [p for _, p in chosen]
        optimizer = torch.optim.Adam(trained, lr=params.lr)

        def tau_norm() -> float:
            live = student.state_dict()
            total = 0.0
            for key in float_keys:
                base = pretrained[key].to(device=device, dtype=torch.float32)
                total += float((live[key].detach().float() - base).double().pow(2).sum())
            return math.sqrt(total)

        def observed() -> dict[str, float]:
            student.eval()
            with torch.no_grad():
                figures = dict(observe(student))
            student.train()
            return figures

        history: list[dict[str, float]] = []
        if observe is not None:
            history.append({"step": 0, "tau_norm": tau_norm(), **observed()})
        batches = _input_batches(unlabeled, params)
        bar = tqdm(range(1, params.steps + 1), desc="distac", unit="step", disable=not progress)
        for step in bar:
            inputs = next(batches).to(device)
            with torch.no_grad():
                z_teacher = teacher(inputs)
            z_student = student(inputs)
            kl = distillation_loss(z_student, z_teacher, params.t_teacher, params.t_student)
            reg = sum(((p.float() - anchor[n].float()) ** 2).sum() for n, p in chosen)
            loss = kl + params.beta * reg
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            if params.grad_clip is not None:
                torch.nn.utils.clip_grad_norm_(trained, params.grad_clip)
            lr = learning_rate(params, step - 1)
            set_lr(optimizer, lr)
            optimizer.step()

            record = {"step": step, "loss": loss.item(), "kl": kl.item(), "reg": float(reg.detach()), "lr": lr}
            if step % norm_every == 0 or step == params.steps:
                record["tau_norm"] = tau_norm()
                if observe is not None:
                    record.update(observed())
                bar.set_postfix(kl=f"{record['kl']:.4g}", tau_norm=f"{record['tau_norm']:.4g}")
            history.append(record)

    final = student.state_dict()
    conditioned = {}
    for key, value in finetuned.items():
        if key in is_float:
            conditioned[key] = final[key].detach().to(device=value.device, dtype=value.dtype).clone()
        else:
            conditioned[key] = value.detach().clone()
    return conditioned, history


@register_calibration("distac", phase="pre", needs_data=True)
class DistacStepParams(DistacParams):
    """DisTaC as a recipe step: ``DistacParams`` plus which task vectors to condition.

    ``preset`` (``norm_mismatch`` or ``low_confidence``) is resolved into explicit values when the step
    is built (explicit values win), so a recipe's id always shows the values used. ``apply_to``:
    ``"all"`` conditions every task vector; ``"largest_norm"`` only the one with the largest norm (the
    norm-mismatch regime, where the others keep kappa = 1 and need no distillation). ``kappa = None``
    means norm matching (``norm_matching_kappas``).
    """

    apply_to: Literal["all", "largest_norm"] = "all"

    @model_validator(mode="before")
    @classmethod
    def _resolve_preset(cls, values: Any) -> Any:
        if not isinstance(values, Mapping) or "preset" not in values:
            return values
        values = dict(values)
        name = values.pop("preset")
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of: {', '.join(sorted(PRESETS))}")
        defaults = dict(PRESETS[name])
        if name == "norm_mismatch":
            defaults["apply_to"] = "largest_norm"
        return {**defaults, **values}

    def distillation_params(self) -> DistacParams:
        return DistacParams(**self.model_dump(exclude={"apply_to"}))

    @staticmethod
    def run_step(params: DistacStepParams, pretrained: StateDict, finetuned: Sequence[StateDict],
                 build_task_model: Callable[[int, StateDict], nn.Module], data: Sequence[Any], *,
                 previous: dict | None = None, **options: Any) -> tuple[list[StateDict], dict]:
        """A recipe's DisTaC step (the registry's ``run``: ``mergecal.run_recipe``): ``condition_models``, its report
        added to the ``previous`` one of an earlier DisTaC step of the recipe (whose kappas it keeps)."""
        models, report = condition_models(params, pretrained, finetuned, build_task_model, data, **options)
        if previous is None:
            return models, {"kappas": report["kappas"], "conditioned": list(report["conditioned"]),
                            "history": dict(report["history"])}
        return models, {**previous, "conditioned": previous["conditioned"] + report["conditioned"],
                        "history": {**previous["history"], **report["history"]}}


def distac_plan(step: DistacStepParams, norms: Sequence[float]) -> tuple[list[float], list[int]]:
    """The kappa of each of K models (norm matching, ``kappas_from_norms``, unless the step fixes kappa) and the
    models conditioned: every one, or with ``apply_to="largest_norm"`` the one whose task vector is longest (the
    first on ties: the one norm matching shrinks). ``norms``: the K task vectors' norms."""
    kappas = kappas_from_norms(norms) if step.kappa is None else [step.kappa] * len(norms)
    if step.apply_to == "largest_norm":
        return kappas, [max(range(len(norms)), key=lambda i: (norms[i], -i))]
    return kappas, list(range(len(norms)))


def condition_model(step: DistacStepParams, kappa: float, build_model: Callable[[StateDict], nn.Module],
                    pretrained: StateDict, finetuned: StateDict, data: Any, **options: Any) -> tuple[StateDict, list]:
    """One model's DisTaC step at the kappa ``distac_plan`` gave it: ``distill_task_vector`` with the step's
    distillation parameters (``options``: its keywords). What ``condition_models`` runs per model, and a caller that
    holds one model at a time (a lab's CLIP track) too."""
    return distill_task_vector(build_model, pretrained, finetuned, data,
                               step.distillation_params().model_copy(update={"kappa": kappa}), **options)


def condition_models(step: DistacStepParams, pretrained: StateDict, finetuned: Sequence[StateDict],
                     build_task_model: Callable[[int, StateDict], nn.Module], data: Sequence[Any], *,
                     trainable: Callable[[str], bool] | None = None, progress: bool = False,
                     device: str | torch.device | None = None, norm_every: int = 10,
                     observe: Callable[[int, nn.Module], Mapping[str, float]] | None = None
                     ) -> tuple[list[StateDict], dict]:
    """DisTaC as a pre-merge step over K fine-tuned models: kappa per model (norm matching unless the step fixes
    kappa), the models it conditions (every one, or with ``apply_to="largest_norm"`` the one whose task vector is
    longest, the first on ties: the one norm matching shrinks), each distilled on its own unlabeled ``data[t]``
    (read only for the models conditioned). Returns the models, conditioned where chosen, and a report
    ``{"kappas", "conditioned": [t], "history": {t: per-step records}}``. ``observe(t, student)``: model t's
    ``distill_task_vector`` observer (its trajectory), every ``norm_every`` steps."""
    from ..task_vectors import task_vector

    if len(data) != len(finetuned):
        raise ParameterError(f"distac: {len(data)} unlabeled datasets for {len(finetuned)} models")
    kappas, targets = distac_plan(step, [task_vector_norm(task_vector(m, pretrained)) for m in finetuned])
    models, report = list(finetuned), {"kappas": kappas, "conditioned": [], "history": {}}
    for t in targets:
        models[t], report["history"][t] = condition_model(
            step, kappas[t], lambda sd, t=t: build_task_model(t, sd), pretrained, models[t], data[t],
            trainable=trainable, progress=progress, device=device, norm_every=norm_every,
            observe=None if observe is None else (lambda student, t=t: observe(t, student)))
        report["conditioned"].append(t)
    return models, report
