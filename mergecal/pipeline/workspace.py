"""A self-contained copy of the pipeline (dvc.yaml, stages/, flows/, the library, params.yaml) in another
directory: used by the end-to-end tests and ``mergecal smoke`` to run the whole DVC + Prefect + MLflow
pipeline at a small size without touching the repository's own outputs."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

from .config import parse_params

REPO = Path(__file__).resolve().parents[2]
COPIED = ("dvc.yaml", "stages", "flows", "mergecal")
SMOKE_PARAMS = REPO / "tests" / "smoke_params.yaml"


def full_params(overrides: dict[str, Any]) -> dict[str, Any]:
    """Every key with its value (defaults filled in), so that every `params:` entry of dvc.yaml exists."""
    return parse_params(overrides, "params").model_dump(mode="json")


def create_workspace(dest: str | Path, overrides: dict[str, Any] | None = None, *, git: bool = True) -> Path:
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in COPIED:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore, dirs_exist_ok=True)
        else:
            shutil.copy2(src, dest / name)
    if overrides is None:
        overrides = yaml.safe_load(SMOKE_PARAMS.read_text())
    (dest / "params.yaml").write_text(yaml.safe_dump(full_params(overrides), sort_keys=False))
    if git and not (dest / ".git").exists():
        subprocess.run(["git", "init", "-q"], cwd=dest, check=True)
        # this interpreter's DVC, so the workspace works without an activated environment
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=dest, check=True)
        subprocess.run([sys.executable, "-m", "dvc", "config", "core.analytics", "false"], cwd=dest, check=True)
        shutil.copy2(REPO / ".dvcignore", dest / ".dvcignore")  # bytecode caches are not stage inputs
    return dest
