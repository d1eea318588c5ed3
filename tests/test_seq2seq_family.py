"""The library pieces of a sequence-to-sequence (T5-shaped) family: data, span-corruption pretraining, fine-tuning
(full and peft IA³) and T0-style evaluation, at tiny sizes (one torch thread; each test a few seconds).

Oracles: the LLM suite's own generators (the text-to-text examples are its records), T5's span corruption
undone by hand (inputs and targets reassemble the block), peft's ``merge_and_unload`` (the IA³ expert mergecal
reads from the adapter directory), and lm-eval's own seq2seq backend (``HFLM(backend="seq2seq")``) for the
log-likelihoods of rank classification.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

from mergecal.data.llm import LlmSuiteConfig, generate_corpus, generate_task, knowledge_words, number_pairs
from mergecal.data.seq2seq import pretraining_documents, seq2seq_splits, seq2seq_task
from mergecal.errors import MergecalError, ParameterError
from mergecal.evaluation.seq2seq import exact_match, loglikelihoods, rank_classification
from mergecal.train.seq2seq import (Seq2SeqTrainConfig, TinyT5Shape, _corruption_batches, create_tiny_t5,
                                    finetune_t5, load_t5, pack_corpus, pretrain_t5, random_spans_noise_mask,
                                    sentinel_ids, span_corrupt, span_lengths, train_t5_tokenizer)

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

SUITE = LlmSuiteConfig(n_pretrain=60, n_train=40, n_validation=10, n_test=12, seed=3)
SHAPE = TinyT5Shape(vocab_size=300, d_model=32, d_kv=8, d_ff=64, num_heads=4, extra_ids=16)
PRETRAIN = Seq2SeqTrainConfig(steps=40, batch_size=8, max_length=32, lr=1e-2, seed=1)
FINETUNE = Seq2SeqTrainConfig(steps=8, batch_size=8, lr=1e-2, seed=2)


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Two threads on a busy two-core machine are 100 times slower here; one is also what makes bytes repeat."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def documents() -> list[str]:
    return pretraining_documents(120, SUITE)


@pytest.fixture(scope="module")
def base(documents, tmp_path_factory) -> Path:
    return pretrain_t5(documents, tmp_path_factory.mktemp("t5") / "base", shape=SHAPE, config=PRETRAIN,
                       progress=False)


def _files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir()) if p.is_file()}


# ------------------------------------------------------------------------------------------------------ data


def test_examples_are_the_llm_records_deterministic_with_disjoint_splits():
    """Each example is the LLM suite's record (the same prompt, the completion as target) with its choices and
    label; a second call gives the same examples; maximum's number pairs and knowledge's words never cross
    splits; the corpus is the LLM suite's."""
    for task in ("maximum", "knowledge", "sentiment"):
        splits = seq2seq_splits(task, SUITE)
        assert splits == seq2seq_splits(task, SUITE)
        assert {s: len(v) for s, v in splits.items()} == {"train": 40, "validation": 10, "test": 12}
        for split, examples in splits.items():
            records = generate_task(task, split, len(examples), SUITE)
            for e, r in zip(examples, records):
                assert set(e) == {"input", "target", "choices", "label"}
                assert e["input"] == r["prompt"] and e["target"] == r["completion"].strip()
                assert e["choices"][e["label"]] == e["target"]
                assert len(e["choices"]) == {"maximum": 2, "knowledge": 4, "sentiment": 2}[task]
        if task == "maximum":
            seen = {s: {frozenset(e["choices"]) for e in v} for s, v in splits.items()}
            pairs = number_pairs(SUITE)
            assert seen["test"] == {frozenset(map(str, p)) for p in pairs["test"][:12]}
        elif task == "knowledge":
            seen = {s: {e["input"].split("\n")[0] for e in v} for s, v in splits.items()}
            words = knowledge_words(SUITE)
            assert seen["test"] <= {f"Word: {w}" for w, _ in words["test"]}
        else:
            continue
        assert not (seen["train"] & seen["test"] or seen["train"] & seen["validation"]
                    or seen["validation"] & seen["test"])
    docs = pretraining_documents(20, SUITE)
    assert docs == [d["text"] for d in generate_corpus(20, SUITE)] and docs == pretraining_documents(20, SUITE)


# --------------------------------------------------------------------------------------------- span corruption


def _reassemble(inputs: list[int], targets: list[int], sentinels: list[int], eos: int) -> list[int]:
    """Undo span corruption: each sentinel of the input replaced by the tokens after it in the target."""
    assert inputs[-1] == eos and targets[-1] == eos
    spans, current = {}, None
    for token in targets[:-1]:
        if token in sentinels:
            current = token
            spans[current] = []
        else:
            spans[current].append(token)
    return [t for token in inputs[:-1] for t in (spans[token] if token in sentinels else [token])]


def test_span_corruption_reassembles_the_block(documents):
    """T5's noise mask has round(15 % of L) noise tokens in round(noise / 3) spans, kept tokens first; the inputs
    (one sentinel per span, ``<extra_id_0>`` first) and the targets (each sentinel, then its tokens) reassemble the
    block; sentinels are the last ids (``<extra_id_0>`` the very last, as in T5's vocabulary)."""
    tokenizer = train_t5_tokenizer(documents, SHAPE.vocab_size, SHAPE.extra_ids)
    sentinels, eos = sentinel_ids(tokenizer), tokenizer.eos_token_id
    assert len(tokenizer) == SHAPE.vocab_size and tokenizer.pad_token_id == 0 and eos == 1
    assert sentinels == list(range(len(tokenizer) - 1, len(tokenizer) - 1 - SHAPE.extra_ids, -1))
    assert tokenizer("max(37, 48) =")["input_ids"][-1] == eos  # T5's tokenizer appends </s>
    assert span_lengths(512, 0.15, 3.0) == (77, 26)  # T5's 512-token inputs: 77 noise tokens in 26 spans
    blocks = pack_corpus(tokenizer, documents, 64)
    rng = np.random.default_rng(0)
    for row in blocks[:20]:
        ids = row.tolist()
        mask = random_spans_noise_mask(len(ids), 0.15, 3.0, rng)
        num_noise, num_spans = span_lengths(len(ids), 0.15, 3.0)
        starts = np.flatnonzero(mask & ~np.concatenate([[False], mask[:-1]]))
        assert mask.sum() == num_noise == 10 and len(starts) == num_spans == 3 and not mask[0]
        inputs, targets = span_corrupt(ids, mask, sentinels, eos)
        assert len(inputs) == 64 - num_noise + num_spans + 1 and len(targets) == num_noise + num_spans + 1
        assert [t for t in inputs if t in sentinels] == sentinels[:num_spans] and targets[0] == sentinels[0]
        assert _reassemble(inputs, targets, sentinels, eos) == ids
    with pytest.raises(ParameterError, match="sentinels"):
        span_corrupt(ids, mask, sentinels[:2], eos)
    for density in (0.5, 0.9):  # dense noise: the spans still alternate with kept tokens
        mask = random_spans_noise_mask(40, density, 3.0, rng)
        num_noise, num_spans = span_lengths(40, density, 3.0)
        inputs, targets = span_corrupt(list(range(40)), mask, sentinels, eos)
        assert mask.sum() == num_noise and sum(t in sentinels for t in inputs) == num_spans
        assert _reassemble(inputs, targets, sentinels, eos) == list(range(40))


# ------------------------------------------------------------------------------------------------ pretraining


def test_pretraining_lowers_the_loss_and_writes_the_same_bytes(base, documents, tmp_path):
    """40 steps of span corruption lower the loss on a fixed corrupted batch from the initial model's (same seed)
    to the saved model's; the directory loads as a ``T5ForConditionalGeneration`` with its tokenizer; a second run
    on the same inputs writes the same bytes, ``training.json`` included (and leaves torch's RNG as it was)."""
    meta = json.loads((base / "training.json").read_text())
    assert meta["objective"] == "span_corruption" and meta["final_loss"] < meta["first_loss"]
    model, tokenizer = load_t5(base)
    assert type(model).__name__ == "T5ForConditionalGeneration" and model.config.feed_forward_proj == "gated-gelu"
    assert len(tokenizer) == model.config.vocab_size == SHAPE.vocab_size
    batch = _corruption_batches(pack_corpus(tokenizer, documents, 32), tokenizer, PRETRAIN)(torch.arange(16))
    initial = create_tiny_t5(tokenizer, SHAPE, seed=PRETRAIN.seed).eval()
    with torch.no_grad():
        before, after = float(initial(**batch).loss), float(model(**batch).loss)
    assert after < 0.6 * before, (before, after)

    state = torch.random.get_rng_state()
    again = pretrain_t5(documents, tmp_path / "again", shape=SHAPE, config=PRETRAIN, progress=False)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert _files(again) == _files(base)


# ------------------------------------------------------------------------------------------------ fine-tuning


def test_full_and_ia3_finetunes_and_the_ia3_expert_is_peft_merge(base, tmp_path):
    """A full fine-tune is a model directory of the base's family (same config and tokenizer); an IA³ fine-tune is
    a peft adapter with peft's T5 defaults (k, v, wo) that ``mergecal.adapters.read_adapter`` reads, whose vectors
    moved away from 1, and whose ``IA3Expert`` equals peft's ``merge_and_unload`` on every key, bit for bit. Two IA³
    runs write the same bytes."""
    from mergecal.adapters import IA3Expert, read_adapter
    from mergecal.backbones.hf_causal_lm import check_same_family
    from mergecal.checkpoint import SafetensorsSource

    examples = seq2seq_task("sentiment", "train", 32, SUITE)
    full = finetune_t5(base, examples, tmp_path / "full", task="sentiment", config=FINETUNE, progress=False)
    check_same_family(base, [full])
    meta = json.loads((full / "training.json").read_text())
    assert meta["method"] == "full" and meta["final_loss"] < meta["first_loss"]
    assert load_t5(full)[0].config.vocab_size == SHAPE.vocab_size

    ia3 = finetune_t5(base, examples, tmp_path / "ia3", task="sentiment", method="ia3", config=FINETUNE,
                      progress=False)
    adapter = read_adapter(ia3)
    assert sorted(adapter.config["target_modules"]) == ["k", "v", "wo"]
    assert adapter.config["task_type"] == "SEQ_2_SEQ_LM" and len(adapter.modules) == 16
    vectors = [adapter.tensors.get(m.vector_key) for m in adapter.modules.values()]
    assert all(float((v - 1).abs().max()) > 0 for v in vectors)
    meta = json.loads((ia3 / "training.json").read_text())
    assert meta["method"] == "ia3" and meta["trainable_parameters"] == sum(v.numel() for v in vectors)

    source = SafetensorsSource(str(base))
    expert = IA3Expert(source, adapter)
    merged = peft.PeftModel.from_pretrained(load_t5(base)[0], str(ia3)).merge_and_unload().state_dict()
    changed = 0
    for key in source.keys():
        assert torch.equal(expert.get(key), merged[key]), key
        changed += not torch.equal(merged[key], source.get(key))
    assert changed == 16
    again = finetune_t5(base, examples, tmp_path / "ia3_again", task="sentiment", method="ia3", config=FINETUNE,
                        progress=False)
    assert _files(again) == _files(ia3)


# ------------------------------------------------------------------------------------------------ evaluation


def test_scores_equal_lm_eval_seq2seq_loglikelihoods(base):
    """The scorer's log-likelihoods equal lm-eval's ``HFLM(backend="seq2seq")`` on the same (context, continuation)
    pairs (all three tasks' choices; a context with a trailing space, moved to the continuation as lm-eval does):
    within 1e-5 one pair at a time on both sides, and within 1e-6 relative in batches of other sizes and orders
    (float32 round-off of other matrix shapes); rank classification takes the best choice of those scores; exact
    match generates greedily, the same texts whatever the batch size."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    model, tokenizer = load_t5(base)
    examples = [e for task in ("maximum", "knowledge", "sentiment") for e in seq2seq_task(task, "test", 4, SUITE)]
    pairs = [(e["input"], choice) for e in examples for choice in e["choices"]] + [("Review: the soup was ", "good")]
    requests = [Instance(request_type="loglikelihood", doc={}, arguments=pair, idx=0) for pair in pairs]

    def lm_eval(batch_size: int) -> list[float]:
        lm = HFLM(pretrained=model, tokenizer=tokenizer, backend="seq2seq", batch_size=batch_size)
        return [ll for ll, _ in lm.loglikelihood(requests, disable_tqdm=True)]

    ours, theirs = loglikelihoods(model, tokenizer, pairs, batch_size=1), lm_eval(1)
    assert len(theirs) == len(ours) == len(pairs)
    assert max(abs(a - b) for a, b in zip(ours, theirs)) <= 1e-5, (ours, theirs)  # measured: 0 (same shapes)
    batched, theirs = loglikelihoods(model, tokenizer, pairs, batch_size=5), lm_eval(4)
    # other batches, other padding: float32 round-off of sums up to ~80 nats (measured 7.6e-6, relative 1.7e-7)
    assert all(abs(a - b) <= 1e-6 * max(1.0, abs(b)) for a, b in zip(batched, theirs)), (batched, theirs)

    ranked = rank_classification(model, tokenizer, examples, batch_size=7)
    at = 0
    for e, row, pred, ok in zip(examples, ranked["scores"], ranked["predictions"], ranked["correct"]):
        assert row == pytest.approx(ours[at:at + len(e["choices"])], abs=1e-5)
        assert pred == int(np.argmax(row)) and ok == int(pred == e["label"])
        at += len(row)
    assert ranked["accuracy"] == sum(ranked["correct"]) / len(examples)
    generated = exact_match(model, tokenizer, examples, max_new_tokens=4, batch_size=5)
    assert generated == exact_match(model, tokenizer, examples, max_new_tokens=4, batch_size=12)
    assert set(generated["correct"]) <= {0, 1} and len(generated["generations"]) == len(examples)


# --------------------------------------------------------------------------------------------- bad values


@pytest.mark.parametrize("make, field", [
    (lambda: TinyT5Shape(d_model=0), "TinyT5Shape.d_model"),
    (lambda: TinyT5Shape(num_heads=2.5), "TinyT5Shape.num_heads"),
    (lambda: TinyT5Shape(vocab_size=200), "TinyT5Shape.vocab_size"),
    (lambda: TinyT5Shape(feed_forward_proj="swish"), "TinyT5Shape.feed_forward_proj"),
    (lambda: TinyT5Shape(dropout_rate=1.0), "TinyT5Shape.dropout_rate"),
    (lambda: Seq2SeqTrainConfig(steps=0), "Seq2SeqTrainConfig.steps"),
    (lambda: Seq2SeqTrainConfig(lr=-1e-3), "Seq2SeqTrainConfig.lr"),
    (lambda: Seq2SeqTrainConfig(noise_density=1.0), "Seq2SeqTrainConfig.noise_density"),
    (lambda: Seq2SeqTrainConfig(mean_noise_span_length=0.5), "Seq2SeqTrainConfig.mean_noise_span_length"),
    (lambda: Seq2SeqTrainConfig(seed=True), "Seq2SeqTrainConfig.seed"),
    (lambda: seq2seq_task("maximum", "dev", 3), "split"),
    (lambda: seq2seq_task("addition", "test", 3), "task"),
    (lambda: finetune_t5("/nonexistent", [{"input": "a", "target": "b"}], "/tmp/x", task="t", method="lora"),
     "method"),
])
def test_bad_values_are_one_line_errors_naming_the_field(make, field):
    """Config values: one-line ParameterErrors naming the field; an unknown task, split or method: one-line
    UnknownNameErrors (a MergecalError too) before anything is loaded."""
    with pytest.raises(MergecalError) as err:
        make()
    message = str(err.value)
    assert "\n" not in message and field in message, message
    assert isinstance(err.value, ParameterError) == ("." in field)


def test_check_config_names_the_field_of_a_rule_across_fields():
    """params.yaml's validator (``check_config``) reads these dataclasses: a rule across fields names its field."""
    from mergecal.config_types import ConfigValueError, check_config

    assert check_config(Seq2SeqTrainConfig, {"steps": 5}) == Seq2SeqTrainConfig(steps=5)
    with pytest.raises(ConfigValueError) as err:
        check_config(TinyT5Shape, {"vocab_size": 280})
    assert err.value.key == "vocab_size" and "\n" not in str(err.value)
