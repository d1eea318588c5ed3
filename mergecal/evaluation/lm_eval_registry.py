"""lm-eval's own registry tasks (``arc_easy``, ``boolq``, ...) scored on datasets already in the local Hugging
Face datasets cache: nothing is downloaded (``mergecal.offline`` sets HF_DATASETS_OFFLINE / HF_HUB_OFFLINE before
lm-eval or datasets is imported).

Splits. The reported score is lm-eval's own: the task's ``test_split`` when it defines one, else its
``validation_split`` (what ``lm_eval --tasks <name>`` reports). The scaling is chosen on a split that is not the
reported one: the ``validation_split`` when the task reports ``test_split`` and has one, else its
``training_split`` (boolq reports validation and chooses on train, gsm8k reports test and chooses on train; an
expert fine-tuned on that train split is favoured there, which the configured ``max_validation`` slice does not
change). A task with no such second split is refused.

Both splits are scored through variant YAMLs written beside the track's work files, each an ``include:`` of the
registry YAML, so lm-eval's definition is used unchanged: ``<task>__mergecal_<split>`` sets ``test_split`` to the
chosen split; ``<task>`` (the reported split, under the task's own name) overrides nothing but the tag, so it is the
task ``lm_eval --tasks <task>`` scores (a ``test_split`` set where lm-eval's has none would change which few-shot
examples lm-eval leaves out). Scoring therefore indexes only that directory (``evaluate_lm``), not the
registry. Indexing lm-eval's registry, to look the tasks up, parses thousands of YAMLs (about 30 s on a busy
2-core machine): it is done once per process (``registry_index``).

Task code. A registry YAML's ``!function`` entries (Python files shipped with lm-eval) run only for the tasks a
track names: the index and ``task_config`` read YAMLs without resolving them (``resolve_func=False``), and
scoring loads only the variants of the named tasks. So registry tracks need no ``trust_task_code`` (a
``task_dir`` track's own YAMLs do: ``mergecal.pipeline.tracks.causal_lm.files.stages.check_task_code``).
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

from .. import offline
from ..checkpoint import atomic_write_text
from ..errors import CheckpointError, UnknownNameError

offline.apply(offline.HUB_OFFLINE)  # before datasets or lm-eval is imported

VARIANT = "{task}__mergecal_{split}"  # the lm-eval name of a registry task scored on another split


@functools.lru_cache(maxsize=1)
def registry_index() -> dict:
    """{name: lm-eval index entry} of lm-eval's registry (its tasks, groups and tags)."""
    from lm_eval.tasks import TaskManager

    return dict(TaskManager(include_defaults=True).task_index)


def task_yaml(task: str, *, key: str | None = None) -> Path:
    """The registry YAML of a single lm-eval task; an unknown name, a group or a tag is one UnknownNameError
    (``key``: the params key to name) with close names."""
    from lm_eval.tasks._index import Kind

    index = registry_index()
    entry = index.get(task)
    where = f"{key}: " if key else ""
    if entry is None:
        close = difflib.get_close_matches(task, [n for n, e in index.items() if e.kind == Kind.TASK], n=3)
        hint = f"; did you mean {', '.join(close)}?" if close else ""
        raise UnknownNameError(f"{where}no task {task!r} in lm-eval's registry{hint}")
    if entry.kind != Kind.TASK or entry.yaml_path is None:
        raise UnknownNameError(f"{where}{task!r} is an lm-eval {entry.kind.name.lower()}, not a single task defined "
                               "by a YAML; name each of its tasks")
    return Path(entry.yaml_path)


def task_config(task: str, *, key: str | None = None) -> dict:
    """The task's configuration as lm-eval resolves it (includes merged; ``!function`` entries as names)."""
    from lm_eval.tasks._yaml_loader import load_yaml

    return load_yaml(task_yaml(task, key=key), resolve_func=False)


def splits(task: str, config: dict, *, key: str | None = None) -> dict[str, str]:
    """{"test": the reported split, "validation": the split the scaling is chosen on} (module docstring)."""
    if config.get("test_split"):  # gsm8k has test and train only: its scaling is chosen on train
        chosen, reported = config.get("validation_split") or config.get("training_split"), config["test_split"]
    else:
        chosen, reported = config.get("training_split"), config.get("validation_split")
    if not reported or not chosen:
        raise UnknownNameError(f"{key + ': ' if key else ''}lm-eval task {task!r} has no two splits to report on and "
                               "to choose the scaling on (test and validation or train, or validation and train)")
    return {"test": reported, "validation": chosen}


def config_digest(task: str) -> str:
    """sha256 of lm-eval's version and the task's resolved configuration: changes when either does."""
    from importlib.metadata import version

    text = json.dumps({"lm_eval": version("lm_eval"), "config": task_config(task)}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def check_cached(task: str, config: dict, split: str) -> None:
    """The task's dataset is in the local HF datasets cache (read offline, nothing downloaded): one
    CheckpointError naming the task and the dataset otherwise."""
    import datasets

    path, name = config.get("dataset_path"), config.get("dataset_name")
    try:
        builder = datasets.load_dataset_builder(path, name, **(config.get("dataset_kwargs") or {}))
        if builder.info.splits is not None and split not in builder.info.splits:
            raise ValueError(f"no split {split!r}")
    except Exception as err:  # noqa: BLE001 - datasets raises ConnectionError, ValueError, FileNotFoundError, ...
        reason = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise CheckpointError(
            f"lm-eval task {task!r}: dataset {path!r}" + (f" (config {name!r})" if name else "")
            + f" is not in the local Hugging Face datasets cache ({datasets.config.HF_DATASETS_CACHE}); it must be "
            "there (load it once where the hub is reachable, or set HF_DATASETS_CACHE): nothing is downloaded "
            f"[{reason}]") from None


def write_variant_yamls(tasks: Sequence[str], task_dir: str | os.PathLike, *,
                        where: str = "") -> dict[str, dict[str, str]]:
    """Check each registry task and its cached dataset and write the variant YAMLs of its two splits into
    ``task_dir`` (module docstring); returns {task: {"validation": lm-eval name, "test": lm-eval name}}.
    ``where``: the params prefix of the ``tasks.<task>`` keys named in errors."""
    import yaml

    names = {}
    for task in tasks:
        config = task_config(task, key=f"{where}tasks.{task}")
        chosen = splits(task, config, key=f"{where}tasks.{task}")
        for split in dict.fromkeys(chosen.values()):
            check_cached(task, config, split)
        variant = VARIANT.format(task=task, split=chosen["validation"])
        include = {"include": str(task_yaml(task))}
        # tag: [] keeps the registry's tags (e.g. ai2_arc) out of task_dir's index; a task's config drops its tags
        for name, extra in ((variant, {"test_split": chosen["validation"]}), (task, {})):
            atomic_write_text(Path(task_dir) / f"{name}.yaml",
                              yaml.safe_dump(include | {"task": name, "tag": []} | extra, sort_keys=False))
        names[task] = {"validation": variant, "test": task}
    return names
