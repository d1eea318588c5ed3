"""Seq2seq tracks from a lab's own directories (params ``local_seq2seq``, issue #60 item 3's ``files`` source): a micro
T5 and its experts, built here by the seq2seq track's stages, read in place as a lab's files. Its stages record
exactly the files the loaders read and the references; on the same models and data its references and cells equal
the built track's; its own task files (JSON lines) are read and checked line by line; a wrong kind of expert, an
adapter as the base, pickled weights and a bad example are one-line errors."""

import json
import shutil

import pytest
import yaml

from mergecal.errors import ParameterError
from mergecal.pipeline.cells import REFERENCES, run_cell
from mergecal.pipeline.config import parse_params
from mergecal.pipeline.own_models import inputs_path
from mergecal.pipeline.track_registry import get_track
from mergecal.pipeline.tracks import lab_files
from mergecal.pipeline.tracks.seq2seq.built import stages as built_stages
from mergecal.pipeline.tracks.seq2seq.files import stages
from mergecal.pipeline.tracks.seq2seq.files.params import LocalSeq2SeqTrack

from test_seq2seq_track import ROOT, built, micro_params  # noqa: F401  (the micro models, built once)

TASKS = ("maximum", "sentiment")


def lab_params(tracks: list[dict], **benchmark):
    """The micro params (the built track's models exist, none of its cells run) with these local tracks."""
    data = micro_params(regimes=(), **benchmark).model_dump(mode="json")
    data["local_seq2seq"] = tracks
    return parse_params(data, "test params")


def track(name: str, regime: str, params, **extra) -> dict:
    experts = {t: built_stages.expert_dir(params, ".", regime, t).as_posix() for t in TASKS}
    return {"name": name, "base": built_stages.base_dir(params, ".").as_posix(), "experts": experts,
            "regime": regime, "data": params.seq2seq.data, "evaluation": params.seq2seq.evaluation.model_dump(),
            "min_test": 10, **extra}


@pytest.fixture(scope="module")
def lab(built):  # noqa: F811
    root, params, references = built
    local = lab_params([track("lab-full", "standard", params), track("lab-ia3", "ia3", params)])
    records = lab_files.record_inputs(local, root)
    found = lab_files.all_references(local, root)
    return root, params, local, references, records, found


def test_the_stages_record_the_read_files_and_the_references_equal_the_built_tracks(lab):
    root, params, local, references, records, found = lab
    assert json.loads(inputs_path(root).read_text()) == records
    full, ia3 = records["lab-full"]["files"], records["lab-ia3"]["files"]
    assert {"base/config.json", "base/model.safetensors", "expert.maximum/model.safetensors"} <= set(full)
    assert {n for n in ia3 if n.startswith("expert.maximum/")} == {"expert.maximum/adapter_config.json",
                                                                   "expert.maximum/adapter_model.safetensors"}
    assert all("sha256" in entry for entry in [*full.values(), *ia3.values()])
    for name, regime in (("lab-full", "standard"), ("lab-ia3", "ia3")):
        report = found[name]
        assert "error" not in report and report["regime"] == regime
        assert json.loads(stages.references_path(local.local_seq2seq[0], root).read_text()) == found["lab-full"]
        # the same models on the same generated data: the built track's references, to the bit
        assert report["base"] == references[regime]["base"]
        for task in TASKS:
            assert report["tasks"][task] == references[regime]["tasks"][task]
    lines = lab_files.report_lines(local, found)
    assert any(line.startswith("lab-ia3/maximum: expert ") for line in lines)


def test_its_cells_equal_the_built_tracks_and_ia3_skips_the_matrix_methods(lab):
    root, params, local, *_ = lab
    cells = get_track("local_seq2seq").cells(local)
    assert {c.track for c in cells} == {"local_seq2seq:lab-full", "local_seq2seq:lab-ia3"}
    assert {c.seed for c in cells} == {params.seeds[0]}
    skipped = get_track("local_seq2seq").skipped(local)
    assert any(c.track.endswith("lab-ia3") and c.merge == "tsv_m" for c, _ in skipped)
    assert not any(c.track.endswith("lab-ia3") and c.merge == "tsv_m" for c in cells)
    assert any(c.track.endswith("lab-full") and c.merge == "tsv_m" for c in cells)
    with_built = micro_params(regimes=("standard", "ia3"))
    theirs = {(c.regime, c.merge, c.chain): c for c in get_track("seq2seq").cells(with_built)}
    for regime, merge, chain in (("standard", "zeroshot", ""), ("standard", "task_arithmetic", "{merge}"),
                                 ("ia3", "finetuned", ""), ("ia3", "task_arithmetic", "{merge}")):
        ours = next(c for c in cells if (c.regime, c.merge, c.chain) == (regime, merge, chain))
        result = run_cell(ours, local, root)
        expected = run_cell(theirs[(regime, merge, chain)], with_built, root)
        assert result.metrics == expected.metrics and result.examples == expected.examples, (regime, merge)
        if merge not in REFERENCES:
            assert result.metrics["selected_scaling"] in ours.grid
    assert not list(stages.work_dir(root).rglob("cell-*"))  # the scratch merges are gone


def test_a_task_dir_of_the_labs_own_examples_is_read_and_checked(lab, tmp_path):
    root, params, *_ = lab
    task_dir = tmp_path / "tasks"
    for task, lab_task in zip(TASKS, ("first", "second")):
        for split in ("validation", "test"):
            (task_dir / lab_task).mkdir(parents=True, exist_ok=True)
            shutil.copy(built_stages.split_path(root, task, split), task_dir / lab_task / f"{split}.jsonl")
    experts = {"first": built_stages.expert_dir(params, root, "standard", "maximum").as_posix(),
               "second": built_stages.expert_dir(params, root, "standard", "sentiment").as_posix()}
    own = {**track("own", "standard", params), "experts": experts, "task_dir": str(task_dir)}
    own.pop("data")
    local = lab_params([own])
    records = lab_files.record_inputs(local, root)
    assert {"task_dir/first/test.jsonl", "task_dir/second/validation.jsonl"} <= set(records["own"]["files"])
    report = lab_files.all_references(local, root)["own"]
    assert report["tasks"]["first"]["test_accuracy"] > 0 and "error" not in report
    # a bad line: the track's references hold one line naming the file and line, and its cells fail with it
    with open(task_dir / "second" / "test.jsonl", "a") as out:
        out.write('{"input": "x", "choices": ["a"], "label": 0}\n')
    report = lab_files.all_references(local, root)["own"]
    assert "second/test.jsonl:13: choices: expected a list of at least 2" in report["error"]
    assert "\n" not in report["error"]
    zeroshot = next(c for c in get_track("local_seq2seq").cells(local) if c.merge == "zeroshot")
    with pytest.raises(Exception, match="test.jsonl:13: choices"):
        run_cell(zeroshot, local, root)


def test_bad_tracks_fail_in_one_line(lab, tmp_path):
    root, params, *_ = lab
    cases = [
        # an IA³ adapter where the regime says full models: refused at local_inputs, naming the key
        ({**track("x", "standard", params),
          "experts": {t: built_stages.expert_dir(params, ".", "ia3", t).as_posix() for t in TASKS}},
         r"local_seq2seq\.0\.experts\.maximum: .* is an IA³ adapter, but regime 'standard'"),
        ({**track("x", "standard", params), "base": built_stages.expert_dir(params, ".", "ia3", "maximum").as_posix()},
         r"local_seq2seq\.0\.base: .* is a PEFT adapter"),
        ({**track("x", "standard", params), "base": str(tmp_path)},
         r"local_seq2seq\.0\.base: .* holds no model files"),
    ]
    for bad, message in cases:
        with pytest.raises(ParameterError, match=message) as raised:
            lab_files.record_inputs(lab_params([bad]), root)
        assert "\n" not in str(raised.value)
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section, message in (({"experts": {"maximum": "a"}}, "at least 2 experts"),
                             ({"experts": {"maximum": "a", "nope": "b"}}, "experts.nope: not a task of the suite"),
                             ({"task_dir": "t", "data": {"n_test": 5}}, "data: only without task_dir"),
                             ({"regime": "dora"}, "regime"),
                             ({"data": {"n_test": 0}}, "data.n_test")):
        bad = {"name": "x", "base": "b", "experts": {"maximum": "a", "sentiment": "c"}, **section}
        with pytest.raises(ParameterError, match=message) as raised:
            parse_params({**data, "local_seq2seq": [bad]})
        assert "\n" not in str(raised.value)
    # pickled weights are never read: the track's references hold one line saying how to convert them
    pickled = tmp_path / "pickled"
    shutil.copytree(root / built_stages.base_dir(params, "."), pickled)
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    report = stages.references(LocalSeq2SeqTrack(**{**track("p", "standard", params), "base": str(pickled)}),
                               root)
    assert "pickled weights" in report["error"] and "\n" not in report["error"]


def test_lora_experts_merge_as_peft_applies_them(lab, tmp_path):
    """LoRA adapters of the T5 made by peft (B drawn, not zero): the references' norm is that of peft's
    merge_and_unload minus the base, and a task-arithmetic cell's merge is the base plus lambda times the sum of
    those differences, within float32 rounding, on every key."""
    import torch
    from peft import LoraConfig, get_peft_model

    from mergecal.recipe import Recipe
    from mergecal.train.seq2seq import load_t5

    root, params, *_ = lab
    base_dir = root / built_stages.base_dir(params, ".")
    experts, deltas = {}, {}
    for seed, task in enumerate(TASKS):
        torch.manual_seed(seed)
        model, _ = load_t5(base_dir)
        peft_model = get_peft_model(model, LoraConfig(r=2, lora_alpha=4, target_modules=["q", "v", "wo"],
                                                      init_lora_weights=False))
        experts[task] = tmp_path / f"lora-{task}"
        peft_model.save_pretrained(str(experts[task]))
        merged = peft_model.merge_and_unload().state_dict()
        plain = load_t5(base_dir)[0].state_dict()
        deltas[task] = {k: merged[k] - plain[k] for k in plain}
    lora = {**track("lab-lora", "lora", params), "experts": {t: str(p) for t, p in experts.items()}}
    local = lab_params([lora], fixed_scaling=[{"scaling": 0.5, "merges": ["task_arithmetic"], "chains": ["{merge}"]}])
    lab_files.record_inputs(local, root)
    report = lab_files.all_references(local, root)["lab-lora"]
    assert "error" not in report, report
    for task in TASKS:
        expected = float(sum(d.double().square().sum() for d in deltas[task].values()) ** 0.5)
        assert expected > 0 and report["tasks"][task]["norm"] == pytest.approx(expected, rel=1e-5)
    track_module = get_track("local_seq2seq")
    cell = next(c for c in track_module.cells(local) if c.label == "task_arithmetic(scaling=0.5)")
    assert any(c.merge == "tsv_m" for c in track_module.cells(local))  # LoRA deltas are matrices
    result = run_cell(cell, local, root)
    assert 0 <= result.metrics["avg_acc"] <= 1
    with track_module.session(cell, Recipe.parse(cell.recipe), (), local, root) as session:
        ours = session.merged(0.5)[0].state_dict()
    plain = load_t5(base_dir)[0].state_dict()
    moved = [k for k in plain if not torch.allclose(ours[k], plain[k], atol=1e-4)]
    assert moved and all(k.endswith((".q.weight", ".v.weight", ".wo.weight")) for k in moved)
    for key, value in plain.items():
        expected = value + 0.5 * sum(deltas[t][key] for t in TASKS)
        assert torch.allclose(ours[key], expected, atol=1e-6), key
