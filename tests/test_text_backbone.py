"""The packaged MiniLM as a text-classifier backbone: offline loading, pooling, fine-tuning, scoring."""

import numpy as np
import pytest
import torch

from mergecal import merge_models
from mergecal.backbones.hf_text import build_classifier, load_encoder, mean_pool, tokenize
from mergecal.errors import CheckpointError, ParameterError
from mergecal.train.finetune_text import TextFinetuneConfig, evaluate_text, finetune_text_task

TEXTS = ["a wild horse that is vicious", "move fast on foot", "a building for worship", "eat a meal quickly",
         "a large bird of prey", "speak in a loud voice", "a small boat with oars", "think about carefully"]
LABELS = np.array([0, 1, 0, 1, 0, 1, 0, 1])  # noun glosses vs verb glosses
CONFIG = TextFinetuneConfig(steps=4, batch_size=4, lr=1e-4, max_length=16, seed=3)


@pytest.fixture(scope="module")
def pretrained():
    torch.set_num_threads(1)
    encoder, tokenizer = load_encoder()
    return {k: v.clone() for k, v in encoder.state_dict().items()}, tokenizer


def test_packaged_minilm_loads_offline(pretrained):
    state, tokenizer = pretrained
    assert "encoder.layer.5.attention.self.query.weight" in state
    assert state["embeddings.word_embeddings.weight"].shape == (30522, 384)
    batch = tokenize(tokenizer, TEXTS[:2], max_length=16)
    assert batch["input_ids"].shape == (2, 16) and batch["attention_mask"][0].sum() < 16
    with pytest.raises(CheckpointError, match="no config.json"):
        load_encoder("/nonexistent/model")


def test_mean_pooling_ignores_padding():
    hidden = torch.tensor([[[1.0, 2.0], [3.0, 4.0], [100.0, 100.0]]])
    assert torch.equal(mean_pool(hidden, torch.tensor([[1, 1, 0]])), torch.tensor([[2.0, 3.0]]))


def test_finetuning_is_deterministic_trains_encoder_and_head_and_keeps_embeddings(pretrained):
    state, _ = pretrained
    enc_a, head_a, hist = finetune_text_task(state, TEXTS, LABELS, 2, CONFIG, progress=False)
    enc_b, head_b, _ = finetune_text_task(state, TEXTS, LABELS, 2, CONFIG, progress=False)
    assert all(torch.equal(enc_a[k], enc_b[k]) for k in enc_a) and torch.equal(head_a["weight"], head_b["weight"])
    assert len(hist) == 4 and all(np.isfinite(h["loss"]) for h in hist)
    assert torch.equal(enc_a["embeddings.word_embeddings.weight"], state["embeddings.word_embeddings.weight"])
    assert not torch.equal(enc_a["encoder.layer.0.attention.self.query.weight"],
                           state["encoder.layer.0.attention.self.query.weight"])
    assert head_a["weight"].shape == (2, 384)
    with pytest.raises(ParameterError, match="8 texts but 3 labels"):
        finetune_text_task(state, TEXTS, LABELS[:3], 2, CONFIG, progress=False)


def test_a_merged_encoder_is_scored_with_each_tasks_own_head(pretrained):
    state, tokenizer = pretrained
    enc_a, head_a, _ = finetune_text_task(state, TEXTS, LABELS, 2, CONFIG, progress=False)
    enc_b, head_b, _ = finetune_text_task(state, TEXTS, 1 - LABELS, 2, CONFIG, progress=False)
    merged = merge_models(state, [enc_a, enc_b], "task_arithmetic", scaling=0.5)
    scores = evaluate_text(merged, head_a, TEXTS, LABELS, 2, max_length=16)
    model = build_classifier(merged, head_a, 2).eval()
    batch = tokenize(tokenizer, TEXTS, max_length=16)
    with torch.no_grad():
        expected = (model(**batch).argmax(-1).numpy() == LABELS).mean()
    assert scores["accuracy"] == pytest.approx(expected) and 0 <= scores["ece"] <= 1 and scores["entropy"] >= 0


def test_trimming_unused_padding_leaves_the_logits_unchanged(pretrained):
    from mergecal.train.finetune_text import _trim

    state, tokenizer = pretrained
    batch = tokenize(tokenizer, TEXTS[:3], max_length=32)
    ids, mask = _trim(batch["input_ids"], batch["attention_mask"])
    assert ids.shape[1] == int(batch["attention_mask"].sum(1).max()) < 32
    model = build_classifier(state, None, 2).eval()
    with torch.no_grad():
        assert torch.allclose(model(ids, mask), model(**batch), atol=1e-5)


def test_smoke_and_default_configs_are_the_documented_sizes():
    from mergecal.train.finetune_text import SMOKE_TEXT_FINETUNE

    default = TextFinetuneConfig()
    assert SMOKE_TEXT_FINETUNE.steps < 10 and default.freeze_embeddings and default.max_length <= 48
