"""Seq2seq tracks from local directories (``local_seq2seq:`` in params.yaml): a lab's own T5 / T0 base and experts
(full fine-tunes, IA³ or LoRA adapters), benchmarked as the papers' profile's seq2seq track is, without copying a
checkpoint.

    models/local/inputs.json                     stage ``local_inputs``: size and sha256 of each file the
                                                 loaders read of every configured directory and task file
                                                 (``input_records``), and of no other file
    models/local/tracks/<name>/references.json   stage ``local_tracks``: rank-classification scores of the base
                                                 and each expert (validation, test), task-vector norms, or the
                                                 error that makes a model unusable
    models/local/tracks/<name>/data/             the suite's text-to-text data, for a track on the suite's tasks

Outside DVC's outputs: ``.mergecal/local_seq2seq/merged`` (merges of running cells, deleted when a cell is done).

A directory is checked before anything reads its weights (``check_base``, ``check_expert``): the base is a model
directory with a config.json and safetensors weights (pickled ``pytorch_model*.bin`` are never read: one line says
how to convert them); an expert is of the track's regime (a model directory of the base's config and tokenizer; an
IA³ or LoRA adapter that applies over the base: its targets' keys and shapes). A task's examples are checked line by
line (``read_examples``). A failure is recorded in references.json as one line; the stage goes on with the other
experts and tracks, and the cells that need that model fail with the same line.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .....adapters import (ADAPTER_CONFIG, ADAPTER_WEIGHTS, IA3Expert, LoraExpert, expert_kind, linear_layouts,
                           read_adapter)
from .....backbones.hf_causal_lm import check_same_config, model_dir_files, weight_format
from .....checkpoint import SafetensorsSource, atomic_write_text
from .....data.llm import LlmSuiteConfig
from .....data.seq2seq import seq2seq_splits
from .....errors import CheckpointError, ParameterError
from ....config import Params
from ....own_models import check_test_counts, content_records, loaded_files, resolve, tracks_dir
from ....results import one_line
from ..scoring import EXPERT_KIND, Scorer, expert_reference, score_base
from .params import LocalSeq2SeqTrack

WORK = Path(".mergecal") / "local_seq2seq"
#: the splits a track's tasks need: validation chooses the scaling, test scores
SPLITS = ("validation", "test")
#: tokenizer files a T5 directory may hold beside ``model_dir_files``'s (sentencepiece's model)
TOKENIZER_FILES = ("spiece.model",)
MODEL_FILES = "model files (expected config.json, tokenizer files and *.safetensors)"
ADAPTER_FILES = f"adapter files (expected {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})"
CONVERT_HINT = ("convert it once to safetensors (transformers: T5ForConditionalGeneration.from_pretrained(dir)"
                ".save_pretrained(new_dir, safe_serialization=True), for a directory you trust) and point the track "
                "at the new directory")


def track_dir(track: LocalSeq2SeqTrack, root: str | Path) -> Path:
    return tracks_dir(root) / track.name


def references_path(track: LocalSeq2SeqTrack, root: str | Path) -> Path:
    return track_dir(track, root) / "references.json"


def data_dir(track: LocalSeq2SeqTrack, root: str | Path) -> Path:
    return track_dir(track, root) / "data"


def work_dir(root: str | Path) -> Path:
    return Path(root) / WORK


def base_path(track: LocalSeq2SeqTrack, root: str | Path) -> Path:
    return resolve(track.base, root)


def expert_path(track: LocalSeq2SeqTrack, task: str, root: str | Path) -> Path:
    return resolve(track.experts[task], root)


def split_path(track: LocalSeq2SeqTrack, task: str, split: str, root: str | Path) -> Path:
    """A task's examples: the lab's ``task_dir/<task>/<split>.jsonl``, or the suite's generated ones."""
    folder = data_dir(track, root) if track.task_dir is None else resolve(track.task_dir, root)
    return folder / task / f"{split}.jsonl"


# ------------------------------------------------------------------------------------------------ files

def model_files(directory: Path) -> list[Path]:
    """The files a model directory is loaded from: ``model_dir_files``'s and a sentencepiece model."""
    extra = [directory / name for name in TOKENIZER_FILES if (directory / name).is_file()]
    return sorted({*model_dir_files(directory), *extra}) if directory.is_dir() else []


def expert_files(directory: Path) -> list[Path]:
    """The files an expert is read from: an adapter's config and safetensors weights, else a model directory's."""
    if (directory / ADAPTER_CONFIG).is_file():
        return [directory / name for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS) if (directory / name).is_file()]
    return model_files(directory)


def read_examples(path: Path) -> list[dict]:
    """A task split's examples (``{"input": str, "choices": [str, ...], "label": int}`` per line); one line naming
    the file and line when one is not."""
    if not path.is_file():
        raise CheckpointError(f"{path}: task examples not found (expected <task>/<split>.jsonl, one JSON example "
                              'per line: {"input": ..., "choices": [...], "label": ...})')
    examples = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            example = json.loads(line)
        except json.JSONDecodeError as err:
            raise CheckpointError(f"{where}: not JSON ({err.msg})") from None
        if not isinstance(example, dict):
            raise CheckpointError(f"{where}: expected an object with input, choices and label")
        choices, label = example.get("choices"), example.get("label")
        if not isinstance(example.get("input"), str) or not example["input"].strip():
            raise CheckpointError(f"{where}: input: expected a non-empty string")
        if not isinstance(choices, list) or len(choices) < 2 or not all(isinstance(c, str) and c for c in choices):
            raise CheckpointError(f"{where}: choices: expected a list of at least 2 non-empty strings")
        if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(choices):
            raise CheckpointError(f"{where}: label: expected the index of the right choice (0..{len(choices) - 1})")
        examples.append(example)
    if not examples:
        raise CheckpointError(f"{path}: no examples")
    return examples


def task_files(track: LocalSeq2SeqTrack, root: str | Path) -> dict[str, Path]:
    """The files that define the track's tasks: the lab's split files, or the generated suite's manifest."""
    if track.task_dir is None:
        return {"data_manifest": data_dir(track, root) / "manifest.json"}
    return {f"task_dir/{task}/{split}.jsonl": split_path(track, task, split, root)
            for task in track.task_names for split in SPLITS}


def scorer(track: LocalSeq2SeqTrack, root: str | Path) -> Scorer:
    return Scorer(lambda task, split: read_examples(split_path(track, task, split, root)),
                  track.evaluation.batch_size, track.evaluation.max_validation)


# ----------------------------------------------------------------------------------------------- checks

_KIND = {"full": "a full model directory", "lora": "a LoRA adapter", "ia3": "an IA³ adapter"}
_KINDS = {"full": "full model directories", "lora": "LoRA adapters", "ia3": "IA³ adapters"}


def kind_mismatch(directory: Path, kind: str, regime: str) -> str | None:
    """Why an expert of ``kind`` (``mergecal.adapters.expert_kind``) does not fit the track's ``regime`` (None: it
    does)."""
    if kind == EXPERT_KIND[regime]:
        return None
    return (f"{directory} is {_KIND[kind]}, but regime {regime!r} merges {_KINDS[EXPERT_KIND[regime]]} (set regime "
            "to the experts' kind: standard, ia3 or lora)")

def check_base(base: Path) -> None:
    """A usable base: a model directory (config.json, safetensors weights), not a PEFT adapter."""
    if (base / ADAPTER_CONFIG).is_file():
        raise CheckpointError(f"{base}: a PEFT adapter; give the base model its adapters were trained on")
    if weight_format(base) == "pickle":
        raise CheckpointError(f"{base}: pickled weights (pytorch_model*.bin) and no *.safetensors; unpickling can "
                              f"run arbitrary code, so they are not read: {CONVERT_HINT}")


def check_expert(base: Path, expert: Path, regime: str) -> None:
    """An expert of the track's regime that fits the base: a model directory of its config and tokenizer files
    (``standard``), or an adapter of the regime's kind whose targets are the base's keys, shapes fitting."""
    kind = expert_kind(expert)
    if (reason := kind_mismatch(expert, kind, regime)) is not None:
        raise CheckpointError(reason)
    if kind == "full":
        check_base(expert)
        check_same_config(base, expert)
        for name in ("tokenizer.json", "spiece.model"):
            mine, theirs = expert / name, base / name
            if mine.exists() != theirs.exists() or (mine.exists() and mine.read_bytes() != theirs.read_bytes()):
                raise CheckpointError(f"{mine}: the tokenizer differs from the base model's ({theirs}); merged "
                                      "weights would index another vocabulary")
        return
    adapter = read_adapter(expert)
    (LoraExpert if kind == "lora" else IA3Expert)(SafetensorsSource(base), adapter, layouts=linear_layouts(base))


# ----------------------------------------------------------------------------------------------- stages

def configured(params: Params) -> list:
    """This source's tracks in params.yaml (``local_seq2seq:``)."""
    return params.local_seq2seq


def model_inputs(track: LocalSeq2SeqTrack, root: str | Path, where: str) -> dict[str, Path | dict]:
    """The files of the track's directories the loaders read, by role; an expert not of the regime's kind, or an
    adapter as the base, refused in one line naming its params key."""
    base = base_path(track, root)
    if (base / ADAPTER_CONFIG).is_file():
        raise ParameterError(f"{where}base: {base} is a PEFT adapter; give the base model its adapters were "
                             "trained on")
    files = loaded_files("base", base, f"{where}base", model_files, MODEL_FILES)
    for task in track.task_names:
        directory, key = expert_path(track, task, root), f"{where}experts.{task}"
        if directory.is_dir():
            try:
                kind = expert_kind(directory)
            except CheckpointError as err:
                raise ParameterError(f"{key}: {one_line(err)}") from None
            if (reason := kind_mismatch(directory, kind, track.regime)) is not None:
                raise ParameterError(f"{key}: {reason}")
        expected = MODEL_FILES if track.regime == "standard" else ADAPTER_FILES
        files.update(loaded_files(f"expert.{task}", directory, key, expert_files, expected))
    return files


def input_records(params: Params, root: str | Path, cache: Path) -> dict:
    """This source's part of the stage ``local_inputs`` (``tracks.lab_files.record_inputs``): per track, size and
    sha256 of each file the loaders read (model and adapter directories, task files) and of no other file."""
    out = {}
    for index, track in enumerate(params.local_seq2seq):
        where = f"params.yaml: local_seq2seq.{index}."
        found = model_inputs(track, root, where)
        if track.task_dir is not None:
            task_dir = resolve(track.task_dir, root)
            if not task_dir.is_dir():
                found["task_dir"] = {"missing": str(task_dir)}
            else:
                found.update(task_files(track, root))
        out[track.name] = {"settings": track.model_dump(mode="json"), "files": content_records(found, cache)}
    return out


def build_suite_data(track: LocalSeq2SeqTrack, root: str | Path, seed: int) -> None:
    """The suite's validation and test examples of the track's tasks, and a manifest of their digests."""
    config = LlmSuiteConfig(**{"seed": seed, **track.data})
    files = {}
    for task in track.task_names:
        splits = seq2seq_splits(task, config)
        for split in SPLITS:
            path = split_path(track, task, split, root)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in splits[split]))
            files[f"{task}/{split}.jsonl"] = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest = {"suite": {k: getattr(config, k) for k in config.__dataclass_fields__}, "files": files}
    atomic_write_text(data_dir(track, root) / "manifest.json", json.dumps(manifest, indent=2, sort_keys=True))


def references(track: LocalSeq2SeqTrack, root: str | Path = ".", *, seed: int = 0, device: str = "cpu") -> dict:
    """One track of the stage ``local_tracks``: generate the suite's data (suite tasks), score the base and each
    expert by rank classification (validation, test) and measure the task vectors; a model that fails its checks
    or its scoring is recorded with its error (one line), the others go on."""
    tasks = track.task_names
    report: dict = {"name": track.name, "regime": track.regime, "tasks": {}}
    base = base_path(track, root)
    try:
        if track.task_dir is None:
            build_suite_data(track, root, seed)
        score = scorer(track, root)
        counts = {task: len(score.examples(task, "test")) for task in tasks}
        check_test_counts(f"local_seq2seq track {track.name!r}", counts, track.min_test, "test examples")
        check_base(base)
        report["base"] = score_base(score, base, tasks, device=device)
    except Exception as err:  # noqa: BLE001 - recorded: the track's cells fail with it, the others go on
        report["error"] = one_line(err)
    else:
        for task in tasks:
            try:
                expert = expert_path(track, task, root)
                check_expert(base, expert, track.regime)
                report["tasks"][task] = expert_reference(score, base, expert, task, tasks, track.regime,
                                                         device=device)
            except Exception as err:  # noqa: BLE001 - as above, for this expert's cells
                report["tasks"][task] = {"error": one_line(err)}
    atomic_write_text(references_path(track, root), json.dumps(report, indent=2, sort_keys=True))
    return report


def task_line(report: dict, task: str, info: dict) -> str:
    """What the stage ``local_tracks`` prints of a task's references (``tracks.lab_files.report_lines``)."""
    return (f"expert {info['test_accuracy']:.3f}, base {report['base']['test'][task]:.3f} (test, rank "
            f"classification); |tau| {info['norm']:.2f}")
