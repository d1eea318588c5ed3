"""What the own-model tracks (``local_llm``, ``local_clip``: a lab's models read in place) share: where their stages
write, a configured path, the files a loader reads of a path (``loaded_files``) and their content records, the
``min_test`` refusal and the check of a track's references.json. A module of its own so that neither track
imports the other."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError, MergecalError, ParameterError
from ..hub_cache import local_path, parse_hub_id, snapshot
from .hashing import content_record
from .results import one_line


def local_root(root: str | Path) -> Path:
    return Path(root) / "models" / "local"


def inputs_path(root: str | Path) -> Path:
    return local_root(root) / "inputs.json"


def tracks_dir(root: str | Path) -> Path:
    return local_root(root) / "tracks"


def resolve(path: str, root: str | Path, repo_type: str = "model") -> Path:
    """A configured path: absolute, or relative to the repository root; or a hub id read from the local Hugging
    Face cache (``mergecal.hub_cache``): ``hf://org/name[@revision][/file]`` (not cached: one line naming it), or a bare
    ``org/name[@revision]`` where no such path exists and the cache holds it (else the path, reported missing as
    any path is). ``repo_type``: the hub repository kind a hub id names here (``model``, ``dataset``)."""
    hub = parse_hub_id(path, explicit_only=True)
    if hub is not None:
        return local_path(hub, repo_type)
    local = Path(path).expanduser() if Path(path).expanduser().is_absolute() else Path(root) / path
    hub = None if local.exists() else parse_hub_id(path)
    if hub is not None:
        try:
            return snapshot(hub, repo_type)
        except CheckpointError:
            return local
    return local


def name_under(path: Path, directory: Path) -> str | None:
    """``path`` relative to ``directory`` (POSIX; also to its real path), or None when it lies elsewhere."""
    for parent in (directory, directory.resolve()):
        try:
            return path.relative_to(parent).as_posix()
        except ValueError:
            continue
    return None


def role_files(role: str, path: Path, files: list[Path]) -> dict[str, Path]:
    """{<role>/<name relative to the path's directory, else absolute>: file} (the names inputs.json records)."""
    directory = path if path.is_dir() else path.parent
    return {f"{role}/{name_under(file, directory) or file.as_posix()}": file for file in files}


def loaded_files(role: str, path: Path, key: str, list_files, expected: str) -> dict[str, Path | dict]:
    """{<role>/<name>: file} of the files ``list_files(path)`` says its loader reads, and nothing else of
    ``path``: {role: {"missing": path}} when it does not exist, {role: {"error": line}} when its files cannot be
    resolved (``local_tracks`` then records the same error for the cells). A path that holds none of them is
    refused: one ParameterError naming ``key`` (the params key), the path and the ``expected`` files."""
    if not path.exists():
        return {role: {"missing": str(path)}}
    try:
        files = list_files(path)
    except MergecalError as err:
        return {role: {"error": one_line(err)}}
    if not files:
        raise ParameterError(f"{key}: {path} holds no {expected}; nothing of it is read")
    return role_files(role, path, files)


def content_records(found: dict[str, Path | dict], cache: Path) -> dict[str, dict]:
    """inputs.json's entry of each file: its size and sha256, or why it has none (missing, error)."""
    return {name: item if isinstance(item, dict) else content_record(item, cache) if item.is_file()
            else {"missing": str(item)} for name, item in found.items()}


def check_test_counts(what: str, counts: dict[str, int], minimum: int, unit: str) -> None:
    """Refuse a task scored on fewer than ``minimum`` test examples (``min_test``: its score would be noise)."""
    for task, n in counts.items():
        if n < minimum:
            raise ParameterError(f"{what}: task {task} has {n} {unit}, fewer than min_test {minimum} (a score on so "
                                 "few is mostly noise; lower min_test to accept it)")


def checked_reference(path: Path, what: str, tasks) -> dict:
    """An own-model track's references.json (``what``: the track, for the message), or the one-line error the
    ``local_tracks`` stage recorded for the track or for one of ``tasks``."""
    if not path.is_file():
        raise CheckpointError(f"{path}: references of {what} not found (run `dvc repro`)")
    reference = json.loads(path.read_text())
    if "error" in reference:
        raise CheckpointError(reference["error"])
    for task in tasks:
        entry = reference["tasks"].get(task)
        if entry is None:
            raise CheckpointError(f"{path}: no reference for task {task!r} (run `dvc repro`)")
        if "error" in entry:
            raise CheckpointError(entry["error"])
    return reference
