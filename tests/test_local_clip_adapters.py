"""PEFT adapter directories as fine-tuned models of a ``local_clip`` track: made by peft on the micro open_clip CLIP
(tests/local_models.py), read as peft's ``merge_and_unload`` computes them (bit for bit), recorded by their adapter
files alone, scored and merged beside full fine-tuned checkpoints, and refused at params time in one line when they
do not fit (another base, no weights, DoRA, LoRA on nn.MultiheadAttention, the text tower, as the pretrained model)."""

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

from local_models import CLIP_ARCH, CLIP_TASKS, perturb_trainable, write_clip_track
from mergecal.backbones import clip_checkpoints
from mergecal.errors import ParameterError
from mergecal.pipeline import cells as cells_mod
from mergecal.pipeline.config import load_params, parse_params
from mergecal.pipeline.tracks import lab_files
from mergecal.pipeline.tracks.clip.files import cells as track_mod
from mergecal.pipeline.tracks.clip.files import stages as local_clip
from test_local_clip import _stages, _write_params, prefect_server  # noqa: F401  (a fixture)

peft = pytest.importorskip("peft")

MLP = r"visual\.transformer\.resblocks\.\d+\.mlp\.(c_fc|c_proj)"  # the image tower's Linear layers


def _clip(pretrained: Path, arch: str = CLIP_ARCH):
    return clip_checkpoints.build_model(arch, clip_checkpoints.open_checkpoint(pretrained))



def _adapter(model, out: Path, config, seed: int) -> Path:
    peft_model = peft.get_peft_model(model, config)
    perturb_trainable(peft_model, seed)
    peft_model.save_pretrained(str(out))
    return out


ADAPTERS = {  # name: (the module peft wraps, its config)
    "lora": ("clip", lambda: peft.LoraConfig(r=4, lora_alpha=8, target_modules=MLP, modules_to_save=["ln_post"])),
    "tower": ("visual", lambda: peft.LoraConfig(r=2, lora_alpha=4, target_modules=["c_fc", "out_proj"])),
    "ia3": ("clip", lambda: peft.IA3Config(target_modules=MLP, feedforward_modules=r"visual.*c_proj")),
}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    """The micro CLIP track's files and, made by peft on its pretrained CLIP, LoRA adapters on the whole CLIP
    (with modules_to_save) and on its image tower alone, an IA³ adapter, and the bad adapters."""
    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("local_clip_adapters")
    track = write_clip_track(root / "lab", "lab")
    pretrained = Path(track["model"]["pretrained"])
    made = {}
    for seed, (name, (wrapped, config)) in enumerate(ADAPTERS.items(), start=7):
        model = _clip(pretrained)
        made[name] = _adapter(model.visual if wrapped == "visual" else model, root / "adapters" / name, config(), seed)
    bad = root / "bad"
    made["dora"] = _adapter(_clip(pretrained), bad / "dora", peft.LoraConfig(r=2, target_modules=MLP, use_dora=True),
                            1)
    made["attn"] = _adapter(_clip(pretrained), bad / "attn",
                            peft.LoraConfig(r=2, target_modules=r"visual\.transformer\.resblocks\.0\.attn"), 2)
    made["text"] = _adapter(_clip(pretrained), bad / "text",
                            peft.LoraConfig(r=2, target_modules=r"transformer\.resblocks\.0\.mlp\.c_fc"), 3)
    from mergecal.backbones.open_clip_vit import create_clip  # another CLIP: the tiny ViT, not the micro one

    made["other"] = _adapter(create_clip("mergecal-vit-tiny", seed=1), bad / "other",
                             peft.LoraConfig(r=2, target_modules=MLP), 4)
    made["no-weights"] = bad / "no-weights"
    shutil.copytree(made["lora"], made["no-weights"])
    (made["no-weights"] / "adapter_model.safetensors").unlink()
    return root, track, made


def _merged_by_peft(pretrained: Path, adapter: Path) -> dict[str, torch.Tensor]:
    """peft's own answer: the adapter loaded on the pretrained CLIP (or its image tower) and merged."""
    model = _clip(pretrained)
    tower = json.loads((adapter / "adapter_config.json").read_text())["auto_mapping"]["base_model_class"] == \
        "VisionTransformer"
    merged = peft.PeftModel.from_pretrained(model.visual if tower else model, str(adapter)).merge_and_unload()
    return {("visual." if tower else "") + k: v for k, v in merged.state_dict().items()}


# ------------------------------------------------------------------------------- the expert's model is peft's

@pytest.mark.parametrize("kind", list(ADAPTERS))
def test_an_adapter_experts_image_encoder_is_peft_merge_and_unload_bit_for_bit(lab, kind):
    """Every image-encoder key the track reads of an adapter expert equals peft's merged model's (torch.equal):
    LoRA on the whole CLIP (modules_to_save included), LoRA made on the image tower alone (keys without visual.,
    attn.out_proj, a square layer), IA³; only the adapter's targets differ from the pretrained model."""
    root, track, made = lab
    pretrained = Path(track["model"]["pretrained"])
    pre = clip_checkpoints.open_checkpoint(pretrained)
    view = local_clip.finetuned_view(pre, made[kind])
    expected = _merged_by_peft(pretrained, made[kind])
    assert view.keys() == clip_checkpoints.visual_keys(pre)
    changed = set()
    for key in view.keys():
        assert torch.equal(view.get(key), expected[key]), key
        if not torch.equal(view.get(key), pre.get(key)):
            changed.add(key.rsplit(".", 2)[-2] if "resblocks" in key else key)
    assert changed == {"lora": {"c_fc", "c_proj", "visual.ln_post.weight", "visual.ln_post.bias"},
                       "tower": {"c_fc", "out_proj"}, "ia3": {"c_fc", "c_proj"}}[kind]


# ----------------------------------------------------------------------------------- params and inputs.json

def _with(track: dict, **finetuned) -> dict:
    return {**track, "finetuned": {**track["finetuned"], **{t: str(p) for t, p in finetuned.items()}}}


def test_an_adapter_expert_is_recorded_by_its_adapter_files_alone(lab, tmp_path):
    root, track, made = lab
    (made["lora"] / "notes.txt").write_text("not read")
    params = parse_params({"local_clip": [_with(track, MNIST=made["lora"])]})
    files = lab_files.record_inputs(params, root)["lab"]["files"]
    assert {n for n in files if n.startswith("finetuned.MNIST/")} == {"finetuned.MNIST/adapter_config.json",
                                                                     "finetuned.MNIST/adapter_model.safetensors"}
    assert files["finetuned.MNIST/adapter_model.safetensors"]["size"] == (
        made["lora"] / "adapter_model.safetensors").stat().st_size


@pytest.mark.parametrize("case, message", [
    ("other", r"finetuned.MNIST: .*/other/adapter_model.safetensors: module 'visual.transformer.resblocks.0.mlp.c_fc' "
              r"\(lora_B @ lora_A is \(\d+, \d+\)\) does not fit the base weight's shape"),
    ("no-weights", r"finetuned.MNIST: .*/no-weights/adapter_model.safetensors: adapter weights not found"),
    ("dora", r"finetuned.MNIST: .*/dora/adapter_config.json: use_dora is set; not read, since DoRA rescales"),
    ("attn", r"finetuned.MNIST: .*/attn/adapter_model.safetensors: module 'visual.transformer.resblocks.0.attn' is "
             r"LoRA on nn.MultiheadAttention"),
    ("text", r"finetuned.MNIST: .*/text/adapter_model.safetensors: key 'transformer.resblocks.0.mlp.c_fc.weight' is "
             r"not of the image encoder"),
    ("pretrained", r"model.pretrained: .*/adapters/lora is a PEFT adapter; give the pretrained CLIP"),
])
def test_bad_adapters_are_refused_at_params_time_in_one_line_naming_the_key(lab, tmp_path, case, message):
    root, track, made = lab
    config = (_with(track, MNIST=made[case]) if case != "pretrained"
              else {**track, "model": {"pretrained": str(made["lora"])}})
    with pytest.raises(ParameterError, match=r"^params.yaml: local_clip.0." + message) as info:
        local_clip.input_records(parse_params({"local_clip": [config]}), root, tmp_path / "hashes")
    assert "\n" not in str(info.value)


def test_the_stage_local_inputs_exits_non_zero_with_the_line(lab, tmp_path, capsys):
    from stages import local_inputs

    _, track, made = lab
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"local_clip": [_with(track, MNIST=made["other"])]}))
    assert local_inputs.run(local_inputs.stage, ["--root", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "local_clip.0.finetuned.MNIST: " in err and "other/adapter_model.safetensors" in err, err


# ------------------------------------------------------------------------------------------------ the cells

def _params(root: Path, tracks: list[dict], name: str):
    data = {"vision": {"enabled": False}, "text": {"enabled": False}, "llm": {"enabled": False},
            "benchmark": {"merges": {"task_arithmetic": {"scaling": [0.3, 1.0]}}, "chains": ["{merge}"]},
            "local_clip": tracks}
    (root / name).write_text(yaml.safe_dump(data))
    return load_params(root / name)


def test_a_lora_expert_beside_full_fine_tunes_is_scored_and_merged_as_peft_merged_checkpoint(lab):
    """Two tracks, the same but for MNIST's model: a LoRA adapter, and peft's merge_and_unload of it saved as a full
    checkpoint. Their references (scores, norms) and every cell's result are the same; the adapter's cell reads its
    two files and the pretrained model's; nothing is written into the adapter's directory."""
    from mergecal.checkpoint import save_state_dict

    root, track, made = lab
    before = sorted(p.name for p in made["lora"].iterdir())
    merged = _merged_by_peft(Path(track["model"]["pretrained"]), made["lora"])
    full = save_state_dict({k: v for k, v in merged.items() if k.startswith("visual.")},
                           root / "peft-merged.safetensors")
    params = _params(root, [{**_with(track, MNIST=made["lora"]), "name": "lora"},
                            {**_with(track, MNIST=full), "name": "full"}], "params-cells.yaml")
    refs = {t.name: local_clip.references(t, root, seed=params.seed) for t in params.local_clip}
    assert all("error" not in e for e in refs["lora"]["tasks"].values()), refs["lora"]
    for task in CLIP_TASKS:
        for key in ("zeroshot", "test_accuracy", "val_accuracy", "ece", "norm", "relative_norm", "test_correct"):
            assert refs["lora"]["tasks"][task][key] == refs["full"]["tasks"][task][key], (task, key)
    assert refs["lora"]["tasks"]["MNIST"]["norm"] > 0

    cells = {(c.track, c.label): c for c in cells_mod.enumerate_cells(params)}
    assert {label for _, label in cells} == {"zeroshot", "finetuned", "task_arithmetic"}
    inputs = track_mod.inputs(cells[("local_clip:lora", "task_arithmetic")], params, root)
    assert {r for r in inputs if r.startswith("finetuned.MNIST/")} == {"finetuned.MNIST/adapter_config.json",
                                                                      "finetuned.MNIST/adapter_model.safetensors"}
    for label in ("finetuned", "task_arithmetic"):
        lora = cells_mod.run_cell(cells[("local_clip:lora", label)], params, root)
        full_result = cells_mod.run_cell(cells[("local_clip:full", label)], params, root)
        assert lora.metrics == full_result.metrics, label
    assert 0 <= lora.metrics["avg_acc"] <= 1
    assert sorted(p.name for p in made["lora"].iterdir()) == before


@pytest.mark.slow
@pytest.mark.integration
def test_a_lora_expert_runs_through_the_stages_and_the_flow(lab, prefect_server):  # noqa: F811
    """The DVC stages (inputs, references, sensitivity, DisTaC) and the flow's cells of a track with one LoRA expert
    beside two full fine-tunes, every chain of the full-checkpoint test."""
    import contextlib
    import io

    from mergecal.pipeline.flow import run_benchmark

    root, track, made = lab
    name = _write_params(root, [_with(track, MNIST=made["lora"])], "params.yaml")
    with contextlib.redirect_stdout(io.StringIO()):
        references = _stages(root, name)["lab"]
    assert "error" not in references and not any("error" in t for t in references["tasks"].values()), references
    result = run_benchmark(params_path=name, root=str(root))
    assert (result["cells"], result["failed"]) == (6, 0), [r.get("error") for r in result["rows"]]


def test_an_adapter_on_a_hugging_face_clip_is_read_in_open_clip_layout_bit_for_bit(tmp_path):
    """LoRA made by peft on transformers' CLIPModel (fc1 and q_proj of the vision encoder): read over the HF CLIP
    directory in its own layout, then mapped to open_clip's (q_proj fused into attn.in_proj_weight), it equals peft's
    merged model mapped the same way."""
    from local_models import micro_hf_clip
    from mergecal.backbones.clip_layouts import OpenClipLayoutSource
    from mergecal.checkpoint import DictSource

    micro_hf_clip().save_pretrained(tmp_path / "pretrained")
    targets = r"vision_model\.encoder\.layers\.\d+\.(mlp\.fc1|self_attn\.q_proj)"
    peft_model = peft.get_peft_model(micro_hf_clip(), peft.LoraConfig(r=2, target_modules=targets))
    perturb_trainable(peft_model, 5)
    peft_model.save_pretrained(str(tmp_path / "adapter"))
    expected = OpenClipLayoutSource(DictSource(peft_model.merge_and_unload().state_dict()))
    pre = clip_checkpoints.open_checkpoint(tmp_path / "pretrained")
    view = local_clip.finetuned_view(pre, tmp_path / "adapter")
    assert all(torch.equal(view.get(k), expected.get(k)) for k in view.keys())
    changed = {k.split(".", 4)[-1] for k in view.keys() if not torch.equal(view.get(k), pre.get(k))}
    assert changed == {"mlp.c_fc.weight", "attn.in_proj_weight"}
