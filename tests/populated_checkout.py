"""A checkout that a run has populated, to run the default tier in (#55): tests must pass in a clean clone (as CI
runs them) and in a checkout where the main job has run (as a newcomer runs them: `make run`, then `make test`).

The copy is a git repository of the files the checkout tracks (as its working tree has them); a smoke-size
`dvc repro` populates it in place (data/, models/, results/, reports/, mlruns/, .mergecal/), then the tracked files
it changed (params.yaml, dvc.lock) are put back, so that the tests read the committed parameters beside a run's
outputs. By hand (the same as the slow test):

    python tests/populated_checkout.py /tmp/populated            # then the default tier there
    python tests/populated_checkout.py /tmp/populated -k matrix  # a part of it (pytest's arguments)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import yaml

from committed import committed_copy, tracked_files

BIN = Path(sys.executable).parent
GIT_IDENTITY = ["-c", "user.name=mergecal tests", "-c", "user.email=tests@mergecal.invalid"]


def environment(checkout: Path) -> dict[str, str]:
    """This interpreter's tools first on PATH, and the copy's library before the installed (editable) one."""
    return dict(os.environ, PATH=f"{BIN}{os.pathsep}{os.environ['PATH']}", PYTHONPATH=str(checkout))


def copy_checkout(dest: Path) -> Path:
    """``dest``: a git repository of one commit holding the checkout's tracked files."""
    committed_copy(dest)
    git = ["git", *GIT_IDENTITY, "-C", str(dest)]
    subprocess.run([*git, "init", "-q"], check=True)
    # -f: a tracked file may match .gitignore (the committed backbones are such files un-ignored one by one)
    subprocess.run([*git, "add", "-f", "--pathspec-from-file=-", "--pathspec-file-nul"], check=True,
                   input="\0".join(tracked_files()).encode())
    subprocess.run([*git, "commit", "-q", "-m", "the checkout's tracked files"], check=True)
    return dest


def populate(checkout: Path) -> str:
    """Run the smoke-size pipeline in ``checkout`` (its `dvc repro` output is returned), then restore the tracked
    files the run changed: the outputs stay, the committed parameters and lock come back."""
    from mergecal.pipeline.workspace import full_params, smoke_overrides

    (checkout / "params.yaml").write_text(yaml.safe_dump(full_params(smoke_overrides()), sort_keys=False))
    run = subprocess.run([str(BIN / "dvc"), "repro"], cwd=checkout, env=environment(checkout), text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    if run.returncode != 0:
        raise RuntimeError(f"dvc repro (smoke) in {checkout} failed:\n{run.stdout[-6000:]}")
    subprocess.run(["git", "-C", str(checkout), "checkout", "-q", "--", "."], check=True)
    return run.stdout


def default_tier(checkout: Path, *pytest_args: str) -> subprocess.CompletedProcess:
    """The default tier (`pytest`, as `make test` runs it first) inside ``checkout``."""
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", *pytest_args],
                          cwd=checkout, env=environment(checkout), text=True, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    checkout = Path(argv[0]).resolve()
    if checkout.exists():
        print(f"{checkout}: exists; give a new directory", file=sys.stderr)
        return 2
    populate(copy_checkout(checkout))
    result = default_tier(checkout, *argv[1:])
    print(result.stdout)
    return result.returncode


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.exit(main(sys.argv[1:]))
