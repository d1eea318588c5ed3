"""LLM families from local directories (``local_llm:`` in params.yaml): a lab's own base model and experts,
benchmarked as the embedded LLM track is, without copying a checkpoint.

    models/local/inputs.json                     stage ``local_inputs``: size and sha256 of every file of
                                                 every configured model directory (and user task YAML)
    models/local/tracks/<name>/references.json   stage ``local_tracks``: lm-eval scores of the base and each
                                                 expert (validation, test), task-vector norms, or the error
                                                 that makes the model unusable
    models/local/tracks/<name>/data/             the suite's data, for a track on the suite's tasks

Outside DVC's outputs: ``.mergecal/local/<name>/lm_eval_tasks`` (YAMLs naming the data by absolute path),
``.mergecal/local/lm_eval_cache`` (lm-eval response caches, one file per model's weight digest, shared by the
tracks) and ``.mergecal/local/merged`` (merges of running cells). Hashes are cached under
``.mergecal/hashes`` by (path, size, mtime): a rerun reads no unchanged checkpoint again.

A model directory is checked before anything reads its weights (``check_model_dir``): it exists, holds a
config.json, its weights are safetensors (pickled ``pytorch_model*.bin`` are never unpickled here) and every
shard its index lists is present; an expert also shares the base's config and tokenizer. A failure is recorded
in references.json as one line; the stage goes on with the other models and tracks, and the cells that need
that model fail with the same line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..checkpoint import atomic_write_text
from ..errors import CheckpointError, MergecalError
from .config import LocalLlmTrack, Params

WORK = Path(".mergecal") / "local"
CONVERT_HINT = ("convert it once to safetensors: python -c \"from mergecal.backbones.hf_causal_lm import "
                "load_causal_lm, save_causal_lm; save_causal_lm(*load_causal_lm('{path}', allow_unsafe_pickle=True), "
                "'{path}-safetensors')\" and point the track at the new directory")


def local_root(root: str | Path) -> Path:
    return Path(root) / "models" / "local"


def inputs_path(root: str | Path) -> Path:
    return local_root(root) / "inputs.json"


def tracks_dir(root: str | Path) -> Path:
    return local_root(root) / "tracks"


def track_dir(track: LocalLlmTrack, root: str | Path) -> Path:
    return tracks_dir(root) / track.name


def references_path(track: LocalLlmTrack, root: str | Path) -> Path:
    return track_dir(track, root) / "references.json"


def data_dir(track: LocalLlmTrack, root: str | Path) -> Path:
    return track_dir(track, root) / "data"


def work_dir(root: str | Path) -> Path:
    return Path(root) / WORK


def resolve(path: str, root: str | Path) -> Path:
    """A configured path: absolute, or relative to the repository root."""
    return Path(path).expanduser() if Path(path).expanduser().is_absolute() else Path(root) / path


def base_path(track: LocalLlmTrack, root: str | Path) -> Path:
    return resolve(track.base, root)


def expert_path(track: LocalLlmTrack, task: str, root: str | Path) -> Path:
    return resolve(track.experts[task], root)


# --------------------------------------------------------------------------------------------- checks

def check_model_dir(path: Path, *, allow_unsafe_pickle: bool = False) -> None:
    """A usable model directory, checked from its file names, config and safetensors headers only (nothing is
    unpickled, no tensor is read): one CheckpointError naming the directory or file otherwise."""
    from ..backbones.hf_causal_lm import weight_format
    from ..checkpoint import SafetensorsSource

    if weight_format(path) == "pickle":
        weights = next(iter(sorted(path.glob("pytorch_model*.bin*"))), path)
        if not allow_unsafe_pickle:
            raise CheckpointError(f"{weights}: pickled weights (pytorch_model*.bin) and no *.safetensors; unpickling "
                                  "can run arbitrary code, so they are not read. For a directory you trust, set "
                                  "allow_unsafe_pickle: true on the track and " + CONVERT_HINT.format(path=path))
        raise CheckpointError(f"{weights}: pickled weights; the streaming merge reads safetensors only, so "
                              + CONVERT_HINT.format(path=path))
    SafetensorsSource(path)  # headers of every shard: a shard missing from the index is named here


def check_expert(base: Path, expert: Path, *, allow_unsafe_pickle: bool = False) -> None:
    from ..backbones.hf_causal_lm import check_same_family

    check_model_dir(expert, allow_unsafe_pickle=allow_unsafe_pickle)
    check_same_family(base, [expert])


# ------------------------------------------------------------------------------------------ evaluation

def scorer(track: LocalLlmTrack, root: str | Path):
    """The track's ``LmEval``: the suite's YAMLs over its generated data, the user's YAML directory, or lm-eval's
    registry tasks (each checked to be one and to have its dataset in the local HF cache)."""
    from ..data.llm import LlmSuiteConfig
    from .llm import LmEval, suite_lm_eval

    cache = work_dir(root) / "lm_eval_cache"
    if track.source == "registry":
        from ..evaluation.lm_eval_registry import write_variant_yamls

        names = write_variant_yamls(track.task_names, work_dir(root) / track.name / "lm_eval_tasks",
                                    where=f"local_llm track {track.name!r}: ")
        return LmEval(work_dir(root) / track.name / "lm_eval_tasks", names,
                      {t: spec.metric for t, spec in track.tasks.items()}, cache, track.evaluation.max_validation,
                      track.evaluation.batch_size)
    if track.task_dir is None:
        return suite_lm_eval(data_dir(track, root), track.task_names, work_dir(root) / track.name / "lm_eval_tasks",
                             cache, track.evaluation, LlmSuiteConfig(**track.data).n_validation)
    task_dir = resolve(track.task_dir, root)
    if not task_dir.is_dir():
        raise CheckpointError(f"{task_dir}: task_dir of local_llm track {track.name!r} not found")
    names = {t: {"test": t, "validation": spec.validation} for t, spec in track.tasks.items()}
    return LmEval(task_dir, names, {t: spec.metric for t, spec in track.tasks.items()}, cache,
                  track.evaluation.max_validation, track.evaluation.batch_size)


def task_files(track: LocalLlmTrack, root: str | Path) -> dict[str, Path]:
    """The files that define the track's lm-eval tasks: the user's YAMLs and the local data files they name
    (``dataset_kwargs.data_files``); for the suite's tasks, the generated data's manifest."""
    import yaml

    if track.source == "registry":
        return {}  # lm-eval's own files: task_config_digests (in references.json) hash them with lm-eval's version
    if track.task_dir is None:
        return {"data_manifest": data_dir(track, root) / "manifest.json"}
    task_dir = resolve(track.task_dir, root)
    files: dict[str, Path] = {}
    for path in sorted(task_dir.rglob("*.y*ml")) if task_dir.is_dir() else []:
        files[f"task_dir/{path.relative_to(task_dir).as_posix()}"] = path
        try:
            config = yaml.safe_load(path.read_text())
        except yaml.YAMLError:
            continue  # lm-eval says what is wrong with it when the track is scored
        data = (config or {}).get("dataset_kwargs", {}).get("data_files") if isinstance(config, dict) else None
        named = data.values() if isinstance(data, dict) else [data] if isinstance(data, str) else data or []
        for item in named:
            for one in [item] if isinstance(item, str) else item if isinstance(item, list) else []:
                if isinstance(one, str) and resolve(one, task_dir).is_file():
                    files[f"data/{one}"] = resolve(one, task_dir)
    return files


def task_config_digests(track: LocalLlmTrack, root: str | Path) -> dict[str, str]:
    """{lm-eval task (or YAML file): sha256 of its configuration} (logged with each cell)."""
    from .llm import suite_config_digests

    if track.source == "registry":
        from ..evaluation.lm_eval_registry import config_digest

        return {task: config_digest(task) for task in track.task_names}
    if track.task_dir is None:
        return suite_config_digests(data_dir(track, root), track.task_names)
    return {role.removeprefix("task_dir/"): hashlib.sha256(path.read_bytes()).hexdigest()
            for role, path in task_files(track, root).items() if role.startswith("task_dir/")}


# ----------------------------------------------------------------------------------------------- stages

def model_dirs(track: LocalLlmTrack, root: str | Path) -> dict[str, Path]:
    return {"base": base_path(track, root), **{f"expert.{t}": expert_path(track, t, root) for t in track.experts}}


def record_inputs(params: Params, root: str | Path = ".") -> dict:
    """The stage ``local_inputs`` (run every time: it stats files and reads only those whose size or mtime
    changed): size and sha256 of every file of the configured model directories and task files (and of the
    CLIP tracks' checkpoints and datasets), so that DVC
    reruns ``local_tracks`` exactly when a byte changed. A missing directory is recorded as missing."""
    from .cells import HASH_CACHE, content_record
    from .tracks.llm import model_files

    cache = Path(root) / HASH_CACHE
    out = {}
    for track in params.local_llm:
        files: dict[str, dict] = {}
        for role, directory in model_dirs(track, root).items():
            if not directory.is_dir():
                files[role] = {"missing": str(directory)}
                continue
            for name, path in model_files({role: directory}).items():
                files[name] = content_record(path, cache)
        if track.task_dir is not None:
            for name, path in task_files(track, root).items():
                files[name] = content_record(path, cache)
        out[track.name] = {"settings": track.model_dump(mode="json"), "files": files}
        if track.source == "registry":  # lm-eval's version and task definitions: local_tracks reruns on a change
            try:
                out[track.name]["registry"] = task_config_digests(track, root)
            except MergecalError as err:  # an unknown task: local_tracks records the error for the track's cells
                out[track.name]["registry"] = {"error": str(err)}
    for track in params.local_clip:  # CLIP tracks (mergecal.pipeline.local_clip): checkpoints and datasets
        from .local_clip import input_files, model_paths

        paths = model_paths(track, root)
        out[track.name] = {"settings": track.model_dump(mode="json"),
                           "files": {role: {"missing": str(paths[role])} if path is None else
                                     content_record(path, cache) for role, path in input_files(track, root).items()}}
    atomic_write_text(inputs_path(root), json.dumps(out, indent=2, sort_keys=True))
    return out


def references(track: LocalLlmTrack, root: str | Path = ".", *, seed: int = 0, device: str = "cpu") -> dict:
    """One track of the stage ``local_tracks``: generate the suite's data (suite tasks), score the base and
    each expert with lm-eval (validation and test) and measure the task vectors; a model that fails its
    checks or its scoring is recorded with its error (one line), the others go on."""
    from ..data.llm import LlmSuiteConfig, build_llm_suite
    from .llm import base_reference, expert_reference
    from .results import one_line

    tasks = track.task_names
    if track.source == "suite":
        build_llm_suite(data_dir(track, root), LlmSuiteConfig(**{"seed": seed, **track.data}), tasks=tuple(tasks))
    report: dict = {"name": track.name, "tasks": {}}
    base = base_path(track, root)
    try:
        score = scorer(track, root)
        report["task_configs"] = task_config_digests(track, root)
        check_model_dir(base, allow_unsafe_pickle=track.allow_unsafe_pickle)
        report["base"] = base_reference(score, base, tasks, device=device)
    except Exception as err:  # noqa: BLE001 - recorded: the track's cells fail with it, the others go on
        report["error"] = one_line(err)
    else:
        for task in tasks:
            expert = expert_path(track, task, root)
            try:
                check_expert(base, expert, allow_unsafe_pickle=track.allow_unsafe_pickle)
                report["tasks"][task] = expert_reference(score, base, expert, task, tasks, device=device)
            except Exception as err:  # noqa: BLE001 - as above, for this expert's cells
                report["tasks"][task] = {"error": one_line(err)}
    atomic_write_text(references_path(track, root), json.dumps(report, indent=2, sort_keys=True))
    return report


def all_references(params: Params, root: str | Path = ".", *, device: str = "cpu") -> dict[str, dict]:
    """The stage ``local_tracks``: every configured track's references, LLM and CLIP (an index of them beside,
    so that the output directory exists when no track is configured)."""
    from . import local_clip

    out = {track.name: references(track, root, seed=params.seed, device=device) for track in params.local_llm}
    out.update({track.name: local_clip.references(track, root, seed=params.seed, device=device)
                for track in params.local_clip})
    atomic_write_text(tracks_dir(root) / "index.json", json.dumps(sorted(out), indent=2))
    return out
