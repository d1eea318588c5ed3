"""The Llama-shaped checkpoints the run-cost measurements merge (#43): the published sizes, the real key layout."""

from __future__ import annotations

import json

import pytest

from mergecal.perf.llm_checkpoints import parameters, shapes, write_family


def test_the_sizes_are_the_published_models():
    assert parameters("7b") == 6_738_415_616  # Llama-2-7B's parameter count (untied embeddings)
    assert parameters("1.6b") == pytest.approx(1.64e9, rel=0.01)


def test_a_written_family_loads_as_a_llama_with_every_key(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from mergecal.checkpoint import load_state_dict

    base, experts = write_family(tmp_path, "smoke", experts=2, max_shard_bytes=100_000)
    assert len(experts) == 2 and (base / "model.safetensors.index.json").is_file()  # sharded
    config = LlamaConfig(**json.loads((base / "config.json").read_text()))
    model = LlamaForCausalLM(config)
    state = load_state_dict(base)
    assert set(state) == set(shapes("smoke")) == set(model.state_dict())
    model.load_state_dict(state)
    expert = load_state_dict(experts[0])
    matrices = [k for k in state if state[k].dim() == 2]
    assert matrices and all(not (expert[k] == state[k]).all() for k in matrices)  # each expert moved every matrix


def test_a_family_is_reused_only_when_written_with_the_same_arguments(tmp_path):
    base, experts = write_family(tmp_path, "smoke", experts=2, reuse=True)
    written = {p: p.stat().st_mtime_ns for p in base.parent.rglob("*.safetensors")}
    assert write_family(tmp_path, "smoke", experts=2, reuse=True) == (base, experts)
    assert {p: p.stat().st_mtime_ns for p in base.parent.rglob("*.safetensors")} == written  # nothing rewritten
    write_family(tmp_path, "smoke", experts=2, layers=1, reuse=True)  # another depth: written again
    assert json.loads((tmp_path / "family.json").read_text())["layers"] == 1
    from mergecal.checkpoint import load_state_dict

    assert set(load_state_dict(base)) == set(shapes("smoke", layers=1))
