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
# ids the hub now serves under another name, as older clients cached them (datasets once without an organisation):
# a cache that FusionBench's configs filled holds `svhn` and `mnist` for ufldl-stanford/svhn and ylecun/mnist
ALIASES = {("dataset", "ufldl-stanford/svhn"): ("svhn",), ("dataset", "ylecun/mnist"): ("mnist",)}


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


def _cached(repo_id: str, repo_type: str, revision: str | None) -> Path | None:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, repo_type=repo_type, revision=revision, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None


def _find(hub_id: HubId, repo_type: str) -> Path | None:
    """The cached snapshot under the id or one of its ``ALIASES``; None when the cache holds neither."""
    for repo_id in (hub_id.repo_id, *ALIASES.get((repo_type, hub_id.repo_id), ())):
        found = _cached(repo_id, repo_type, hub_id.revision)
        if found is not None:
            return found
    return None


def snapshot(hub_id: HubId, repo_type: str = "model") -> Path:
    """The cached snapshot folder of ``hub_id`` (its revision, else ``main``), found offline, under its own id or
    an older one the hub redirects from (``ALIASES``); a one-line CheckpointError when the cache does not hold it.
    (``hub_id.path`` is not applied: see ``local_path``.)"""
    if repo_type not in REPO_TYPES:
        raise ValueError(f"repo_type: expected one of {REPO_TYPES}, got {repo_type!r}")
    found = _find(hub_id, repo_type)
    if found is not None:
        return found
    raise CheckpointError(
        f"{hub_id} ({repo_type}): not in the local Hugging Face cache ({cache_dir()}); nothing is downloaded "
        f"here: fetch it where a network exists ({fetch_command(hub_id, repo_type)}) and copy the cache, or set "
        "HF_HUB_CACHE to where it is")


def hub_ids_in(values, dataset_keys: tuple[str, ...] = ("datasets",)) -> list[tuple[HubId, str]]:
    """Every explicit hub id (``hf://...``) in a track's settings, at any depth, with the repository kind it names
    there: ``dataset`` under one of ``dataset_keys``, else ``model``; each once, in the order found."""
    found: dict[tuple[HubId, str], None] = {}

    def walk(value, repo_type: str) -> None:
        if isinstance(value, str):
            hub = parse_hub_id(value, explicit_only=True)
            if hub is not None:
                found[(HubId(hub.repo_id, hub.revision), repo_type)] = None
        elif isinstance(value, dict):
            for key, item in value.items():
                walk(item, "dataset" if key in dataset_keys else repo_type)
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item, repo_type)

    walk(values, "model")
    return list(found)


def check_cached(wanted: list[tuple[HubId, str]]) -> None:
    """One CheckpointError naming every id of ``wanted`` the cache lacks, and one command that fetches them all
    where a network exists, instead of the first one a run meets."""
    missing = [(hub, kind) for hub, kind in wanted if _find(hub, kind) is None]
    if missing:
        names = ", ".join(f"{hub} ({kind})" for hub, kind in missing)
        commands = " && ".join(fetch_command(hub, kind) for hub, kind in missing)
        raise CheckpointError(
            f"{len(missing)} hub id{'s are' if len(missing) > 1 else ' is'} not in the local Hugging Face cache "
            f"({cache_dir()}): {names}; nothing is downloaded here: fetch them where a network exists ({commands}) "
            "and copy the cache, or set HF_HUB_CACHE to where it is")


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
