"""Content hashes of the benchmark's input files: what a cell's id and the own-model stages' input records hash.

A file is read streaming once; its digest is kept in memory and, with a cache folder, on disk by (path, size,
mtime), so a rerun reads no multi-GB checkpoint again.
"""

from __future__ import annotations

import hashlib
import json
from functools import lru_cache
from pathlib import Path
from typing import Any

from ..checkpoint import atomic_write_text
from ..errors import CheckpointError

#: per-file record of content hashes (size, sha256) by (path, size, mtime), so that a rerun reads no
#: multi-GB checkpoint again: one JSON file per path, written atomically (several processes may hash)
HASH_CACHE = Path(".mergecal") / "hashes"


def _sha256_file(path: str) -> str:
    """The streaming read (1 MiB blocks) behind every content hash."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


@lru_cache(maxsize=4096)
def file_digest_at(path: str, size: int, mtime_ns: int, cache_dir: str | None = None) -> str:
    """sha256 of the file at absolute ``path`` whose stat gave ``size`` and ``mtime_ns`` (the memory cache's key)."""
    record = None
    if cache_dir is not None:
        record = Path(cache_dir) / f"{hashlib.sha256(path.encode()).hexdigest()[:32]}.json"
        try:
            known = json.loads(record.read_text())
            if (known["path"], known["size"], known["mtime_ns"]) == (path, size, mtime_ns):
                return known["sha256"]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # absent, cut short or of another file: hash again
    digest = _sha256_file(path)
    if record is not None:
        atomic_write_text(record, json.dumps({"path": path, "size": size, "mtime_ns": mtime_ns, "sha256": digest}))
    return digest


def file_digest(path: str | Path, cache_dir: str | Path | None = None) -> str:
    """sha256 of a file's bytes, read streaming; cached in memory and, with ``cache_dir``, on disk by
    (path, size, mtime): a file whose size or mtime changed is read again, an unchanged one never."""
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: input of the benchmark not found (run `dvc repro` to build it)")
    stat = path.stat()
    return file_digest_at(str(path.resolve()), stat.st_size, stat.st_mtime_ns,
                          None if cache_dir is None else str(cache_dir))


def content_record(path: str | Path, cache_dir: str | Path | None = None) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of a file (what the stages of own-model tracks record)."""
    return {"size": Path(path).stat().st_size, "sha256": file_digest(path, cache_dir)}
