"""Hub ids read from the local Hugging Face cache, never from the network.

Wherever a lab's track names a checkpoint or a dataset (``local_clip``: ``model.pretrained``, ``finetuned``,
``datasets``; ``local_llm``: ``base``, ``experts``, ``unscored``), a hub id may stand for a path: ``hf://org/name``
(explicit), or ``org/name`` when no such path exists under the repository, with an optional ``@revision`` (a branch,
a tag or a commit hash, without ``/``); ``hf://org/name[@revision]/a/file.safetensors`` names a file of the
repository. It resolves to the snapshot folder that huggingface_hub's own offline lookup
(``snapshot_download(..., local_files_only=True)``) finds in the cache (``HF_HUB_CACHE``, else ``HF_HOME``/hub);
the files are then read and hashed like any local file, so the snapshot's content enters the cell ids. An id
that is not in the cache is one line naming it and the command that fetches it where a network exists.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .errors import CheckpointError

SCHEME = "hf://"
# org/name[@revision][/path in the repository], as the hub spells repository ids (letters, digits, '-', '_', '.')
_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+)(?:@(?P<revision>[A-Za-z0-9._-]+))?"
                 r"(?:/(?P<path>[^/].*))?$")
REPO_TYPES = ("model", "dataset")


@dataclass(frozen=True)
class HubId:
    repo_id: str
    revision: str | None = None
    path: str | None = None  # a file or folder inside the repository

    def __str__(self) -> str:
        return self.repo_id + (f"@{self.revision}" if self.revision else "")


def parse_hub_id(value: str, *, explicit_only: bool = False) -> HubId | None:
    """The hub id ``value`` names (``hf://org/name[@rev][/path]``, or with ``explicit_only=False`` a bare
    ``org/name[@rev]``), else None. A malformed ``hf://`` value is an error: it can be nothing else."""
    explicit = value.startswith(SCHEME)
    if not explicit and explicit_only:
        return None
    match = _ID.match(value[len(SCHEME):] if explicit else value)
    if match is None or (match["path"] and not explicit) or ".." in Path(match["path"] or "").parts:
        if explicit:
            raise CheckpointError(f"{value}: not a hub id (expected {SCHEME}org/name, {SCHEME}org/name@revision or "
                                  f"{SCHEME}org/name[@revision]/path/in/the/repository)")
        return None
    return HubId(match["repo"], match["revision"], match["path"])


def cache_dir() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def fetch_command(hub_id: HubId, repo_type: str) -> str:
    """The command that puts ``hub_id`` in the cache where a network exists (huggingface_hub's CLI)."""
    return ("hf download " + hub_id.repo_id + (" --repo-type dataset" if repo_type == "dataset" else "")
            + (f" --revision {hub_id.revision}" if hub_id.revision else ""))


def snapshot(hub_id: HubId, repo_type: str = "model") -> Path:
    """The cached snapshot folder of ``hub_id`` (its revision, else ``main``), found offline; a one-line
    CheckpointError when the cache does not hold it. (``hub_id.path`` is not applied: see ``local_path``.)"""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    if repo_type not in REPO_TYPES:
        raise ValueError(f"repo_type: expected one of {REPO_TYPES}, got {repo_type!r}")
    try:
        return Path(snapshot_download(hub_id.repo_id, repo_type=repo_type, revision=hub_id.revision,
                                      local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        raise CheckpointError(
            f"{hub_id} ({repo_type}): not in the local Hugging Face cache ({cache_dir()}); nothing is downloaded "
            f"here: fetch it where a network exists ({fetch_command(hub_id, repo_type)}) and copy the cache, or set "
            "HF_HUB_CACHE to where it is") from None


def local_path(hub_id: HubId, repo_type: str = "model") -> Path:
    """Where ``hub_id`` lies in the local cache: its snapshot folder, or the file or folder ``hub_id.path`` in it
    (one line when that is not in the snapshot)."""
    folder = snapshot(hub_id, repo_type)
    if hub_id.path is None:
        return folder
    target = folder / hub_id.path
    if not target.exists():
        raise CheckpointError(f"{hub_id} ({repo_type}): the cached snapshot {folder} holds no {hub_id.path!r}")
    return target
