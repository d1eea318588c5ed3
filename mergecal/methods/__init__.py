"""Merge methods, one per file: importing this package imports every module of it that applies ``@register``
(``mergecal.plugins``), so a new method is one file here and no list names it."""

import importlib
from pathlib import Path

from ..plugins import registering_modules
from .base import MERGE_METHODS, MergeMethod, MergeParams, get_merge_method

for _module in registering_modules(Path(__file__).parent, "register"):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["MERGE_METHODS", "MergeMethod", "MergeParams", "get_merge_method"]
