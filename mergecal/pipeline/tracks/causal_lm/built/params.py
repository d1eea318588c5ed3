"""The LLM track's params.yaml section (``llm:``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .....config_types import ConfigValueError
from ....params_base import Strict, _check_dataclass, _distinct, _known_tasks
from ..params import LlmEvaluation


#: the regimes of the papers' profile (``paper_regimes``): ``lora``, the experts peft LoRA adapters of the base
PAPER_REGIMES = ("lora",)


class LlmTrack(Strict):
    """The LLM track: a tiny Llama pretrained by the project on the synthetic corpus, one fine-tuned expert
    per task, merged experts scored with lm-eval on the suite's local task YAMLs. The papers' profile adds the
    regime ``lora`` (``paper_regimes``): each expert a peft LoRA adapter (``lora``), trained with each task's
    fine-tuning values changed by ``finetune_lora``."""

    enabled: bool = True  # as vision: False leaves the cells out; the LLM stages always build the track
    backbone: str = Field("tiny-llama", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    task_set: str = "llm3"
    tasks: list[str] = Field(default_factory=lambda: list(_library_default_llm_tasks()))
    regimes: list[Literal["standard"]] = Field(default_factory=lambda: ["standard"])  # the default run's
    paper_regimes: list[Literal["lora"]] = Field(default_factory=lambda: list(PAPER_REGIMES))  # built by make paper
    data: dict[str, Any] = Field(default_factory=dict)  # mergecal.data.llm.LlmSuiteConfig
    shape: dict[str, Any] = Field(default_factory=dict)  # mergecal.train.lm.TinyLlamaShape
    pretrain: dict[str, Any] = Field(default_factory=dict)  # mergecal.train.lm.LmTrainConfig
    finetune: dict[str, Any] = Field(default_factory=dict)  # LmTrainConfig of every expert ...
    finetune_per_task: dict[str, dict[str, Any]] = Field(default_factory=dict)  # ... with per-task changes
    lora: dict[str, Any] = Field(default_factory=dict)  # mergecal.train.lm.LoraSettings of the lora regime
    finetune_lora: dict[str, Any] = Field(default_factory=dict)  # LmTrainConfig changes of its experts
    evaluation: LlmEvaluation = Field(default_factory=LlmEvaluation)

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, tasks: list[str]) -> list[str]:
        from .....data.llm import TASKS

        return _known_tasks(tasks, TASKS, "the LLM suite's tasks are")

    @field_validator("regimes")
    @classmethod
    def _regimes(cls, regimes: list[str]) -> list[str]:
        return _distinct(regimes, "regimes")

    @field_validator("paper_regimes")
    @classmethod
    def _paper_regimes(cls, regimes: list[str]) -> list[str]:
        return _distinct(regimes, "paper_regimes", at_least=0)

    @model_validator(mode="after")
    def _check(self) -> "LlmTrack":
        from .....data.llm import LlmSuiteConfig
        from .....train.lm import LmTrainConfig, LoraSettings, TinyLlamaShape

        self.data = _check_dataclass(LlmSuiteConfig, self.data, "data")
        self.shape = _check_dataclass(TinyLlamaShape, self.shape, "shape")
        self.pretrain = _check_dataclass(LmTrainConfig, self.pretrain, "pretrain")
        self.finetune = _check_dataclass(LmTrainConfig, self.finetune, "finetune")
        for task, values in self.finetune_per_task.items():
            if task not in self.tasks:
                raise ConfigValueError(f"finetune_per_task.{task}", f"not one of the track's tasks "
                                                                    f"({', '.join(self.tasks)})")
            self.finetune_per_task[task] = _check_dataclass(LmTrainConfig, {**self.finetune, **values},
                                                            f"finetune_per_task.{task}")
            self.finetune_per_task[task] = {k: self.finetune_per_task[task][k] for k in values}
        self.lora = _check_dataclass(LoraSettings, self.lora, "lora")
        self.finetune_lora = _check_dataclass(LmTrainConfig, self.finetune_lora, "finetune_lora")
        return self

    def finetune_config(self, task: str, seed: int, regime: str = "standard") -> dict[str, Any]:
        """The LmTrainConfig values of one task's expert in ``regime``."""
        lora = self.finetune_lora if regime == "lora" else {}
        return {"seed": seed, **self.finetune, **self.finetune_per_task.get(task, {}), **lora}


def _library_default_llm_tasks() -> tuple[str, ...]:
    from .....data.llm import TASKS

    return tuple(TASKS)



#: its section of ``Params`` (``mergecal.pipeline.config``, key: the track's name): (type, default)
SECTION = (LlmTrack, Field(default_factory=LlmTrack))
