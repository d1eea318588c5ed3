"""The text suite from offline materials: real sources, disjoint balanced splits, determinism, files."""

import json

import numpy as np
import pytest

from mergecal.data.text import (LEXNAMES, WORDNET_DIR, TextSuiteConfig, balanced_split, build_text_suite,
                                build_text_tasks, load_text_split, read_bbc, read_kaomoji, read_wordnet)
from mergecal.errors import CheckpointError, ParameterError

pytestmark = pytest.mark.skipif(not (WORDNET_DIR / "data.noun").exists(),
                                reason="Debian's wordnet-base is not installed (make setup installs it)")


@pytest.fixture(scope="module")
def tasks():
    return build_text_tasks(TextSuiteConfig(n_train=400, n_test=200))


def test_wordnet_categories_come_from_the_lexicographer_field():
    verbs = dict((g, lex) for g, lex in read_wordnet("verb"))
    # 'breathe' (00001740) is in lexicographer file 29, verb.body
    assert any(lex == "verb.body" and "breath" in g for g, lex in verbs.items())
    assert LEXNAMES[29] == "verb.body" and LEXNAMES[5] == "noun.animal" and len(LEXNAMES) == 45
    nouns = read_wordnet("noun")
    assert len(nouns) > 80_000 and all(lex.startswith("noun.") for _, lex in nouns)


def test_real_sources_have_their_documented_sizes():
    bbc = read_bbc(200)
    assert len(bbc) == 2225 and len({t for _, t in bbc}) == 5
    assert len(read_kaomoji()) > 50_000


def test_tasks_are_balanced_disjoint_and_share_inputs(tasks):
    assert set(tasks) == {"wordnet_nouns", "wordnet_verbs", "wordnet_pos", "bbc_topics", "kaomoji_emotions"}
    for name, (task, splits) in tasks.items():
        train, test = splits["train"], splits["test"]
        assert not {r["text"] for r in train} & {r["text"] for r in test}, name
        counts = np.bincount([r["label"] for r in test], minlength=len(task.classnames))
        assert counts.min() == counts.max() == 200 // len(task.classnames), name
    # the part-of-speech task reads the same kind of inputs (glosses) as the category tasks
    glosses = {g for g, _ in read_wordnet("noun")}
    pos_texts = {r["text"] for r in tasks["wordnet_pos"][1]["train"]}
    assert len(pos_texts & glosses) > 0.2 * len(pos_texts)


def test_same_seed_same_records_other_seed_differs():
    a = build_text_tasks(TextSuiteConfig(n_train=100, n_test=50, seed=1))["bbc_topics"][1]
    b = build_text_tasks(TextSuiteConfig(n_train=100, n_test=50, seed=1))["bbc_topics"][1]
    c = build_text_tasks(TextSuiteConfig(n_train=100, n_test=50, seed=2))["bbc_topics"][1]
    assert a == b and a != c


def test_balanced_split_takes_test_first_from_small_classes():
    pairs = [(f"a{i}", "a") for i in range(10)] + [(f"b{i}", "b") for i in range(3)] + [("a1", "a")]
    splits = balanced_split(pairs, ["a", "b"], n_train=20, n_test=4, seed=0)
    assert sum(r["label"] == 1 for r in splits["test"]) == 2 and sum(r["label"] == 1 for r in splits["train"]) == 1
    assert len({r["text"] for r in splits["train"] + splits["test"]}) == len(splits["train"]) + len(splits["test"])


def test_suite_on_disk(tmp_path):
    manifest = build_text_suite(tmp_path, TextSuiteConfig(n_train=100, n_test=50))
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    texts, labels = load_text_split(tmp_path, "wordnet_verbs", "test")
    assert len(texts) == manifest["tasks"]["wordnet_verbs"]["sizes"]["test"] == len(labels)
    with pytest.raises(CheckpointError, match="split not found"):
        load_text_split(tmp_path, "wordnet_verbs", "validation")
    with pytest.raises(ParameterError, match="n_train and n_test must be >= 10"):
        build_text_tasks(TextSuiteConfig(n_train=5))
