"""``params.yaml``: the benchmark matrix and every setting of the pipeline, validated on load.

One pydantic model per section, ``extra="forbid"`` everywhere, so a typo is one clear message naming the
dotted path and listing what is allowed. Sections that configure library objects (suite sizes, trainers,
DisTaC, probing, merge methods, recipes) are additionally validated by building those objects, so the
pipeline accepts exactly what the library accepts.

Cells of the matrix: track (backbone × task set) × regime × merge method × calibration chain. A chain is a
recipe with ``{merge}`` standing for the merge method, e.g. ``"{merge}>svc"`` or ``"distac>{merge}>svc>dsc"``.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..errors import MergecalError, ParameterError

REGIMES = ("standard", "norm_mismatch", "low_confidence")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _check_dataclass(cls: type, values: dict[str, Any], where: str) -> None:
    """Build the library's dataclass config once, so unknown fields fail at load time with a clear message."""
    names = [f.name for f in dataclasses.fields(cls)]
    unknown = sorted(set(values) - set(names))
    if unknown:
        raise ValueError(f"unknown field {unknown[0]!r} in {where}; allowed: {', '.join(names)}")
    cls(**values)


class VisionTrack(Strict):
    """The open_clip track: a small ViT pretrained by the project, fine-tuned per task (image encoder only)."""

    enabled: bool = True
    backbone: str = "clip-tiny"
    arch: str = "mergecal-vit-tiny"
    task_set: str = "vision8"
    tasks: list[str] = Field(default_factory=lambda: ["shapes", "colors", "counts", "textures", "digits", "typefaces",
                                                      "inks", "handwritten"])
    regimes: list[Literal["standard", "norm_mismatch", "low_confidence"]] = Field(default_factory=lambda: list(REGIMES))
    # fine-tuned for every task (DVC stage `finetune`); `norm_mismatch` adds one task at a higher lr
    finetune_variants: list[Literal["standard", "low_confidence"]] = Field(
        default_factory=lambda: ["standard", "low_confidence"])
    norm_mismatch_task: str = "shapes"
    norm_mismatch_lr_multiplier: float = Field(10.0, gt=0)
    data: dict[str, Any] = Field(default_factory=dict)
    pretrain: dict[str, Any] = Field(default_factory=dict)
    finetune: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "VisionTrack":
        from ..data.vision import TASKS, SuiteConfig
        from ..train.finetune import FinetuneConfig
        from ..train.pretrain_clip import PretrainConfig

        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise ValueError(f"unknown task {unknown[0]!r}; choose from: {', '.join(TASKS)}")
        if len(set(self.tasks)) != len(self.tasks) or len(self.tasks) < 2:
            raise ValueError("tasks must be at least two distinct task names")
        needs = {"standard": "standard", "norm_mismatch": "standard", "low_confidence": "low_confidence"}
        for regime in self.regimes:
            if needs[regime] not in self.finetune_variants:
                raise ValueError(f"regime {regime!r} needs {needs[regime]!r} in finetune_variants")
        if "norm_mismatch" in self.regimes and self.norm_mismatch_task not in self.tasks:
            raise ValueError(f"norm_mismatch_task {self.norm_mismatch_task!r} is not one of the track's tasks")
        _check_dataclass(SuiteConfig, self.data, "data")
        _check_dataclass(PretrainConfig, {k: v for k, v in self.pretrain.items() if k != "arch"}, "pretrain")
        if "arch" in self.pretrain:
            raise ValueError("pretrain.arch: set the architecture once, as 'arch' of the track")
        if "regime" in self.finetune:
            raise ValueError("finetune.regime: regimes are listed in 'regimes', not set per fine-tune")
        _check_dataclass(FinetuneConfig, self.finetune, "finetune")
        return self


class TextTrack(Strict):
    """The MiniLM track: the packaged pretrained encoder, a head per task, merged encoders scored per head."""

    enabled: bool = False
    backbone: str = "minilm"
    task_set: str = "text4"
    tasks: list[str] = Field(default_factory=lambda: ["wordnet_nouns", "wordnet_verbs", "wordnet_pos", "bbc_topics"])
    regimes: list[Literal["standard", "low_confidence"]] = Field(default_factory=lambda: ["standard"])
    data: dict[str, Any] = Field(default_factory=dict)
    finetune: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _check(self) -> "TextTrack":
        from ..data.text import TextSuiteConfig
        from ..train.finetune_text import TextFinetuneConfig

        allowed = ["wordnet_nouns", "wordnet_verbs", "wordnet_pos", "bbc_topics", "kaomoji_emotions"]
        unknown = [t for t in self.tasks if t not in allowed]
        if unknown:
            raise ValueError(f"unknown task {unknown[0]!r}; choose from: {', '.join(allowed)}")
        _check_dataclass(TextSuiteConfig, self.data, "data")
        _check_dataclass(TextFinetuneConfig, self.finetune, "finetune")
        return self


class Probing(Strict):
    """MAGIC's magnitude-sensitivity probe: scale each key's slice of the weight-averaged task vector by
    ``scale`` and rank keys by the accuracy drop on the probe set (which is none of the tasks)."""

    scale: float = 1.1
    top: int = Field(10, ge=0)
    max_samples: int = Field(256, ge=1)
    key_pattern: str | None = None


class Evaluation(Strict):
    batch_size: int = Field(256, ge=1)
    max_validation: int = Field(200, ge=1)  # validation examples per task for choosing the scaling
    fsc_samples_per_task: int = Field(8, ge=1)  # samples per task that FSC measures its ratios on
    distac_samples: int = Field(512, ge=1)  # unlabeled train samples per task for DisTaC


class Benchmark(Strict):
    """The merge × calibration part of the matrix. ``merges`` maps a method to its parameters; a list value
    for ``scaling`` is a grid searched on the validation split (by average normalized accuracy).

    ``calibrated_scaling`` says where a calibrated chain (one with svc/wsc/fsc/dsc steps) gets the merge's
    scaling from: ``selected`` (default) takes the value its uncalibrated cell chose on validation (tune the
    merge, then correct it: one merge per cell); ``grid`` searches the grid again with the calibration
    applied (joint search, |grid| merges and calibrations per cell)."""

    merges: dict[str, dict[str, Any]] = Field(default_factory=lambda: {"task_arithmetic": {"scaling": [0.1, 0.3, 0.5]}})
    chains: list[str] = Field(default_factory=lambda: ["{merge}"])
    calibrated_scaling: Literal["selected", "grid"] = "selected"
    evaluation: Evaluation = Field(default_factory=Evaluation)

    @field_validator("merges")
    @classmethod
    def _merges(cls, merges: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
        from ..methods import MERGE_METHODS
        from ..methods.base import build_params

        if not merges:
            raise ValueError("at least one merge method is required")
        for name, values in merges.items():
            if name not in MERGE_METHODS:
                raise ValueError(f"unknown merge method {name!r}; choose from: {', '.join(MERGE_METHODS)}")
            values = dict(values or {})
            grid = values.get("scaling")
            if isinstance(grid, list):
                if not grid or not all(isinstance(v, (int, float)) and v > 0 for v in grid):
                    raise ValueError(f"{name}.scaling: a grid must be a non-empty list of positive numbers")
                values["scaling"] = float(grid[0])
            try:
                build_params(MERGE_METHODS[name].Params, name, values)
            except MergecalError as err:
                raise ValueError(str(err)) from None
        return merges

    @field_validator("chains")
    @classmethod
    def _chains(cls, chains: list[str]) -> list[str]:
        from ..recipe import Recipe

        if not chains:
            raise ValueError("at least one chain is required (\"{merge}\" alone is the uncalibrated merge)")
        for chain in chains:
            if chain.count("{merge}") != 1:
                raise ValueError(f"chain {chain!r} must contain '{{merge}}' exactly once")
            try:
                Recipe.parse(chain.replace("{merge}", "task_arithmetic"))
            except MergecalError as err:
                raise ValueError(f"chain {chain!r}: {err}") from None
        if len(set(chains)) != len(chains):
            raise ValueError("chains must be distinct")
        return chains

    @model_validator(mode="after")
    def _selected_needs_an_uncalibrated_chain(self) -> "Benchmark":
        from .cells import scaling_source

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
    experiment: str = "mergecal"
    store: str = "mlruns"  # directory under the repository: mlruns.db (SQLite) and artifacts/


class Runner(Strict):
    """How the Prefect flow runs cells: ``threads`` (default), ``processes`` (a process pool) or ``dask``
    (prefect-dask's DaskTaskRunner; ``address`` of an existing cluster, else a local one)."""

    kind: Literal["threads", "processes", "dask"] = "threads"
    max_workers: int = Field(1, ge=1)
    retries: int = Field(1, ge=0)
    retry_delay_seconds: float = Field(1.0, ge=0)
    address: str | None = None


class Params(Strict):
    seed: int = 0
    device: str = "auto"
    vision: VisionTrack = Field(default_factory=VisionTrack)
    text: TextTrack = Field(default_factory=TextTrack)
    distac: dict[str, Any] = Field(default_factory=dict)
    probing: Probing = Field(default_factory=Probing)
    benchmark: Benchmark = Field(default_factory=Benchmark)
    tracking: Tracking = Field(default_factory=Tracking)
    runner: Runner = Field(default_factory=Runner)

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if device not in ("auto", "cpu") and not device.startswith("cuda"):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {device!r}")
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

    def tracks(self) -> list[VisionTrack | TextTrack]:
        return [t for t in (self.vision, self.text) if t.enabled]


def _one_line(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        # name what is allowed at that level
        model: Any = Params
        for part in first["loc"][:-1]:
            field = model.model_fields.get(str(part)) if isinstance(model, type) else None
            model = field.annotation if field is not None else None
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
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" (line {mark.line + 1})" if mark is not None else ""
        raise ParameterError(f"{path}: not valid YAML{where}: {getattr(err, 'problem', err)}") from None
    return parse_params(data, str(path))
