"""The text track's params.yaml section (``text:``)."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator, model_validator

from .....regimes import Objective
from ....params_base import Strict, _check_dataclass, _distinct, _known_tasks


def _library_default_tasks() -> tuple[str, ...]:
    from .....data.text import DEFAULT_TASKS

    return DEFAULT_TASKS


class TextTrack(Strict):
    """The MiniLM track: the packaged pretrained encoder, a head per task, merged encoders scored per head."""

    enabled: bool = True  # as vision: False leaves the cells out; the text stages always build the track
    backbone: str = Field("minilm", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    task_set: str = "text4"
    tasks: list[str] = Field(default_factory=lambda: list(_library_default_tasks()))
    regimes: list[Objective] = Field(default_factory=lambda: ["standard"])  # no norm-mismatch variant here
    data: dict[str, Any] = Field(default_factory=dict)
    finetune: dict[str, Any] = Field(default_factory=dict)

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, tasks: list[str]) -> list[str]:
        from .....data.text import ALL_TASKS

        return _known_tasks(tasks, ALL_TASKS, "choose from")

    @field_validator("regimes")
    @classmethod
    def _regimes(cls, regimes: list[str]) -> list[str]:
        return _distinct(regimes, "regimes")

    @model_validator(mode="after")
    def _check(self) -> "TextTrack":
        from .....data.text import TextSuiteConfig
        from .....train.finetune_text import TextFinetuneConfig

        self.data = _check_dataclass(TextSuiteConfig, self.data, "data")
        self.finetune = _check_dataclass(TextFinetuneConfig, self.finetune, "finetune")
        return self



#: its section of ``Params`` (``mergecal.pipeline.config``, key: the track's name): (type, default)
SECTION = (TextTrack, Field(default_factory=TextTrack))
