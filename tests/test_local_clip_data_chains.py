"""The data chains of `local_clip` tracks (#16): MAGIC's sensitivity probe and DisTaC computed once per track by
their stage functions, and the cells `{merge}>dsc`, `distac>{merge}`, `distac>{merge}>svc>dsc` on a micro open_clip
CLIP with three fine-tuned checkpoints and tiny datasets written to disk (tests/local_models.py)."""

import json
import re
import shutil

import pytest
import torch
import yaml
from safetensors import safe_open

from local_models import CLIP_ARCH, CLIP_TASKS, perturbed, write_clip_track
from mergecal.errors import CheckpointError, ParameterError
from mergecal.pipeline import cells as cells_mod
from mergecal.pipeline.tracks.clip.files import calibration
from mergecal.backbones import clip_checkpoints
from mergecal.pipeline.tracks.clip.files import stages as local_clip
from mergecal.pipeline.config import load_params
from mergecal.pipeline.tracks.clip.files import cells as track_mod

CHAINS = ["{merge}", "{merge}>wsc", "{merge}>dsc", "distac>{merge}", "distac>{merge}>svc>dsc"]


def _params(root, track: dict, **evaluation):
    """params.yaml of the lab's track alone, with every chain, written under ``root`` and loaded."""
    data = {"vision": {"enabled": False}, "text": {"enabled": False}, "llm": {"enabled": False},
            "probing": {"max_samples": 12, "top": 3},
            "benchmark": {"merges": {"task_arithmetic": {"scaling": [0.3, 1.0]}}, "chains": CHAINS,
                          "evaluation": {"distac_samples": 16, **evaluation}},
            "local_clip": [track]}
    (root / "params.yaml").write_text(yaml.safe_dump(data))
    return load_params(root / "params.yaml")


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The track's references (stage `local_tracks`), then its probe and DisTaC (stages `local_sensitivity`,
    `local_distac`, in process)."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("local_data")
    config = write_clip_track(root / "lab", "lab")
    # SVHN fine-tuned "longer": a task vector twice the others' norm, the setting DisTaC's preset conditions
    from mergecal.backbones.open_clip_vit import create_clip
    from mergecal.checkpoint import save_state_dict

    save_state_dict(perturbed(create_clip(CLIP_ARCH, seed=1).state_dict(), 9, "visual.", scale=0.04),
                    config["finetuned"]["SVHN"])
    params = _params(root, config)
    track = params.local_clip[0]
    local_clip.references(track, root, seed=params.seed)
    from stages import local_distac, local_sensitivity

    for stage in (local_sensitivity, local_distac):
        assert stage.run(stage.stage, ["--root", str(root)]) == 0
    return root, params, track


def test_the_probe_ranks_image_encoder_keys_once_per_track_deterministically(lab):
    from mergecal.calibrations.probing import SensitivityRanking
    from mergecal.keys import get_key_rule

    root, params, track = lab
    path = calibration.sensitivity_path(track, root)
    ranking = SensitivityRanking.load(path)
    assert len(ranking.sensitive) == 3 and all(k.startswith("visual.") for k, _ in ranking.scores)
    # the candidates are MAGIC's layers (probing.candidates: the weight matrices WSC calibrates), each with its interval
    checkpoint = clip_checkpoints.open_checkpoint(local_clip.pretrained_path(track, root))
    layers = get_key_rule("wsc_weights")
    expected = [k for k in clip_checkpoints.visual_keys(checkpoint)
                if layers.matches(k, tuple(checkpoint.get(k).shape), checkpoint.get(k).dtype)]
    assert sorted(k for k, _ in ranking.scores) == sorted(expected) and set(ranking.drops) == set(expected)
    assert ranking.metadata["metric"] == "nll" and ranking.top_separated is not None
    again = calibration.probe(params, track, root)
    assert again["sensitive"] == ranking.sensitive and SensitivityRanking.load(path).scores == ranking.scores


def test_distac_conditions_the_longest_task_vector_to_the_mean_norm_of_the_others(lab):
    root, params, track = lab
    info = json.loads((calibration.distac_dir(track, root) / "distac.json").read_text())
    norms = {t: e["norm"] for t, e in json.loads(local_clip.references_path(track, root).read_text())["tasks"].items()}
    longest = max(CLIP_TASKS, key=lambda t: norms[t])
    assert longest == "SVHN" and info["conditioned"] == [longest] and info["params"]["apply_to"] == "largest_norm"
    target = sum(norms[t] for t in CLIP_TASKS if t != longest) / 2  # the preset's target: the others' mean norm
    assert info["norms"][longest]["target"] == pytest.approx(target) and target < 0.6 * norms[longest]
    # distillation starts at the target norm; 3 Adam steps at lr 1e-5 anchored there barely move it
    assert info["norms"][longest]["after"] == pytest.approx(target, rel=0.02)
    written = sorted(p.name for p in calibration.distac_dir(track, root).iterdir())
    assert written == sorted(["distac.json", f"{longest}.safetensors"])  # the others: the lab's checkpoints, in place
    with safe_open(str(calibration.distac_dir(track, root) / f"{longest}.safetensors"), "pt") as fh:
        assert json.loads(fh.metadata()["distac"]) == info["params"]
        assert all(k.startswith("visual.") for k in fh.keys())


def test_too_few_train_images_is_one_line_naming_the_key_and_recorded_for_the_track(lab, tmp_path):
    root, _, track = lab
    params = _params(tmp_path, track.model_dump(mode="json"), distac_samples=999)
    message = (r"^params.yaml: local_clip.0.datasets.SVHN: the train split at .* holds 20 images; "
               r"benchmark.evaluation.distac_samples needs 999$")
    out = calibration.all_tracks(params, tmp_path, "distac", log=lambda _: None)
    assert "references of local_clip track 'lab' not found" in out["lab"]["error"]  # no local_tracks here yet
    shutil.copytree(root / "models/local/tracks", tmp_path / "models/local/tracks")  # the references, as built
    with pytest.raises(ParameterError, match=message):
        calibration.distac(params, track, tmp_path)
    out = calibration.all_tracks(params, tmp_path, "distac", log=lambda _: None)
    assert re.match(message, out["lab"]["error"].removeprefix("ParameterError: "))
    assert json.loads((calibration.distac_dir(track, tmp_path) / "distac.json").read_text()) == out["lab"]
    assert not list(calibration.distac_dir(track, tmp_path).glob("*.safetensors"))


def test_every_chain_is_a_cell_of_the_track_and_none_is_skipped(lab):
    _, params, _ = lab
    cells = [c for c in cells_mod.enumerate_cells(params) if c.track == "local_clip:lab"]
    assert sorted(c.chain for c in cells if c.chain) == sorted(CHAINS)
    assert track_mod.skipped(params) == []
    distac = next(c for c in cells if c.chain == "distac>{merge}")
    assert distac.recipe.startswith("distac(") and "apply_to='largest_norm'" in distac.recipe


def _cell(params, chain):
    return next(c for c in cells_mod.enumerate_cells(params) if c.track == "local_clip:lab" and c.chain == chain)


def test_a_dsc_cell_reads_the_ranking_and_fsc_changes_the_merge(lab):
    root, params, _ = lab
    inputs = track_mod.inputs(_cell(params, "{merge}>dsc"), params, root)
    assert "sensitivity" in inputs and "distac" not in inputs
    wsc = cells_mod.run_cell(_cell(params, "{merge}>wsc"), params, root, scaling=1.0)
    dsc = cells_mod.run_cell(_cell(params, "{merge}>dsc"), params, root, scaling=1.0)
    feature = dsc.diagnostics["magic_coefficients"]["feature"]  # FSC's mean ratio per hooked module
    assert any(abs(r - 1) > 1e-3 for r in feature.values())  # the calibrated model differs from WSC's
    assert dsc.diagnostics["sensitivity"]["scores"] and "feature" not in wsc.diagnostics["magic_coefficients"]
    assert dsc.params["fsc.n_samples_per_task"] == "1" and "wsc.projection" in dsc.params
    assert 0 <= dsc.metrics["avg_acc"] <= 1 and dsc.metrics["selected_scaling"] == 1.0
    assert set(wsc.metrics) <= set(dsc.metrics)


def test_distac_cells_read_the_conditioned_encoder_instead_of_the_checkpoint(lab):
    root, params, track = lab
    info = json.loads((calibration.distac_dir(track, root) / "distac.json").read_text())
    longest = info["conditioned"][0]
    cell = _cell(params, "distac>{merge}")
    inputs = track_mod.inputs(cell, params, root)
    assert inputs[f"distac.{longest}"] == calibration.distac_dir(track, root) / f"{longest}.safetensors"
    plain = cells_mod.run_cell(_cell(params, "{merge}"), params, root, scaling=1.0)
    result = cells_mod.run_cell(cell, params, root, scaling=1.0)
    assert result.diagnostics["distac"]["conditioned"] == [longest]
    assert result.diagnostics["task_vectors"][longest]["norm"] == pytest.approx(info["norms"][longest]["after"])
    assert result.diagnostics["task_vectors"][longest]["norm"] < plain.diagnostics["task_vectors"][longest]["norm"]
    assert result.params["distac.apply_to"] == "largest_norm"
    # its own grid (calibrated_scaling: grid): FSC measured on each merge of the grid, the chosen one rebuilt
    searched = params.model_copy(update={"benchmark": params.benchmark.model_copy(
        update={"calibrated_scaling": "grid"})})
    full = cells_mod.run_cell(_cell(searched, "distac>{merge}>svc>dsc"), searched, root)
    assert full.diagnostics["distac"]["conditioned"] == [longest]
    assert "feature" in full.diagnostics["magic_coefficients"]
    assert len(full.diagnostics["scaling_curve"]) == 2 and 0 <= full.metrics["avg_norm_acc"]


def test_a_cell_refuses_distac_files_of_other_parameters(lab):
    root, params, _ = lab
    other = params.model_copy(update={"local_clip": [params.local_clip[0].model_copy(
        update={"distac": {"steps": 4, "batch_size": 8}})]})
    with pytest.raises(CheckpointError, match="DisTaC parameters differ from the cell's recipe"):
        cells_mod.run_cell(_cell(other, "distac>{merge}"), other, root, scaling=1.0)


def test_a_distac_file_is_read_only_with_the_step_it_records(tmp_path):
    """The check both CLIP tracks make of a DisTaC stage's file (``clip.family.check_distac_file``): its ``distac``
    metadata is the expected step; another step, no record or an unreadable file is one line naming the file."""
    from mergecal.checkpoint import save_state_dict
    from mergecal.pipeline.tracks.clip.family import check_distac_file

    step = {"steps": 4, "batch_size": 8}
    path = save_state_dict({"w": torch.zeros(2)}, tmp_path / "SVHN.safetensors", {"distac": json.dumps(step)})
    check_distac_file(path, step, "distac.json")
    with pytest.raises(CheckpointError, match=r"SVHN.safetensors: DisTaC parameters differ from distac.json \(rerun"):
        check_distac_file(path, {**step, "steps": 5}, "distac.json")
    bare = save_state_dict({"w": torch.zeros(2)}, tmp_path / "bare.safetensors")
    with pytest.raises(CheckpointError, match=r"bare.safetensors: DisTaC parameters differ from the cell's recipe"):
        check_distac_file(bare, step, "the cell's recipe")
    (tmp_path / "bad.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(CheckpointError, match=r"bad.safetensors: not a readable DisTaC checkpoint \(") as info:
        check_distac_file(tmp_path / "bad.safetensors", step, "distac.json")
    assert "\n" not in str(info.value)


def test_fsc_measures_a_lazy_sequence_of_fine_tuned_models_as_a_list():
    from mergecal.backbones.open_clip_vit import create_clip
    from mergecal.calibrations.fsc import measure_fsc

    torch.manual_seed(0)
    pre = create_clip("mergecal-vit-micro", seed=1).eval()
    models = [create_clip("mergecal-vit-micro", seed=s).eval() for s in (2, 3)]
    merged = create_clip("mergecal-vit-micro", seed=4).eval()
    data = [torch.randn(2, 3, 32, 32) for _ in models]
    reads = []

    class Lazy:
        def __len__(self):
            return len(models)

        def __getitem__(self, t):
            reads.append(t)
            return models[t]

    eager = measure_fsc(merged, pre, models, data, progress=False)
    lazy = measure_fsc(merged, pre, Lazy(), data, progress=False)
    assert reads == [0, 1]  # each model read once, in task order
    assert all(torch.equal(eager.raw_ratios[k], lazy.raw_ratios[k]) for k in eager.raw_ratios)


@pytest.mark.parametrize("distac, message", [
    ({"stepz": 1}, r"^params.yaml: local_clip.0.distac: distac: unknown parameter 'stepz'"),
    ({"steps": 0}, r"^params.yaml: local_clip.0.distac: distac: parameter 'steps'"),
])
def test_a_bad_distac_setting_of_a_track_is_one_line_naming_its_key(distac, message):
    from mergecal.pipeline.config import parse_params

    track = {"name": "x", "model": {"arch": CLIP_ARCH, "pretrained": "p.safetensors"}, "finetuned": {"MNIST": "a",
             "SVHN": "b"}, "datasets": {"MNIST": "d", "SVHN": "d"}, "distac": distac}
    with pytest.raises(ParameterError, match=message) as info:
        parse_params({"local_clip": [track]})
    assert "\n" not in str(info.value)


def test_a_tracks_distac_is_the_papers_preset_unless_it_overrides_it():
    from mergecal.pipeline.config import parse_params

    track = {"name": "x", "model": {"arch": CLIP_ARCH, "pretrained": "p.safetensors"}, "finetuned": {"MNIST": "a",
             "SVHN": "b"}, "datasets": {"MNIST": "d", "SVHN": "d"}}
    params = parse_params({"local_clip": [track], "distac": {"steps": 7}})  # the testbed's section: not applied
    step = params.local_clip[0].distac_step()
    assert (step.steps, step.batch_size, step.lr, step.beta, step.t_teacher, step.t_student, step.kappa,
            step.apply_to) == (500, 128, 1e-5, 0.5, 10.0, 10.0, None, "largest_norm")
    assert parse_params({"local_clip": [{**track, "distac": {"preset": "low_confidence"}}]}).local_clip[0] \
        .distac_step().apply_to == "all"


def test_fsc_reads_exactly_the_fsc_steps_sample_count(lab):
    """The count the recipe id states (``fsc(n_samples_per_task=...)``) is the count loaded: no other setting."""
    from mergecal.calibrations.fsc import FscParams
    from mergecal.pipeline.tracks.clip.files.cells import _fsc_data

    root, params, track = lab
    tasks = list(track.finetuned)
    data = _fsc_data(params, track, root, tasks, 32, FscParams(n_samples_per_task=3))
    assert [len(batch) for batch in data] == [3] * len(tasks)
    shared = _fsc_data(params, track, root, tasks, 32, FscParams(n_samples_per_task=1, data="task_agnostic"))
    assert [len(batch) for batch in shared] == [len(tasks)]
