"""AdaMerging as the benchmark's merge methods (mergecal.methods.adamerging): the registry and its parameters, the
data-free path's refusal, a vision-track cell that learns its coefficients, and the tracks that skip it."""

import json

import pytest
import torch

from mergecal import MERGE_METHODS, get_merge_method, merge_task_vectors
from mergecal.cli import main
from mergecal.errors import ParameterError
from mergecal.methods.adamerging import AdaMergedTaskVectors
from mergecal.merge import iter_merge
from mergecal.recipe import Recipe
from mergecal.task_vectors import TaskVectorSet



def refusal(name: str) -> str:
    return (rf"^{name}: learns its coefficients on a model and unlabelled inputs of each task, so it cannot merge "
            r"task vectors alone; run it in the benchmark's vision track or with mergecal\.adamerging\.adamerging$")


def test_registered_with_the_authors_defaults_and_validated_parameters():
    assert MERGE_METHODS["adamerging_tw"].needs_data and MERGE_METHODS["adamerging_lw"].needs_data
    assert not MERGE_METHODS["task_arithmetic"].needs_data
    tw, lw = get_merge_method("adamerging_tw"), get_merge_method("adamerging_lw")
    assert tw.id == ("adamerging_tw(batch_size=16,clamp=True,init=0.3,inputs='test',lr=0.001,scaling=1.0,seed=0,"
                     "steps=500)")
    assert tw.config().granularity == "task" and lw.config().granularity == "layer"
    assert lw.config().model_dump() == {"granularity": "layer", "init": 0.3, "lr": 1e-3, "steps": 500,
                                        "batch_size": 16, "clamp": True, "seed": 0, "log_every": 10}
    assert Recipe.parse("adamerging_lw(steps=2,inputs='validation')>svc").merge.params.inputs == "validation"
    for values, message in [({"inputs": "train"}, r"adamerging_tw: parameter 'inputs'"),
                            ({"steps": 0}, r"adamerging_tw: parameter 'steps'"),
                            ({"lr": 0}, r"adamerging_tw: parameter 'lr'"),
                            ({"clamp": 1}, r"adamerging_tw: parameter 'clamp'"),
                            ({"granularity": "task"}, r"adamerging_tw: unknown parameter 'granularity'")]:
        with pytest.raises(ParameterError, match=message):
            get_merge_method("adamerging_tw", **values)


def test_the_data_free_path_refuses_it_in_one_line(task_vectors, pretrained, finetuned, tmp_path):
    with pytest.raises(ParameterError, match=refusal("adamerging_tw")):
        merge_task_vectors(task_vectors, "adamerging_tw")
    with pytest.raises(ParameterError, match=refusal("adamerging_lw")):
        dict(iter_merge(TaskVectorSet.from_task_vectors(task_vectors), get_merge_method("adamerging_lw")))
    from mergecal.checkpoint import save_state_dict

    pre = save_state_dict(pretrained, tmp_path / "pre.safetensors")
    fts = [save_state_dict(m, tmp_path / f"ft{i}.safetensors") for i, m in enumerate(finetuned)]
    assert main(["merge", "--pretrained", str(pre), "--finetuned", *map(str, fts), "--method", "adamerging_tw",
                 "--out", str(tmp_path / "out")]) != 0
    assert not (tmp_path / "out").exists()


def test_learned_coefficients_merge_as_adamerging_does():
    """``learn`` on a small MLP: ``iter_merge`` over the task vectors it returns gives AdaMerging's state; another
    configuration's coefficients are refused."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    pre = {k: v.detach().clone() for k, v in model.state_dict().items()}
    fts = [{k: v + 0.1 * torch.randn_like(v) for k, v in pre.items()} for _ in range(2)]
    tvs = TaskVectorSet.from_models(pre, fts)
    inputs = [torch.randn(20, 6) + k for k in range(2)]
    for name in ("adamerging_tw", "adamerging_lw"):
        method = get_merge_method(name, steps=5, lr=0.05, batch_size=4)
        learned, result = method.learn(model, tvs, inputs)
        assert isinstance(learned, AdaMergedTaskVectors) and learned.K == 2
        assert result.coefficients.shape == ((2,) if name == "adamerging_tw" else (2, 4))
        assert not torch.allclose(result.coefficients, torch.full_like(result.coefficients, 0.3))
        merged = dict(iter_merge(learned, method))
        for key in pre:
            torch.testing.assert_close(pre[key] + merged[key], result.state[key], rtol=1e-6, atol=1e-6)
        with pytest.raises(ParameterError, match=rf"{name}: the task vectors' coefficients were learned with another"):
            dict(iter_merge(learned, get_merge_method(name, steps=6, lr=0.05, batch_size=4)))


# ------------------------------------------------------------------------------------------------ the pipeline

@pytest.fixture(scope="module")
def vision_workspace(tmp_path_factory):
    """The smoke workspace's vision track, standard regime only, with AdaMerging (2 steps) in the matrix."""
    from pathlib import Path

    from mergecal.pipeline.config import load_params
    from mergecal.pipeline.tracks.clip.built import stages as vision
    from mergecal.pipeline.workspace import create_workspace, smoke_overrides

    torch.set_num_threads(1)
    overrides = smoke_overrides()
    overrides["benchmark"] = {**overrides["benchmark"], "merges": {"adamerging_tw": {"steps": 2},
                                                                   "adamerging_lw": {"steps": 2},
                                                                   "task_arithmetic": {"scaling": [0.3, 1.0]}},
                              "chains": ["{merge}", "{merge}>svc", "{merge}>dsc"], "fixed_scaling": []}
    root = create_workspace(tmp_path_factory.mktemp("adamerging"), overrides,
                            root=Path(__file__).resolve().parents[1], git=False)
    params = load_params(root / "params.yaml")
    params = params.model_copy(update={"vision": params.vision.model_copy(update={"regimes": ["standard"]})})
    vision.build_data(params, root, progress=False)
    vision.pretrain(params, root, progress=False)
    for task, variant in vision.regime_variants(params.vision, "standard").items():
        vision.finetune(params, task, variant, root, progress=False)
    vision.task_vectors(params, root, regimes=["standard"])
    return root, params


def test_a_vision_cell_learns_its_coefficients_then_calibrates(vision_workspace):
    from mergecal.pipeline import cells as cells_mod

    root, params = vision_workspace
    cells = {c.label: c for c in cells_mod.enumerate_cells(params) if c.track == "vision"}
    cell = cells["adamerging_tw"]
    assert cell.grid == () and cells_mod.cell_grid(cell, Recipe.parse(cell.recipe), None) == (1.0,)
    assert cells["adamerging_tw>dsc"].scaling_from == ""  # no search to take a scaling from: its own, 1
    result = cells_mod.run_cell(cell, params, root)
    assert 0.0 <= result.metrics["avg_acc"] <= 1.0 and result.metrics["selected_scaling"] == 1.0
    learned = result.diagnostics["adamerging"]
    assert set(learned["coefficients"]) == set(params.vision.tasks) and learned["steps"] == 2
    assert all(c != 0.3 and 0.0 <= c <= 1.0 for c in learned["coefficients"].values())
    assert json.loads(result.params["adamerging_tw.steps"]) == 2
    svc = cells_mod.run_cell(cells["adamerging_tw>svc"], params, root)  # a calibration after it, as for any merge
    assert svc.diagnostics["adamerging"] == learned and svc.metrics != result.metrics


def test_tracks_without_its_data_list_its_cells_as_skipped(vision_workspace):
    from mergecal.pipeline import cells as cells_mod
    from mergecal.pipeline.chains import DATA_MERGE_SKIP
    from mergecal.pipeline.track_registry import skipped_cells

    _, params = vision_workspace
    assert params.text.enabled
    computed = {(c.track, c.merge) for c in cells_mod.enumerate_cells(params)}
    assert ("vision", "adamerging_lw") in computed and ("text", "adamerging_lw") not in computed
    assert ("text", "task_arithmetic") in computed
    skipped = {(c.track, c.label): reason for c, reason in skipped_cells(params)}
    for merge in ("adamerging_tw", "adamerging_lw"):
        for chain in ("{merge}", "{merge}>svc"):
            assert skipped[("text", chain.replace("{merge}", merge))] == DATA_MERGE_SKIP
    assert not any(track == "vision" for track, _ in skipped)
    assert skipped[("text", "task_arithmetic>dsc")] != DATA_MERGE_SKIP  # the calibration's own reason
    if params.llm.enabled:
        assert skipped[("llm", "adamerging_tw")] == DATA_MERGE_SKIP
