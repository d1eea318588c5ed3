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
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, Field, ValidationError, create_model, field_validator, model_validator

from ..config_types import (ConfigValueError, Count, NonNegativeInt, NonNegativeReal, PositiveReal, ThreadCount,
                            WorkerCount)
from ..errors import MergecalError, ParameterError


from .params_base import Strict, _distinct
from .track_registry import param_sections


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
    and compared with ``none@λ=<scaling>``, the merge at that scaling (list ``{merge}`` among the chains).
    ``settings``: the protocol's own merge settings beside the matrix's (FusionBench's TIES: ``{disjoint: sum}``);
    its rows are then a variant of their own, ``ties(scaling=0.3,disjoint='sum')`` with base
    ``none@λ=0.3,disjoint=sum``, beside the matrix's merge at that scaling."""

    scaling: PositiveReal
    chains: list[str] = Field(min_length=1)
    merges: list[str] = Field(default_factory=list)
    settings: dict[str, Any] = Field(default_factory=dict)

    @field_validator("settings")
    @classmethod
    def _settings(cls, settings: dict[str, Any]) -> dict[str, Any]:
        if "scaling" in settings:
            raise ValueError("the protocol's scaling is its own key (scaling), not a setting")
        return settings

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
        from ..methods import MERGE_METHODS
        from ..methods.base import build_params
        from .chains import fixed_chain

        listed: dict[str, int] = {}  # each fixed-scaling row's label -> the protocol that lists it
        for i, protocol in enumerate(self.fixed_scaling):
            unknown = [m for m in protocol.merges if m not in self.merges]
            if unknown:
                raise ConfigValueError(f"fixed_scaling[{i}].merges", f"{unknown[0]!r} is not among benchmark.merges "
                                                                     f"({', '.join(self.merges)})")
            for merge in protocol.merges or list(self.merges):
                own = {k: v for k, v in self.merges[merge].items() if k != "scaling"}
                try:
                    build_params(MERGE_METHODS[merge].Params, merge,
                                 {**own, **protocol.settings, "scaling": protocol.scaling})
                except MergecalError as err:
                    raise ConfigValueError(f"fixed_scaling[{i}].settings", str(err)) from None
                for chain in protocol.chains:
                    label = fixed_chain(chain, protocol.scaling, protocol.settings).replace("{merge}", merge)
                    if label in listed:
                        raise ConfigValueError(f"fixed_scaling[{i}]", f"the row {label} is listed by "
                                                                      f"fixed_scaling[{listed[label]}] already: list "
                                                                      "each chain at a scaling once")
                    listed[label] = i
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


# the URI schemes MLflow keeps runs behind: a tracking server, or a database SQLAlchemy reaches (+driver allowed)
STORE_SCHEMES = ("http", "https", "sqlite", "postgresql", "mysql", "mssql")


class Tracking(Strict):
    experiment: str = Field("mergecal", min_length=1)
    store: str = "mlruns"  # directory under the repository: mlruns.db (SQLite) and artifacts/
    # a lab's shared store (docs/lab.md): an MLflow tracking server (http://host:5000) or a database URI; none: the
    # checkout's own store above. MLFLOW_TRACKING_URI, when set, takes precedence (MLflow's own convention)
    uri: str | None = None
    artifacts: str | None = None  # with a database uri: the artifact location every machine reaches

    @field_validator("uri")
    @classmethod
    def _a_store_uri(cls, uri: str | None) -> str | None:
        if uri is not None and urlsplit(uri).scheme.split("+")[0] not in STORE_SCHEMES:
            raise ValueError("expected a tracking server (http://host:5000) or a database URI (postgresql://..., "
                             "sqlite:////abs/path/mlruns.db)")  # the value is not repeated: it may hold a password
        return uri

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
    max_workers: WorkerCount = 2  # with threads: 2, two one-thread cells at once (params.yaml)
    retries: NonNegativeInt = 1
    retry_delay_seconds: NonNegativeReal = 1.0
    address: str | None = None


class _ParamsChecks(Strict):
    """The checks of the top level; its fields are composed below (``Params``)."""

    @field_validator("device", check_fields=False)
    @classmethod
    def _device(cls, device: str) -> str:
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", device):
            raise ValueError(f"expected auto, cpu, cuda or cuda:N, got {device!r}")
        return device

    @field_validator("seeds", check_fields=False)
    @classmethod
    def _seeds(cls, seeds: list[int]) -> list[int]:
        # the fine-tuning seeds: each repeats the fine-tunes and every stage and cell downstream of them
        if not seeds:
            raise ValueError("expected at least one fine-tuning seed, e.g. [0]")
        return _distinct(seeds, "seeds")

    @field_validator("distac", check_fields=False)
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
        # a single track's name is its backbone; a list section (local_llm, local_clip) names each of its tracks
        sections = [name for name in TRACK_SECTIONS if isinstance(getattr(self, name), list)]
        taken = {getattr(self, name).backbone for name in TRACK_SECTIONS if name not in sections}
        seen: set[str] = set()
        for section in sections:
            for i, track in enumerate(getattr(self, section)):
                if track.name in taken or track.name in seen:
                    raise ConfigValueError(f"{section}.{i}.name", f"{track.name!r} is already the name of another "
                                                                  "track (the leaderboard groups rows by it)")
                seen.add(track.name)
        return self


#: each registered track's section (``mergecal.pipeline.tracks``), in matrix order: key -> (type, default)
TRACK_SECTIONS = param_sections()

#: params.yaml: the core sections around the tracks' (this order is the order ``model_dump`` writes)
Params = create_model(
    "Params", __base__=_ParamsChecks, __module__=__name__,
    seed=(NonNegativeInt, 0),  # the data's and the pretrained backbones' (shared by every fine-tuning seed)
    seeds=(list[NonNegativeInt], Field(default_factory=lambda: [0])),  # the fine-tuning seeds (docs/pipeline.md)
    device=(str, "auto"),
    # torch's threads in every stage that trains or evaluates (a model's bits depend on it; mergecal.pipeline.threads)
    threads=(ThreadCount, 2),
    **TRACK_SECTIONS,
    distac=(dict[str, Any], Field(default_factory=dict)),
    probing=(Probing, Field(default_factory=Probing)),
    benchmark=(Benchmark, Field(default_factory=Benchmark)),
    tracking=(Tracking, Field(default_factory=Tracking)),
    runner=(Runner, Field(default_factory=Runner)),
)


def fine_tuning_seed(params: Params, seed: int | None = None) -> int:
    """``seed``, or else the first of ``params.seeds``: the seed whose models a caller that names none reads (the
    stability stage, the own-model tracks' cells)."""
    return params.seeds[0] if seed is None else seed


def seed_dir(models: Path, seed: int) -> Path:
    """Where one fine-tuning seed's models and what is built from them lie under a backbone's ``models``
    directory: the same layout for every seed."""
    return models / "seeds" / str(seed)


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
