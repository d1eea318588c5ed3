"""The vision track's params.yaml section (``vision:``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, TypeAdapter, ValidationError, field_validator, model_validator

from .....config_types import ConfigValueError, PositiveReal
from .....errors import ParameterError
from .....regimes import OBJECTIVE_OF_REGIME, REGIMES, Objective, Regime, check_regime, lengthened_task
from ....params_base import Strict, _check_dataclass, _distinct


def _library_default(module: str, cls: str, field: str) -> Any:
    """A default the schema shares with a library config dataclass: read from it, not written twice."""
    import dataclasses
    import importlib

    config = getattr(importlib.import_module(f"mergecal.{module}"), cls)
    return next(f.default for f in dataclasses.fields(config) if f.name == field)



class VisionTrack(Strict):
    """The open_clip track: a small ViT pretrained by the project, fine-tuned per task (image encoder only)."""

    enabled: bool = True  # False leaves the track's cells out of the matrix (its DVC stages still build it)
    backbone: str = Field("clip-tiny", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a directory name under models/
    arch: str = Field(default_factory=lambda: _library_default("train.pretrain_clip", "PretrainConfig", "arch"))
    # which procedural datasets are generated and what pretraining shows (mergecal.data.vision.TASK_SETS)
    task_set: str = Field(default_factory=lambda: _library_default("data.vision", "SuiteConfig", "task_set"))
    tasks: list[str] | None = None  # None: every task of the task set
    regimes: list[Regime] = Field(default_factory=lambda: list(REGIMES))
    # the papers' profile's regimes (`make paper`; mergecal.regimes: norm_mismatch_<task>, mixup, focal,
    # label_smoothing_<alpha>): each built by its own stage, never by the default run
    paper_regimes: list[str] = Field(default_factory=list)
    # fine-tuned for every task (DVC stage `finetune`); `norm_mismatch` adds one task at a higher lr
    finetune_variants: list[Objective] = Field(
        default_factory=lambda: ["standard", "low_confidence"])
    norm_mismatch_task: str | None = None  # None: the first task
    # the lr multiple of a lengthened task: one for every task, or one per task (each task a norm-mismatch regime
    # lengthens must be named; lr_multiplier(task) reads it)
    norm_mismatch_lr_multiplier: float | dict[str, float] = 10.0
    data: dict[str, Any] = Field(default_factory=dict)
    pretrain: dict[str, Any] = Field(default_factory=dict)
    finetune: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arch")
    @classmethod
    def _arch(cls, arch: str) -> str:
        from .....backbones.architectures import ARCHITECTURES

        if arch not in ARCHITECTURES:  # the track pretrains its own CLIP: one of the project's architectures
            raise ValueError(f"unknown architecture {arch!r}; choose from: {', '.join(ARCHITECTURES)}")
        return arch

    @field_validator("task_set")
    @classmethod
    def _task_set(cls, task_set: str) -> str:
        from .....data.vision import TASK_SETS

        if task_set not in TASK_SETS:
            raise ValueError(f"unknown task set {task_set!r}; choose from: {', '.join(TASK_SETS)}")
        return task_set

    @model_validator(mode="after")
    def _tasks(self) -> "VisionTrack":
        from .....data.vision import TASK_SETS

        allowed = TASK_SETS[self.task_set]
        if self.tasks is None:
            self.tasks = list(allowed)
        unknown = [t for t in self.tasks if t not in allowed]
        if unknown:  # only the task set's datasets are generated
            raise ConfigValueError("tasks", f"unknown task {unknown[0]!r} in task set {self.task_set!r}; "
                                            f"choose from: {', '.join(allowed)}")
        try:
            _distinct(self.tasks, "tasks", at_least=2)
        except ValueError as err:
            raise ConfigValueError("tasks", str(err)) from None
        if self.norm_mismatch_task is None:
            self.norm_mismatch_task = self.tasks[0]
        return self

    @field_validator("norm_mismatch_lr_multiplier", mode="before")
    @classmethod
    def _multiples(cls, value: Any) -> float | dict[str, float]:
        positive = TypeAdapter(PositiveReal)

        def one(multiple: Any, key: str) -> float:
            try:
                return positive.validate_python(multiple)
            except ValidationError as err:
                raise ConfigValueError(key, f"{err.errors()[0]['msg']} (got {multiple!r})") from None

        if isinstance(value, dict):
            return {str(task): one(multiple, str(task)) for task, multiple in value.items()}
        return one(value, "")

    @field_validator("regimes", "finetune_variants")
    @classmethod
    def _lists(cls, values: list[str]) -> list[str]:
        return _distinct(values, "entries")

    @field_validator("paper_regimes")
    @classmethod
    def _profile(cls, values: list[str]) -> list[str]:
        return _distinct(values, "entries", at_least=0)

    @model_validator(mode="after")
    def _check(self) -> "VisionTrack":
        from .....data.vision import SuiteConfig
        from .....train.finetune import FinetuneConfig
        from .....train.pretrain_clip import PretrainConfig

        for regime in self.regimes:
            if OBJECTIVE_OF_REGIME[regime] not in self.finetune_variants:
                raise ValueError(f"regime {regime!r} needs {OBJECTIVE_OF_REGIME[regime]!r} in finetune_variants")
        if "norm_mismatch" in self.regimes and self.norm_mismatch_task not in self.tasks:
            raise ValueError(f"norm_mismatch_task {self.norm_mismatch_task!r} is not one of the track's tasks")
        for regime in self.paper_regimes:
            if regime in self.regimes:
                raise ConfigValueError("paper_regimes", f"{regime!r} is already in regimes (the default run's)")
            try:
                check_regime(regime, self.tasks, self.norm_mismatch_task)
            except ParameterError as err:
                raise ConfigValueError("paper_regimes", str(err)) from None
        self._check_multipliers()
        if "task_set" in self.data:
            raise ConfigValueError("data.task_set", "set the task set once, as 'task_set' of the track")
        self.data = _check_dataclass(SuiteConfig, self.data, "data")
        if "arch" in self.pretrain:
            raise ConfigValueError("pretrain.arch", "set the architecture once, as 'arch' of the track")
        self.pretrain = _check_dataclass(PretrainConfig, self.pretrain, "pretrain")
        if "regime" in self.finetune:
            raise ConfigValueError("finetune.regime", "regimes are listed in 'regimes', not set per fine-tune")
        self.finetune = _check_dataclass(FinetuneConfig, self.finetune, "finetune")
        return self


    def _check_multipliers(self) -> None:
        multiples = self.norm_mismatch_lr_multiplier
        if not isinstance(multiples, dict):
            return
        unknown = [t for t in multiples if t not in self.tasks]
        if unknown:
            raise ConfigValueError("norm_mismatch_lr_multiplier", f"{unknown[0]!r} is not one of the track's tasks "
                                                                  f"({', '.join(self.tasks)})")
        lengthened = [t for t in (lengthened_task(r, self.norm_mismatch_task)
                                  for r in [*self.regimes, *self.paper_regimes]) if t is not None]
        missing = [t for t in lengthened if t not in multiples]
        if missing:
            raise ConfigValueError("norm_mismatch_lr_multiplier", f"no multiple for {missing[0]!r}, which a "
                                                                  "norm-mismatch regime lengthens")

    def lr_multiplier(self, task: str) -> float:
        """The lr multiple that lengthens ``task`` (its norm-mismatch fine-tune)."""
        multiples = self.norm_mismatch_lr_multiplier
        if not isinstance(multiples, dict):
            return float(multiples)
        if task not in multiples:
            raise ParameterError(f"vision.norm_mismatch_lr_multiplier: no multiple for task {task!r}")
        return float(multiples[task])


#: its section of ``Params`` (``mergecal.pipeline.config``, key: the track's name): (type, default)
SECTION = (VisionTrack, Field(default_factory=VisionTrack))
