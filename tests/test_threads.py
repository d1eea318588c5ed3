"""params.yaml's `threads`: every stage that trains or evaluates with torch pins torch's thread count to it, so a
model's bits do not depend on the machine's core count (torch's default), and dvc.yaml lists it for those stages."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from mergecal.pipeline.config import parse_params
from mergecal.pipeline.threads import pin_threads, worker_threads
from mergecal.pipeline.workspace import smoke_overrides
from thread_pinning import finetune_digest

REPO = Path(__file__).resolve().parents[1]

def _stage_in_processes(tmp_path: Path, defaults: list[int], threads: int) -> list[tuple[int, str]]:
    """(torch's thread count, state-dict digest) of tests/thread_pinning.py's stage with params.yaml's ``threads``,
    one process per default thread count of torch (OMP_NUM_THREADS), all started at once."""
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({**smoke_overrides(), "threads": threads}))
    processes = []
    for default in defaults:
        env = {**os.environ, "OMP_NUM_THREADS": str(default), "MKL_NUM_THREADS": str(default),
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        processes.append(subprocess.Popen([sys.executable, str(REPO / "tests" / "thread_pinning.py"), str(tmp_path)],
                                          cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        count, digest = out.split()[-2:]
        results.append((int(count), digest))
    return results


@pytest.mark.integration  # two interpreters that import torch and open_clip: about 10 s of CPU
def test_a_pinned_training_stage_gives_the_same_bits_whatever_the_default_thread_count(tmp_path):
    """Regression: the stages trained with torch's default thread count (the machine's cores), and 4 smoke-size
    fine-tuning steps already give other bits at 1 and at 2 threads."""
    one_core, two_cores = _stage_in_processes(tmp_path, defaults=[1, 2], threads=2)
    assert one_core == two_cores and one_core[0] == 2
    # the thread count does change these bits (so the equality above can fail): the same steps in this process
    params = parse_params({**smoke_overrides(), "threads": 2})
    before = torch.get_num_threads()
    try:
        digests = {}
        for n in (1, 2):
            pin_threads(n)
            digests[n] = finetune_digest(params)
    finally:
        torch.set_num_threads(before)
    assert digests[2] == two_cores[1] and digests[1] != digests[2]


def _pins_threads(script: Path) -> bool:
    """Whether a stage script starts through ``run(stage, threads=True)``."""
    return any(isinstance(node, ast.Call) and getattr(node.func, "id", None) == "run"
               and any(k.arg == "threads" and getattr(k.value, "value", None) is True for k in node.keywords)
               for node in ast.walk(ast.parse(script.read_text())))


def test_dvc_yaml_lists_threads_for_every_stage_that_pins_them():
    pinned = set()
    for name, stage in yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"].items():
        body = stage.get("do", stage)
        module = re.fullmatch(r"python -m stages\.(\w+).*", body["cmd"]).group(1)
        script = REPO / "stages" / f"{module}.py"
        pins = _pins_threads(script)
        assert pins == ("threads" in body.get("params", [])), f"{name}: pins threads {pins}, dvc.yaml disagrees"
        # a stage that resolves a torch device trains or evaluates with torch
        assert pins or "device(params)" not in script.read_text(), f"{name} runs torch without pinning threads"
        if pins:
            pinned.add(name)
    assert {"pretrain", "finetune", "distac", "text_finetune", "llm_pretrain", "llm_finetune", "probe",
            "task_vectors", "text_references", "llm_task_vectors", "local_tracks", "local_sensitivity",
            "local_distac", "benchmark", "testbed"} <= pinned


def test_worker_threads_divide_the_threads_among_parallel_workers():
    assert worker_threads(2, 1) == 2  # one worker: every thread of the parameter
    assert worker_threads(16, 4) == 4
    assert worker_threads(2, 3) == 1  # never below one thread
