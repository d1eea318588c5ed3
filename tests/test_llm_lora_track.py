"""The LLM track's regime ``lora`` (params ``llm.paper_regimes``, the papers' profile): its stage writes a peft LoRA
adapter of a micro Llama per task and the regime's references; its cells merge the adapters with the library (each
delta on the base) and score them with lm-eval; a merged cell equals the base plus lambda times the sum of peft's own
merged deltas; the default matrix has none of its cells; bad ``llm.*`` values fail in one line."""

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from mergecal.errors import ParameterError
from mergecal.pipeline.cells import REFERENCES, run_cell
from mergecal.pipeline.config import parse_params
from mergecal.pipeline.track_registry import get_track
from mergecal.pipeline.tracks.causal_lm.built import stages
from mergecal.recipe import Recipe

ROOT = Path(__file__).resolve().parents[1]
MICRO = {"vocab_size": 300, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 128}


def micro_params(regimes=("standard",), **llm):
    data = yaml.safe_load((ROOT / "params.yaml").read_text())
    data["seeds"] = [0]
    data["llm"].update({"tasks": ["maximum", "sentiment"],
                        "data": {"n_pretrain": 200, "n_train": 40, "n_validation": 8, "n_test": 8}, "shape": MICRO,
                        "pretrain": {"steps": 4, "batch_size": 8}, "finetune": {"steps": 3, "batch_size": 8},
                        "finetune_per_task": {}, "evaluation": {"max_validation": 8, "batch_size": 8},
                        "lora": {"rank": 2, "alpha": 4}, "finetune_lora": {"lr": 0.05}, "regimes": list(regimes),
                        **llm})
    data["benchmark"].update(merges={"task_arithmetic": {"scaling": [0.5, 1.0]}, "tsv_m": {"scaling": [1.0]}},
                             fixed_scaling=[])
    return parse_params(data, "test params")


def with_lora_cells(params):
    """The params of the papers' profile's cells: the track's regimes narrowed to ``lora`` (as an experiment)."""
    return params.model_copy(update={"llm": params.llm.model_copy(update={"regimes": ["lora"]})})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("llm_lora")
    params = micro_params()
    stages.build_data(params, root)
    stages.pretrain(params, root, progress=False)
    references = stages.build_paper_regimes(params, root, seed=0)
    return root, params, references


def test_the_stage_writes_adapters_and_references(built):
    root, params, references = built
    assert list(references) == ["lora"]
    for task in params.llm.tasks:
        expert = stages.expert_dir(params, root, task, 0, "lora")
        assert expert.parent.parent == root / "models" / params.llm.backbone / "papers" / "seeds" / "0" / "lora"
        assert sorted(p.name for p in expert.iterdir() if not p.name.startswith(".")) == [
            "adapter_config.json", "adapter_model.safetensors", "training.json"]  # and the writer's marker
        config = json.loads((expert / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == f"models/{params.llm.backbone}/base"
        assert config["r"] == 2 and config["lora_alpha"] == 4 and config["peft_type"] == "LORA"
        assert set(config["target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                                 "down_proj"}
        training = json.loads((expert / "training.json").read_text())
        assert training["config"]["lr"] == 0.05 and training["lora"]["rank"] == 2
        assert training["trainable_parameters"] == sum(t.numel() for t in load_file(
            expert / "adapter_model.safetensors").values())
    found = json.loads(stages.diagnostics_path(params, root, 0, "lora").read_text())
    assert found == references["lora"]
    for entry in found["tasks"].values():
        assert len(entry["test_correct"]) == 8 and entry["norm"] > 0
    # nothing built names the checkout, and the scratch experts the references scored are gone
    for path in stages.models_root(params, root).rglob("*"):
        if path.is_file():
            assert str(root).encode() not in path.read_bytes(), path
    assert not list(stages.work_dir(root).glob("expert-*"))


def test_the_adapters_are_seeded(built, tmp_path):
    root, params, _ = built
    again = tmp_path / "again"
    task = params.llm.tasks[0]
    (again / "data").mkdir(parents=True)
    (again / "data" / "llm").symlink_to(stages.data_root(root))
    (again / "models" / params.llm.backbone).mkdir(parents=True)
    (again / "models" / params.llm.backbone / "base").symlink_to(stages.base_dir(params, root))
    stages.finetune(params, task, again, seed=0, progress=False, regime="lora")
    for name in ("adapter_model.safetensors", "adapter_config.json", "training.json"):
        assert (stages.expert_dir(params, again, task, 0, "lora") / name).read_bytes() == \
               (stages.expert_dir(params, root, task, 0, "lora") / name).read_bytes(), name


def test_a_lora_cell_is_the_base_plus_the_sum_of_peft_deltas(built):
    """Task arithmetic of LoRA experts at lambda: every weight of the cell's merge is the base's plus lambda times
    the sum of what peft's ``merge_and_unload`` adds to it for each expert."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    root, params, _ = built
    track, scaling = get_track("llm"), 0.5
    cell = next(c for c in track.cells(with_lora_cells(params)) if c.label == "task_arithmetic")
    base_dir = stages.base_dir(params, root)
    base = load_file(base_dir / "model.safetensors")
    deltas = []
    for task in cell.tasks:
        model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
        merged = PeftModel.from_pretrained(model, str(stages.expert_dir(params, root, task, 0, "lora")))
        state = merged.merge_and_unload().state_dict()
        deltas.append({k: state[k] - v for k, v in base.items()})
    moved = [k for k in base if float(deltas[0][k].abs().max()) > 0]
    assert moved and all(".self_attn." in k or ".mlp." in k for k in moved)
    with track.session(cell, Recipe.parse(cell.recipe), cell.grid, params, root) as session:
        out, _ = session.merged(scaling)
        ours = load_file(Path(out) / "model.safetensors")
    for key, value in base.items():
        torch.testing.assert_close(ours[key], value + scaling * sum(d[key] for d in deltas), rtol=0, atol=1e-6)


def test_lora_cells_run_every_weight_space_chain(built):
    root, params, references = built
    cells = get_track("llm").cells(with_lora_cells(params))
    assert {c.regime for c in cells} == {"lora"}
    for cell in [c for c in cells if c.merge in REFERENCES]:
        result = run_cell(cell, params, root)
        if cell.merge == "finetuned":  # each expert's own test score, as the stage scored it
            assert {t: result.metrics[f"acc.{t}"] for t in params.llm.tasks} == {
                t: e["test_accuracy"] for t, e in references["lora"]["tasks"].items()}
        else:  # the base, scored at cell time as the stage scored it
            assert {t: result.metrics[f"acc.{t}"] for t in params.llm.tasks} == references["lora"]["base"]["test"]
    chosen = {}
    for label in ("task_arithmetic", "tsv_m>svc", "task_arithmetic>wsc"):
        cell = next(c for c in cells if c.label == label)
        result = run_cell(cell, params, root, scaling=chosen["task_arithmetic"] if cell.scaling_from else None)
        chosen[label] = result.metrics["selected_scaling"]
        assert 0 <= result.metrics["avg_acc"] <= 1 and chosen[label] in (cell.grid or (chosen[label],)), label
        assert set(result.examples) == set(params.llm.tasks)
    assert not list((stages.work_dir(root) / "merged").glob("cell-*"))


def test_the_default_matrix_has_no_lora_cells_and_bad_values_fail_in_one_line():
    params = micro_params()
    assert {c.regime for c in get_track("llm").cells(params)} == {"standard"}
    assert params.llm.paper_regimes == ["lora"]
    for llm, words in [({"paper_regimes": ["standard"]}, "llm.paper_regimes"),
                       ({"lora": {"rank": 0}}, "llm.lora.rank"),
                       ({"lora": {"targets": []}}, "llm.lora.targets"),
                       ({"finetune_lora": {"stepz": 3}}, "llm.finetune_lora.stepz")]:
        with pytest.raises(ParameterError, match=words.replace(".", r"\.")) as info:
            micro_params(**llm)
        assert "\n" not in str(info.value), llm
    with pytest.raises(ParameterError, match=r"llm\.regimes"):
        micro_params(regimes=("standard", "lora"))
