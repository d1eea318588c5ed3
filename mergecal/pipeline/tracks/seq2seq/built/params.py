"""The seq2seq track's params.yaml section (``seq2seq:``)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .....config_types import Count
from ....params_base import Strict, _check_dataclass, _distinct, _known_tasks

#: its regimes: the experts fully fine-tuned (SVC's T5 rows) or tuned with IA³ (SVC's and MAGIC's T0 rows)
REGIMES = ("standard", "ia3")
Regime = Literal["standard", "ia3"]
#: the LLM suite's tasks a tiny T5 learns: ``knowledge`` (a held-out word's category, recalled from pretraining) is
#: left out, as span corruption does not teach it to a model of this size (docs/seq2seq.md: its expert at chance)
DEFAULT_TASKS = ("maximum", "sentiment")


class Seq2SeqEvaluation(Strict):
    """Rank classification of a seq2seq track: examples per task on validation (choosing the scaling; the whole
    split when larger) and the batch size of the scorer."""

    max_validation: Count = 150
    batch_size: Count = 64


class Seq2SeqTrack(Strict):
    """The seq2seq track: a tiny T5 pretrained by span corruption on the LLM suite's corpus, one expert per task
    and regime, merged and scored T0-style (rank classification) on the suite's tasks in text-to-text form. Its
    regimes run in the papers' profile only (``paper_regimes``; the default run's ``regimes`` are none), so that
    ``make run`` keeps its cost."""

    enabled: bool = True  # False: its cells are in no matrix, not even the papers' experiments
    backbone: str = Field("tiny-t5", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    task_set: str = "llm2"
    tasks: list[str] = Field(default_factory=lambda: list(DEFAULT_TASKS))
    regimes: list[Regime] = Field(default_factory=list)  # in the default run's matrix
    paper_regimes: list[Regime] = Field(default_factory=lambda: list(REGIMES))  # built by `make paper`
    data: dict[str, Any] = Field(default_factory=dict)  # mergecal.data.llm.LlmSuiteConfig
    shape: dict[str, Any] = Field(default_factory=dict)  # mergecal.train.seq2seq.TinyT5Shape
    pretrain: dict[str, Any] = Field(default_factory=dict)  # mergecal.train.seq2seq.Seq2SeqTrainConfig
    finetune: dict[str, dict[str, Any]] = Field(default_factory=dict)  # per regime: Seq2SeqTrainConfig values
    evaluation: Seq2SeqEvaluation = Field(default_factory=Seq2SeqEvaluation)

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, tasks: list[str]) -> list[str]:
        from .....data.llm import TASKS

        return _known_tasks(tasks, TASKS, "the LLM suite's tasks are")

    @field_validator("regimes", "paper_regimes")
    @classmethod
    def _regimes(cls, regimes: list[str]) -> list[str]:
        return _distinct(regimes, "regimes", at_least=0)

    @model_validator(mode="after")
    def _check(self) -> "Seq2SeqTrack":
        from .....config_types import ConfigValueError
        from .....data.llm import LlmSuiteConfig
        from .....train.seq2seq import Seq2SeqTrainConfig, TinyT5Shape

        self.data = _check_dataclass(LlmSuiteConfig, self.data, "data")
        self.shape = _check_dataclass(TinyT5Shape, self.shape, "shape")
        self.pretrain = _check_dataclass(Seq2SeqTrainConfig, self.pretrain, "pretrain")
        for regime, values in self.finetune.items():
            if regime not in REGIMES:
                raise ConfigValueError(f"finetune.{regime}", f"not a regime ({', '.join(REGIMES)})")
            self.finetune[regime] = _check_dataclass(Seq2SeqTrainConfig, values, f"finetune.{regime}")
        both = [r for r in self.paper_regimes if r in self.regimes]
        if both:
            raise ConfigValueError("paper_regimes", f"{both[0]!r} is already in regimes (the default run's)")
        return self

    def finetune_config(self, regime: str, seed: int) -> dict[str, Any]:
        """The Seq2SeqTrainConfig values of a regime's experts."""
        return {**self.finetune.get(regime, {}), "seed": seed}


#: its section of ``Params`` (``mergecal.pipeline.config``, key: the track's name): (type, default)
SECTION = (Seq2SeqTrack, Field(default_factory=Seq2SeqTrack))
