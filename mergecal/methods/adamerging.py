"""AdaMerging as merge methods (Yang et al., "AdaMerging: Adaptive Model Merging for Multi-Task Learning",
ICLR 2024, arXiv:2310.02575): ``adamerging_tw`` (one coefficient per task) and ``adamerging_lw`` (one per task
and merged key, the paper's best).

    theta = theta_0 + scaling * sum_k c_k[key] tau_k[key],   c learned by ``mergecal.adamerging.adamerging``

The coefficients minimise the entropy of the merged model's predictions on unlabelled inputs of each task, so the
method needs a model and those inputs: it cannot merge key by key from task vectors alone. ``learn`` runs the
optimisation and returns the task vectors with the learned coefficients attached (``AdaMergedTaskVectors``); ``fit``
reads them there, and refuses any other ``TaskVectorSet`` (the data-free path: ``merge_task_vectors``,
``iter_merge``, ``mergecal merge``) with a one-line ParameterError. The benchmark's vision track runs it
(``mergecal.pipeline.tracks.clip.session``). ``scaling`` stays 1: the coefficients are the method's own scale.

Keys AdaMerging does not merge (not a parameter of the model it learned on) stay theta_0 (a zero update), as in
``adamerging``'s state. The sum here runs in ``iter_merge``'s order, theta_0 + (c_1 tau_1 + ... + c_K tau_K);
``adamerging``'s own state is ((theta_0 + c_1 tau_1) + c_2 tau_2) + ...: equal up to float32 round-off.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import torch

from ..errors import ParameterError
from ..task_vectors import TaskVectorSet
from .adamerging_settings import AdaMergingSettings
from .base import MergeMethod, MergeParams, register

if TYPE_CHECKING:
    from ..adamerging import AdaMergingConfig, AdaMergingResult


class AdaMergingParams(AdaMergingSettings, MergeParams):
    """``AdaMergingSettings``; ``inputs``: which split's images (labels never read) the coefficients are learned
    on, the test split as in the paper, or validation."""

    scaling: float = 1.0  # a multiplier of the learned merge: 1 is AdaMerging's
    inputs: Literal["test", "validation"] = "test"


class AdaMergedTaskVectors(TaskVectorSet):
    """``task_vectors`` (the same sources, read the same way) with AdaMerging's learned ``coefficients`` ((K,) or
    (K, len(keys)), as they were used: clamped if the config clamps) over ``keys``, learned by ``config``."""

    def __init__(self, task_vectors: TaskVectorSet, coefficients: torch.Tensor, keys: Sequence[str],
                 config: "AdaMergingConfig"):
        vars(self).update(vars(task_vectors))  # a view of the same set: sources, keys, finiteness checks
        self.coefficients = coefficients.detach().float().cpu()
        self.columns = {key: i for i, key in enumerate(keys)}
        self.config = config


class AdaMerging(MergeMethod):
    """Task arithmetic with AdaMerging's learned coefficients (see the module docstring)."""

    Params = AdaMergingParams
    needs_data = True
    granularity: ClassVar[Literal["task", "layer"]]

    def __init__(self, params: MergeParams | None = None, **values: Any):
        super().__init__(params, **values)
        self._learned: AdaMergedTaskVectors | None = None

    def config(self) -> "AdaMergingConfig":
        """The library's configuration of these parameters (``mergecal.adamerging.adamerging``)."""
        from ..adamerging import AdaMergingConfig  # it imports this package's base: imported when used

        values = self.params.model_dump(exclude={"scaling", "inputs"})
        return AdaMergingConfig(granularity=self.granularity, **values)

    def _refuse(self) -> ParameterError:
        return ParameterError(f"{self.name}: learns its coefficients on a model and unlabelled inputs of each task, "
                              "so it cannot merge task vectors alone; run it in the benchmark's vision track or "
                              "with mergecal.adamerging.adamerging")

    def learn(self, model: torch.nn.Module, task_vectors: TaskVectorSet, batches: Sequence[Any], *,
              logits: Callable[[Any, int], torch.Tensor] | None = None,
              progress: bool = False) -> tuple[AdaMergedTaskVectors, "AdaMergingResult"]:
        """Learn the coefficients (``mergecal.adamerging.adamerging`` with this method's config) on ``model``
        (holding any weights: theta_0 is read from ``task_vectors.pretrained``), ``batches[k]`` task k's unlabelled
        inputs and ``logits(output, k)``; the merged keys are the model's parameters that the task vectors hold.
        Returns the task vectors with the coefficients attached, which ``fit`` reads, and the run's result."""
        from ..adamerging import adamerging

        if task_vectors.pretrained is None:
            raise ParameterError(f"{self.name}: parameter 'task_vectors': needs the pretrained model (from_models)")
        names = {n for n, _ in model.named_parameters()}
        keys = [k for k in task_vectors.keys if k in names]
        pretrained = {k: task_vectors.load_pretrained(k) for k in task_vectors.keys}
        taus: list[dict[str, torch.Tensor]] = [{} for _ in range(task_vectors.K)]
        for key in keys:
            for k, tau in enumerate(task_vectors.load(key)):
                taus[k][key] = tau
        config = self.config()
        result = adamerging(model, pretrained, taus, batches, config, logits=logits, keys=keys, progress=progress)
        return AdaMergedTaskVectors(task_vectors, result.coefficients, result.keys, config), result

    def fit(self, task_vectors: TaskVectorSet, keys: Sequence[str]) -> None:
        if not isinstance(task_vectors, AdaMergedTaskVectors):
            raise self._refuse()
        if task_vectors.config != self.config():
            raise ParameterError(f"{self.name}: the task vectors' coefficients were learned with another "
                                 f"configuration ({task_vectors.config!r}), not {self.config()!r}")
        self._learned = task_vectors

    def combine(self, key: str, taus: list[torch.Tensor]) -> torch.Tensor:
        if self._learned is None:
            raise self._refuse()
        column = self._learned.columns.get(key)
        if column is None:  # not a parameter AdaMerging merged: theta_0 stays
            return torch.zeros_like(taus[0], dtype=torch.float32)
        c = self._learned.coefficients
        merged = torch.zeros_like(taus[0], dtype=torch.float32)
        for k, tau in enumerate(taus):
            merged.add_(tau, alpha=float(c[k] if c.dim() == 1 else c[k, column]))
        return merged


@register
class AdaMergingTaskWise(AdaMerging):
    name = "adamerging_tw"
    granularity = "task"
    summary = "task arithmetic, one coefficient per task learned by entropy on unlabelled inputs (needs data)"


@register
class AdaMergingLayerWise(AdaMerging):
    name = "adamerging_lw"
    granularity = "layer"
    summary = "task arithmetic, one coefficient per task and key learned by entropy on unlabelled inputs (needs data)"
