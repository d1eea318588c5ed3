"""A self-contained copy of the pipeline (dvc.yaml, stages/, flows/, the library, params.yaml) in another
directory: used by the end-to-end tests and ``mergecal smoke`` to run the whole DVC + Prefect + MLflow
pipeline at a small size without touching the checkout's own outputs.

The pipeline files come from a mergecal checkout given by the caller (``mergecal smoke --root``), never from
where this package is installed: an installed wheel holds the library only. The smoke-size parameters are
package data (``smoke_params.yaml`` beside this module)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from importlib.resources import files
from pathlib import Path
from typing import Any

import yaml

from ..errors import MergecalError
from .config import parse_params
from .tracking import SOURCE_VERSION, code_version

# what a checkout holds of the pipeline; dvc.yaml's stages run stages/, flows/ and the library's sources
PIPELINE_FILES = ("dvc.yaml", "stages", "flows", "mergecal")
SMOKE_PARAMS = files(__package__) / "smoke_params.yaml"


def checkout_root(root: str | Path) -> Path:
    """``root`` resolved, or MergecalError (one line) when it is not a mergecal checkout."""
    root = Path(root).resolve()
    missing = [name for name in PIPELINE_FILES if not (root / name).exists()]
    if missing:
        raise MergecalError(f"{root} is not a mergecal checkout (no {', '.join(missing)}): run this in the "
                            "repository or give it with --root")
    return root


def smoke_overrides() -> dict[str, Any]:
    """The smoke-size parameters (micro CLIP, tiny data), as in the file: only the keys that differ."""
    return yaml.safe_load(SMOKE_PARAMS.read_text())


def full_params(overrides: dict[str, Any]) -> dict[str, Any]:
    """Every key with its value (defaults filled in), so that every `params:` entry of dvc.yaml exists."""
    return parse_params(overrides, "params").model_dump(mode="json")


def create_workspace(dest: str | Path, overrides: dict[str, Any] | None = None, *, root: str | Path,
                     git: bool = True) -> Path:
    """Copy the pipeline of the checkout ``root`` into ``dest`` with ``overrides`` (default: the smoke
    parameters) as its params.yaml; with ``git``, make it a git + DVC repository ready for ``dvc repro``."""
    root = checkout_root(root)
    dest = Path(dest)
    if dest.resolve() == root:  # the workspace's params.yaml would replace the checkout's
        raise MergecalError(f"{dest}: the workspace must be another directory than the checkout {root}")
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in PIPELINE_FILES:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dest / name)
    if (root / ".dvcignore").exists():  # bytecode caches are not stage inputs; `dvc init` keeps this file
        shutil.copy2(root / ".dvcignore", dest / ".dvcignore")
    if overrides is None:
        overrides = smoke_overrides()
    (dest / "params.yaml").write_text(yaml.safe_dump(full_params(overrides), sort_keys=False))
    # where the workspace came from; its runs' code version is its own repository's commit (``no-commit`` until
    # the first), the source's only as ``copy-of-<version>`` in a copy without git (tracking.code_version)
    (dest / SOURCE_VERSION).parent.mkdir(parents=True, exist_ok=True)
    (dest / SOURCE_VERSION).write_text(code_version(root) + "\n")
    if git and not (dest / ".git").exists():
        subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
        # this interpreter's DVC, so the workspace works without an activated environment
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=dest, check=True)
        subprocess.run([sys.executable, "-m", "dvc", "config", "core.analytics", "false"], cwd=dest, check=True)
    return dest
