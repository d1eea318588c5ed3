"""scripts/perf_adapters.py (mergecal merge of LoRA adapters against peft's add_weighted_adapter + merge_and_unload) at
tiny shapes: the adapters it writes directly are what peft's save_pretrained writes and what peft loads, and the whole
script runs both routes in fresh processes, their outputs within their bounds of the exact merge. Nothing is
downloaded."""

from __future__ import annotations

import importlib.util
import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--hidden", "64", "--intermediate", "176", "--heads", "4", "--vocab", "128", "--layers", "1",
        "--experts", "2", "--rank", "4"]


def load_script():
    spec = importlib.util.spec_from_file_location("perf_adapters", ROOT / "scripts" / "perf_adapters.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict]:
    with safe_open(str(path), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


def test_the_adapters_are_written_as_peft_saves_and_loads_them(tmp_path):
    """The tiny base loads in transformers; an adapter written directly has the config fields, keys, shapes, dtypes
    and metadata of peft's own save_pretrained for the same LoRA config, and peft loads every tensor of it as
    written (no key missed or left over)."""
    script = load_script()
    config = script.llama_config(hidden=64, intermediate=176, heads=4, vocab=128, layers=1)
    base = script.write_base(tmp_path / "base", config)
    ours = script.write_adapter(tmp_path / "ours", base, config, rank=4, seed=1)

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        transformers.logging.set_verbosity_error()
        model = transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16)
        lora = peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=list(script.TARGETS),
                               task_type="CAUSAL_LM")
        peft.get_peft_model(model, lora).save_pretrained(str(tmp_path / "peft"))
        loaded = peft.PeftModel.from_pretrained(
            transformers.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.bfloat16), str(ours))

    theirs_config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    our_config = json.loads((ours / "adapter_config.json").read_text())
    assert set(our_config) == set(theirs_config)
    assert sorted(our_config.pop("target_modules")) == sorted(theirs_config.pop("target_modules"))
    assert our_config == theirs_config

    theirs, their_metadata = _tensors(tmp_path / "peft" / "adapter_model.safetensors")
    written, our_metadata = _tensors(ours / "adapter_model.safetensors")
    assert our_metadata == their_metadata == {"format": "pt"}
    assert {k: (tuple(v.shape), v.dtype) for k, v in written.items()} == \
           {k: (tuple(v.shape), v.dtype) for k, v in theirs.items()}
    assert len(written) == 2 * len(script.TARGETS)

    held = {name.replace(".default", ""): p for name, p in loaded.named_parameters() if "lora_" in name}
    assert sorted(held) == sorted(written)
    assert all(torch.equal(held[k], written[k]) for k in written)  # float32 on a bfloat16 base, as written


@pytest.mark.slow  # two fresh processes importing torch and transformers: ~16 s
def test_the_script_merges_with_both_routes_and_the_outputs_agree(tmp_path, capsys):
    """End to end at tiny shapes (about 15 s on a loaded 2-core machine: two fresh processes importing torch and
    transformers): the Markdown table has both routes and the ratio row, each output is within its bound of the
    exact merge, the two outputs differ by at most what both bounds allow, and --output holds the report."""
    script = load_script()
    out = tmp_path / "perf.md"
    assert script.main([*TINY, "--no-floor", "--workdir", str(tmp_path / "work"), "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    report = out.read_text()
    assert report in printed
    rows = re.findall(r"^\| (mergecal|peft|peft / mergecal) \|", report, flags=re.M)
    assert rows == ["mergecal", "peft", "peft / mergecal"]
    within = re.findall(r"^- (\w+) against the exact merge: largest max\|out-exact\|/max\|exact\| (\S+) .*: (\w+)$",
                        report, flags=re.M)
    assert [(name, verdict) for name, _, verdict in within] == [("mergecal", "within"), ("peft", "within")]
    assert all(0 < float(value) < 2.0**-8 * 3 for _, value, _ in within)  # K = 2: (K + 1) half ulps at most
    pair = float(re.search(r"^- peft against mergecal: largest max\|a-b\|/max\|b\| (\S+) ", report, re.M).group(1))
    assert pair <= 5 * 2.0**-8
    assert "1 of 32 layers" in report and "the base model, for scale" in report
    assert not (tmp_path / "work" / "out-mergecal").exists()  # the outputs are removed unless --keep
