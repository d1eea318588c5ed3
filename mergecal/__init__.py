"""mergecal: merge fine-tuned models and calibrate the merge.

Library API (pure functions over state dicts ``{name: tensor}`` or safetensors checkpoints):

    from mergecal import merge_models, merge_task_vectors, task_vector, MERGE_METHODS
    merged = merge_models(pretrained_sd, [ft1_sd, ft2_sd], "ties", top_k=0.2, scaling=1.0)

The names below are imported on first use (PEP 562), not with the package: ``import mergecal.offline`` must be
able to set the thread and kernel variables (``mergecal.offline``) before torch and numpy load their libraries,
which read them once, at load time.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

#: public name -> the submodule that defines it
_EXPORTS = {
    "DictSource": "checkpoint", "SafetensorsSource": "checkpoint", "load_state_dict": "checkpoint",
    "save_checkpoint": "checkpoint", "save_state_dict": "checkpoint",
    "MergecalError": "errors",
    "KEY_RULES": "keys", "get_key_rule": "keys",
    "iter_merge": "merge", "merge_checkpoints": "merge", "merge_models": "merge", "merge_task_vectors": "merge",
    "MERGE_METHODS": "methods", "MergeMethod": "methods", "get_merge_method": "methods",
    "TaskVectorSet": "task_vectors", "apply_task_vector": "task_vectors", "task_vector": "task_vectors",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:  # `from mergecal import <submodule>` goes on to import the submodule
        raise AttributeError(f"module 'mergecal' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
