"""The LLM pair preset (#42): WizardMath-7B-V1.0 + Llama-2-7b-chat on Llama-2-7B, scored on GSM8K with lm-eval's
registry task. On a Hugging Face cache fabricated in the hub's layout (micro Llamas under the three repository ids;
the WizardMath stand-in adds a [PAD] token, as the real one does) and a fabricated ``openai/gsm8k`` dataset cache:
the preset resolves offline, its experts pass the aligned-vocabulary checks (and fail the plain ones), the chat
expert is merged but not scored, and the board's published section compares the GSM8K column with both papers."""

from __future__ import annotations

import pytest
import torch
import yaml

from mergecal.errors import CheckpointError
from mergecal.pipeline.config import load_params, parse_params
from mergecal.pipeline.tracks.causal_lm.files import stages as local_llm
from test_hub_cache import cache_repo
from test_lm_eval_registry import _cache_hub_dataset

PRESET = "wizardmath-llama-2-chat-7b"
REPOS = {"base": "meta-llama/Llama-2-7b-hf", "math": "WizardLMTeam/WizardMath-7B-V1.0",
         "chat": "meta-llama/Llama-2-7b-chat-hf"}
MICRO = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             max_position_embeddings=1024, tie_word_embeddings=False)  # lm-eval generates up to 256 tokens


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    """(hub cache, {role: its snapshot}) of the three micro models, and the HF datasets cache holding GSM8K."""
    import datasets
    from huggingface_hub import constants
    from transformers import AutoTokenizer, LlamaForCausalLM

    from mergecal.train.lm import TinyLlamaShape, create_tiny_llama, train_tokenizer

    torch.set_num_threads(1)
    root = tmp_path_factory.mktemp("llm_preset")
    tokenizer = train_tokenizer(["Question: 2 + 3? Answer: 5 #### 5", "Tom has 4 apples. #### 4"] * 20, 200)
    written = {"base": root / "models" / "base"}
    create_tiny_llama(tokenizer, TinyLlamaShape(**MICRO), seed=1).save_pretrained(written["base"])
    tokenizer.save_pretrained(written["base"])
    for name, seed, added in (("math", 2, "[PAD]"), ("chat", 3, None)):
        model, tok = LlamaForCausalLM.from_pretrained(written["base"]), AutoTokenizer.from_pretrained(written["base"])
        if added:
            tok.add_special_tokens({"pad_token": added})
            model.resize_token_embeddings(len(tok))
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=g))
        written[name] = root / "models" / name
        model.save_pretrained(written[name])
        tok.save_pretrained(written[name])
    cache = root / "hf-cache"
    snapshots = {role: cache_repo(cache, "model", REPOS[role], {f.name: f for f in written[role].iterdir()})
                 for role in REPOS}
    datasets_cache = root / "hf_datasets"
    _cache_hub_dataset(datasets_cache, "openai/gsm8k", "main", {split: [
        {"question": f"{split}: what is {i} + {i}?", "answer": f"{i} + {i} = {2 * i}\n#### {2 * i}"}
        for i in range(n)] for split, n in (("train", 8), ("test", 4))})
    mp = pytest.MonkeyPatch()
    mp.setattr(constants, "HF_HUB_CACHE", str(cache))
    mp.setattr(datasets.config, "HF_DATASETS_CACHE", datasets_cache)
    yield root, snapshots
    mp.undo()


def _track(**extra):
    return {"name": "wm", "preset": PRESET, "evaluation": {"max_validation": 2, "batch_size": 4}, "min_test": 4,
            **extra}


def test_the_pair_preset_resolves_offline_merges_the_chat_expert_unscored_and_names_both_tables(pool):
    from mergecal.pipeline.track_registry import lab_tracks
    from mergecal.published import for_tracks, rows

    root, snapshots = pool
    params = parse_params({"local_llm": [_track()]})
    track = params.local_llm[0]
    assert (track.base, track.task_names, list(track.unscored)) == ("hf://meta-llama/Llama-2-7b-hf", ["gsm8k"],
                                                                     ["chat"])
    assert track.align_vocabulary and track.source == "registry"
    assert track.tasks["gsm8k"].metric == "exact_match,flexible-extract"
    assert local_llm.base_path(track, root) == snapshots["base"]
    assert local_llm.merged_paths(track, ["gsm8k"], root) == [snapshots["math"], snapshots["chat"]]
    for expert in (snapshots["math"], snapshots["chat"]):
        local_llm.check_expert(snapshots["base"], expert, align_vocabulary=True)
    with pytest.raises(CheckpointError, match=r"config.json: vocab_size is \d+, the base model"):
        local_llm.check_expert(snapshots["base"], snapshots["math"])
    size, own = local_llm.track_vocabulary(track, root)
    assert own == {snapshots["base"]: size - 1, snapshots["math"]: size, snapshots["chat"]: size - 1}
    svc = rows("svc", "Llama-2-7B", "wizardmath-chat", {"GSM8K": "gsm8k"})
    assert {r.tasks for r in svc} == {("AlpacaEval", "gsm8k")}
    assert for_tracks(lab_tracks(params)) == {
        "wm": [svc, rows("magic", "Llama-2-7B", "wizardmath-chat", {"GSM8K": "gsm8k"})]}


def test_an_expert_missing_from_the_cache_is_one_line_naming_it_and_the_fetch(pool, tmp_path, monkeypatch):
    from huggingface_hub import constants

    root, _ = pool
    partial = tmp_path / "partial-cache"
    cache_repo(partial, "model", REPOS["base"], {"config.json": b"{}"})
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(partial))
    track = parse_params({"local_llm": [_track()]}).local_llm[0]
    with pytest.raises(CheckpointError, match=r"WizardLMTeam/WizardMath-7B-V1.0.*not in the local Hugging Face cache"
                                              r".*hf download WizardLMTeam/WizardMath-7B-V1.0") as err:
        local_llm.expert_path(track, "gsm8k", root)
    assert "\n" not in str(err.value)


@pytest.mark.slow
@pytest.mark.integration
def test_the_pair_preset_runs_through_the_flow_to_the_published_gsm8k_column(pool, tmp_path):
    import contextlib
    import io
    import json

    from prefect.testing.utilities import prefect_test_harness

    import mergecal.pipeline.flow as flow_module
    from stages import local_inputs, local_tracks, report

    repo = tmp_path / "repo"
    repo.mkdir()
    (repo / "params.yaml").write_text(yaml.safe_dump({
        "vision": {"enabled": False}, "text": {"enabled": False}, "llm": {"enabled": False},
        "benchmark": {"merges": {"task_arithmetic": {"scaling": [0.5]}}, "chains": ["{merge}", "{merge}>svc"]},
        "local_llm": [_track()]}))
    out = io.StringIO()  # not capsys: Prefect's console handler would keep its stream after the test
    with contextlib.redirect_stdout(out):
        for stage in (local_inputs, local_tracks):
            assert stage.run(stage.stage, ["--root", str(repo)]) == 0
        references = json.loads(local_llm.references_path(load_params(repo / "params.yaml").local_llm[0],
                                                          repo).read_text())
        assert "error" not in references and set(references["tasks"]) == {"gsm8k"}, references
        assert set(references["unscored"]) == {"chat"} and "error" not in references["unscored"]["chat"]
        with prefect_test_harness(server_startup_timeout=120):
            summary = flow_module.run_benchmark(params_path="params.yaml", root=str(repo))
        assert report.run(report.stage, ["--root", str(repo)]) == 0
    assert summary["failed"] == 0, [r.get("error") for r in summary["rows"]]
    sections = json.loads((repo / "reports" / "leaderboard.json").read_text())["published"]
    assert len(sections) == 2 and {s["backbone"] for s in sections} == {"wm"}
    # each paper's rows at its own protocol (#56): the preset adds the fixed-scaling cells the matrix lacks, MAGIC's
    # TA and TA w/ WSC at lambda 0.3, SVC's TA w/ SVC at lambda 1; SVC's TA row is the searched merge
    compared = {}
    for section in sections:  # GSM8K only: AlpacaEval has no column here, so no average either
        assert {c["column"] for c in section["comparisons"]} == {"gsm8k"}
        assert all(c["interval"] and c["inside"] is not None for c in section["comparisons"]), section
        paper = "svc" if "2602.05536" in section["source"] else "magic"
        compared[paper] = {c["recipe"] for c in section["comparisons"]}
    assert compared == {"svc": {"task_arithmetic", "task_arithmetic(scaling=1.0)>svc"},
                        "magic": {"task_arithmetic(scaling=0.3)", "task_arithmetic(scaling=0.3)>wsc"}}
    assert "## Published: wm · wizardmath-chat · standard" in (repo / "reports" / "leaderboard.md").read_text()
