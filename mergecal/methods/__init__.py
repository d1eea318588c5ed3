"""Merge methods, one per file; importing this package registers them all."""

from . import consensus, dare, iso_c, iso_cts, task_arithmetic, ties, tsv_m, weight_averaging  # noqa: F401
from .base import MERGE_METHODS, MergeMethod, MergeParams, get_merge_method

__all__ = ["MERGE_METHODS", "MergeMethod", "MergeParams", "get_merge_method"]
