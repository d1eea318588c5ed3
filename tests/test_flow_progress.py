"""The benchmark flow's output as a terminal shows it (#62), from a real run of a small smoke matrix (vision and
LLM cells, two threads, as `dvc repro` runs it): a line per cell as it completes, progress lines through
Prefect's run logger with the right counts, and no inner progress bar or random-initialisation notice."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mergecal.pipeline.cells import enumerate_cells
from mergecal.pipeline.config import load_params
from mergecal.pipeline.tracks.causal_lm.built import stages as llm
from mergecal.pipeline.tracks.clip.built import stages as vision
from mergecal.pipeline.workspace import create_workspace

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[1]
SMALL = "params-progress.yaml"


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The smoke workspace with the inputs of a 7-cell matrix built in process (the stage functions): the
    vision track's standard regime and the LLM track, task arithmetic and the references of each (multitask: the
    vision track's only)."""
    import torch

    torch.set_num_threads(1)
    root = create_workspace(tmp_path_factory.mktemp("progress"), root=REPO, git=False)
    data = yaml.safe_load((root / "params.yaml").read_text())
    data["benchmark"].update(merges={"task_arithmetic": {"scaling": [0.3, 1.0]}}, chains=["{merge}"],
                             fixed_scaling=[])
    data["vision"].update(regimes=["standard"], finetune_variants=["standard"])
    data["text"]["enabled"] = False
    (root / SMALL).write_text(yaml.safe_dump(data))
    params = load_params(root / SMALL)
    vision.build_data(params, root, progress=False)
    vision.pretrain(params, root, progress=False)
    for task in params.vision.tasks:
        vision.finetune(params, task, "standard", root, progress=False)
    vision.multitask(params, root, progress=False)  # the standard regime's multi-task reference
    vision.task_vectors(params, root)
    llm.build_data(params, root)
    llm.pretrain(params, root, progress=False)
    for task in params.llm.tasks:
        llm.finetune(params, task, root, progress=False)
    llm.references(params, root)
    return root, len(enumerate_cells(params))


def _run_flow(root: Path) -> str:
    """`python -m flows.benchmark` on the small matrix (its own temporary Prefect server), stdout and stderr as
    one terminal would show them."""
    env = {name: value for name, value in os.environ.items() if name != "PREFECT_API_URL"}
    env["MERGECAL_PROGRESS_SECONDS"] = "1"
    done = subprocess.run([sys.executable, "-m", "flows.benchmark", "--params", SMALL, "--root", str(root),
                           "--output", "results/progress.json"], cwd=root, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-6000:]
    return done.stdout


def _progress_lines(output: str) -> list[str]:
    return re.findall(r"Flow run '[^']+' - (cells \d+/\d+ done .*)", output)


def _check_quiet(output: str) -> None:
    assert not re.search(r"\d+/\d+ \[[\d:<?]+,|it/s\]|s/it\]|\d+%\|", output), output[-4000:]  # tqdm's bars
    assert "Model initialized randomly" not in output


def test_cells_and_progress_lines_come_through_the_run_logger_without_inner_bars(workspace):
    root, n = workspace
    output = _run_flow(root)
    _check_quiet(output)
    cell_lines = re.findall(r"Flow run '[^']+' - \[(\d+)/(\d+)\] ", output)
    assert sorted(int(i) for i, _ in cell_lines) == list(range(1, n + 1)) and {int(t) for _, t in cell_lines} == {n}
    lines = _progress_lines(output)
    assert lines and re.fullmatch(rf"cells {n}/{n} done \(0 cached, 0 failed\), 0 running, elapsed \d+:\d\d",
                                  lines[-1]), lines
    counts = [int(re.match(r"cells (\d+)/", line).group(1)) for line in lines]
    assert counts == sorted(counts)
    assert all(re.search(r", [0-2] running, elapsed \d+:\d\d, ETA ", line) for line in lines[:-1]), lines
    assert re.search(rf"benchmark \S+: {n} cells, 0 cached, 0 failed, [\d.]+ s", output)
    summary = (root / "results" / "progress.json").read_bytes()

    rerun = _run_flow(root)  # every cell from the cache: done at once, no estimate needed
    _check_quiet(rerun)
    assert re.fullmatch(rf"cells {n}/{n} done \({n} cached, 0 failed\), 0 running, elapsed \d+:\d\d",
                        _progress_lines(rerun)[-1])
    assert (root / "results" / "progress.json").read_bytes() == summary  # rows in matrix order, both times
