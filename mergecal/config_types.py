"""Value types of the library's configuration dataclasses (suite sizes, trainers): the one place where their
types and ranges are stated. ``check_config`` validates a mapping against such a dataclass with pydantic; the
pipeline's ``params.yaml`` validator uses it, so the library and the pipeline accept exactly the same values.

Counts and steps are strict integers (``"120"``, ``12.5``, ``3.0``, ``1e30`` and ``true`` are refused) with an upper
bound (``MAX_*`` below). Reals are finite numbers, never booleans; a numeric string is accepted because YAML 1.1
reads ``1e-5`` (no dot) as text.
"""

from __future__ import annotations

import dataclasses
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, Strict, TypeAdapter, ValidationError


def _real(value: Any) -> Any:
    if isinstance(value, bool):
        raise ValueError("expected a number, not a boolean")
    if isinstance(value, str):  # YAML 1.1 reads 1e-5 as text; anything else that is not a number stays an error
        try:
            return float(value)
        except ValueError:
            pass
    return value


Real = Annotated[float, BeforeValidator(_real), Field(allow_inf_nan=False)]
PositiveReal = Annotated[Real, Field(gt=0)]
NonNegativeReal = Annotated[Real, Field(ge=0)]
Probability = Annotated[Real, Field(ge=0, lt=1)]  # label smoothing, a split fraction
UnitInterval = Annotated[Real, Field(ge=0, le=1)]  # a rate that may be 0 or 1
# Upper bounds of integer settings, stated once here (and in docs/pipeline.md): far above what a lab runs, so
# only a typo (1e30 written out, 2**63) is refused, at load rather than inside a stage or a Prefect worker.
MAX_COUNT = 10**8  # samples, documents and images per task or split; batch sizes, token lengths, model dimensions
MAX_STEPS = 10**7  # optimizer steps of one training or DisTaC run
MAX_WORKERS = 256  # cells computed at once (runner.max_workers)
MAX_THREADS = 1024  # torch threads of a stage (params.yaml's threads)
MAX_INDEX = 2**32 - 1  # seeds (numpy's legacy seed range), warmup steps, shifts, retries, a top-k or task index

Count = Annotated[int, Strict(), Field(ge=1, le=MAX_COUNT)]  # batch sizes, sample counts, lengths, model shapes
Steps = Annotated[int, Strict(), Field(ge=1, le=MAX_STEPS)]  # optimizer steps
WorkerCount = Annotated[int, Strict(), Field(ge=1, le=MAX_WORKERS)]
ThreadCount = Annotated[int, Strict(), Field(ge=1, le=MAX_THREADS)]
NonNegativeInt = Annotated[int, Strict(), Field(ge=0, le=MAX_INDEX)]  # warmup steps, shifts, seeds
Flag = Annotated[bool, Strict()]  # true or false, not "yes" or 1


class ConfigValueError(ValueError):
    """A value of one field of a configuration mapping is wrong; ``key`` names the field (dotted below it)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


def check_config(cls: type, values: dict[str, Any]) -> Any:
    """Build ``cls`` (a dataclass whose fields carry the types above) from ``values``, validating every value.

    Raises ``ConfigValueError`` naming the first wrong field: an unknown name (listing the allowed ones), a
    value of the wrong type or out of range (saying what is allowed and what was given)."""
    names = [f.name for f in dataclasses.fields(cls)]
    if not isinstance(values, dict):
        raise ConfigValueError("", f"expected a mapping of {', '.join(names)}, got {type(values).__name__}")
    unknown = sorted(set(values) - set(names), key=str)
    if unknown:
        raise ConfigValueError(str(unknown[0]), f"unknown field; allowed: {', '.join(names)}")
    try:
        return TypeAdapter(cls).validate_python(values)
    except ValidationError as err:
        first = err.errors()[0]
        cause = first.get("ctx", {}).get("error")
        if isinstance(cause, ConfigValueError):  # a rule across fields (``__post_init__``): it names its field
            raise ConfigValueError(cause.key, str(cause)) from None
        key = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigValueError(key, f"{message} (got {first.get('input')!r})") from None

