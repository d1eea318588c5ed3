"""PEFT adapter directories as experts of a ``local_llm`` track: refused at params time when the adapters package
does not read them, recorded by their adapter files alone, applied to the base as peft's ``merge_and_unload`` applies
them (bit for bit), and scored and merged end to end beside a full checkpoint."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from mergecal.errors import IncompatibleModelsError, ParameterError
from mergecal.pipeline.config import load_params, parse_params
from mergecal.pipeline.tracks import lab_files
from mergecal.pipeline.tracks.causal_lm.files import stages as local_llm
from test_local_llm import _stages, _track, _write_params, checkpoints, prefect_server  # noqa: F401  (fixtures)
from local_models import perturb_trainable

peft = pytest.importorskip("peft")

TARGETS = ["q_proj", "v_proj", "up_proj"]


def _load(base: Path):
    from mergecal.backbones.hf_causal_lm import load_causal_lm

    return load_causal_lm(base)



def _adapter(base: Path, out: Path, config, seed: int) -> Path:
    model, _ = _load(base)
    peft_model = peft.get_peft_model(model, config)
    perturb_trainable(peft_model, seed)
    peft_model.save_pretrained(str(out))
    return out


def _merged_by_peft(base: Path, adapter: Path):
    """peft's own answer: the adapter loaded on the base and merged (``merge_and_unload``), and the tokenizer."""
    model, tokenizer = _load(base)
    return peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload(), tokenizer


@pytest.fixture(scope="module")
def adapters(checkpoints):  # noqa: F811  (the fixture imported above)
    root, _ = checkpoints
    base = root / "ckpt" / "base"
    lora = _adapter(base, root / "ckpt" / "lora-sent", peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS), 7)
    ia3 = _adapter(base, root / "ckpt" / "ia3-sent", peft.IA3Config(target_modules=["k_proj", "down_proj"],
                                                                    feedforward_modules=["down_proj"]), 8)
    return root, {"lora": lora, "ia3": ia3}


def _safetensors_state(directory: Path) -> dict[str, torch.Tensor]:
    state = {}
    for shard in sorted(directory.glob("*.safetensors")):
        state.update(load_file(str(shard)))
    return state


# ------------------------------------------------------------------------------- the expert's model is peft's

@pytest.mark.parametrize("kind", ["lora", "ia3"])
def test_an_adapter_experts_model_is_peft_merge_and_unload_bit_for_bit(adapters, kind):
    """The full model the track scores and merges for an adapter expert holds, key for key, the tensors of peft's
    merged model; it is written once (a second call reuses it) under the work directory, named by content."""
    root, made = adapters
    base = root / "ckpt" / "base"
    out = local_llm.expert_model_dir(base, made[kind], root)
    assert out.parent == root / ".mergecal" / "local" / "applied" and out.name.startswith(made[kind].name)
    merged, _ = _merged_by_peft(base, made[kind])
    expected = merged.state_dict()
    state = _safetensors_state(out)
    assert set(state) <= set(expected) and len(state) >= len(_safetensors_state(base))
    changed = 0
    for key, tensor in state.items():
        assert tensor.dtype == expected[key].dtype and torch.equal(tensor, expected[key]), key
        changed += not torch.equal(tensor, _safetensors_state(base)[key])
    assert changed == (3 if kind == "lora" else 2)  # the targets of the one layer, nothing else
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert local_llm.expert_model_dir(base, made[kind], root) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime  # reused, not written again
    local_llm.check_expert(base, out)  # the base's config and tokenizer
    assert local_llm.expert_model_dir(base, root / "ckpt" / "max", root) == root / "ckpt" / "max"


# ----------------------------------------------------------------------------------- params and inputs.json

def _params(root: Path, experts: dict[str, str], **extra):
    return parse_params({"local_llm": [_track("lab", experts, base=str(root / "ckpt" / "base"), **extra)]})


def test_an_adapter_expert_is_recorded_by_its_adapter_files_alone(adapters):
    root, made = adapters
    (made["lora"] / "notes.txt").write_text("not read")
    params = _params(root, {"maximum": str(root / "ckpt" / "max"), "sentiment": str(made["lora"])})
    files = lab_files.record_inputs(params, root)["lab"]["files"]
    assert {n for n in files if n.startswith("expert.sentiment/")} == {"expert.sentiment/adapter_config.json",
                                                                      "expert.sentiment/adapter_model.safetensors"}
    assert files["expert.sentiment/adapter_model.safetensors"]["size"] == (
        made["lora"] / "adapter_model.safetensors").stat().st_size


def _copy_adapter(source: Path, out: Path, **config) -> Path:
    shutil.copytree(source, out)
    data = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**data, **config}))
    return out


@pytest.mark.parametrize("case, message", [
    ("dora", r"^params.yaml: local_llm.0.experts.sentiment: .*/dora/adapter_config.json: use_dora is set; not read, "
             r"since DoRA rescales"),
    ("bin", r"^params.yaml: local_llm.0.experts.sentiment: .*/bin/adapter_model.bin: pickled adapter weights are not "
            r"read"),
    ("loha", r"^params.yaml: local_llm.0.unscored.chat: .*/loha/adapter_config.json: peft_type 'LOHA' is not read"),
    ("base", r"^params.yaml: local_llm.0.base: .*/lora-sent is a PEFT adapter; give the base model"),
])
def test_adapters_the_package_refuses_are_refused_at_params_time_in_one_line(adapters, tmp_path, case, message):
    root, made = adapters
    experts = {"maximum": str(root / "ckpt" / "max"), "sentiment": str(made["lora"])}
    extra = {}
    if case == "dora":
        experts["sentiment"] = str(_copy_adapter(made["lora"], tmp_path / "dora", use_dora=True))
    elif case == "bin":
        bad = _copy_adapter(made["lora"], tmp_path / "bin")
        (bad / "adapter_model.safetensors").rename(bad / "adapter_model.bin")
        experts["sentiment"] = str(bad)
    elif case == "loha":
        extra["unscored"] = {"chat": str(_copy_adapter(made["lora"], tmp_path / "loha", peft_type="LOHA"))}
    params = _params(root, experts, **extra)
    if case == "base":
        params.local_llm[0].base = str(made["lora"])
    with pytest.raises(ParameterError, match=message) as info:
        local_llm.input_records(params, root, tmp_path / "hashes")
    assert "\n" not in str(info.value)


def test_an_adapter_that_does_not_fit_the_base_is_the_experts_one_line_error(adapters, tmp_path):
    """Read over the base, an adapter whose factors do not fit a target is refused (the stage records the line for
    the expert's cells); a target the base lacks likewise."""
    root, made = adapters
    base = root / "ckpt" / "base"
    for name, edit in [("wide", lambda k, v: torch.zeros(v.shape[0], 7) if k.endswith("q_proj.lora_A.weight") else v),
                       ("absent", None)]:
        bad = _copy_adapter(made["lora"], tmp_path / name)
        tensors = load_file(str(bad / "adapter_model.safetensors"))
        if edit is not None:
            tensors = {k: edit(k, v) for k, v in tensors.items()}
        else:
            tensors = {k.replace("layers.0.", "layers.5."): v for k, v in tensors.items()}
        save_file(tensors, str(bad / "adapter_model.safetensors"))
        with pytest.raises(IncompatibleModelsError, match=r"adapter_model.safetensors: (module .*q_proj.* does not fit "
                                                          r"the base weight's shape \(16, 16\)|.* key .*layers.5.* is "
                                                          r"not in the base model)") as info:
            local_llm.check_expert(base, bad)
        assert "\n" not in str(info.value)


# ------------------------------------------------------------------------------------------------ the flow

@pytest.mark.slow
@pytest.mark.integration
def test_a_lora_expert_beside_a_full_one_is_scored_as_peft_merges_it_and_merged(adapters, prefect_server):  # noqa: F811
    """A track of one full expert and one LoRA adapter (made by peft) runs its references and the smallest matrix
    through the flow; the adapter expert's lm-eval scores are those of peft's merge_and_unload model saved as a full
    checkpoint, and nothing is written into the adapter's directory."""
    from mergecal.backbones.hf_causal_lm import save_causal_lm
    from mergecal.pipeline.flow import run_benchmark
    from mergecal.pipeline.tracks.causal_lm.files import cells as local_cells

    root, made = adapters
    before = sorted(p.name for p in made["lora"].iterdir())
    name = _write_params(root, [_track("lab-lora", {"maximum": "ckpt/max", "sentiment": "ckpt/lora-sent"})],
                         "params-lora.yaml", chains=("{merge}",), scaling=(0.5,))
    if not (root / "params.yaml").exists():  # run alone: the flow's workers know a checkout by its params.yaml
        shutil.copy(root / name, root / "params.yaml")
    references = _stages(root, name)["lab-lora"]
    assert "error" not in references and not any("error" in t for t in references["tasks"].values()), references

    params = load_params(root / name)
    track = params.local_llm[0]
    merged, tokenizer = _merged_by_peft(root / "ckpt" / "base", made["lora"])
    peft_dir = save_causal_lm(merged, tokenizer, root / "peft-merged-sent")
    score = local_llm.scorer(track, root)
    expected = score.score(peft_dir, ["maximum", "sentiment"], "test")
    assert references["tasks"]["sentiment"]["test_all_tasks"] == expected
    assert references["tasks"]["sentiment"]["val_accuracy"] == score.score(peft_dir, ["sentiment"],
                                                                           "validation")["sentiment"]
    # the micro models' scores tell few models apart; the task vector's norm, measured by the stage on the model it
    # scored, is peft's merged delta's to the last bit
    from mergecal.pipeline.tracks.causal_lm.scoring import task_vector_norms

    norms = task_vector_norms(root / "ckpt" / "base", peft_dir)
    assert norms["norm"] > 0 and references["tasks"]["sentiment"]["norm"] == norms["norm"]
    assert references["tasks"]["sentiment"]["norm_by_layer_type"] == norms["norm_by_layer_type"]

    cells = {c.merge: c for c in local_cells.cells(params)}
    experts = local_cells.models(cells["task_arithmetic"], track, root).experts
    assert experts[0] == root / "ckpt" / "max" and experts[1].parent == root / ".mergecal" / "local" / "applied"
    inputs = local_cells.inputs(cells["task_arithmetic"], params, root)
    assert {r for r in inputs if r.startswith("expert.sentiment/")} == {"expert.sentiment/adapter_config.json",
                                                                       "expert.sentiment/adapter_model.safetensors"}

    result = run_benchmark(params_path=name, root=str(root), output="results/lora.json")
    assert (result["cells"], result["failed"]) == (3, 0), [r.get("error") for r in result["rows"]]
    rows = {r["label"]: r for r in result["rows"]}
    assert 0.0 <= rows["task_arithmetic"]["avg_acc"] <= 1.0
    assert sorted(p.name for p in made["lora"].iterdir()) == before
    assert not list((root / ".mergecal" / "local" / "applied").glob(".*"))  # no staging left behind
