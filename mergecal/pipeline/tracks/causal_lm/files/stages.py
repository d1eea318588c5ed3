"""LLM tracks from local directories (``local_llm:`` in params.yaml): a lab's own base model and experts,
benchmarked as the embedded LLM track is, without copying a checkpoint.

    models/local/inputs.json                     stage ``local_inputs``: size and sha256 of each file the
                                                 loaders read of every configured model directory and
                                                 task_dir (``input_records``), and of no other file
    models/local/tracks/<name>/references.json   stage ``local_tracks``: lm-eval scores of the base and each
                                                 expert (validation, test), task-vector norms, or the error
                                                 that makes the model unusable
    models/local/tracks/<name>/data/             the suite's data, for a track on the suite's tasks

Outside DVC's outputs: ``.mergecal/local/<name>/lm_eval_tasks`` (YAMLs naming the data by absolute path),
``.mergecal/local/lm_eval_cache`` (lm-eval response caches, one file per model's weight digest, shared by the
tracks) and ``.mergecal/local/merged`` (merges of running cells). Hashes are cached under
``.mergecal/hashes`` by (path, size, mtime): a rerun reads no unchanged checkpoint again.

An expert may be a PEFT adapter directory trained on the base (``mergecal.adapters``): ``local_inputs`` records its
adapter_config.json and adapter_model.safetensors, refusing what the adapters package does not read (one line naming
the params key and the file); its model, the base with the adapter applied as peft's ``merge_and_unload`` applies it,
is written once under ``.mergecal/local/applied`` (``expert_model_dir``) and scored and merged as a full expert's.

A model directory is checked before anything reads its weights (``check_model_dir``): it exists, holds a
config.json, its weights are safetensors (pickled ``pytorch_model*.bin`` are never unpickled here) and every
shard its index lists is present; an expert also shares the base's config and tokenizer (with
``align_vocabulary``: but for tokens it adds after the base's vocabulary, ``mergecal.backbones.vocabulary``). A
failure is recorded in references.json as one line; the stage goes on with the other models and tracks, and the
cells that need that model fail with the same line. A ``task_dir`` YAML whose ``!function`` entries would run the
folder's Python code is refused before lm-eval imports anything unless the track sets ``trust_task_code``; a task
with fewer than ``min_test`` test documents refuses the track (``check_test_counts``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid
from pathlib import Path

from .....adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, IA3Expert, LoraExpert, is_adapter_dir, linear_layouts,
                           read_adapter, write_full_model)
from .....backbones.hf_causal_lm import check_same_family, model_dir_files, weight_format
from .....backbones.vocabulary import PaddedVocabularySource, aligned_vocabulary, check_aligned_family
from .....checkpoint import SafetensorsSource, atomic_write_text
from .....data.llm import LlmSuiteConfig, build_llm_suite
from .....errors import CheckpointError, MergecalError, ParameterError
from .....evaluation.lm_eval_registry import config_digest, write_variant_yamls
from .....evaluation.lm_eval_tasks import task_sources as sources
from ....config import Params
from ....hashing import HASH_CACHE, content_record
from .params import LocalLlmTrack
from ..scoring import LmEval, expert_reference, suite_config_digests, suite_lm_eval, task_vector_norms
from ....own_models import (check_test_counts, content_records, loaded_files, name_under, resolve, role_files,
                            tracks_dir)
from ....results import one_line

WORK = Path(".mergecal") / "local"
CONVERT_HINT = ("convert it once to safetensors: python -c \"from mergecal.backbones.hf_causal_lm import "
                "load_causal_lm, save_causal_lm; save_causal_lm(*load_causal_lm('{path}', allow_unsafe_pickle=True), "
                "'{path}-safetensors')\" and point the track at the new directory")


def track_dir(track: LocalLlmTrack, root: str | Path) -> Path:
    return tracks_dir(root) / track.name


def references_path(track: LocalLlmTrack, root: str | Path) -> Path:
    return track_dir(track, root) / "references.json"


def data_dir(track: LocalLlmTrack, root: str | Path) -> Path:
    return track_dir(track, root) / "data"


def work_dir(root: str | Path) -> Path:
    return Path(root) / WORK


def base_path(track: LocalLlmTrack, root: str | Path) -> Path:
    return resolve(track.base, root)


def expert_path(track: LocalLlmTrack, name: str, root: str | Path) -> Path:
    """The directory of an expert, scored (by its task) or ``unscored`` (by its name)."""
    return resolve(track.expert_of(name), root)


def merged_paths(track: LocalLlmTrack, tasks, root: str | Path) -> list[Path]:
    """The experts a merge cell over ``tasks`` reads: theirs, then every unscored one."""
    return [expert_path(track, name, root) for name in [*tasks, *track.unscored]]


# ------------------------------------------------------------------------------------- PEFT adapter experts

def expert_files(directory: Path) -> list[Path]:
    """The files an expert is read from: a PEFT adapter directory's config and safetensors weights (nothing else of
    it), else a model directory's (``model_dir_files``)."""
    if is_adapter_dir(directory):
        return [directory / name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if (directory / name).is_file()]
    return model_dir_files(directory)


def applied_adapter(base: Path, adapter_dir: Path):
    """An adapter expert over the track's base as a ``TensorSource`` (``mergecal.adapters``): LoRA as base + delta,
    one target's delta at a time, bit for bit peft's ``merge_and_unload``; IA³ as the base scaled by its vectors, as
    ``merge_and_unload`` scales it. Reading it checks that it applies over the base (every target key present, shapes
    fitting); what the adapters package refuses (DoRA, LoRA variants, pickled weights) is one CheckpointError."""
    adapter = read_adapter(adapter_dir)
    expert = LoraExpert if adapter.kind == "lora" else IA3Expert
    return expert(SafetensorsSource(base), adapter, layouts=linear_layouts(base))


def applied_dir(base: Path, adapter_dir: Path, root: str | Path) -> Path:
    """Where an adapter expert's full model is written: under the work directory, named by the content of the base's
    and the adapter's files (a changed byte of either, a new model)."""
    records = {role: content_record(path, Path(root) / HASH_CACHE)["sha256"] for files in
               (role_files("base", base, model_dir_files(base)), role_files("adapter", adapter_dir,
                                                                           expert_files(adapter_dir)))
               for role, path in files.items()}
    digest = hashlib.sha256(json.dumps(records, sort_keys=True).encode()).hexdigest()
    return work_dir(root) / "applied" / f"{adapter_dir.name}-{digest[:16]}"


def expert_model_dir(base: Path, expert: Path, root: str | Path) -> Path:
    """The model directory lm-eval scores and the merges read for an expert: a full checkpoint as it is; a PEFT
    adapter applied to the base (``applied_adapter``) and written once as a full model (``applied_dir``, key by key:
    one key of the base in memory), which every later stage and cell reuses."""
    if not is_adapter_dir(expert):
        return expert
    out = applied_dir(base, expert, root)
    if out.is_dir():
        return out
    # written beside it, then renamed into place: a cell writing the same model at once finds it whole or not at all
    staging = out.parent / f".{out.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        write_full_model(base, [expert], applied_adapter(base, expert), staging,
                         metadata={"mergecal_applied_adapter": expert.name}, label=f"PEFT adapter {expert.name} "
                         "applied (merge_and_unload)", hf_directory=True)
        try:
            os.rename(staging, out)
        except OSError:
            if not out.is_dir():  # another cell's rename won the race otherwise
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out


def expert_model_dirs(track: LocalLlmTrack, names, root: str | Path) -> list[Path]:
    """``expert_model_dir`` of the named experts (scored or unscored) of a track."""
    base = base_path(track, root)
    return [expert_model_dir(base, expert_path(track, name, root), root) for name in names]


# --------------------------------------------------------------------------------------------- checks

def check_model_dir(path: Path, *, allow_unsafe_pickle: bool = False) -> None:
    """A usable model directory, checked from its file names, config and safetensors headers only (nothing is
    unpickled, no tensor is read): one CheckpointError naming the directory or file otherwise."""
    if weight_format(path) == "pickle":
        weights = next(iter(sorted(path.glob("pytorch_model*.bin*"))), path)
        if not allow_unsafe_pickle:
            raise CheckpointError(f"{weights}: pickled weights (pytorch_model*.bin) and no *.safetensors; unpickling "
                                  "can run arbitrary code, so they are not read. For a directory you trust, set "
                                  "allow_unsafe_pickle: true on the track and " + CONVERT_HINT.format(path=path))
        raise CheckpointError(f"{weights}: pickled weights; the streaming merge reads safetensors only, so "
                              + CONVERT_HINT.format(path=path))
    SafetensorsSource(path)  # headers of every shard: a shard missing from the index is named here


def check_expert(base: Path, expert: Path, *, allow_unsafe_pickle: bool = False,
                 align_vocabulary: bool = False) -> None:
    """An expert usable over the base: a model directory of the base's family, or a PEFT adapter that applies over
    the base (``applied_adapter``: its targets' keys and shapes; its config's ``base_model_name_or_path`` is not
    compared, as a path or hub id of the machine it was trained on says nothing of this one's files)."""
    if is_adapter_dir(expert):
        applied_adapter(base, expert)
        return
    check_model_dir(expert, allow_unsafe_pickle=allow_unsafe_pickle)
    if align_vocabulary:
        check_aligned_family(base, [expert])
    else:
        check_same_family(base, [expert])


def track_vocabulary(track: LocalLlmTrack, root: str | Path) -> tuple[int, dict[Path, int]] | None:
    """(aligned size, {model directory: own size}) over the base and every expert of an ``align_vocabulary``
    track (None otherwise): the shapes every merge and norm of the track reads."""
    if not track.align_vocabulary:
        return None
    size, _, own = aligned_vocabulary(base_path(track, root), expert_model_dirs(track, track.merged_names, root))
    return size, own


def norm_sources(track: LocalLlmTrack, root: str | Path, base: Path, expert: Path):
    """What an expert's task-vector norms read: the files (None), or with ``align_vocabulary`` the base and the
    expert with the track's aligned vocabulary (``task_vector_norms``'s ``sources``)."""
    vocabulary = track_vocabulary(track, root)
    if vocabulary is None:
        return None
    size, own = vocabulary
    return (PaddedVocabularySource(SafetensorsSource(base), own[base], size),
            PaddedVocabularySource(SafetensorsSource(expert), own[expert], size))


# ------------------------------------------------------------------------------------------ evaluation

def scorer(track: LocalLlmTrack, root: str | Path):
    """The track's ``LmEval``: the suite's YAMLs over its generated data, the user's YAML directory, or lm-eval's
    registry tasks (each checked to be one and to have its dataset in the local HF cache)."""
    cache = work_dir(root) / "lm_eval_cache"
    if track.source == "registry":
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
    check_task_code(track, root)
    names = {t: {"test": t, "validation": spec.validation} for t, spec in track.tasks.items()}
    return LmEval(task_dir, names, {t: spec.metric for t, spec in track.tasks.items()}, cache,
                  track.evaluation.max_validation, track.evaluation.batch_size)


def lm_eval_names(track: LocalLlmTrack) -> list[str]:
    """The lm-eval tasks a ``task_dir`` track loads: each task and its validation task."""
    return [name for task, spec in track.tasks.items() for name in (task, spec.validation)]


def task_sources(track: LocalLlmTrack, root: str | Path):
    """What lm-eval reads of the track's ``task_dir`` (``mergecal.evaluation.lm_eval_tasks.TaskSources``)."""
    return sources(resolve(track.task_dir, root), lm_eval_names(track))


def check_task_code(track: LocalLlmTrack, root: str | Path) -> None:
    """Refuse, before lm-eval imports anything, task YAMLs whose ``!function`` entries would run the task
    folder's Python code, unless the track trusts it (``trust_task_code``)."""
    if track.trust_task_code:
        return
    sources = task_sources(track, root)
    allow = f"local_llm track {track.name!r} runs it only with trust_task_code: true (for a folder you trust)"
    if sources.functions:
        path, key, function = sources.functions[0]
        raise MergecalError(f"{path}: {key}: !function {function} would import and run Python code of the task "
                            f"folder; {allow}")
    if sources.unreadable:  # lm-eval's own parser may read it, and run what it names
        path, reason = sources.unreadable[0]
        raise MergecalError(f"{path}: not readable as a safe YAML ({reason}), so whether it would run Python code "
                            f"cannot be checked; fix it, or: {allow}")


def task_files(track: LocalLlmTrack, root: str | Path) -> dict[str, Path]:
    """The files that define the track's lm-eval tasks, as lm-eval loads them (``task_sources``): the YAMLs
    of its tasks and those they include, the Python files their ``!function`` entries name and the local data
    files they name (``dataset_kwargs.data_files``); for the suite's tasks, the generated data's manifest. No
    other file of ``task_dir``."""
    if track.source == "registry":
        return {}  # lm-eval's own files: task_config_digests (in references.json) hash them with lm-eval's version
    if track.task_dir is None:
        return {"data_manifest": data_dir(track, root) / "manifest.json"}
    task_dir = resolve(track.task_dir, root)
    sources = task_sources(track, root)
    files: dict[str, Path] = {}
    for path in [*sources.yamls, *sources.modules]:
        under = name_under(path, task_dir)
        files[f"task_dir/{under}" if under is not None else f"task_file/{path.as_posix()}"] = path
    for one in sources.data_files:
        if resolve(one, task_dir).is_file():
            files[f"data/{one}"] = resolve(one, task_dir)
    return files


def task_config_digests(track: LocalLlmTrack, root: str | Path) -> dict[str, str]:
    """{lm-eval task (or YAML file): sha256 of its configuration} (logged with each cell)."""
    if track.source == "registry":
        return {task: config_digest(task) for task in track.task_names}
    if track.task_dir is None:
        return suite_config_digests(data_dir(track, root), track.task_names)
    return {role.removeprefix("task_dir/"): hashlib.sha256(path.read_bytes()).hexdigest()
            for role, path in task_files(track, root).items() if role.startswith("task_dir/")}


# ----------------------------------------------------------------------------------------------- stages

def model_dirs(track: LocalLlmTrack, root: str | Path) -> dict[str, Path]:
    return {"base": base_path(track, root), **{f"expert.{t}": expert_path(track, t, root) for t in track.experts},
            **{f"unscored.{n}": expert_path(track, n, root) for n in track.unscored}}


def model_keys(track: LocalLlmTrack) -> dict[str, str]:
    """{role in inputs.json: the params key of its path}."""
    return {"base": "base", **{f"expert.{t}": f"experts.{t}" for t in track.experts},
            **{f"unscored.{n}": f"unscored.{n}" for n in track.unscored}}


MODEL_FILES = "model files (expected config.json, tokenizer files and *.safetensors or pytorch_model*.bin)"


def check_adapter_params(role: str, directory: Path, key: str) -> None:
    """A PEFT adapter where the track names one, refused when the params are read (stage ``local_inputs``) in one
    line naming its params key and file: as the base (give the model it was trained on), or an adapter the adapters
    package does not read (DoRA and other LoRA variants, a peft_type other than LORA or IA3, adapter_model.bin)."""
    if not is_adapter_dir(directory):
        return
    if role == "base":
        raise ParameterError(f"{key}: {directory} is a PEFT adapter; give the base model its adapters were trained on")
    try:
        read_adapter(directory)
    except CheckpointError as err:
        raise ParameterError(f"{key}: {one_line(err)}") from None


def model_inputs(track: LocalLlmTrack, root: str | Path, where: str = "") -> dict[str, Path | dict]:
    """The files of the track's model directories that the loaders read (``expert_files``), by role."""
    keys = model_keys(track)
    files: dict[str, Path | dict] = {}
    for role, directory in model_dirs(track, root).items():
        check_adapter_params(role, directory, where + keys[role])
        files.update(loaded_files(role, directory, where + keys[role], expert_files, MODEL_FILES))
    return files


def configured(params: Params) -> list:
    """This source's tracks in params.yaml (``local_llm:``)."""
    return params.local_llm


def input_records(params: Params, root: str | Path, cache: Path) -> dict:
    """This source's part of the stage ``local_inputs`` (``tracks.lab_files.record_inputs``): per track, size and
    sha256 of each file the loaders read (model directories, task files) and of no other file, so that DVC reruns
    ``local_tracks`` exactly when a byte changed. A missing path is recorded as missing; a path that holds none of
    the files its loader reads (a wrong path) is refused, one line naming its params key."""
    out = {}
    for index, track in enumerate(params.local_llm):
        where = f"params.yaml: local_llm.{index}."
        found = model_inputs(track, root, where)
        if track.task_dir is not None:
            task_dir = resolve(track.task_dir, root)
            if not task_dir.is_dir():
                found["task_dir"] = {"missing": str(task_dir)}
            elif not task_sources(track, root).defined:
                raise ParameterError(f"{where}task_dir: {task_dir} defines none of the track's lm-eval tasks "
                                     f"(expected *.yaml files with task: {', '.join(lm_eval_names(track))}); "
                                     "nothing of it is read")
            found.update(task_files(track, root))
        out[track.name] = {"settings": track.model_dump(mode="json"), "files": content_records(found, cache)}
        if track.source == "registry":  # lm-eval's version and task definitions: local_tracks reruns on a change
            try:
                out[track.name]["registry"] = task_config_digests(track, root)
            except MergecalError as err:  # an unknown task: local_tracks records the error for the track's cells
                out[track.name]["registry"] = {"error": str(err)}
    return out


def references(track: LocalLlmTrack, root: str | Path = ".", *, seed: int = 0, device: str = "cpu") -> dict:
    """One track of the stage ``local_tracks``: generate the suite's data (suite tasks), score the base and
    each expert with lm-eval (validation and test) and measure the task vectors; a model that fails its
    checks or its scoring is recorded with its error (one line), the others go on."""
    tasks = track.task_names
    if track.source == "suite":
        build_llm_suite(data_dir(track, root), LlmSuiteConfig(**{"seed": seed, **track.data}), tasks=tuple(tasks))
    report: dict = {"name": track.name, "tasks": {}}
    base = base_path(track, root)
    try:
        score = scorer(track, root)
        report["task_configs"] = task_config_digests(track, root)
        check_model_dir(base, allow_unsafe_pickle=track.allow_unsafe_pickle)
        # test first: a task too small to mean anything refuses the track before more is scored
        test, counts = score.score_and_count(base, tasks, "test", device=device)
        check_test_counts(f"local_llm track {track.name!r}", counts, track.min_test, "test documents")
        report["base"] = {"validation": score.score(base, tasks, "validation", device=device), "test": test}
    except Exception as err:  # noqa: BLE001 - recorded: the track's cells fail with it, the others go on
        report["error"] = one_line(err)
    else:
        checks = {"allow_unsafe_pickle": track.allow_unsafe_pickle, "align_vocabulary": track.align_vocabulary}
        for task in tasks:
            try:
                check_expert(base, expert_path(track, task, root), **checks)
                expert = expert_model_dir(base, expert_path(track, task, root), root)
                report["tasks"][task] = expert_reference(score, base, expert, task, tasks, device=device,
                                                         sources=norm_sources(track, root, base, expert))
            except Exception as err:  # noqa: BLE001 - as above, for this expert's cells
                report["tasks"][task] = {"error": one_line(err)}
        for name in track.unscored:  # checked and measured, never scored (no task of their own)
            try:
                check_expert(base, expert_path(track, name, root), **checks)
                expert = expert_model_dir(base, expert_path(track, name, root), root)
                report.setdefault("unscored", {})[name] = task_vector_norms(
                    base, expert, norm_sources(track, root, base, expert))
            except Exception as err:  # noqa: BLE001 - the merge cells fail with it
                report.setdefault("unscored", {})[name] = {"error": one_line(err)}
    atomic_write_text(references_path(track, root), json.dumps(report, indent=2, sort_keys=True))
    return report


def task_line(report: dict, task: str, info: dict) -> str:
    """What the stage ``local_tracks`` prints of a task's references (``tracks.lab_files.report_lines``)."""
    return (f"expert {info['test_accuracy']:.3f}, base {report['base']['test'][task]:.3f}; "
            f"|tau| {info['norm']:.2f} ({info['relative_norm']:.4f} of |theta_0|)")
