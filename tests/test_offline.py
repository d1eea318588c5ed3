"""The offline/quiet environment is defined once (mergecal.offline); the Makefile exports the same variables for
dvc and the servers it starts, and the stage scripts and model loaders apply it."""

import re
import subprocess
import sys
from pathlib import Path

from mergecal import offline

REPO = Path(__file__).resolve().parents[1]


def test_makefile_exports_exactly_the_offline_environment():
    exported = dict(re.findall(r"^export (\w+) := (\S+)$", (REPO / "Makefile").read_text(), flags=re.M))
    assert exported == offline.OFFLINE_ENV


def test_apply_keeps_a_users_explicit_choice():
    env = {"HF_HUB_OFFLINE": "0"}
    offline.apply(environ=env)
    assert env == {**offline.OFFLINE_ENV, "HF_HUB_OFFLINE": "0"}


def test_importing_a_model_loader_makes_the_hub_offline():
    code = ("import os; [os.environ.pop(k, None) for k in {names!r}]; import mergecal.backbones.hf_causal_lm; "
            "print(all(os.environ.get(k) == v for k, v in {hub!r}.items()))").format(
        names=list(offline.OFFLINE_ENV), hub=offline.HUB_OFFLINE)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert out.stdout.strip() == "True"
