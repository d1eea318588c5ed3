"""#30 item 2: `seeds:` repeats the fine-tunes and everything downstream per seed: the cells (each seed's own
input files), the DVC stages (one per seed through foreach / matrix) and the stage scripts' `--seed`."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from mergecal.pipeline.cells import cell_inputs, enumerate_cells, source_index
from mergecal.pipeline.config import parse_params
from mergecal.pipeline import track_registry
from mergecal.pipeline.track_registry import skipped_cells
from mergecal.pipeline.workspace import full_params, smoke_overrides

ROOT = Path(__file__).resolve().parents[1]


def _params(seeds):
    # the seq2seq track's regimes run in the papers' profile only: one in the matrix here, so its cells are checked
    return parse_params({**smoke_overrides(), "seeds": seeds,
                         "seq2seq": {"regimes": ["standard"], "paper_regimes": ["ia3"]}}, "params")


def test_two_seeds_give_every_cell_twice_each_reading_its_seeds_files(tmp_path):
    one, two = enumerate_cells(_params([0])), enumerate_cells(_params([0, 3]))
    assert [c.seed for c in one] == [0] * len(one)
    # each track's cells once per seed, the same matrix for each: only the seed differs (recipe ids included)
    assert [c for c in two if c.seed == 0] == one
    assert [c.to_dict() | {"seed": 0} for c in two if c.seed == 3] == [c.to_dict() for c in one]
    params = _params([0, 3])
    for cell in two:
        for role, path in cell_inputs(cell, params, tmp_path).items():
            if role.startswith(("finetuned.", "expert.", "distac.", "reference", "sensitivity")):
                assert f"/seeds/{cell.seed}/" in path, (cell.track, cell.label, role, path)
                assert f"/seeds/{3 - cell.seed}/" not in path
    # a calibrated chain takes its scaling from its own seed's cell
    for cell, source in zip(two, source_index(two)):
        if source is not None:
            assert two[source].seed == cell.seed
    assert [c.seed for c, _ in skipped_cells(params)].count(3) == len(skipped_cells(_params([0])))


def test_dvc_yaml_has_each_seed_dependent_stage_once_per_seed(tmp_path):
    (tmp_path / "dvc.yaml").write_text((ROOT / "dvc.yaml").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(full_params({**smoke_overrides(), "seeds": [0, 1]}),
                                                         sort_keys=False))
    dvc = [sys.executable, "-m", "dvc"]
    subprocess.run([*dvc, "init", "--no-scm", "-q"], cwd=tmp_path, check=True)
    listed = subprocess.run([*dvc, "stage", "list", "--name-only"], cwd=tmp_path, check=True, capture_output=True,
                            text=True).stdout.split()
    params = _params([0, 1])
    for seed in (0, 1):
        for stage in ("finetune", "task_vectors", "distac", "probe", "text_references", "llm_task_vectors"):
            assert f"{stage}@{seed}" in listed
        for task in params.text.tasks:
            assert f"text_finetune@{seed}-{task}" in listed
        for task in params.llm.tasks:
            assert f"llm_finetune@{seed}-{task}" in listed
    # shared by every seed: one stage each
    for stage in ("data", "pretrain", "text_data", "llm_data", "llm_pretrain", "local_tracks", "benchmark",
                  "testbed", "stability", "report"):
        assert stage in listed
    assert len(listed) == len(set(listed))


def test_a_stage_refuses_a_seed_that_params_yaml_does_not_list(tmp_path, capsys):
    from stages._common import run

    (tmp_path / "params.yaml").write_text(yaml.safe_dump({**smoke_overrides(), "seeds": [0, 1]}))
    ran = []
    assert run(lambda params, root, args: ran.append(args.seed), ["--root", str(tmp_path), "--seed", "2"]) == 2
    assert capsys.readouterr().err.strip() == "error: --seed 2: not one of params.yaml's seeds [0, 1]"
    assert ran == []
    assert run(lambda params, root, args: ran.append(args.seed), ["--root", str(tmp_path), "--seed", "1"]) == 0
    assert ran == [1]


@pytest.mark.parametrize("track", track_registry.BUILT)
def test_a_seeds_paths_lie_under_its_own_directory(track, tmp_path):
    from mergecal.pipeline.tracks.causal_lm.built import stages as llm
    from mergecal.pipeline.tracks.text.built import stages as text
    from mergecal.pipeline.tracks.clip.built import stages as vision
    from mergecal.pipeline.tracks.seq2seq.built import stages as seq2seq

    params = _params([4, 7])
    path = {"vision": lambda s: vision.paths_for(params, tmp_path, s).finetuned("standard", "digits"),
            "text": lambda s: text.finetuned_path(params, tmp_path, "bbc_topics", s),
            "llm": lambda s: llm.expert_dir(params, tmp_path, "maximum", s),
            "seq2seq": lambda s: seq2seq.expert_dir(params, tmp_path, "standard", "maximum", s)}[track]
    assert "/seeds/7/" in str(path(7)) and path(None) == path(4)  # no seed named: the first


class _Loaded(Exception):
    """Raised by a recording loader: what a track's reference or session asked for is all this test needs."""


@pytest.mark.parametrize("track_name", track_registry.BUILT)
@pytest.mark.parametrize("merge", ["zeroshot", "finetuned", "task_arithmetic"])
def test_a_cells_reference_and_session_load_its_own_seeds_models(track_name, merge, tmp_path, monkeypatch):
    """Every path from a cell to the models it scores carries the cell's seed (a reference row or a session that
    loaded the first seed's models would score seed 0 under every seed's label)."""
    from mergecal.pipeline.cells import run_cell
    from mergecal.pipeline.track_registry import get_track

    module = get_track(track_name)
    params = _params([0, 3])
    seen = []

    def recorder(name, position):
        def load(*args, **kwargs):
            seen.append((name, kwargs.get("seed", args[position] if len(args) > position else None)))
            raise _Loaded
        return load

    loaders = {"vision": {"VisionModels": 2}, "text": {"TextModels": 2, "references_path": 2},
               "llm": {"diagnostics_path": 2, "expert_dir": 3},
               "seq2seq": {"references_path": 3, "expert_dir": 4}}[track_name]
    for name, position in loaders.items():
        monkeypatch.setattr(module, name, recorder(name, position))
    cell = next(c for c in enumerate_cells(params) if c.track == track_name and c.seed == 3 and c.merge == merge
                and (merge in ("zeroshot", "finetuned") or c.chain == "{merge}"))
    with pytest.raises(_Loaded):
        run_cell(cell, params, tmp_path, scaling=0.3 if cell.grid else None)
    assert seen and all(seed == 3 for _, seed in seen), seen
