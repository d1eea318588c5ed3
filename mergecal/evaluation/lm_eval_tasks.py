"""Scoring causal LMs with lm-eval on the LLM suite's local task YAMLs (``mergecal.data.llm``).

Each task's YAML reads a split's JSON lines by absolute path (lm-eval resolves relative ``data_files`` against
the working directory, not the YAML) with exactly one ``dataset_kwargs`` key. ``generate_until`` tasks are
scored by ``exact_match`` after stripping whitespace from the greedy answer; ``multiple_choice`` tasks by
``acc`` (log-likelihood of each choice after the prompt). Scoring goes through lm-eval's documented Python API
for a model object built by the caller (``HFLM``, ``CachingLM``, ``TaskManager.load``, ``evaluator.evaluate``),
with ``bootstrap_iters=0`` and a task manager that sees only these YAMLs. ``simple_evaluate`` does the same and
then, unconditionally, attaches an environment report (torch's ``collect_env`` runs pip and ten other
subprocesses): about half of each call on the tiny LLM, for nothing the benchmark reads.

Response caches: lm-eval keys cached answers by request, not by model, so merged models written to the same
path would share stale answers. ``evaluate_lm`` therefore names each model's cache file by a sha256 of its
config and weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path

from ..backbones.hf_causal_lm import weight_format, weights_digest
from ..device import resolve_device
from ..checkpoint import atomic_write_text
from ..data.llm import TASKS, split_path
from ..errors import UnknownNameError
from .. import offline

offline.apply(offline.HUB_OFFLINE)  # before transformers is imported


MAX_GEN_TOKS = 8  # answers are a few tokens; generation also stops at a newline or EOS
FEWSHOT_SEED = 1234  # simple_evaluate's default fewshot_random_seed (the suite's tasks are zero-shot)


def task_name(task: str, split: str = "test") -> str:
    """The lm-eval task name of a split: the task's own name for test, ``<task>_<split>`` otherwise."""
    return task if split == "test" else f"{task}_{split}"


def task_config(task: str, data_file: str | os.PathLike, split: str = "test") -> dict:
    """The lm-eval task configuration of one split (what the YAML holds)."""
    if task not in TASKS:
        raise UnknownNameError(f"unknown LLM task {task!r}; choose one of: {', '.join(TASKS)}")
    spec = TASKS[task]
    config = {
        "task": task_name(task, split),
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(Path(data_file).resolve())}},
        "test_split": "test",
        "output_type": spec.output_type,
        "doc_to_text": "prompt",  # a column name: lm-eval reads doc["prompt"]
    }
    if spec.output_type == "generate_until":
        config |= {
            "doc_to_target": "target",
            "generation_kwargs": {"until": ["\n"], "do_sample": False, "max_gen_toks": MAX_GEN_TOKS},
            "filter_list": [{"name": "strip", "filter": [{"function": "remove_whitespace"},
                                                         {"function": "take_first"}]}],
            "metric_list": [{"metric": "exact_match", "aggregation": "mean", "higher_is_better": True}],
        }
    else:
        config |= {
            "doc_to_choice": "choices",
            "doc_to_target": "label",
            "metric_list": [{"metric": "acc", "aggregation": "mean", "higher_is_better": True}],
        }
    return config | {"metadata": {"version": 1.0}}


def write_task_yamls(data_root: str | os.PathLike, task_dir: str | os.PathLike,
                     tasks: Sequence[str] = tuple(TASKS), splits: Sequence[str] = ("test",)) -> dict[str, Path]:
    """Write one YAML per (task, split) into ``task_dir``; returns {lm-eval task name: YAML path}."""
    import yaml

    written = {}
    for task in tasks:
        for split in splits:
            config = task_config(task, split_path(data_root, task, split), split)
            path = Path(task_dir) / f"{config['task']}.yaml"
            atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))
            written[config["task"]] = path
    return written


def _metrics(raw: dict) -> dict[str, float]:
    """lm-eval's ``{"acc,none": v, "acc_stderr,none": s, "alias": ...}`` as ``{"acc": v, "acc_stderr": s}``."""
    out = {}
    for key, value in raw.items():
        if "," in key and isinstance(value, (int, float)):
            out[key.split(",")[0]] = float(value)
    return out


def evaluate_lm(model_dir: str | os.PathLike, tasks: Sequence[str], task_dir: str | os.PathLike, *,
                cache_path: str | os.PathLike | None = None, limit: int | float | None = None,
                device: str = "auto", batch_size: int = 16, dtype: str = "float32") -> dict[str, dict[str, float]]:
    """Score the local model directory on lm-eval tasks defined in ``task_dir``: {task: {metric: value, "n": n}}.

    ``cache_path``: a directory for response caches; the model's cache file in it is named by the sha256 of
    its config and weights, so every distinct model gets its own. ``device="auto"``: CUDA when present.
    Only ``task_dir``'s YAMLs are indexed (lm-eval's registry tasks are scored through variant YAMLs written
    there that include theirs: ``mergecal.evaluation.lm_eval_registry``)."""
    from lm_eval.api.model import CachingLM
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    weight_format(model_dir)  # a one-line CheckpointError for a missing or weightless directory
    for name in ("lm-eval", "lm_eval"):
        logging.getLogger(name).setLevel(logging.WARNING)
    use_cache = None
    if cache_path is not None:
        Path(cache_path).mkdir(parents=True, exist_ok=True)
        use_cache = str(Path(cache_path) / f"{Path(model_dir).name}-{weights_digest(model_dir)[:16]}")
    manager = TaskManager(include_path=str(Path(task_dir).resolve()), include_defaults=False)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise UnknownNameError(f"{task_dir}: no lm-eval task named {', '.join(unknown)} (write_task_yamls first)")
    lm = HFLM(pretrained=str(Path(model_dir).resolve()), dtype=dtype, device=resolve_device(device),
              batch_size=batch_size)
    if use_cache is not None:
        lm = CachingLM(lm, f"{use_cache}_rank0.db")  # the file name simple_evaluate gives a single process
    loaded = manager.load(list(tasks))
    for task_obj in loaded["tasks"].values():  # what simple_evaluate does for tasks with no few-shot setting
        if task_obj.get_config("num_fewshot") is None:
            task_obj.set_config(key="num_fewshot", value=0)
        task_obj.set_fewshot_seed(seed=FEWSHOT_SEED)
    results = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=False)
    out = {}
    for task in tasks:
        out[task] = _metrics(results["results"][task])
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        if n is not None:
            out[task]["n"] = float(n)
    return out
