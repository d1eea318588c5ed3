"""The params.yaml section of LLM tracks from local directories (``local_llm:``, a list)."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import Field, field_validator, model_serializer, model_validator

from .....config_types import ConfigValueError, Count
from ....params_base import MIN_TEST_EXAMPLES, Strict, _check_dataclass
from ..params import LlmEvaluation


class LocalLmTask(Strict):
    """A task of a user's lm-eval YAML directory: the metric the leaderboard reads (as lm-eval names it, e.g.
    ``acc`` or ``exact_match``) and the lm-eval task scoring the validation split (the scaling is chosen on
    it); by convention ``<task>_validation``."""

    metric: str = Field(min_length=1)
    validation: str | None = None


class LocalLlmTrack(Strict):
    """An LLM family from local Hugging Face directories (a lab's own checkpoints): a base model and one expert
    fine-tuned from it per task, merged checkpoint to checkpoint and scored with lm-eval, as the embedded LLM
    track. Tasks come from the suite (``task_dir`` unset: expert keys are suite task names, whose data the
    ``local_tracks`` stage generates with ``data``) or from a directory of the user's lm-eval YAMLs
    (``task_dir``, with ``tasks.<task>.metric`` and ``.validation``) or from lm-eval's own registry
    (``task_source: registry``, with ``tasks.<task>.metric``: expert keys are registry task names whose datasets
    must be in the local HF datasets cache; splits: ``mergecal.evaluation.lm_eval_registry``). Relative paths
    are relative to the repository root. Nothing is downloaded and nothing is copied: the stages record each
    file's size and sha256. Pickled weights (pytorch_model*.bin) are never unpickled: without
    ``allow_unsafe_pickle`` such an expert is refused; with it, the error names the file and how to convert it
    to safetensors. A task YAML with ``!function`` entries (lm-eval imports and runs the Python file beside it)
    is refused unless ``trust_task_code`` (as ``trust_remote_code``: for a folder you trust). A task with fewer
    than ``min_test`` test documents is refused (``MIN_TEST_EXAMPLES``). ``unscored`` experts (name: model
    directory) are merged with the others but have no task here: the published pair WizardMath-7B-V1.0 +
    Llama-2-7b-chat is scored on GSM8K only (its chat expert's AlpacaEval needs a judge model lm-eval does not run);
    they take no part in the ``finetuned`` row or the normalized scores, and every merge cell reads them.
    ``align_vocabulary``: experts may add tokens after the base's vocabulary (WizardMath-7B-V1.0's ``[PAD]``), given
    mean rows where a model lacks one, as DARE's code aligns them (``mergecal.backbones.vocabulary``). An expert may
    be a PEFT adapter directory (LoRA or IA³) over ``base``: applied to it as peft's ``merge_and_unload`` applies it
    (``stages.expert_model_dir``)."""

    enabled: bool = True
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # the backbone label of the leaderboard
    task_set: str = Field("local", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    base: str = Field(min_length=1)
    experts: dict[str, str]
    unscored: dict[str, str] = Field(default_factory=dict)  # experts merged with the others, no task of their own
    task_dir: str | None = None
    task_source: Literal["suite", "task_dir", "registry"] | None = None  # unset: task_dir if given, else suite
    tasks: dict[str, LocalLmTask] = Field(default_factory=dict)  # with task_dir: one entry per expert
    data: dict[str, Any] = Field(default_factory=dict)  # without task_dir: mergecal.data.llm.LlmSuiteConfig
    evaluation: LlmEvaluation = Field(default_factory=LlmEvaluation)
    allow_unsafe_pickle: bool = False
    # experts may add tokens after the base's vocabulary (WizardMath's [PAD]): aligned as DARE's code does
    # (mergecal.backbones.vocabulary); off, an expert with another vocab_size or tokenizer is refused
    align_vocabulary: bool = False
    trust_task_code: bool = False  # task_dir only: let lm-eval run the `!function` code of the task YAMLs
    min_test: Count = MIN_TEST_EXAMPLES
    # the preset it was built from (mergecal.presets); not in model_dump, so not in cell ids (its values are)
    preset: str | None = Field(None, exclude=True)

    @model_serializer(mode="wrap")
    def _dump(self, handler):
        # options at their default are left out of dumps, so the cell ids of tracks written before them are unchanged
        out = handler(self)
        if not self.unscored:
            out.pop("unscored", None)
        if not self.align_vocabulary:
            out.pop("align_vocabulary", None)
        return out

    @model_validator(mode="before")
    @classmethod
    def _preset(cls, values: Any) -> Any:
        """``preset: <name>`` (and ``preset_tasks``): a published pool's settings, the track's own keys winning
        (``mergecal.presets``)."""
        from .....presets import expand

        return expand(values, "local_llm")

    @field_validator("experts", "unscored")
    @classmethod
    def _experts(cls, experts: dict[str, str]) -> dict[str, str]:
        for task, path in experts.items():
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", task):
                raise ConfigValueError(task, "a name: letters, digits, '.', '_' or '-'")
            if not path:
                raise ConfigValueError(task, "expected a model directory")
        return experts

    @model_validator(mode="after")
    def _count(self) -> "LocalLlmTrack":
        if not self.experts:
            raise ConfigValueError("experts", "expected at least one expert with a task (task: model directory)")
        if len(self.experts) + len(self.unscored) < 2:
            raise ConfigValueError("experts", f"expected at least 2 experts to merge (task: model directory; or "
                                              f"more in unscored), got {len(self.experts)}")
        both = [name for name in self.unscored if name in self.experts]
        if both:
            raise ConfigValueError(f"unscored.{both[0]}", "also an expert with a task: name each expert once")
        return self

    @model_validator(mode="after")
    def _check(self) -> "LocalLlmTrack":
        from .....data.llm import TASKS, LlmSuiteConfig

        if self.task_source == "task_dir" and self.task_dir is None:
            raise ConfigValueError("task_dir", "missing: task_source: task_dir names a directory of lm-eval YAMLs")
        if self.task_source == "suite" and self.task_dir is not None:
            raise ConfigValueError("task_dir", "not with task_source: suite (the suite's own YAMLs)")
        if self.trust_task_code and self.source != "task_dir":
            raise ConfigValueError("trust_task_code", "only with task_dir (the suite's YAMLs hold no code; registry "
                                                      "tasks run lm-eval's own)")
        if self.source == "registry":
            return self._check_registry()
        if self.task_dir is None:
            unknown = [t for t in self.experts if t not in TASKS]
            if unknown:
                raise ConfigValueError(f"experts.{unknown[0]}", f"not a task of the LLM suite ({', '.join(TASKS)});"
                                                                " for your own lm-eval YAMLs set task_dir")
            if self.tasks:
                raise ConfigValueError("tasks", "only with task_dir (the suite's tasks have their own metric)")
            self.data = _check_dataclass(LlmSuiteConfig, self.data, "data")
            n_test = LlmSuiteConfig(**self.data).n_test
            if n_test < self.min_test:
                raise ConfigValueError("data.n_test", f"{n_test} test documents per task, fewer than min_test "
                                                      f"{self.min_test}")
            return self
        if self.data:
            raise ConfigValueError("data", "only without task_dir (data of the suite's tasks)")
        for task in self.experts:
            if task not in self.tasks:
                raise ConfigValueError(f"tasks.{task}", "missing: give the metric (and the validation task) of "
                                                        "every expert's task")
            if self.tasks[task].validation is None:
                self.tasks[task].validation = f"{task}_validation"
        extra = [t for t in self.tasks if t not in self.experts]
        if extra:
            raise ConfigValueError(f"tasks.{extra[0]}", "no expert for this task")
        return self

    def _check_registry(self) -> "LocalLlmTrack":
        """lm-eval's registry tasks: a metric per expert, no task_dir, data or validation name (the split the
        scaling is chosen on follows from the task's splits). Whether each name is a registry task with its
        dataset cached is checked when the track is scored (indexing the registry takes tens of seconds)."""
        for key in ("task_dir", "data"):
            if getattr(self, key):
                raise ConfigValueError(key, "not with task_source: registry (lm-eval's own task definitions)")
        for task in self.experts:
            if task not in self.tasks:
                raise ConfigValueError(f"tasks.{task}", "missing: give the metric of every expert's task")
            if self.tasks[task].validation is not None:
                raise ConfigValueError(f"tasks.{task}.validation", "not with task_source: registry (the scaling is "
                                                                   "chosen on the task's validation or train split)")
        extra = [t for t in self.tasks if t not in self.experts]
        if extra:
            raise ConfigValueError(f"tasks.{extra[0]}", "no expert for this task")
        return self

    @property
    def source(self) -> str:
        """Where the tasks come from: suite, task_dir or registry."""
        return self.task_source or ("suite" if self.task_dir is None else "task_dir")

    @property
    def task_names(self) -> list[str]:
        return list(self.experts)

    @property
    def merged_names(self) -> list[str]:
        """Every expert a merge reads: the scored ones in task order, then the unscored."""
        return [*self.experts, *self.unscored]

    def expert_of(self, name: str) -> str:
        """The model directory of an expert, scored or unscored, as params.yaml gives it."""
        return self.experts[name] if name in self.experts else self.unscored[name]



#: its section of ``Params`` (``mergecal.pipeline.config``, key: the track's name): (type, default)
SECTION = (list[LocalLlmTrack], Field(default_factory=list))  # LLM tracks from local directories
