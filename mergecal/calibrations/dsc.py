"""MAGIC's DSC (dual-space calibration) and DSC-A, as composite calibrations: names a recipe expands.

DSC = WSC, then FSC measured on the WSC-calibrated model (``mergecal.run_recipe`` measures FSC on what the
weight-space steps produced). DSC-A is the same with FSC on task-agnostic data (``data="task_agnostic"``).
They add no computation of their own, so a recipe holds their parts as ordinary steps: the id of
``tsv_m→dsc`` is that of ``tsv_m→wsc→fsc``. ``dsc(wsc={...}, fsc={...})`` passes each part its parameters.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any, ClassVar

from ..errors import ParameterError
from .registry import register_calibration


class Composite:
    """A named sequence of calibration steps; ``parts`` are (step name, fixed parameters) in order."""

    name: ClassVar[str]
    parts: ClassVar[tuple[tuple[str, Mapping[str, Any]], ...]]

    @classmethod
    def expand(cls, values: Mapping[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
        """The parts with the parameters given to each (a group per part, named like it; given values win).
        A generator, so a recipe reports a bad first part before looking at the next one."""
        groups = [part for part, _ in cls.parts]
        unknown = set(values) - set(groups)
        if unknown:
            raise ParameterError(f"recipe: {cls.name} takes {' and '.join(repr(g) for g in groups)} parameter groups, "
                                 f"not {min(unknown)!r}")
        for part, fixed in cls.parts:
            given = values.get(part, {}) or {}
            if not isinstance(given, Mapping):
                raise ParameterError(f"recipe: {cls.name}: '{part}' must be a mapping of parameters")
            yield part, {**fixed, **given}


@register_calibration("dsc", phase="composite", needs_data=True)
class Dsc(Composite):
    name = "dsc"
    parts = (("wsc", {}), ("fsc", {}))


@register_calibration("dsc_a", phase="composite", needs_data=True)
class DscA(Composite):
    name = "dsc_a"
    parts = (("wsc", {}), ("fsc", {"data": "task_agnostic"}))
