"""What every params.yaml section shares (``mergecal.pipeline.config`` and each track's ``params``): the strict base
model and the validators of task lists and library dataclass sections."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

from ..config_types import ConfigValueError, check_config


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


# Fewest test examples (images, documents) per task an own-model track is scored on (`min_test`): at 50 an
# accuracy near 0.5 has a binomial standard error of sqrt(0.25 / 50) = 0.07 (a 95% interval of +-14 points);
# below it a score says little (one image scores 0 or 1).
MIN_TEST_EXAMPLES = 50
