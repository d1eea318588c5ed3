"""mergecal: merge fine-tuned models and calibrate the merge.

Library API (pure functions over state dicts ``{name: tensor}`` or safetensors checkpoints):

    from mergecal import merge_models, merge_task_vectors, task_vector, MERGE_METHODS
    merged = merge_models(pretrained_sd, [ft1_sd, ft2_sd], "ties", top_k=0.2, scaling=1.0)
"""

from .checkpoint import DictSource, SafetensorsSource, load_state_dict, save_checkpoint, save_state_dict
from .errors import MergecalError
from .keys import KEY_RULES, get_key_rule
from .merge import iter_merge, merge_checkpoints, merge_models, merge_task_vectors
from .methods import MERGE_METHODS, MergeMethod, get_merge_method
from .task_vectors import TaskVectorSet, apply_task_vector, task_vector

__version__ = "0.1.0"

__all__ = [
    "DictSource", "SafetensorsSource", "load_state_dict", "save_checkpoint", "save_state_dict",
    "MergecalError", "KEY_RULES", "get_key_rule", "iter_merge", "merge_checkpoints", "merge_models",
    "merge_task_vectors", "MERGE_METHODS", "MergeMethod", "get_merge_method", "TaskVectorSet",
    "apply_task_vector", "task_vector",
]
