"""The seq2seq track (params ``seq2seq``, the papers' profile): its stages build a micro T5 and its experts of both
regimes (full fine-tunes, IA³ adapters), its cells merge them with the library and score them by rank
classification; an IA³ cell equals peft's own IA³ model with the merged vectors; the ia3 regime lists the
matrix-only chains as skipped and runs the vector forms of SVC and WSC."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file

from mergecal.errors import ParameterError
from mergecal.evaluation.seq2seq import rank_classification
from mergecal.pipeline.cells import REFERENCES, run_cell
from mergecal.pipeline.config import parse_params
from mergecal.pipeline.track_registry import get_track
from mergecal.pipeline.tracks.seq2seq.built import stages
from mergecal.pipeline.tracks.seq2seq.built.cells import VECTOR_SKIP, why_not
from mergecal.recipe import Recipe
from mergecal.train.seq2seq import load_t5

ROOT = Path(__file__).resolve().parents[1]
MICRO = {"vocab_size": 300, "d_model": 16, "d_kv": 8, "d_ff": 32, "num_layers": 1, "num_decoder_layers": 1,
         "num_heads": 2, "extra_ids": 8}


def micro_params(regimes=("standard", "ia3"), **benchmark):
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["seeds"] = [0]
    data["seq2seq"].update(
        data={"n_pretrain": 120, "n_train": 24, "n_validation": 8, "n_test": 12}, shape=MICRO,
        pretrain={"steps": 4, "batch_size": 8, "max_length": 32},
        finetune={"standard": {"steps": 3, "batch_size": 8}, "ia3": {"steps": 3, "batch_size": 8, "lr": 0.3}},
        evaluation={"max_validation": 6, "batch_size": 8}, regimes=list(regimes), paper_regimes=[])
    data["benchmark"].update(benchmark)
    return parse_params(data, "test params")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("seq2seq")
    params = micro_params()
    stages.build_data(params, root)
    stages.pretrain(params, root, progress=False)
    references = {r: stages.build_regime(params, root, r, seed=0) for r in ("standard", "ia3")}
    return root, params, references


def test_stages_write_the_layout_and_references(built):
    root, params, references = built
    manifest = json.loads(stages.manifest_path(root).read_text())
    assert sorted(manifest["files"]) == sorted(f"{t}/{s}.jsonl" for t in params.seq2seq.tasks
                                               for s in ("train", "validation", "test"))
    assert manifest["files"]["maximum/test.jsonl"]["examples"] == 12
    for task in params.seq2seq.tasks:
        assert (stages.expert_dir(params, root, "standard", task) / "model.safetensors").is_file()
        assert (stages.expert_dir(params, root, "ia3", task) / "adapter_model.safetensors").is_file()
    for regime, found in references.items():
        assert json.loads(stages.references_path(params, root, regime).read_text()) == found
        for task, entry in found["tasks"].items():
            assert len(entry["test_correct"]) == 12 and entry["norm"] > 0
            assert entry["test_accuracy"] == pytest.approx(sum(entry["test_correct"]) / 12)
        assert set(found["base"]) == {"validation", "test"}
    # nothing in the built files names the checkout (peft writes the base's path into an adapter's config)
    for path in [*stages.data_root(root).rglob("*"), *stages.models_root(params, root).rglob("*")]:
        if path.is_file():
            assert str(root).encode() not in path.read_bytes(), path
    config = json.loads((stages.expert_dir(params, root, "ia3", "maximum") / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == f"models/{params.seq2seq.backbone}/base"


def test_references_and_a_searched_cell_run(built):
    root, params, references = built
    cells = [c for c in get_track("seq2seq").cells(params) if c.regime == "standard"]
    tasks = params.seq2seq.tasks
    for cell in [c for c in cells if c.merge in REFERENCES]:
        result = run_cell(cell, params, root)
        assert set(result.examples) == set(tasks)
        if cell.merge == "finetuned":
            assert result.metrics["avg_norm_acc"] == pytest.approx(1.0)
        else:  # the base scored at cell time, as its stage scored it
            assert {t: result.metrics[f"acc.{t}"] for t in tasks} == references["standard"]["base"]["test"]
    searched = next(c for c in cells if c.label == "task_arithmetic")
    result = run_cell(searched, params, root)
    curve = result.diagnostics["scaling_curve"]
    assert [p["scaling"] for p in curve] == list(searched.grid)
    best = max(curve, key=lambda p: p["avg_norm_acc"])  # the first of equal scores
    assert result.metrics["selected_scaling"] == best["scaling"]
    # a point of the curve: the merge at that scaling on the validation examples, normalized by the experts' own
    point = curve[-1]
    with get_track("seq2seq").session(searched, Recipe.parse(searched.recipe), searched.grid, params, root) as session:
        model = session.merged(point["scaling"])
    val = stages.scorer(params, root).score(*model, tasks, "validation")  # its first max_validation examples
    reference = references["standard"]["tasks"]
    assert point["avg_norm_acc"] == pytest.approx(
        sum(val[t]["accuracy"] / reference[t]["val_accuracy"] for t in tasks) / len(tasks))
    assert not list(stages.work_dir(root).glob("cell-*"))  # the scratch merges are gone


def test_an_ia3_cell_equals_peft_with_the_merged_vectors(built, tmp_path):
    """Task arithmetic of IA³ experts at lambda: the vectors 1 + lambda * sum_k (v_k - 1), written as an adapter and
    run by peft, give the choices the same log-likelihoods as the cell's merged full model (the base scaled by the
    merged vectors), and so the same test outcomes."""
    from peft import PeftModel

    root, params, _ = built
    scaling, tasks = 0.7, params.seq2seq.tasks
    track = get_track("seq2seq")
    cell = next(c for c in track.cells(micro_params(fixed_scaling=[
        {"scaling": scaling, "merges": ["task_arithmetic"], "chains": ["{merge}"]}]))
        if c.regime == "ia3" and c.label == f"task_arithmetic(scaling={scaling})")
    result = run_cell(cell, params, root)
    with track.session(cell, Recipe.parse(cell.recipe), (), params, root) as session:
        ours, tokenizer = session.merged(scaling)

    adapters = [load_file(stages.expert_dir(params, root, "ia3", t) / "adapter_model.safetensors") for t in tasks]
    merged = {k: 1 + scaling * sum(a[k] - 1 for a in adapters) for k in adapters[0]}
    assert max(float((v - 1).abs().max()) for v in merged.values()) > 1e-3  # the experts moved their vectors
    first = stages.expert_dir(params, root, "ia3", tasks[0])
    (tmp_path / "adapter_config.json").write_text((first / "adapter_config.json").read_text())
    save_file(merged, str(tmp_path / "adapter_model.safetensors"))
    base, _ = load_t5(stages.base_dir(params, root))
    peft_model = PeftModel.from_pretrained(base, str(tmp_path)).eval()
    plain, _ = load_t5(stages.base_dir(params, root))
    for task in tasks:
        examples = stages.load_split(root, task, "test")
        theirs = rank_classification(peft_model, tokenizer, examples, batch_size=8)
        found = rank_classification(ours, tokenizer, examples, batch_size=8)
        assert torch.allclose(torch.as_tensor(found["scores"]), torch.as_tensor(theirs["scores"]), atol=1e-5)
        assert [float(c) for c in theirs["correct"]] == result.examples[task]
        unmerged = rank_classification(plain, tokenizer, examples, batch_size=8)
        assert not torch.allclose(torch.as_tensor(unmerged["scores"]), torch.as_tensor(theirs["scores"]),
                                  atol=1e-5)  # the comparison can fail: the base scores otherwise


def test_ia3_skips_matrix_chains_and_runs_the_vector_forms(built):
    root, params, _ = built
    assert why_not(Recipe.parse("tsv_m"), "ia3") == VECTOR_SKIP.format(what="tsv_m")
    assert "svc (key rule svc_authors)" in why_not(Recipe.parse("task_arithmetic>svc"), "ia3")
    assert why_not(Recipe.parse("task_arithmetic>svc"), "standard") is None
    assert why_not(Recipe.parse("task_arithmetic>svc(calibrate_vectors=true)"), "ia3") is None
    assert why_not(Recipe.parse("task_arithmetic>wsc(key_rule='vectors')"), "ia3") is None
    assert "feature-space" in why_not(Recipe.parse("task_arithmetic>dsc"), "standard")
    skipped = {(c.regime, c.label) for c, _ in get_track("seq2seq").skipped(params)}
    assert ("ia3", "tsv_m") in skipped and ("standard", "tsv_m") not in skipped
    labels = {(c.regime, c.label) for c in get_track("seq2seq").cells(params)}
    assert ("ia3", "task_arithmetic") in labels and not skipped & labels

    vectors = micro_params(regimes=("ia3",), chains=["{merge}", "{merge}>svc(calibrate_vectors=true)",
                                                     "{merge}>wsc(key_rule='vectors', granularity='layer')"],
                           fixed_scaling=[])
    cells = {c.label: c for c in get_track("seq2seq").cells(vectors)}
    track, examples = get_track("seq2seq"), stages.load_split(root, "maximum", "test")

    def scores(cell, scaling):  # the log-likelihood of every choice under the cell's merge at ``scaling``
        with track.session(cell, Recipe.parse(cell.recipe), (scaling,), vectors, root) as session:
            model, tokenizer = session.merged(scaling)
        return torch.as_tensor(rank_classification(model, tokenizer, examples, batch_size=8)["scores"])

    plain = scores(cells["task_arithmetic"], 0.5)
    for label in ("task_arithmetic>svc(calibrate_vectors=true)",
                  "task_arithmetic>wsc(key_rule='vectors', granularity='layer')"):
        result = run_cell(cells[label], vectors, root, scaling=0.5 if cells[label].scaling_from else None)
        assert 0.0 <= result.metrics["avg_acc"] <= 1.0 and set(result.examples) == set(vectors.seq2seq.tasks)
        assert not torch.allclose(scores(cells[label], 0.5), plain, atol=1e-6), label  # the step changed the merge
    assert "DisTaC" in why_not(Recipe.parse("rescale>task_arithmetic"), "standard")  # conditions whole models


def test_the_default_run_has_no_seq2seq_cells_and_bad_values_fail_in_one_line():
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    params = parse_params(data)
    assert params.seq2seq.regimes == [] and get_track("seq2seq").cells(params) == []
    for section, message in (({"regimes": ["ia3"]}, "already in regimes"),
                             ({"finetune": {"lora": {}}}, "finetune.lora"),
                             ({"finetune": {"ia3": {"steps": 0}}}, "finetune.ia3.steps"),
                             ({"shape": {"d_model": "wide"}}, "shape.d_model")):
        bad = {**data, "seq2seq": {**data["seq2seq"], **section}}
        with pytest.raises(ParameterError, match=message) as raised:
            parse_params(bad)
        assert "\n" not in str(raised.value)


def test_the_default_run_refuses_seq2seq_regimes_whose_models_make_paper_has_not_built(tmp_path, capsys):
    """``seq2seq.regimes`` puts the track in the default run's matrix, whose stages build no seq2seq model: the stage
    ``benchmark`` names the missing references and the command that builds them, in one line, before any cell."""
    from stages.benchmark import stage
    from stages._common import run

    params = micro_params(regimes=("standard",))
    assert "run `make paper`" in get_track("seq2seq").unbuilt(params, tmp_path)
    assert get_track("seq2seq").unbuilt(micro_params(regimes=()), tmp_path) is None
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))
    assert run(stage, ["--root", str(tmp_path)]) != 0
    error = capsys.readouterr().err.strip()
    assert "references.json: not built; seq2seq.regimes ['standard']" in error and "\n" not in error
    assert not (tmp_path / "results").exists()  # no cell ran
