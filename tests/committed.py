"""The checkout as committed, for tests that read the repository's own files: a copy of the files git tracks, never
what a run left beside them (#55: after `make run` the LLM experts exist, and a cell's inputs expand to their files).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def tracked_files(*parts: str) -> list[str]:
    """The files of the checkout's source under ``parts`` (every path when none), relative to it, as the working
    tree has them: what git tracks and what it would (an edit or a new file not yet committed counts, a file
    deleted from the working tree does not), never what it ignores (a run's outputs)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard", "--", *parts],
                            cwd=REPO, capture_output=True, check=True).stdout
    return [name for name in listed.decode().split("\0") if name and (REPO / name).is_file()]


def committed_copy(dest: Path, *parts: str) -> Path:
    """Copy the tracked files under ``parts`` into ``dest`` (a checkout of those parts and nothing else)."""
    for name in tracked_files(*parts):
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, dest / name)
    return dest
