"""``params.yaml``: the benchmark matrix and every setting of the pipeline, validated on load.

One pydantic model per section, ``extra="forbid"`` everywhere, so a typo is one clear message naming the
dotted path and listing what is allowed. Sections that configure library objects (suite sizes, trainers,
DisTaC, probing, merge methods, recipes) are additionally validated by building those objects, so the
pipeline accepts exactly what the library accepts. Those library modules are imported inside the validators
that build them: importing this module (the command line does, before it knows its command) loads no torch.

Cells of the matrix: track (backbone × task set) × regime × merge method × calibration chain. A chain is a
recipe with ``{merge}`` standing for the merge method, e.g. ``"{merge}>svc"`` or ``"distac>{merge}>svc>dsc"``.
"""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..config_types import (ConfigValueError, Count, NonNegativeInt, NonNegativeReal, PositiveReal, ThreadCount,
                            WorkerCount, check_config)
from ..errors import MergecalError, ParameterError
from ..regimes import DISTAC_PRESETS, OBJECTIVE_OF_REGIME, REGIMES, Objective, Regime


class Strict(BaseModel):
    # strict: "120" is no count and "yes" no flag; reals use config_types.Real, which reads YAML's 1e-5 text
    model_config = ConfigDict(extra="forbid", strict=True)


def _check_dataclass(cls: type, values: dict[str, Any], where: str) -> dict[str, Any]:
    """Validate a section against the library's dataclass config (its fields carry the types and ranges: one
    source of truth), so a wrong name or value fails at load time naming ``where.field``. Returns the values
    given, as validated (YAML's text "1e-5" becomes the number)."""
    try:
        built = check_config(cls, values)
    except ConfigValueError as err:
        raise ConfigValueError(f"{where}.{err.key}" if err.key else where, str(err)) from None
    return {name: getattr(built, name) for name in values}


def _library_default(module: str, cls: str, field: str) -> Any:
    """A default the schema shares with a library config dataclass: read from it, not written twice."""
    import dataclasses
    import importlib

    config = getattr(importlib.import_module(f"mergecal.{module}"), cls)
    return next(f.default for f in dataclasses.fields(config) if f.name == field)


def _known_tasks(tasks: list[str], allowed, listing: str) -> list[str]:
    """``tasks`` if each is one of ``allowed`` and there are at least two, distinct; else a ValueError naming
    the first unknown one and ``listing: <allowed>``."""
    unknown = [t for t in tasks if t not in allowed]
    if unknown:
        raise ValueError(f"unknown task {unknown[0]!r}; {listing}: {', '.join(allowed)}")
    return _distinct(tasks, "tasks", at_least=2)


def _distinct(values: list[str], what: str, at_least: int = 1) -> list[str]:
    if len(values) < at_least:
        raise ValueError(f"expected at least {at_least} {what}, got {len(values)}")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise ValueError(f"{what} must be distinct; {repeated[0]!r} is listed twice")
    return values


class VisionTrack(Strict):
    """The open_clip track: a small ViT pretrained by the project, fine-tuned per task (image encoder only)."""

    enabled: bool = True  # False leaves the track's cells out of the matrix (its DVC stages still build it)
    backbone: str = Field("clip-tiny", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # a directory name under models/
    arch: str = Field(default_factory=lambda: _library_default("train.pretrain_clip", "PretrainConfig", "arch"))
    # which procedural datasets are generated and what pretraining shows (mergecal.data.vision.TASK_SETS)
    task_set: str = Field(default_factory=lambda: _library_default("data.vision", "SuiteConfig", "task_set"))
    tasks: list[str] | None = None  # None: every task of the task set
    regimes: list[Regime] = Field(default_factory=lambda: list(REGIMES))
    # fine-tuned for every task (DVC stage `finetune`); `norm_mismatch` adds one task at a higher lr
    finetune_variants: list[Objective] = Field(
        default_factory=lambda: ["standard", "low_confidence"])
    norm_mismatch_task: str | None = None  # None: the first task
    norm_mismatch_lr_multiplier: PositiveReal = 10.0
    data: dict[str, Any] = Field(default_factory=dict)
    pretrain: dict[str, Any] = Field(default_factory=dict)
    finetune: dict[str, Any] = Field(default_factory=dict)

    @field_validator("arch")
    @classmethod
    def _arch(cls, arch: str) -> str:
        from ..backbones.architectures import ARCHITECTURES

        if arch not in ARCHITECTURES:  # the track pretrains its own CLIP: one of the project's architectures
            raise ValueError(f"unknown architecture {arch!r}; choose from: {', '.join(ARCHITECTURES)}")
        return arch

    @field_validator("task_set")
    @classmethod
    def _task_set(cls, task_set: str) -> str:
        from ..data.vision import TASK_SETS

        if task_set not in TASK_SETS:
            raise ValueError(f"unknown task set {task_set!r}; choose from: {', '.join(TASK_SETS)}")
        return task_set

    @model_validator(mode="after")
    def _tasks(self) -> "VisionTrack":
        from ..data.vision import TASK_SETS

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

    @field_validator("regimes", "finetune_variants")
    @classmethod
    def _lists(cls, values: list[str]) -> list[str]:
        return _distinct(values, "entries")

    @model_validator(mode="after")
    def _check(self) -> "VisionTrack":
        from ..data.vision import SuiteConfig
        from ..train.finetune import FinetuneConfig
        from ..train.pretrain_clip import PretrainConfig

        for regime in self.regimes:
            if OBJECTIVE_OF_REGIME[regime] not in self.finetune_variants:
                raise ValueError(f"regime {regime!r} needs {OBJECTIVE_OF_REGIME[regime]!r} in finetune_variants")
        if "norm_mismatch" in self.regimes and self.norm_mismatch_task not in self.tasks:
            raise ValueError(f"norm_mismatch_task {self.norm_mismatch_task!r} is not one of the track's tasks")
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


def _library_default_tasks() -> tuple[str, ...]:
    from ..data.text import DEFAULT_TASKS

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
        from ..data.text import ALL_TASKS

        return _known_tasks(tasks, ALL_TASKS, "choose from")

    @field_validator("regimes")
    @classmethod
    def _regimes(cls, regimes: list[str]) -> list[str]:
        return _distinct(regimes, "regimes")

    @model_validator(mode="after")
    def _check(self) -> "TextTrack":
        from ..data.text import TextSuiteConfig
        from ..train.finetune_text import TextFinetuneConfig

        self.data = _check_dataclass(TextSuiteConfig, self.data, "data")
        self.finetune = _check_dataclass(TextFinetuneConfig, self.finetune, "finetune")
        return self


class LlmEvaluation(Strict):
    """lm-eval settings of the LLM track: documents per task on validation (choosing the scaling; all of them
    when larger than the split) and the batch size of each lm-eval scoring call."""

    max_validation: Count = 150
    batch_size: Count = 32


class LlmTrack(Strict):
    """The LLM track: a tiny Llama pretrained by the project on the synthetic corpus, one fine-tuned expert
    per task, merged experts scored with lm-eval on the suite's local task YAMLs."""

    enabled: bool = True  # as vision: False leaves the cells out; the LLM stages always build the track
    backbone: str = Field("tiny-llama", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    task_set: str = "llm3"
    tasks: list[str] = Field(default_factory=lambda: list(_library_default_llm_tasks()))
    regimes: list[Literal["standard"]] = Field(default_factory=lambda: ["standard"])  # no regime variants yet
    data: dict[str, Any] = Field(default_factory=dict)  # mergecal.data.llm.LlmSuiteConfig
    shape: dict[str, Any] = Field(default_factory=dict)  # mergecal.train.lm.TinyLlamaShape
    pretrain: dict[str, Any] = Field(default_factory=dict)  # mergecal.train.lm.LmTrainConfig
    finetune: dict[str, Any] = Field(default_factory=dict)  # LmTrainConfig of every expert ...
    finetune_per_task: dict[str, dict[str, Any]] = Field(default_factory=dict)  # ... with per-task changes
    evaluation: LlmEvaluation = Field(default_factory=LlmEvaluation)

    @field_validator("tasks")
    @classmethod
    def _tasks(cls, tasks: list[str]) -> list[str]:
        from ..data.llm import TASKS

        return _known_tasks(tasks, TASKS, "the LLM suite's tasks are")

    @field_validator("regimes")
    @classmethod
    def _regimes(cls, regimes: list[str]) -> list[str]:
        return _distinct(regimes, "regimes")

    @model_validator(mode="after")
    def _check(self) -> "LlmTrack":
        from ..data.llm import LlmSuiteConfig
        from ..train.lm import LmTrainConfig, TinyLlamaShape

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
        return self

    def finetune_config(self, task: str, seed: int) -> dict[str, Any]:
        """The LmTrainConfig values of one task's expert."""
        return {"seed": seed, **self.finetune, **self.finetune_per_task.get(task, {})}


def _library_default_llm_tasks() -> tuple[str, ...]:
    from ..data.llm import TASKS

    return tuple(TASKS)


# Fewest test examples (images, documents) per task an own-model track is scored on (`min_test`): at 50 an
# accuracy near 0.5 has a binomial standard error of sqrt(0.25 / 50) = 0.07 (a 95% interval of +-14 points);
# below it a score says little (one image scores 0 or 1).
MIN_TEST_EXAMPLES = 50


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
    than ``min_test`` test documents is refused (``MIN_TEST_EXAMPLES``)."""

    enabled: bool = True
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # the backbone label of the leaderboard
    task_set: str = Field("local", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    base: str = Field(min_length=1)
    experts: dict[str, str]
    task_dir: str | None = None
    task_source: Literal["suite", "task_dir", "registry"] | None = None  # unset: task_dir if given, else suite
    tasks: dict[str, LocalLmTask] = Field(default_factory=dict)  # with task_dir: one entry per expert
    data: dict[str, Any] = Field(default_factory=dict)  # without task_dir: mergecal.data.llm.LlmSuiteConfig
    evaluation: LlmEvaluation = Field(default_factory=LlmEvaluation)
    allow_unsafe_pickle: bool = False
    trust_task_code: bool = False  # task_dir only: let lm-eval run the `!function` code of the task YAMLs
    min_test: Count = MIN_TEST_EXAMPLES

    @field_validator("experts")
    @classmethod
    def _experts(cls, experts: dict[str, str]) -> dict[str, str]:
        if len(experts) < 2:
            raise ValueError(f"expected at least 2 experts (task: model directory), got {len(experts)}")
        for task, path in experts.items():
            if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", task):
                raise ConfigValueError(task, "a task name: letters, digits, '.', '_' or '-'")
            if not path:
                raise ConfigValueError(task, "expected a model directory")
        return experts

    @model_validator(mode="after")
    def _check(self) -> "LocalLlmTrack":
        from ..data.llm import TASKS, LlmSuiteConfig

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


WEIGHT_SUFFIXES = (".safetensors", ".pt", ".pth", ".bin", ".ckpt")  # a file; anything else is a directory


class LocalClipEvaluation(Strict):
    """Images per task of a local CLIP track: a seeded subset of validation (choosing the scaling) and of test
    (``max_test: null``: the whole test split), and the evaluation batch size."""

    batch_size: Count = 128
    max_validation: Count = 512
    max_test: Count | None = None


class LocalClipModel(Strict):
    """The pretrained CLIP of a local track: an open_clip weights file with its architecture (``arch``, e.g.
    ViT-B-32-quickgelu for OpenAI's weights), or a Hugging Face CLIP directory (``arch`` unset: read from its
    config.json)."""

    pretrained: str = Field(min_length=1)
    arch: str | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _arch(self) -> "LocalClipModel":
        is_file = self.pretrained.endswith(WEIGHT_SUFFIXES)
        if is_file and self.arch is None:
            raise ConfigValueError("arch", "required with a weights file: its open_clip architecture, e.g. "
                                           "ViT-B-32-quickgelu")
        if not is_file and self.arch is not None:
            raise ConfigValueError("arch", "only with a weights file (a Hugging Face directory names its own)")
        return self


class LocalClipTrack(Strict):
    """A lab's own CLIP checkpoints and datasets: the pretrained model, one fine-tuned checkpoint per task (an
    open_clip state dict in safetensors, a Hugging Face CLIP(Vision)Model directory, or, with
    ``allow_unsafe_pickle``, a pickled file such as task_vectors' finetuned.pt) and one local dataset per task
    (the data location holding it in any layout ``mergecal.data.real_vision`` reads). Tasks are the eight
    standard vision tasks (their names as ``real_vision`` spells them, case ignored); ``class_names`` and
    ``templates`` replace a task's standard ones in its zero-shot head (as many names as the task's classes).
    Relative paths are relative to the repository root. Nothing is copied or downloaded. A task with fewer
    than ``min_test`` test images is refused (``MIN_TEST_EXAMPLES``)."""

    enabled: bool = True
    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")  # the backbone label of the leaderboard
    task_set: str = Field("local", pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
    model: LocalClipModel
    finetuned: dict[str, str]
    datasets: dict[str, str]
    class_names: dict[str, list[str]] = Field(default_factory=dict)
    templates: dict[str, list[str]] = Field(default_factory=dict)
    evaluation: LocalClipEvaluation = Field(default_factory=LocalClipEvaluation)
    # DisTaC of the track's `distac>` chains: the paper's norm_mismatch preset (500 steps, batch 128, lr 1e-5),
    # these values overriding it (not the shared `distac:` section, which is the embedded testbed's)
    distac: dict[str, Any] = Field(default_factory=dict)
    allow_unsafe_pickle: bool = False
    min_test: Count = MIN_TEST_EXAMPLES

    @field_validator("distac")
    @classmethod
    def _distac(cls, values: dict[str, Any]) -> dict[str, Any]:
        from ..calibrations.distac import DistacStepParams
        from ..methods.base import build_params

        try:
            build_params(DistacStepParams, "distac", {"preset": "norm_mismatch", **values})
        except MergecalError as err:
            raise ValueError(str(err)) from None
        return values

    def distac_step(self):
        """The track's DisTaC step: the paper's preset for models without a known failure mode (the vision
        track's standard regime: norm matching, ``mergecal.regimes.DISTAC_PRESETS``), then ``distac``."""
        from ..calibrations.distac import DistacStepParams
        from ..methods.base import build_params

        return build_params(DistacStepParams, "distac", {"preset": DISTAC_PRESETS["standard"], **self.distac})

    @field_validator("finetuned")
    @classmethod
    def _finetuned(cls, finetuned: dict[str, str]) -> dict[str, str]:
        from ..data.real_vision import canonical_task
        from ..data.real_vision_metadata import REAL_TASKS

        if len(finetuned) < 2:
            raise ValueError(f"expected at least 2 fine-tuned checkpoints (task: path), got {len(finetuned)}")
        for task, path in finetuned.items():
            try:
                canonical_task(task)
            except MergecalError:
                raise ConfigValueError(task, f"not one of the vision tasks ({', '.join(REAL_TASKS)})") from None
            if not path:
                raise ConfigValueError(task, "expected a checkpoint file or directory")
        return finetuned

    @model_validator(mode="after")
    def _check(self) -> "LocalClipTrack":
        from ..data.real_vision import canonical_task
        from ..data.real_vision_metadata import CLASSNAMES

        for task in self.finetuned:
            if not self.datasets.get(task):
                raise ConfigValueError(f"datasets.{task}", "missing: the data location holding this task's dataset")
        for section in ("datasets", "class_names", "templates"):
            extra = [t for t in getattr(self, section) if t not in self.finetuned]
            if extra:
                raise ConfigValueError(f"{section}.{extra[0]}", "no fine-tuned checkpoint for this task")
        canonical = [canonical_task(t) for t in self.finetuned]
        if len(set(canonical)) != len(canonical):
            raise ConfigValueError("finetuned", "two entries name the same task")
        if self.evaluation.max_test is not None and self.evaluation.max_test < self.min_test:
            raise ConfigValueError("evaluation.max_test", f"{self.evaluation.max_test} images, fewer than min_test "
                                                          f"{self.min_test}")
        for task, names in self.class_names.items():
            expected = len(CLASSNAMES[canonical_task(task)])
            if len(names) != expected or not all(names):
                raise ConfigValueError(f"class_names.{task}", f"{len(names)} names, but {canonical_task(task)} has "
                                                              f"{expected} classes (labels of its dataset)")
        for task, templates in self.templates.items():
            bad = next((t for t in templates if t.count("{}") != 1), None) if templates else "(none)"
            if bad is not None:
                raise ConfigValueError(f"templates.{task}", f"each template needs one '{{}}' for the class name, "
                                                            f"got {bad!r}")
        return self

    @property
    def task_names(self) -> list[str]:
        return list(self.finetuned)


class Probing(Strict):
    """MAGIC's magnitude-sensitivity probe: scale each key's slice of the weight-averaged task vector by
    ``scale`` and rank keys by the score drop on the probe set (which is none of the tasks). ``metric``:
    ``accuracy`` (MAGIC's) or ``nll`` (true-class log-likelihood); ``candidates``: ``layers`` (the weight
    matrices WSC calibrates, rule ``wsc_weights``) or ``all`` float keys (``mergecal.calibrations.probing``)."""

    scale: PositiveReal = 1.1
    top: NonNegativeInt = 10
    max_samples: Count = 500
    metric: Literal["accuracy", "nll"] = "nll"
    candidates: Literal["layers", "all"] = "layers"
    key_pattern: str | None = None

    @property
    def key_rule(self) -> str | None:
        """The ``mergecal.keys`` rule the candidates follow (None: every float key)."""
        return "wsc_weights" if self.candidates == "layers" else None

    @field_validator("key_pattern")
    @classmethod
    def _pattern(cls, pattern: str | None) -> str | None:
        if pattern is not None:
            try:
                re.compile(pattern)
            except re.error as err:
                raise ValueError(f"not a regular expression ({err})") from None
        return pattern


class Evaluation(Strict):
    batch_size: Count = 256
    max_validation: Count = 200  # validation examples per task for choosing the scaling
    distac_samples: Count = 512  # unlabeled train samples per task for DisTaC


def _check_chain(chain: str) -> None:
    """A chain template: ``{merge}`` exactly once, a valid recipe around it."""
    from ..recipe import Recipe

    if chain.count("{merge}") != 1:
        raise ValueError(f"chain {chain!r} must contain '{{merge}}' exactly once")
    if "{merge}(" in chain:  # the cells take the merge's parameters from benchmark.merges, never from the chain
        raise ValueError(f"chain {chain!r}: give the merge's parameters under benchmark.merges (a fixed scaling "
                         "under benchmark.fixed_scaling), not on '{merge}'")
    try:
        Recipe.parse(chain.replace("{merge}", "task_arithmetic"))
    except MergecalError as err:
        raise ValueError(f"chain {chain!r}: {err}") from None


class FixedScaling(Strict):
    """A paper's protocol that fixes the merge's scaling instead of searching it on validation: ``chains`` at
    ``scaling`` for ``merges`` (empty: every merge of the matrix). Its rows are named ``<calibration>@λ=<scaling>``
    and compared with ``none@λ=<scaling>``, the merge at that scaling (list ``{merge}`` among the chains)."""

    scaling: PositiveReal
    chains: list[str] = Field(min_length=1)
    merges: list[str] = Field(default_factory=list)

    @field_validator("chains")
    @classmethod
    def _chains(cls, chains: list[str]) -> list[str]:
        for chain in chains:
            _check_chain(chain)
        if len(set(chains)) != len(chains):
            raise ValueError("chains must be distinct")
        return chains


class Benchmark(Strict):
    """The merge × calibration part of the matrix. ``merges`` maps a method to its parameters; a list value
    for ``scaling`` is a grid searched on the validation split (by average normalized accuracy).

    ``calibrated_scaling`` says where a calibrated chain (one with svc/wsc/fsc/dsc steps) gets the merge's
    scaling from: ``selected`` (default) takes the value its uncalibrated cell chose on validation (tune the
    merge, then correct it: one merge per cell); ``grid`` searches the grid again with the calibration
    applied (joint search, |grid| merges and calibrations per cell). A chain whose calibrations all read the
    merge at scaling 1 (SVC's protocol) always searches the grid with the calibration in place.
    ``fixed_scaling``: the papers' fixed-scaling protocols beside the searched rows (``FixedScaling``)."""

    merges: dict[str, dict[str, Any] | None] = Field(
        default_factory=lambda: {"task_arithmetic": {"scaling": [0.1, 0.3, 0.5]}})
    chains: list[str] = Field(default_factory=lambda: ["{merge}"])
    calibrated_scaling: Literal["selected", "grid"] = "selected"
    fixed_scaling: list[FixedScaling] = Field(default_factory=list)
    evaluation: Evaluation = Field(default_factory=Evaluation)

    @field_validator("merges")
    @classmethod
    def _merges(cls, merges: dict[str, dict[str, Any] | None]) -> dict[str, dict[str, Any]]:
        from ..methods import MERGE_METHODS
        from ..methods.base import build_params

        if not merges:
            raise ValueError("at least one merge method is required")
        for name, values in merges.items():
            if name not in MERGE_METHODS:
                raise ValueError(f"unknown merge method {name!r}; choose from: {', '.join(MERGE_METHODS)}")
            values = dict(values or {})
            grid = values.get("scaling")
            scalings = grid if isinstance(grid, list) else [grid] if "scaling" in values else []
            if isinstance(grid, list) and (not grid or len(set(map(repr, grid))) != len(grid)):
                raise ConfigValueError(f"{name}.scaling", f"a grid must be a non-empty list of distinct numbers, "
                                                          f"got {grid!r}")
            # each value as the method's own Params reads it (finite, no boolean), then the benchmark's bound: the
            # library allows a negative scaling (task negation), a multi-task merge here does not
            for scaling in scalings or [None]:
                candidate = {**values, "scaling": scaling} if scaling is not None else values
                try:
                    built = build_params(MERGE_METHODS[name].Params, name, candidate)
                except MergecalError as err:
                    raise ValueError(str(err)) from None
                if built.scaling <= 0:
                    raise ConfigValueError(f"{name}.scaling", f"expected a positive number, got {scaling!r}")
        return {name: dict(values or {}) for name, values in merges.items()}  # `ties:` with no value: defaults

    @field_validator("chains")
    @classmethod
    def _chains(cls, chains: list[str]) -> list[str]:
        if not chains:
            raise ValueError("at least one chain is required (\"{merge}\" alone is the uncalibrated merge)")
        for chain in chains:
            _check_chain(chain)
        if len(set(chains)) != len(chains):
            raise ValueError("chains must be distinct")
        return chains

    @model_validator(mode="after")
    def _fixed_scaling_merges_are_in_the_matrix(self) -> "Benchmark":
        for i, protocol in enumerate(self.fixed_scaling):
            unknown = [m for m in protocol.merges if m not in self.merges]
            if unknown:
                raise ConfigValueError(f"fixed_scaling[{i}].merges", f"{unknown[0]!r} is not among benchmark.merges "
                                                                     f"({', '.join(self.merges)})")
        return self

    @model_validator(mode="after")
    def _selected_needs_an_uncalibrated_chain(self) -> "Benchmark":
        from .chains import scaling_source

        # only a scaling grid has a value to select; fixed scalings need no source chain
        has_grid = any(isinstance((values or {}).get("scaling"), list) for values in self.merges.values())
        if self.calibrated_scaling == "selected" and has_grid:
            for chain in self.chains:
                if scaling_source(chain, self.chains) is None:
                    raise ValueError(f"chain {chain!r}: calibrated_scaling 'selected' takes the scaling chosen by "
                                     "the uncalibrated chain '{merge}', which is not in chains (add it, or set "
                                     "calibrated_scaling: grid)")
        return self


class Tracking(Strict):
    experiment: str = Field("mergecal", min_length=1)
    store: str = "mlruns"  # directory under the repository: mlruns.db (SQLite) and artifacts/

    @field_validator("store")
    @classmethod
    def _inside_repository(cls, store: str) -> str:
        path = PurePosixPath(store)
        if not store or path.is_absolute() or ".." in path.parts or store.startswith("~"):
            raise ValueError(f"expected a relative directory inside the repository (e.g. mlruns), got {store!r}")
        return store


class Runner(Strict):
    """How the Prefect flow runs cells: ``threads`` (default), ``processes`` (a process pool) or ``dask``
    (prefect-dask's DaskTaskRunner; ``address`` of an existing cluster, else a local one)."""

    kind: Literal["threads", "processes", "dask"] = "threads"
    max_workers: WorkerCount = 1
    retries: NonNegativeInt = 1
    retry_delay_seconds: NonNegativeReal = 1.0
    address: str | None = None


class Params(Strict):
    seed: NonNegativeInt = 0
    device: str = "auto"
    # torch's threads in every stage that trains or evaluates (a model's bits depend on it; mergecal.pipeline.threads)
    threads: ThreadCount = 2
    vision: VisionTrack = Field(default_factory=VisionTrack)
    text: TextTrack = Field(default_factory=TextTrack)
    llm: LlmTrack = Field(default_factory=LlmTrack)
    local_llm: list[LocalLlmTrack] = Field(default_factory=list)  # LLM families from local directories
    local_clip: list[LocalClipTrack] = Field(default_factory=list)  # CLIP checkpoints and datasets from local files
    distac: dict[str, Any] = Field(default_factory=dict)
    probing: Probing = Field(default_factory=Probing)
    benchmark: Benchmark = Field(default_factory=Benchmark)
    tracking: Tracking = Field(default_factory=Tracking)
    runner: Runner = Field(default_factory=Runner)

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {device!r}")
        return device

    @field_validator("distac")
    @classmethod
    def _distac(cls, values: dict[str, Any]) -> dict[str, Any]:
        from ..calibrations.distac import DistacStepParams
        from ..methods.base import build_params

        try:
            build_params(DistacStepParams, "distac", dict(values))
        except MergecalError as err:
            raise ValueError(str(err)) from None
        return values

    @model_validator(mode="after")
    def _local_names(self) -> "Params":
        taken = {self.vision.backbone, self.text.backbone, self.llm.backbone}
        seen: set[str] = set()
        for section in ("local_llm", "local_clip"):
            for i, track in enumerate(getattr(self, section)):
                if track.name in taken or track.name in seen:
                    raise ConfigValueError(f"{section}.{i}.name", f"{track.name!r} is already the name of another "
                                                                  "track (the leaderboard groups rows by it)")
                seen.add(track.name)
        return self


def _one_line(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    cause = first.get("ctx", {}).get("error")
    if isinstance(cause, ConfigValueError):  # a value below this field: name its dotted key
        where = ".".join(p for p in (where, cause.key) if p)
        message = str(cause)
    if first["type"] == "extra_forbidden":
        # name what is allowed at that level
        model: Any = Params
        for part in first["loc"][:-1]:
            if isinstance(part, int):  # an item of a list section (local_llm): the item's model
                continue
            field = model.model_fields.get(str(part)) if isinstance(model, type) else None
            model = field.annotation if field is not None else None
            if getattr(model, "__origin__", None) is list:
                model = model.__args__[0]
        allowed = ", ".join(model.model_fields) if isinstance(model, type) and issubclass(model, BaseModel) else ""
        message = "unknown key" + (f"; allowed: {allowed}" if allowed else "")
    elif first["type"] == "literal_error":
        message = f"{message} (got {first.get('input')!r})"
    return f"{source}: {where or '(top level)'}: {message}"


def parse_params(data: Any, source: str = "params.yaml") -> Params:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ParameterError(f"{source}: expected a mapping at the top level, got {type(data).__name__}")
    try:
        return Params.model_validate(data)
    except ValidationError as err:
        raise ParameterError(_one_line(err, source)) from None


def load_params(path: str | Path = "params.yaml") -> Params:
    path = Path(path)
    if not path.is_file():
        raise ParameterError(f"{path}: parameters file not found")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        line = err.object[:err.start].count(b"\n") + 1
        raise ParameterError(f"{path}: not UTF-8 text (byte {err.object[err.start]:#04x} on line {line}); save it "
                             "as UTF-8") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ParameterError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    if data is None:  # an empty file (or only comments) is more likely a mistake than a wish for every default
        raise ParameterError(f"{path}: empty; expected the pipeline's settings (a mapping such as the repository's "
                             "params.yaml; write {} to take every default)")
    return parse_params(data, str(path))
