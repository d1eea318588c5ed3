"""Scoring causal LMs with lm-eval on the LLM suite's local task YAMLs (``mergecal.data.llm``).

Each task's YAML reads a split's JSON lines by absolute path (lm-eval resolves relative ``data_files`` against
the working directory, not the YAML) with exactly one ``dataset_kwargs`` key. ``generate_until`` tasks are
scored by ``exact_match`` after stripping whitespace from the greedy answer; ``multiple_choice`` tasks by
``acc`` (log-likelihood of each choice after the prompt). Scoring goes through lm-eval's documented Python API
for a model object built by the caller (``HFLM``, ``CachingLM``, ``TaskManager.load``, ``evaluator.evaluate``),
with ``bootstrap_iters=0`` and a task manager that sees only these YAMLs. ``simple_evaluate`` does the same and
then, unconditionally, attaches an environment report (torch's ``collect_env`` runs pip and ten other
subprocesses): about half of each call on the tiny LLM, for nothing the benchmark reads.

A user's task YAMLs are read with a safe YAML loader that records lm-eval's ``!function`` tag without
importing anything (``task_sources``): which YAMLs, Python files and data files a track's tasks load.

Response caches: lm-eval keys cached answers by request, not by model, so merged models written to the same
path would share stale answers. ``evaluate_lm`` therefore names each model's cache file by a sha256 of its
config and weights.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from ..backbones.construction import MODEL_CONSTRUCTION
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
    written = {}
    for task in tasks:
        for split in splits:
            config = task_config(task, split_path(data_root, task, split), split)
            path = Path(task_dir) / f"{config['task']}.yaml"
            atomic_write_text(path, yaml.safe_dump(config, sort_keys=False))
            written[config["task"]] = path
    return written


# --------------------------------------------------------------------------- a user's task YAMLs, read safely

class TaskFunction(str):
    """A ``!function`` entry of a task YAML: the name of the Python function lm-eval would import and run
    (``utils.process_docs``: ``utils.py`` beside the YAML), read as text; nothing is imported."""


# the YAML parser lm-eval's own loader builds on (_yaml_loader._Base), without its !function constructor
class _SafeTaskLoader(yaml.CSafeLoader if getattr(yaml, "__with_libyaml__", False) else yaml.SafeLoader):
    """A safe YAML loader that reads lm-eval's ``!function`` tag as a ``TaskFunction``."""


_SafeTaskLoader.add_constructor("!function", lambda loader, node: TaskFunction(loader.construct_scalar(node)))

IGNORED_DIRS = ("__pycache__", ".ipynb_checkpoints")  # lm-eval's TaskIndex skips YAMLs under these


@dataclass
class TaskYaml:
    """A task YAML as lm-eval resolves it, read safely: its configuration (includes merged), the YAML and
    those it includes, its ``!function`` entries as (YAML, dotted key, function), and the files that did not
    parse (as (file, reason): what they would run cannot be checked)."""

    config: dict = field(default_factory=dict)
    files: list[Path] = field(default_factory=list)
    functions: list[tuple[Path, str, str]] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)


@dataclass
class TaskSources:
    """What lm-eval reads to load some tasks of a YAML directory: the YAMLs that define them (a group's
    member tasks too) and every YAML they include; their ``!function`` entries and the Python files those
    name; the ``dataset_kwargs.data_files`` they name (as written); which of the asked names some YAML
    defines; and the YAMLs of the directory (or included) that do not parse."""

    yamls: list[Path] = field(default_factory=list)
    functions: list[tuple[Path, str, str]] = field(default_factory=list)
    modules: list[Path] = field(default_factory=list)
    data_files: list[str] = field(default_factory=list)
    defined: list[str] = field(default_factory=list)
    unreadable: list[tuple[Path, str]] = field(default_factory=list)


def _functions(value, key: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, function name) of every ``!function`` entry in a parsed YAML value."""
    if isinstance(value, TaskFunction):
        yield key, str(value)
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _functions(v, f"{key}.{k}" if key else str(k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield from _functions(v, f"{key}.{i}")


def read_task_yaml(path: Path, _seen: frozenset = frozenset()) -> TaskYaml:
    """A task YAML as lm-eval's ``load_yaml`` resolves it (``include:`` relative to the YAML or absolute, its
    own keys winning), read with a safe loader: nothing is imported. A file that cannot be read or is no
    mapping (lm-eval refuses it too) gives no configuration and is not listed."""
    path = path.expanduser()
    try:
        config = yaml.load(path.read_text(), Loader=_SafeTaskLoader)  # noqa: S506 - a safe loader
    except OSError:
        return TaskYaml()
    except (UnicodeDecodeError, yaml.YAMLError) as err:
        return TaskYaml(unreadable=[(path, str(err).splitlines()[0] if str(err) else type(err).__name__)])
    if not isinstance(config, dict) or path.resolve() in _seen:
        return TaskYaml()
    out = TaskYaml(files=[path], functions=[(path, key, name) for key, name in _functions(config)])
    includes = config.pop("include", None)
    for include in includes if isinstance(includes, list) else [includes] if includes else []:
        if isinstance(include, str):
            target = Path(include) if Path(include).is_absolute() else path.parent / include
            included = read_task_yaml(target, _seen | {path.resolve()})
            included.config.pop("task_list", None)
            out.config.update(included.config)
            out.files += included.files
            out.functions += included.functions
            out.unreadable += included.unreadable
    out.config.update(config)
    return out


def _data_files(config: dict) -> list[str]:
    """The local files a task configuration names in ``dataset_kwargs.data_files`` (a name, list or mapping)."""
    kwargs = config.get("dataset_kwargs")
    data = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    named = data.values() if isinstance(data, dict) else [data] if isinstance(data, str) else data or []
    return [one for item in named for one in ([item] if isinstance(item, str) else item if isinstance(item, list)
                                              else []) if isinstance(one, str)]


def task_sources(task_dir: str | os.PathLike, names: Sequence[str]) -> TaskSources:
    """The ``TaskSources`` of lm-eval tasks ``names`` in ``task_dir``, found as lm-eval's index finds them
    (every ``**/*.yaml``, by its ``group`` or else ``task`` name), read safely (``read_task_yaml``)."""
    task_dir = Path(task_dir)
    out, index = TaskSources(), {}
    for path in sorted(task_dir.glob("**/*.yaml")) if task_dir.is_dir() else []:
        if any(part in IGNORED_DIRS for part in path.relative_to(task_dir).parts):
            continue
        parsed = read_task_yaml(path)
        out.unreadable += [u for u in parsed.unreadable if u[0] == path]  # its includes: when a task loads it
        name = parsed.config.get("group") or parsed.config.get("task")
        if isinstance(name, str):
            index.setdefault(name, []).append(parsed)
    wanted, seen = list(names), set()
    while wanted:
        name = wanted.pop(0)
        if name in seen or name not in index:
            continue
        seen.add(name)
        out.defined.append(name)
        for parsed in index[name]:
            out.yamls += [f for f in parsed.files if f not in out.yamls]
            out.functions += parsed.functions
            out.unreadable += [u for u in parsed.unreadable if u not in out.unreadable]
            out.data_files += [f for f in _data_files(parsed.config) if f not in out.data_files]
            members = parsed.config.get("task") if "group" in parsed.config else None
            for member in members if isinstance(members, list) else []:
                member = member.get("task") if isinstance(member, dict) else member
                if isinstance(member, str):
                    wanted.append(member)
    for yaml_path, _, function in out.functions:  # lm-eval's _import_func_in_yml: <module>.py beside the YAML
        module = yaml_path.parent / f"{function.rpartition('.')[0].replace('.', '/')}.py"
        if module.is_file() and module not in out.modules:
            out.modules.append(module)
    return out


def _by_filter(values) -> dict:
    """``{(metric, filter): value}`` named for reading: ``"<metric>,<filter>"`` for a named filter, and the bare
    metric when one filter alone reports it (GSM8K's ``exact_match`` comes under ``strict-match`` and
    ``flexible-extract``: which one is the user's to name, never the last one lm-eval happens to list)."""
    out, filters = {}, {}
    for (metric, name), value in values.items():
        filters.setdefault(metric, []).append(name)
        if name != "none":
            out[f"{metric},{name}"] = value
        out[metric] = value
    for metric, names in filters.items():
        if len(names) > 1:
            del out[metric]
    return out


def _metrics(raw: dict) -> dict[str, float]:
    """lm-eval's ``{"acc,none": v, "acc_stderr,none": s, "alias": ...}`` as ``{"acc": v, "acc_stderr": s}``, a
    filtered metric named as ``_by_filter`` names it."""
    return _by_filter({tuple(key.split(",", 1)): float(value) for key, value in raw.items()
                       if "," in key and isinstance(value, (int, float))})


def _per_document(samples: list[dict]) -> dict[str, list[float]]:
    """Each metric's per-document scores (doc_id order) from lm-eval's samples, named as ``_metrics`` names them:
    a task with several filters logs one sample per document and filter."""
    by_filter: dict[str, list[dict]] = {}
    for sample in samples:
        by_filter.setdefault(sample.get("filter", "none"), []).append(sample)
    values = {}
    for name, group in by_filter.items():
        group = sorted(group, key=lambda sample: sample["doc_id"])
        for metric in (group[0]["metrics"] if group else []):
            values[metric, name] = [float(s[metric]) for s in group]
    return _by_filter(values)


def evaluate_lm(model_dir: str | os.PathLike, tasks: Sequence[str], task_dir: str | os.PathLike, *,
                cache_path: str | os.PathLike | None = None, limit: int | float | None = None,
                device: str = "auto", batch_size: int = 16, dtype: str = "float32",
                per_document: dict[str, dict[str, list[float]]] | None = None) -> dict[str, dict[str, float]]:
    """Score the local model directory on lm-eval tasks defined in ``task_dir``: {task: {metric: value, "n": n}}.
    ``per_document``: a dict to fill with each task's per-document scores, {task: {metric: [score per document in
    doc_id order]}}, from lm-eval's own per-sample output (``log_samples``), for the leaderboard's intervals.

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
    with MODEL_CONSTRUCTION:  # HFLM loads by from_pretrained, which patches process-wide functions
        lm = HFLM(pretrained=str(Path(model_dir).resolve()), dtype=dtype, device=resolve_device(device),
                  batch_size=batch_size)
    if use_cache is not None:
        lm = CachingLM(lm, f"{use_cache}_rank0.db")  # the file name simple_evaluate gives a single process
    loaded = manager.load(list(tasks))
    for task_obj in loaded["tasks"].values():  # what simple_evaluate does for tasks with no few-shot setting
        if task_obj.get_config("num_fewshot") is None:
            task_obj.set_config(key="num_fewshot", value=0)
        task_obj.set_fewshot_seed(seed=FEWSHOT_SEED)
    results = evaluate(lm=lm, task_dict=loaded, limit=limit, bootstrap_iters=0, log_samples=per_document is not None)
    out = {}
    for task in tasks:
        out[task] = _metrics(results["results"][task])
        if per_document is not None:
            per_document[task] = _per_document(results["samples"][task])
        n = results.get("n-samples", {}).get(task, {}).get("effective")
        if n is not None:
            out[task]["n"] = float(n)
    return out
