"""Weight-space calibrations: data-free corrections of a merged task vector, applied key by key.

A ``WeightCalibration`` sees, for one key, the merged update and the K task vectors, and returns the calibrated
update plus diagnostics for reports. ``iter_calibrated`` chains one or more of them after any merge method while
streaming key by key, like ``mergecal.merge``. A calibration that reads the merged update's geometry at scaling 1
(``calibrate_at: unit_scaling``: SVC) sees the unscaled merge, and the merge method's scaling is applied after it
(``mergecal.merge.iter_weight_space``); the others see the scaled one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import torch

from .. import cost
from ..methods.base import HyperParams, build_params, format_params


class CalibrationParams(HyperParams):
    """Calibration hyperparameters. Unknown names are rejected; values are validated (``HyperParams``)."""


class WeightCalibration(ABC):
    name: ClassVar[str]
    Params: ClassVar[type[CalibrationParams]]

    def __init__(self, params: CalibrationParams | None = None, **values: Any):
        self.params = params if params is not None else build_params(self.Params, self.name, values)

    @classmethod
    def from_step(cls, params: CalibrationParams, sensitive: Sequence[str] | None = None) -> WeightCalibration:
        """The calibration for a recipe step with ``params``; ``sensitive`` is the probed magnitude-sensitive
        keys, for calibrations that use them (see ``Wsc``)."""
        return cls(params)

    @abstractmethod
    def covers(self, key: str, shape: tuple[int, ...], dtype: torch.dtype) -> bool:
        """Whether this calibration changes ``key`` (others pass through unchanged)."""

    @abstractmethod
    def calibrate(self, key: str, merged: torch.Tensor, taus: list[torch.Tensor]) -> tuple[torch.Tensor, dict]:
        """Calibrated update and diagnostics for one covered key. Never modify the inputs in place."""

    @property
    def id(self) -> str:
        return f"{self.name}({format_params(self.params)})"


def iter_calibrated(merged: Iterable[tuple[str, torch.Tensor]], task_vectors, calibrations: Sequence[WeightCalibration],
                    diagnostics: dict[str, dict] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Apply ``calibrations`` in order to a stream of ``(key, merged update)`` pairs.

    ``task_vectors`` is the ``TaskVectorSet`` the merge was computed from. Per-key diagnostics are
    stored in ``diagnostics[calibration.name][key]`` when a dict is given. A zero-size key is passed through.
    """
    cost.count_pass(c.name for c in calibrations)
    for key, update in merged:
        shape, dtype = tuple(update.shape), update.dtype
        if update.numel() == 0:  # a zero-size key passes unchanged: no row, spectrum or norm to calibrate
            yield key, update
            continue
        covering = [c for c in calibrations if c.covers(key, shape, dtype)]
        if covering:
            with cost.step(covering[0].name, memory=False, call=False):  # the read counts to the first
                taus = task_vectors.load(key)
            for calibration in covering:
                with cost.step(calibration.name, memory=False, call=False):  # its memory: the stream's (cost)
                    update, info = calibration.calibrate(key, update, taus)
                if diagnostics is not None:
                    diagnostics.setdefault(calibration.name, {})[key] = info
        yield key, update
