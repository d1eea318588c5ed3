"""The params.yaml section of seq2seq tracks from local directories (``local_seq2seq:``, a list)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from .....config_types import ConfigValueError, Count
from ....params_base import MIN_TEST_EXAMPLES, Strict, _check_dataclass
from ..built.params import Seq2SeqEvaluation


class LocalSeq2SeqTrack(Strict):
    """A seq2seq family from local Hugging Face directories (a lab's own T5 / T0 checkpoints): a base model
    (``config.json``, tokenizer files, ``*.safetensors``: pickled weights are never read) and one expert per task,
    all of the ``regime``'s kind: ``standard``, full fine-tuned model directories; ``ia3``, PEFT IA³ adapter
    directories (merged in vector form, as the TIES and MAGIC papers merge T0's IA³ experts); ``lora``, PEFT LoRA
    adapter directories (a delta per target matrix). Merged by the library and scored T0-style, by rank
    classification, as the ``seq2seq`` track. Tasks come from the suite (``task_dir`` unset: expert keys are suite
    task names, whose text-to-text data the ``local_tracks`` stage generates with ``data``) or from a directory of
    the lab's own (``task_dir``: ``<task>/validation.jsonl`` and ``<task>/test.jsonl``, one example per line,
    ``{"input": str, "choices": [str, ...], "label": int}``). Relative paths are relative to the repository root.
    Nothing is downloaded and nothing is copied: the stages record each file's size and sha256. A task with fewer
    than ``min_test`` test examples is refused (``MIN_TEST_EXAMPLES``)."""

    enabled: bool = True
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # the backbone label of the leaderboard
    task_set: str = Field("local", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    base: str = Field(min_length=1)
    experts: dict[str, str]
    regime: Literal["standard", "ia3", "lora"] = "standard"  # the experts' kind: full models, IA³ or LoRA adapters
    task_dir: str | None = None
    data: dict[str, Any] = Field(default_factory=dict)  # without task_dir: mergecal.data.llm.LlmSuiteConfig
    evaluation: Seq2SeqEvaluation = Field(default_factory=Seq2SeqEvaluation)
    min_test: Count = MIN_TEST_EXAMPLES

    @field_validator("experts")
    @classmethod
    def _experts(cls, experts: dict[str, str]) -> dict[str, str]:
        for task, path in experts.items():
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", task):
                raise ConfigValueError(task, "a name: letters, digits, '.', '_' or '-'")
            if not path:
                raise ConfigValueError(task, "expected a model or adapter directory")
        if len(experts) < 2:
            raise ConfigValueError("experts", f"expected at least 2 experts to merge (task: directory), got "
                                              f"{len(experts)}")
        return experts

    @model_validator(mode="after")
    def _check(self) -> "LocalSeq2SeqTrack":
        from .....data.llm import TASKS, LlmSuiteConfig

        if self.task_dir is None:
            unknown = [t for t in self.experts if t not in TASKS]
            if unknown:
                raise ConfigValueError(f"experts.{unknown[0]}", f"not a task of the suite ({', '.join(TASKS)}); "
                                                                "for your own tasks set task_dir")
            self.data = _check_dataclass(LlmSuiteConfig, self.data, "data")
        elif self.data:
            raise ConfigValueError("data", "only without task_dir (the suite's data settings)")
        return self

    @property
    def task_names(self) -> list[str]:
        return list(self.experts)


#: its section of ``Params`` (``mergecal.pipeline.config``, key: the track's name): (type, default)
SECTION = (list[LocalSeq2SeqTrack], Field(default_factory=list))  # seq2seq tracks from local directories
