"""The offline/quiet environment is defined once (mergecal.offline); the Makefile exports the same variables for
dvc and the servers it starts, and the stage scripts and model loaders apply it."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from mergecal import offline

REPO = Path(__file__).resolve().parents[1]


def test_makefile_exports_exactly_the_offline_environment():
    exported = dict(re.findall(r"^export (\w+) [:?]= (\S+)$", (REPO / "Makefile").read_text(), flags=re.M))
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


def test_a_stage_sets_the_threads_before_torch_and_numpy_load_their_libraries(tmp_path):
    """The thread and kernel variables are read when OpenBLAS and libgomp load: a stage's setup must come first
    even under a plain `dvc repro` (no Makefile exports), so `import mergecal.offline` imports neither."""
    code = ("import os, sys; [os.environ.pop(k, None) for k in {names!r}]\n"
            "from stages._common import setup_env\n"
            "import mergecal.offline\n"
            "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'mergecal imported torch/numpy'\n"
            "setup_env(__import__('pathlib').Path({root!r}))\n"
            "import numpy, scipy.linalg, torch\n"
            "import json\nfrom threadpoolctl import threadpool_info\n"
            "blas = [(i['num_threads'], i['architecture'].lower()) for i in threadpool_info()\n"
            "        if i['internal_api'] == 'openblas']\n"
            "print(json.dumps([blas, os.environ['OMP_WAIT_POLICY'], os.environ['MKL_CBWR']]))").format(
        names=[n for n in offline.OFFLINE_ENV if n != "OPENBLAS_CORETYPE"], root=str(tmp_path))
    # OPENBLAS_CORETYPE stays as this process has it: Haswell (conftest's offline.apply), unless the machine's
    # environment sets it for OpenBLAS's correctness on its CPU, which no test changes
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    blas, policy, kernels = json.loads(out.stdout.splitlines()[-1])
    coretype = os.environ["OPENBLAS_CORETYPE"].lower()
    assert blas and {tuple(b) for b in blas} == {(1, coretype)}  # numpy's and scipy's OpenBLAS: 1 thread, pinned
    assert (policy, kernels) == ("PASSIVE", "AVX2")
