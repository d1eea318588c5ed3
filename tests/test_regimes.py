"""The benchmark's regimes (mergecal.regimes), the vision track's ``paper_regimes`` and where each regime's files
lie (mergecal.pipeline.tracks.clip.built.stages)."""

from dataclasses import fields
from pathlib import Path

import pytest
from pydantic import ValidationError

from mergecal.errors import ParameterError
from mergecal.regimes import (
    REGIMES,
    check_regime,
    distac_preset,
    finetune_overrides,
    label_smoothing_of,
    lengthened_task,
    variants,
)
from mergecal.train.finetune import FinetuneConfig, _check_config

TASKS = ["cars", "dtd", "eurosat", "gtsrb"]
NM_TASK = "eurosat"
REPO = Path(__file__).resolve().parents[1]


# --- mergecal.regimes ---------------------------------------------------------------------------------------------

def test_the_three_default_regimes():
    assert REGIMES == ("standard", "norm_mismatch", "low_confidence")
    for name in REGIMES:
        assert check_regime(name, TASKS, NM_TASK) == name
    assert variants("standard", TASKS, NM_TASK) == {t: "standard" for t in TASKS}
    assert variants("low_confidence", TASKS, NM_TASK) == {t: "low_confidence" for t in TASKS}
    nm = variants("norm_mismatch", TASKS, NM_TASK)
    assert nm == {"cars": "standard", "dtd": "standard", "eurosat": "norm_mismatch", "gtsrb": "standard"}
    assert list(nm) == TASKS  # task order kept
    assert lengthened_task("norm_mismatch", NM_TASK) == NM_TASK
    assert lengthened_task("standard", NM_TASK) is None
    assert lengthened_task("low_confidence", NM_TASK) is None
    assert distac_preset("standard") == "norm_mismatch"
    assert distac_preset("norm_mismatch") == "norm_mismatch"
    assert distac_preset("low_confidence") == "low_confidence"


def test_norm_mismatch_of_another_task_lengthens_that_task_only():
    name = "norm_mismatch_dtd"
    assert check_regime(name, TASKS, NM_TASK) == name
    assert lengthened_task(name, NM_TASK) == "dtd"
    got = variants(name, TASKS, NM_TASK)
    assert got == {"cars": "standard", "dtd": "norm_mismatch", "eurosat": "standard", "gtsrb": "standard"}
    assert list(got) == TASKS
    assert distac_preset(name) == "norm_mismatch"
    # its variants are the default norm mismatch's: one fine-tune shared per (task, variant)
    assert set(got.values()) == {"standard", "norm_mismatch"}


@pytest.mark.parametrize("name, words", [
    (f"norm_mismatch_{NM_TASK}", [NM_TASK, "norm_mismatch_task", "'norm_mismatch'"]),
    ("norm_mismatch_svhn", ["svhn", "not one of the tasks", *TASKS]),
    ("norm_mismatch_", ["not one of the tasks"]),
    ("foo", ["unknown regime", "norm_mismatch_<task>", "label_smoothing_<alpha>", "mixup", "focal"]),
    ("label_smoothing_2", ["unknown regime"]),
    ("label_smoothing_-0.1", ["unknown regime"]),
    ("label_smoothing_", ["unknown regime"]),
    ("Standard", ["unknown regime"]),
])
def test_bad_regimes_are_refused_in_one_line_naming_the_regime(name, words):
    for call in (lambda: check_regime(name, TASKS, NM_TASK), lambda: variants(name, TASKS, NM_TASK)):
        with pytest.raises(ParameterError) as info:
            call()
        message = str(info.value)
        assert "\n" not in message
        assert repr(name) in message, message
        for word in words:
            assert word in message, (word, message)


@pytest.mark.parametrize("name", ["mixup", "focal", "label_smoothing_0.01"])
def test_loss_regimes_use_one_variant_for_every_task(name):
    assert check_regime(name, TASKS, NM_TASK) == name
    assert variants(name, TASKS, NM_TASK) == {t: name for t in TASKS}
    assert lengthened_task(name, NM_TASK) is None
    assert distac_preset(name) == "low_confidence"


@pytest.mark.parametrize("name, alpha", [
    ("label_smoothing_0.01", 0.01), ("label_smoothing_0", 0.0), ("label_smoothing_0.1", 0.1),
    ("label_smoothing_.5", 0.5), ("label_smoothing_1", 1.0), ("label_smoothing_1.0", 1.0),
    ("label_smoothing_2", None), ("label_smoothing_1.5", None), ("label_smoothing_0.", None), ("label_smoothing", None),
    ("label_smoothing_0.1x", None), ("mixup", None), ("standard", None),
])
def test_label_smoothing_of(name, alpha):
    got = label_smoothing_of(name)
    if alpha is None:
        assert got is None
    else:
        assert got == pytest.approx(alpha, abs=0)


def test_finetune_overrides_of_each_variant():
    assert finetune_overrides("standard", 1e-3, 10.0) == {"regime": "standard"}
    assert finetune_overrides("low_confidence", 1e-3, 10.0) == {"regime": "low_confidence"}
    nm = finetune_overrides("norm_mismatch", 2e-3, 7.0)
    assert nm["regime"] == "standard"
    assert nm["lr"] == pytest.approx(14e-3)
    assert finetune_overrides("mixup", 1e-3, 10.0) == {"regime": "low_confidence", "low_confidence_loss": "mixup"}
    assert finetune_overrides("focal", 1e-3, 10.0) == {"regime": "low_confidence", "low_confidence_loss": "focal"}
    ls = finetune_overrides("label_smoothing_0.01", 1e-3, 10.0)
    assert ls == {"regime": "low_confidence", "low_confidence_loss": "label_smoothing", "label_smoothing": 0.01}
    for bad in ("foo", "norm_mismatch_dtd", "label_smoothing_3"):
        with pytest.raises(ParameterError, match=repr(bad)):
            finetune_overrides(bad, 1e-3, 10.0)


@pytest.mark.parametrize("variant", ["standard", "low_confidence", "norm_mismatch", "mixup", "focal",
                                     "label_smoothing_0.01", "label_smoothing_0"])
def test_each_variants_overrides_make_a_valid_finetune_config(variant):
    base = {"steps": 7, "lr": 2e-3, "seed": 3, "label_smoothing": 0.1}
    overrides = finetune_overrides(variant, base["lr"], 10.0)
    names = {f.name for f in fields(FinetuneConfig)}
    assert set(overrides) <= names, set(overrides) - names
    config = FinetuneConfig(**{**base, **overrides})
    _check_config(config)
    for key, value in overrides.items():
        assert getattr(config, key) == value
    assert config.steps == 7 and config.seed == 3
    if variant == "norm_mismatch":
        assert config.lr == pytest.approx(2e-2) and config.regime == "standard"
    else:
        assert config.lr == 2e-3
    if variant.startswith("label_smoothing_"):
        assert (config.regime, config.low_confidence_loss) == ("low_confidence", "label_smoothing")
        assert config.label_smoothing == label_smoothing_of(variant)


# --- the vision track's paper_regimes -----------------------------------------------------------------------------

def vision_track(**values):
    from mergecal.pipeline.tracks.clip.built.params import VisionTrack

    return VisionTrack(**{"task_set": "headroom8", "norm_mismatch_task": "symbols", **values})


def test_vision_track_accepts_valid_paper_regimes():
    names = ["norm_mismatch_objects", "mixup", "focal", "label_smoothing_0.01"]
    track = vision_track(paper_regimes=names)
    assert track.paper_regimes == names
    assert vision_track().paper_regimes == []


@pytest.mark.parametrize("paper_regimes, words", [
    (["mixup", "standard"], ["'standard'", "already in regimes"]),
    (["norm_mismatch"], ["'norm_mismatch'", "already in regimes"]),
    (["mixup", "mixup"], ["'mixup'", "twice"]),
    (["foo"], ["'foo'", "unknown regime"]),
    (["norm_mismatch_symbols"], ["'norm_mismatch_symbols'", "norm_mismatch_task"]),
    (["norm_mismatch_shapes"], ["'norm_mismatch_shapes'", "not one of the tasks"]),
    (["label_smoothing_2"], ["'label_smoothing_2'"]),
])
def test_vision_track_refuses_bad_paper_regimes(paper_regimes, words):
    with pytest.raises(ValidationError) as info:
        vision_track(paper_regimes=paper_regimes)
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)


def test_params_yaml_names_the_bad_paper_regime_in_one_line(tmp_path):
    from mergecal.pipeline.config import load_params

    text = (REPO / "params.yaml").read_text()
    assert "paper_regimes: [norm_mismatch_objects," in text
    bad = tmp_path / "params.yaml"
    bad.write_text(text.replace("paper_regimes: [norm_mismatch_objects,", "paper_regimes: [norm_mismatch_symbols,", 1))
    with pytest.raises(ParameterError) as info:
        load_params(bad)
    message = str(info.value)
    assert "\n" not in message
    assert "paper_regimes" in message and "norm_mismatch_symbols" in message, message


# --- where each regime's files lie --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def params():
    from mergecal.pipeline.config import load_params

    return load_params(REPO / "params.yaml")


@pytest.fixture(scope="module")
def paths(params):
    from mergecal.pipeline.tracks.clip.built.stages import paths_for

    return paths_for(params, "root", seed=0)


def test_the_repositorys_paper_regimes(params):
    track = params.vision
    assert "norm_mismatch_objects" in track.paper_regimes and "mixup" in track.paper_regimes
    assert f"norm_mismatch_{track.norm_mismatch_task}" not in track.paper_regimes
    assert not set(track.paper_regimes) & set(track.regimes)
    for name in track.paper_regimes:
        assert check_regime(name, track.tasks, track.norm_mismatch_task) == name


def test_default_regimes_read_the_default_runs_fine_tunes(params, paths):
    from mergecal.pipeline.tracks.clip.built.stages import regime_files, regime_runs

    track = params.vision
    seeded = Path("root") / "models" / track.backbone / "seeds" / "0"
    assert paths.seed == 0 and paths.profile == tuple(track.paper_regimes)
    for regime in track.regimes:
        files = regime_files(paths, track, regime)
        assert list(files) == track.tasks
        for task, path in files.items():
            variant = variants(regime, track.tasks, track.norm_mismatch_task)[task]
            assert path == seeded / "finetuned" / variant / f"{task}.safetensors"
        assert regime_runs(track, regime) == []  # the default run made them all
        assert paths.task_vectors(regime) == seeded / "task_vectors" / regime
        assert paths.distac(regime) == seeded / "distac" / regime
        assert paths.sensitivity(regime) == seeded / "sensitivity" / f"{regime}.json"
    nm = regime_files(paths, track, "norm_mismatch")
    lengthened = track.norm_mismatch_task
    assert nm[lengthened] == seeded / "finetuned" / "norm_mismatch" / f"{lengthened}.safetensors"


def test_a_profile_norm_mismatch_adds_only_its_lengthened_task(params, paths):
    from mergecal.pipeline.tracks.clip.built.stages import regime_files, regime_runs

    track = params.vision
    seeded = Path("root") / "models" / track.backbone / "seeds" / "0"
    profile = Path("root") / "models" / track.backbone / "papers" / "seeds" / "0"
    regime = "norm_mismatch_objects"
    files = regime_files(paths, track, regime)
    assert list(files) == track.tasks
    assert files["objects"] == profile / regime / "finetuned" / "objects.safetensors"
    for task in track.tasks:
        if task != "objects":  # the default run's standard fine-tunes, shared
            assert files[task] == seeded / "finetuned" / "standard" / f"{task}.safetensors"
    assert regime_runs(track, regime) == [("objects", "norm_mismatch")]
    assert paths.task_vectors(regime) == profile / regime / "task_vectors"
    assert paths.distac(regime) == profile / regime / "distac"
    assert paths.sensitivity(regime) == profile / regime / "sensitivity.json"


@pytest.mark.parametrize("regime", ["mixup", "focal", "label_smoothing_0.01"])
def test_a_profile_loss_regime_fine_tunes_every_task_in_its_own_directory(params, paths, regime):
    from mergecal.pipeline.tracks.clip.built.stages import regime_files, regime_runs

    track = params.vision
    profile = Path("root") / "models" / track.backbone / "papers" / "seeds" / "0"
    assert regime_runs(track, regime) == [(t, regime) for t in track.tasks]
    assert len(regime_runs(track, regime)) == 8
    files = regime_files(paths, track, regime)
    assert files == {t: profile / regime / "finetuned" / f"{t}.safetensors" for t in track.tasks}
    assert paths.task_vectors(regime) == profile / regime / "task_vectors"
    assert paths.distac(regime) == profile / regime / "distac"


def test_every_profile_regimes_files_are_distinct_from_the_default_runs(params, paths):
    from mergecal.pipeline.tracks.clip.built.stages import finetune_runs, regime_files, regime_runs

    track = params.vision
    default_files = {paths.finetuned(v, t) for t, v in finetune_runs(track)}
    added = {}
    for regime in track.paper_regimes:
        files = regime_files(paths, track, regime)
        runs = regime_runs(track, regime)
        own = {paths.model(regime, t, v) for t, v in runs}
        assert own == {p for p in files.values() if p not in default_files}, regime
        assert not own & default_files, regime
        for path in own:  # no two regimes write the same file
            assert path not in added, (regime, added.get(path))
            added[path] = regime


def test_seed_and_root_are_in_every_path(params):
    from mergecal.pipeline.tracks.clip.built.stages import paths_for, regime_files

    track = params.vision
    other = paths_for(params, "/elsewhere", seed=2)
    seeded = Path("/elsewhere") / "models" / track.backbone / "seeds" / "2"
    profile = Path("/elsewhere") / "models" / track.backbone / "papers" / "seeds" / "2"
    assert regime_files(other, track, "norm_mismatch_objects")["objects"] == (
        profile / "norm_mismatch_objects" / "finetuned" / "objects.safetensors")
    standard = regime_files(other, track, "standard")
    assert standard["objects"] == seeded / "finetuned" / "standard" / "objects.safetensors"


def test_the_lr_multiple_is_one_for_every_task_or_one_per_task(params):
    assert vision_track().lr_multiplier("digits") == vision_track().lr_multiplier("symbols") == 10.0
    per_task = vision_track(norm_mismatch_lr_multiplier={"symbols": 10, "greek": 3},
                            paper_regimes=["norm_mismatch_greek"])
    assert (per_task.lr_multiplier("symbols"), per_task.lr_multiplier("greek")) == (10.0, 3.0)
    with pytest.raises(ParameterError, match="no multiple for task 'digits'"):
        per_task.lr_multiplier("digits")
    track = params.vision  # the repository's: every lengthened task has its own (pilot P27)
    assert track.lr_multiplier(track.norm_mismatch_task) == 10.0
    assert track.lr_multiplier("greek") == 3.0


def test_a_lengthened_fine_tune_runs_at_its_tasks_multiple(params, monkeypatch, tmp_path):
    from mergecal.pipeline.tracks.clip.built import stages

    seen = []

    class Stop(Exception):
        pass

    def config(**values):
        seen.append(values["lr"])
        if len(seen) == 2:  # the config the fine-tune would run with
            raise Stop
        return FinetuneConfig(**values)

    monkeypatch.setattr(stages, "FinetuneConfig", config)
    with pytest.raises(Stop):
        stages.finetune(params, "greek", "norm_mismatch", tmp_path)
    assert seen[1] == pytest.approx(params.vision.finetune["lr"] * 3.0)
