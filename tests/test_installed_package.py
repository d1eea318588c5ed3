"""The package as `pip install .` leaves it, outside a checkout (issue #18, defect 8): a wheel of this tree in a
fresh venv gives a working `mergecal` command, and the commands that need a checkout (`smoke`, `schedule`)
say so in one line instead of reaching for repository files."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mergecal import merge_models
from mergecal.checkpoint import SafetensorsSource

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[1]


def _run(cmd, cwd, check=True):
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    result = subprocess.run([str(c) for c in cmd], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if check:
        assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return result


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A venv holding only the wheel; the dependencies come from this interpreter's site-packages, added after
    the venv's own by a .pth line (which runs none of that directory's .pth files, so this environment's
    editable install of mergecal stays out)."""
    tmp = tmp_path_factory.mktemp("installed")
    # build from a copy of what the wheel is made of, so the build leaves nothing in the checkout
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "mergecal", src / "mergecal", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", tmp / "wheel", src], cwd=tmp)
    (wheel,) = (tmp / "wheel").glob("mergecal-*.whl")
    env_dir = tmp / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", env_dir], cwd=tmp)
    python = env_dir / "bin" / "python"
    _run([*pip, "--python", python, "install", "--no-deps", "--no-index", wheel], cwd=tmp)
    own = Path(_run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                    cwd=tmp).stdout.strip())
    deps = dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib"))
    (own / "zz_dependencies.pth").write_text("".join(f"{path}\n" for path in deps))
    work = tmp / "elsewhere"  # the cwd of every command: no checkout in it or above it
    work.mkdir()
    return env_dir, work


def test_the_installed_package_is_the_wheel_with_its_data(venv):
    env_dir, work = venv
    code = ("import mergecal, mergecal.pipeline.workspace as w; print(mergecal.__file__); "
            "print(sorted(w.smoke_overrides()))")
    where, keys = _run([env_dir / "bin" / "python", "-c", code], cwd=work).stdout.splitlines()
    assert Path(where).is_relative_to(env_dir) and "vision" in keys


def test_the_installed_cli_merges_outside_a_checkout(venv):
    env_dir, work = venv
    mergecal = env_dir / "bin" / "mergecal"
    assert "merge" in _run([mergecal, "--help"], cwd=work).stdout
    assert "--pretrained" in _run([mergecal, "merge", "--help"], cwd=work).stdout

    g = torch.Generator().manual_seed(0)
    pre = {"w": torch.randn(6, 4, generator=g), "b": torch.randn(6, generator=g)}
    fts = [{k: v + 0.1 * torch.randn(v.shape, generator=g) for k, v in pre.items()} for _ in range(3)]
    paths = []
    for name, state in [("pre", pre)] + [(f"ft{i}", ft) for i, ft in enumerate(fts)]:
        save_file(state, work / f"{name}.safetensors")
        paths.append(f"{name}.safetensors")
    result = _run([mergecal, "merge", "--pretrained", paths[0], "--finetuned", *paths[1:], "--method", "ties",
                   "--set", "top_k=0.5", "--out", "merged"], cwd=work)
    assert "merged checkpoint written to" in result.stdout
    merged = SafetensorsSource(work / "merged")
    expected = merge_models(pre, fts, "ties", top_k=0.5)
    assert set(merged.keys()) == set(expected)
    assert all(torch.equal(merged.get(k), expected[k]) for k in expected)


@pytest.mark.parametrize("args", [["smoke", "ws"], ["schedule", "--cron", "0 3 * * 1"]])
def test_commands_that_need_a_checkout_say_so_in_one_line(venv, args):
    env_dir, work = venv
    result = _run([env_dir / "bin" / "mergecal", *args], cwd=work, check=False)
    err = result.stderr.strip()
    assert result.returncode == 2 and err.count("\n") == 0 and "Traceback" not in err, err
    assert err.startswith("mergecal: error: ") and "is not a mergecal checkout" in err and "--root" in err
    assert not (work / "ws").exists()
