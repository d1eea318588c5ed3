"""Value types of the library's configuration dataclasses (suite sizes, trainers): the one place where their
types and ranges are stated. ``check_config`` validates a mapping against such a dataclass with pydantic; the
pipeline's ``params.yaml`` validator uses it, so the library and the pipeline accept exactly the same values.

Counts and steps are strict integers (``"120"``, ``12.5`` and ``true`` are refused). Reals are finite numbers,
never booleans; a numeric string is accepted because YAML 1.1 reads ``1e-5`` (no dot) as text.
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
Count = Annotated[int, Strict(), Field(ge=1)]  # steps, batch sizes, sample counts
NonNegativeInt = Annotated[int, Strict(), Field(ge=0)]  # warmup steps, shifts, seeds
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
        key = ".".join(str(p) for p in first["loc"])
        message = first["msg"].removeprefix("Value error, ")
        raise ConfigValueError(key, f"{message} (got {first.get('input')!r})") from None

