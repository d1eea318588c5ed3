"""The LLM track: deterministic synthetic data, a micro Llama scored through lm-eval on the local task YAMLs,
sharded save/load of causal LMs, and the loaders' errors for missing paths and pickle-only directories."""

import json

import pytest
import torch

from mergecal import merge_models
from mergecal.backbones.hf_causal_lm import (causal_lm_state_dict, load_causal_lm, save_causal_lm,
                                             save_causal_lm_weights, stored_state_dict, weights_digest)
from mergecal.merge_causal_lm import merge_causal_lms
from mergecal.data.llm import (CATEGORIES, LlmSuiteConfig, build_llm_suite, knowledge_words, load_records,
                               number_pairs)
from mergecal.errors import CheckpointError, OutputError
from mergecal.train.lm import (LmTrainConfig, TinyLlamaShape, create_tiny_llama, encode_examples, finetune_lm,
                               read_metadata, train_tokenizer)

SMALL = LlmSuiteConfig(n_pretrain=150, n_train=24, n_validation=8, n_test=8)
MICRO = TinyLlamaShape(vocab_size=320, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


@pytest.fixture(scope="module")
def suite(tmp_path_factory):
    root = tmp_path_factory.mktemp("llm_suite")
    return root, build_llm_suite(root, SMALL)


@pytest.fixture(scope="module")
def micro(suite, tmp_path_factory):
    """A micro Llama (a few thousand parameters, random weights) saved as a model directory."""
    torch.set_num_threads(1)
    root, _ = suite
    tokenizer = train_tokenizer([r["text"] for r in load_records(root, "pretrain", "train")], MICRO.vocab_size)
    model = create_tiny_llama(tokenizer, MICRO, seed=1)
    out = save_causal_lm(model, tokenizer, tmp_path_factory.mktemp("models") / "micro")
    return out, model, tokenizer


def test_data_is_deterministic_and_splits_are_disjoint(suite, tmp_path):
    root, manifest = suite
    again = build_llm_suite(tmp_path / "again", SMALL)
    assert again["digests"] == manifest["digests"]
    for name in manifest["digests"]:
        assert (root / f"{name}.jsonl").read_bytes() == (tmp_path / "again" / f"{name}.jsonl").read_bytes()
    other = build_llm_suite(tmp_path / "other", LlmSuiteConfig(**{**SMALL.__dict__, "seed": 1}))
    assert other["digests"]["pretrain/train"] != manifest["digests"]["pretrain/train"]

    pairs = {s: {tuple(p) for p in v.tolist()} for s, v in number_pairs(SMALL).items()}
    assert not pairs["test"] & pairs["train"] and not pairs["validation"] & pairs["train"]
    assert len(pairs["train"]) + len(pairs["test"]) + len(pairs["validation"]) == 90 * 89 // 2
    corpus = " ".join(r["text"] for r in load_records(root, "pretrain", "train"))
    assert " is larger than " in corpus
    for a, b in pairs["test"]:  # no test pair is compared anywhere in the corpus
        for said in (f"{b} is larger than {a}.", f"{a} is smaller than {b}.", f"{b} is more than {a}.",
                     f"Is {b} larger than {a}?", f"Is {a} larger than {b}?", f"max({a}, {b})", f"max({b}, {a})"):
            assert said not in corpus
    for record, (a, b) in zip(load_records(root, "maximum", "test"), number_pairs(SMALL)["test"].tolist()):
        assert record["prompt"] in (f"max({a}, {b}) =", f"max({b}, {a}) =") and record["target"] == str(b)
    qa = build_llm_suite(tmp_path / "qa", LlmSuiteConfig(**{**SMALL.__dict__, "prompt_style": "qa"}))
    assert qa["digests"]["pretrain/train"] == manifest["digests"]["pretrain/train"]  # the style changes prompts only
    assert load_records(tmp_path / "qa", "maximum", "test")[0]["prompt"].startswith("Q: max(")
    assert load_records(tmp_path / "qa", "sentiment", "test")[0]["prompt"].endswith("\nA:")

    words = knowledge_words(SMALL)
    questions = [line for r in load_records(root, "pretrain", "train") for line in r["text"].split("\n")
                 if line.startswith("Q: Is ") and not line[6].isdigit()]  # "Q: Is a mango a fruit?"
    assert questions and not [q for q in questions for w, _ in words["test"] if f" {w} " in q]
    assert len(words["test"]) == 3 * len(CATEGORIES)
    assert not {w for w, _ in words["test"]} & {w for w, _ in words["train"]}
    for record in load_records(root, "knowledge", "test"):
        assert record["choices"][record["label"]] == record["completion"].strip() and len(set(record["choices"])) == 4
        assert any(f" {w}" in record["prompt"] for w, _ in words["test"])


def test_tokenizer_splits_digits_and_encode_examples_masks_the_prompt(micro):
    _, _, tokenizer = micro
    assert [t for t in tokenizer.tokenize("Q: 37+48=") if t.isdigit()] == ["3", "7", "4", "8"]
    batch = encode_examples(tokenizer, ["Q: 1+2=\nA:", "Q: 10+20=\nA:"], [" 3", " 30"], max_length=64)
    for i, (prompt, completion) in enumerate([("Q: 1+2=\nA:", " 3"), ("Q: 10+20=\nA:", " 30")]):
        n_p = len(tokenizer(prompt, add_special_tokens=False)["input_ids"])
        expected = tokenizer(completion, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        labels, mask = batch["labels"][i], batch["attention_mask"][i]
        assert (labels[:n_p] == -100).all() and labels[n_p:n_p + len(expected)].tolist() == expected
        assert (labels[mask == 0] == -100).all() and int(mask.sum()) == n_p + len(expected)
    short = encode_examples(tokenizer, ["Q: 10+20=\nA:"], [" 30"], max_length=5)  # the prompt's start is cut
    assert short["input_ids"].shape == (1, 5) and (short["labels"][0, -4:] == short["input_ids"][0, -4:]).all()


def test_sharded_save_load_round_trip_and_merge_keys(micro, tmp_path):
    path, model, tokenizer = micro
    stored = stored_state_dict(model)
    assert "lm_head.weight" not in stored and "model.embed_tokens.weight" in stored  # tied: stored once
    sharded = save_causal_lm(model, tokenizer, tmp_path / "sharded", max_shard_bytes=4096)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 2 and not list(tmp_path.glob(".*"))  # no staging left
    loaded, tok = load_causal_lm(sharded)
    again = stored_state_dict(loaded)
    assert again.keys() == stored.keys() and all(torch.equal(again[k], stored[k]) for k in stored)
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    assert tok("Q: 1+2=")["input_ids"] == tokenizer("Q: 1+2=")["input_ids"]
    from_disk = causal_lm_state_dict(sharded)
    assert all(torch.equal(from_disk[k], stored[k]) for k in stored) and from_disk.keys() == stored.keys()


def test_merged_state_dict_saves_as_a_loadable_model(micro, tmp_path):
    path, model, _ = micro
    pre = causal_lm_state_dict(path)
    g = torch.Generator().manual_seed(0)
    experts = [{k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in pre.items()} for _ in range(2)]
    merged = merge_models(pre, experts, "task_arithmetic", scaling=0.5)
    with_head = {**merged, "lm_head.weight": merged["model.embed_tokens.weight"].clone()}
    out = save_causal_lm_weights(with_head, tmp_path / "merged", like=path, max_shard_bytes=2048)
    assert (out / "tokenizer.json").exists() and (out / "config.json").exists()
    assert causal_lm_state_dict(out).keys() == pre.keys()  # the tied head was not written twice
    loaded, tokenizer = load_causal_lm(out)
    ids = torch.tensor([tokenizer("Q: 12+7=\nA:")["input_ids"]])
    reference = create_tiny_llama(tokenizer, MICRO)
    reference.load_state_dict(merged, strict=False)
    reference.tie_weights()
    with torch.no_grad():
        assert torch.allclose(loaded(ids).logits, reference.eval()(ids).logits, atol=1e-6)
    assert weights_digest(out) != weights_digest(path)

    dirs = [save_causal_lm_weights(e, tmp_path / f"expert{i}", like=path, max_shard_bytes=3000)
            for i, e in enumerate(experts)]
    streamed = merge_causal_lms(path, dirs, "task_arithmetic", tmp_path / "streamed", scaling=0.5)
    again = causal_lm_state_dict(streamed)
    assert again.keys() == merged.keys() and all(torch.equal(again[k], merged[k]) for k in merged)
    assert load_causal_lm(streamed)[0].config.vocab_size == model.config.vocab_size
    with pytest.raises(OutputError, match="must not be one of the input checkpoints"):
        merge_causal_lms(path, dirs, "task_arithmetic", dirs[0])


def test_missing_and_pickle_only_directories_are_clear_errors(micro, tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(CheckpointError, match="model directory not found") as err:
        load_causal_lm(missing)
    assert str(missing) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="no config.json"):
        causal_lm_state_dict(tmp_path)

    path, model, _ = micro
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "config.json").write_text((path / "config.json").read_text())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (pickled / name).write_bytes((path / name).read_bytes())
    torch.save(stored_state_dict(model), pickled / "pytorch_model.bin")
    for load in (load_causal_lm, causal_lm_state_dict):
        with pytest.raises(CheckpointError, match="allow_unsafe_pickle=True") as err:
            load(pickled)
        assert str(pickled) in str(err.value) and "\n" not in str(err.value)
    loaded, _ = load_causal_lm(pickled, allow_unsafe_pickle=True)  # tensors only: weights_only=True accepts it
    assert all(torch.equal(v, stored_state_dict(model)[k]) for k, v in stored_state_dict(loaded).items())


def test_finetune_is_seeded_and_writes_metadata(suite, micro, tmp_path):
    root, manifest = suite
    path, _, _ = micro
    records = load_records(root, "sentiment", "train")
    config = LmTrainConfig(steps=3, batch_size=4, lr=1e-2, max_length=48, seed=5)
    a = finetune_lm(path, records, tmp_path / "a", task="sentiment", config=config, progress=False)
    b = finetune_lm(path, records, tmp_path / "b", task="sentiment", config=config, progress=False)
    sa, sb, s0 = causal_lm_state_dict(a), causal_lm_state_dict(b), causal_lm_state_dict(path)
    assert all(torch.equal(sa[k], sb[k]) for k in sa) and any(not torch.equal(sa[k], s0[k]) for k in sa)
    meta = read_metadata(a)
    assert meta["task"] == "sentiment" and meta["config"]["steps"] == 3 and meta["n_examples"] == len(records)
    assert len(meta["data_sha256"]) == 64 and meta["final_loss"] > 0
    frozen = finetune_lm(path, records, tmp_path / "frozen", task="sentiment", progress=False,
                         config=LmTrainConfig(**{**config.__dict__, "freeze_embeddings": True}))
    sf = causal_lm_state_dict(frozen)
    assert torch.equal(sf["model.embed_tokens.weight"], s0["model.embed_tokens.weight"])
    assert not torch.equal(sf["model.layers.0.mlp.up_proj.weight"], s0["model.layers.0.mlp.up_proj.weight"])


def _loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    c = tokenizer(context, add_special_tokens=False)["input_ids"]
    t = tokenizer(continuation, add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logp = torch.log_softmax(model(torch.tensor([c + t])).logits[0].double(), -1)
    return float(sum(logp[len(c) - 1 + i, tok] for i, tok in enumerate(t)))


def test_lm_eval_runs_the_local_yamls_and_matches_an_independent_scoring(suite, micro, tmp_path):
    from mergecal.evaluation.lm_eval_tasks import evaluate_lm, write_task_yamls

    root, _ = suite
    path, _, _ = micro
    yamls = write_task_yamls(root, tmp_path / "tasks", splits=("test", "validation"))
    assert set(yamls) == {"maximum", "knowledge", "sentiment", "maximum_validation", "knowledge_validation",
                          "sentiment_validation"}
    assert str((root / "knowledge" / "test.jsonl").resolve()) in yamls["knowledge"].read_text()
    limit = 4
    per_document: dict = {}
    scores = evaluate_lm(path, ["maximum", "knowledge", "sentiment"], tmp_path / "tasks", limit=limit,
                         cache_path=tmp_path / "cache", device="cpu", per_document=per_document)
    assert {t: s["n"] for t, s in scores.items()} == {"maximum": limit, "knowledge": limit, "sentiment": limit}
    assert list(tmp_path.glob("cache/micro-*")) and weights_digest(path)[:16] in next(tmp_path.glob("cache/*")).name

    model, tokenizer = load_causal_lm(path)
    for task in ("knowledge", "sentiment"):  # acc = argmax over choices of log p(" " + choice | prompt)
        docs = load_records(root, task, "test")[:limit]
        hits = [max(range(len(d["choices"])), key=lambda i: _loglikelihood(model, tokenizer, d["prompt"],
                                                                             " " + d["choices"][i])) == d["label"]
                for d in docs]
        assert scores[task]["acc"] == pytest.approx(sum(hits) / limit)
        assert per_document[task]["acc"] == [float(hit) for hit in hits]  # lm-eval's per-sample scores, in order
    hits = []
    for doc in load_records(root, "maximum", "test")[:limit]:  # greedy answer up to a newline, stripped
        ids = torch.tensor([tokenizer(doc["prompt"], add_special_tokens=False)["input_ids"]])
        out = model.generate(ids, max_new_tokens=8, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        answer = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split("\n")[0].strip()
        hits.append(answer == doc["target"])
    assert scores["maximum"]["exact_match"] == pytest.approx(sum(hits) / limit)
    assert per_document["maximum"]["exact_match"] == [float(hit) for hit in hits]


def test_the_response_cache_never_serves_one_models_answers_for_another(suite, micro, tmp_path):
    """Two different models written in turn to the same directory, scored with the same cache directory: the
    second gets its own answers (lm-eval keys cached answers by request, not by model)."""
    from mergecal.evaluation.lm_eval_tasks import evaluate_lm, write_task_yamls

    root, _ = suite
    path, model, tokenizer = micro
    write_task_yamls(root, tmp_path / "tasks")
    tasks, cache = ["knowledge", "sentiment"], tmp_path / "cache"
    scores = []
    for seed in (3, 5):  # random models whose sentiment scores differ (0.625 and 0.375 on these 8 documents)
        other = create_tiny_llama(tokenizer, MICRO, seed=seed)
        target = save_causal_lm(other, tokenizer, tmp_path / "same_path", overwrite=True)
        cached = evaluate_lm(target, tasks, tmp_path / "tasks", cache_path=cache, device="cpu")
        fresh = evaluate_lm(target, tasks, tmp_path / "tasks", device="cpu")
        assert cached == fresh
        scores.append(fresh)
    assert scores[0] != scores[1] and len(list(cache.iterdir())) == 2


def test_models_built_in_threads_at_once_are_the_models_built_alone(suite, micro, tmp_path):
    """Benchmark cells run two at a time in threads. transformers' from_pretrained makes torch.nn.init and
    PreTrainedModel.tie_weights no-ops while it builds and puts back what it found, so two loads at once left them
    patched for good and a later load of a tied model had no lm_head (transformers PR #44940): a wrong LLM score in
    the lab test. With every construction under mergecal.backbones.construction's lock, loads, lm-eval scorings
    and seeded open_clip constructions in four threads at once give what each gives alone, and leave
    transformers and torch as they were."""
    import threading

    from transformers import PreTrainedModel

    from mergecal.backbones import create_clip
    from mergecal.evaluation.lm_eval_tasks import evaluate_lm, write_task_yamls

    root, _ = suite
    path, model, _ = micro
    write_task_yamls(root, tmp_path / "tasks")
    patched = {"tie_weights": PreTrainedModel.tie_weights, "init_weights": PreTrainedModel.init_weights,
               "normal_": torch.nn.init.normal_, "kaiming_uniform_": torch.nn.init.kaiming_uniform_}
    alone_scores = evaluate_lm(path, ["sentiment"], tmp_path / "tasks", limit=4)
    alone_clip = create_clip("mergecal-vit-micro", seed=3).state_dict()
    loaded, scores, clips, errors = [], [], [], []

    def repeat(work, times):
        try:
            for _ in range(times):
                work()
        except BaseException as err:  # surfaced below: a thread's exception would not fail the test by itself
            errors.append(err)

    threads = [*(threading.Thread(target=repeat, args=(lambda: loaded.append(load_causal_lm(path)[0]), 12))
                 for _ in range(2)),
               threading.Thread(target=repeat, args=(lambda: scores.append(
                   evaluate_lm(path, ["sentiment"], tmp_path / "tasks", limit=4)), 3)),
               threading.Thread(target=repeat, args=(lambda: clips.append(
                   create_clip("mergecal-vit-micro", seed=3).state_dict()), 12))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert {"tie_weights": PreTrainedModel.tie_weights, "init_weights": PreTrainedModel.init_weights,
            "normal_": torch.nn.init.normal_, "kaiming_uniform_": torch.nn.init.kaiming_uniform_} == patched
    assert scores == [alone_scores] * 3
    for state in clips:
        assert all(torch.equal(state[k], v) for k, v in alone_clip.items())
    ids = torch.arange(12).unsqueeze(0)
    with torch.no_grad():
        expected = model(ids).logits
        for other in [*loaded, load_causal_lm(path)[0]]:
            assert other.lm_head.weight.data_ptr() == other.model.embed_tokens.weight.data_ptr()  # tied
            assert torch.equal(other(ids).logits, expected)


def test_experts_must_share_the_base_config_and_tokenizer(micro, tmp_path):
    from mergecal.backbones.hf_causal_lm import check_same_family

    path, model, tokenizer = micro
    pre = causal_lm_state_dict(path)
    expert = save_causal_lm_weights(pre, tmp_path / "expert", like=path)
    check_same_family(path, [expert])  # a copy of the base is one of the family
    config = json.loads((expert / "config.json").read_text())
    (expert / "config.json").write_text(json.dumps({**config, "num_attention_heads": 1}))
    with pytest.raises(CheckpointError, match=r"expert/config.json: num_attention_heads is 1, the base model") as err:
        merge_causal_lms(path, [expert, expert], "task_arithmetic", tmp_path / "out")
    assert "\n" not in str(err.value) and not (tmp_path / "out").exists()
    (expert / "config.json").write_text(json.dumps(config))
    other = train_tokenizer(["a completely different corpus of words 123"] * 20, 300)
    other.save_pretrained(str(expert))
    with pytest.raises(CheckpointError, match=r"expert/tokenizer.json: the tokenizer differs from the base model's"):
        check_same_family(path, [expert])


def test_streamed_recipe_merge_equals_the_in_memory_recipe(micro, tmp_path):
    """merge_causal_lms with a data-free recipe (merge then SVC) writes what run_recipe computes in memory."""
    from mergecal.recipe import Recipe
    from mergecal.run_recipe import run_recipe

    path, _, _ = micro
    pre = causal_lm_state_dict(path)
    g = torch.Generator().manual_seed(1)
    experts = [{k: v + 0.02 * torch.randn(v.shape, generator=g) if v.ndim == 2 else v for k, v in pre.items()}
               for _ in range(3)]
    dirs = [save_causal_lm_weights(e, tmp_path / f"e{i}", like=path) for i, e in enumerate(experts)]
    recipe = Recipe.parse("task_arithmetic(scaling=0.4)>svc")
    diagnostics: dict = {}
    out = merge_causal_lms(path, dirs, recipe, tmp_path / "merged", diagnostics=diagnostics)
    streamed = causal_lm_state_dict(out)
    expected = run_recipe(recipe, pre, experts).state_dict
    assert streamed.keys() == pre.keys()
    for key in pre:
        assert torch.allclose(streamed[key], expected[key], atol=1e-6), key
    assert {k for k, v in pre.items() if ".layers." in k and v.ndim == 2} <= set(diagnostics["svc"])
    from safetensors import safe_open

    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as fh:
        assert fh.metadata()["mergecal_recipe"] == recipe.id


def test_a_model_scored_once_leaves_no_response_cache(suite, micro, tmp_path):
    """A cell's merges are scored once and deleted: LmEval.score(cache=False) writes no lm-eval response cache
    (it costs about half of an LLM cell), and gives the same scores as a cached call."""
    from mergecal.pipeline.tracks.causal_lm.params import LlmEvaluation
    from mergecal.pipeline.tracks.causal_lm.scoring import LmEval, suite_lm_eval

    root, _ = suite
    path, _, _ = micro
    scorer = suite_lm_eval(root, ["knowledge", "sentiment"], tmp_path / "tasks", tmp_path / "cache",
                           LlmEvaluation(max_validation=4, batch_size=8), n_validation=SMALL.n_validation)
    assert isinstance(scorer, LmEval)
    once = scorer.score(path, ["knowledge", "sentiment"], "validation", device="cpu", cache=False)
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
    cached = scorer.score(path, ["knowledge", "sentiment"], "validation", device="cpu")
    assert once == cached and len(list((tmp_path / "cache").iterdir())) == 1


def test_lm_eval_scoring_does_not_import_open_clip():
    """The LLM stages import the lm-eval scorer; open_clip (and torchvision) would add 5-10 s to each such process
    on the 2-core machine for nothing, so ``mergecal.evaluation`` imports its CLIP evaluation only on first use."""
    import subprocess
    import sys

    code = ("import sys, mergecal.evaluation.lm_eval_tasks, mergecal.pipeline.tracks.causal_lm.built.stages; "
            "assert 'open_clip' not in sys.modules, 'open_clip imported'; "
            "from mergecal.evaluation import evaluate; assert evaluate.__module__ == 'mergecal.evaluation.zeroshot'; "
            "assert 'open_clip' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]


def test_the_flow_imports_lm_eval_before_the_llm_cells_fan_out():
    """``flow.preload``: lm-eval's Hugging Face model (and transformers) imported in the flow's thread, so that two
    cell threads never import it for the first time at once (which once left HFLM holding a half-built transformers
    module and failed every LLM cell of a run: 'module transformers has no attribute AutoConfig')."""
    import subprocess
    import sys

    code = ("import sys\n"
            "from mergecal.pipeline.cells import enumerate_cells\n"
            "from mergecal.pipeline.config import parse_params\n"
            "from mergecal.pipeline.flow import preload\n"
            "cells = [c for c in enumerate_cells(parse_params({})) if c.track == 'llm']\n"
            "assert cells and 'lm_eval.models.huggingface' not in sys.modules\n"
            "preload(cells[:1])\n"
            "hf = sys.modules['lm_eval.models.huggingface']\n"
            "assert hf.transformers is sys.modules['transformers'] and hf.transformers.AutoConfig\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


def test_every_tracks_preload_names_third_party_libraries_only():
    """What ``flow.preload`` imports by name is outside the project, so the import graph (stage deps, cell code
    digests) misses nothing; a project module named there is refused in one line."""
    from mergecal.errors import MergecalError
    from mergecal.pipeline import flow, track_registry
    from mergecal.pipeline.cells import Cell

    named = {name: getattr(track_registry.get_track(name), "PRELOAD", ()) for name in track_registry.MODULES}
    assert named["llm"] == ("lm_eval.models.huggingface",) and named["seq2seq"] == ("transformers",)
    assert not [n for names in named.values() for n in names if n.split(".")[0] == "mergecal"]
    module = track_registry.get_track("llm")
    module.PRELOAD, kept = ("mergecal.pipeline.flow",), module.PRELOAD
    try:
        with pytest.raises(MergecalError, match="PRELOAD names the project's module 'mergecal.pipeline.flow'"):
            flow.preload([Cell("llm", "tiny-llama", "llm3", ("maximum", "sentiment"), "standard", "zeroshot", "")])
    finally:
        module.PRELOAD = kept
