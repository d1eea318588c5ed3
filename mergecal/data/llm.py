"""The default LLM task suite: synthetic text for a tiny causal LM, generated offline and deterministically.

Nothing can be downloaded, so the LLM track pretrains its own small model on a general corpus and fine-tunes it
into experts. The corpus mixes every skill at a low level, in other surface forms than the expert tasks: sentences,
and a few documents of yes/no questions ("Q: Is 48 larger than 37?\\nA: yes"; ``qa_fraction``, train splits only),
so the base model knows question answering in general but none of the experts' formats:

Prompts below are the default ``prompt_style="distinct"`` (each task its own format); ``"qa"`` asks each one as
"Q: ...\\nA:" (see ``PROMPTS``).

* ``maximum`` (``generate_until``, ``exact_match``): "max(37, 48) = 48", two distinct two-digit numbers.
  The 4,005 unordered pairs are split once (test, validation, train pool); the corpus compares only train-pool
  pairs ("48 is larger than 37."), so a test pair is never seen anywhere. (Two-digit addition was tried first: a
  model of this size leaves the units digit at chance after 500 fine-tuning steps, as modular arithmetic is
  learnt late; comparison and copying are learnt within the budget.)
* ``knowledge`` (``multiple_choice``, ``acc``): "Word: mango\\nCategory: fruit" among 4 categories.
  Words are split per category into train / validation / test words; the corpus says what every word is ("a mango
  is a kind of fruit.") and uses it in category-typical sentences, so answering about a held-out word means
  recalling pretraining knowledge in the fine-tuned question format (knowledge elicitation, as in "chat" tuning).
* ``sentiment`` (``multiple_choice``, ``acc``): "Review: ...\\nSentiment: negative", a two-clause review.
  Clauses joined by "and" share a polarity; with "but" the second clause decides. The corpus uses the same adjectives in
  sentences that reveal their polarity ("i loved it").

Every sample is drawn from its own generator, seeded by sha256(seed, dataset, split, index)
(``mergecal.data.vision.sample_rng``): same seed, same bytes, whatever the order of generation. Splits are JSON
lines with ``prompt`` and ``completion`` (what fine-tuning learns: prompt + completion) and, for lm-eval,
``target`` (generate_until) or ``choices`` and ``label`` (multiple_choice).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from typing import Literal
from pathlib import Path

import numpy as np

from ..checkpoint import atomic_write_text
from ..config_types import Count, NonNegativeInt, UnitInterval
from ..errors import CheckpointError, ParameterError, UnknownNameError
from .vision import sample_rng

CATEGORIES: dict[str, list[str]] = {
    "animal": ["dog", "cat", "horse", "cow", "sheep", "goat", "pig", "rabbit", "mouse", "lion", "tiger", "bear",
               "wolf", "fox", "deer", "monkey"],
    "fruit": ["apple", "banana", "mango", "pear", "peach", "plum", "cherry", "grape", "lemon", "melon", "kiwi",
              "lime", "apricot", "fig", "papaya", "coconut"],
    "vegetable": ["carrot", "potato", "onion", "cabbage", "lettuce", "pepper", "spinach", "celery", "garlic",
                  "turnip", "radish", "broccoli", "cucumber", "pumpkin", "leek", "beet"],
    "tool": ["hammer", "saw", "drill", "wrench", "shovel", "rake", "axe", "chisel", "pliers", "screwdriver",
             "ladder", "spade", "trowel", "crowbar", "clamp", "hoe"],
    "vehicle": ["car", "bus", "truck", "bicycle", "train", "tram", "van", "tractor", "scooter", "motorcycle",
                "taxi", "boat", "ship", "plane", "jeep", "wagon"],
    "instrument": ["piano", "guitar", "violin", "drum", "flute", "trumpet", "harp", "cello", "banjo", "organ",
                   "clarinet", "trombone", "tuba", "oboe", "ukulele", "saxophone"],
    "clothing": ["shirt", "coat", "jacket", "hat", "scarf", "glove", "sock", "boot", "dress", "skirt", "sweater",
                 "belt", "vest", "cap", "shoe", "blouse"],
    "furniture": ["chair", "table", "sofa", "bed", "desk", "shelf", "stool", "bench", "cabinet", "wardrobe",
                  "dresser", "couch", "armchair", "bookcase", "cupboard", "crib"],
}
# Category-typical contexts: the distributional signal a pretrained model picks up about a word.
CONTEXTS: dict[str, list[str]] = {
    "animal": ["the {w} ran across the field.", "a {w} was sleeping in the sun.", "we fed the hungry {w}.",
               "the {w} has four legs and a tail."],
    "fruit": ["i ate a sweet {w}.", "the {w} was ripe and juicy.", "she picked {a} {w} from the tree.",
              "we made juice from the {w}."],
    "vegetable": ["we cooked the {w} in a soup.", "the {w} grew in the garden.", "he chopped {a} {w} for dinner.",
                  "a fresh {w} from the farm."],
    "tool": ["he fixed the fence with a {w}.", "the {w} hung in the shed.", "use the {w} to build it.",
             "she bought a new {w} at the hardware store."],
    "vehicle": ["we drove the {w} to town.", "the {w} stopped at the station.", "he rode {a} {w} to work.",
                "the {w} carried ten people."],
    "instrument": ["she played the {w} at the concert.", "the {w} made a lovely sound.",
                   "he practised the {w} every day.", "the band needed a {w} player."],
    "clothing": ["he wore a warm {w}.", "she washed the {w} and hung it to dry.", "the {w} was too small for me.",
                 "i bought a new {w} for winter."],
    "furniture": ["we sat on the {w}.", "the {w} stood in the living room.", "they carried the heavy {w} upstairs.",
                  "the {w} was made of oak."],
}
KNOWLEDGE_QUESTIONS = ["Q: What kind of thing is {a} {w}?\nA:", "Q: {A} {w} is a kind of what?\nA:",
                       "Q: Which category does the word {w} belong to?\nA:"]
# ``prompt_style``: "qa" asks every task as "Q: ...\nA:", so every expert learns to answer in the same slot and
# any expert's task vector wipes out the others' answers (pilot: every expert and every merge at lambda >= 0.5
# answered one sentiment class); "distinct" (default) gives each task its own format, as the vision suites give
# each task its own images: experts 82/100/100 against a base of 0/25/52, task arithmetic 15/30/100 at
# lambda 0.7 (docs/llm-track.md)
PROMPTS = {"qa": {"maximum": "Q: max({a}, {b})=\nA:", "sentiment": "Review: {text}\nQ: Is this review positive or "
                                                                   "negative?\nA:"},
           "distinct": {"maximum": "max({a}, {b}) =", "knowledge": "Word: {w}\nCategory:",
                        "sentiment": "Review: {text}\nSentiment:"}}

POSITIVE = ["tasty", "fresh", "friendly", "wonderful", "great", "lovely", "delightful", "excellent", "pleasant",
            "superb", "charming", "cheerful", "clean", "comfortable", "cozy", "helpful"]
NEGATIVE = ["bland", "stale", "rude", "awful", "terrible", "dirty", "noisy", "boring", "greasy", "slow", "dull",
            "horrible", "unpleasant", "cramped", "gloomy", "shabby"]
SUBJECTS = ["the food", "the soup", "the room", "the staff", "the service", "the movie", "the hotel", "the music",
            "the show", "the bread", "the cafe", "the waiter", "the garden", "the trip", "the concert", "the bed"]
SENTIMENT_LABELS = ["positive", "negative"]

MIN_NUMBER, MAX_NUMBER = 10, 99


@dataclass(frozen=True)
class LlmTask:
    """An expert task: how lm-eval scores it (``output_type``, ``metric``) and what it teaches."""

    name: str
    output_type: str  # "generate_until" or "multiple_choice"
    metric: str  # "exact_match" or "acc"
    description: str


TASKS: dict[str, LlmTask] = {t.name: t for t in [
    LlmTask("maximum", "generate_until", "exact_match", "the larger of two two-digit numbers, generated greedily"),
    LlmTask("knowledge", "multiple_choice", "acc", "category of a held-out word among 4, recalled from pretraining"),
    LlmTask("sentiment", "multiple_choice", "acc", "polarity of a two-clause review ('but' -> second clause)"),
]}


@dataclass(frozen=True)
class LlmSuiteConfig:
    n_pretrain: Count = 12000  # corpus documents
    n_train: Count = 3000  # per task
    n_validation: Count = 150
    n_test: Count = 300
    knowledge_test_words: Count = 3  # per category (of 16)
    knowledge_validation_words: Count = 3
    qa_fraction: UnitInterval = 0.1  # corpus documents made of yes/no question-answer lines
    prompt_style: Literal["qa", "distinct"] = "distinct"  # see PROMPTS
    seed: NonNegativeInt = 0


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def _pick(rng: np.random.Generator, items: list):
    return items[int(rng.integers(len(items)))]


def number_pairs(config: LlmSuiteConfig) -> dict[str, np.ndarray]:
    """The unordered pairs (a < b) of each split, disjoint: a seeded permutation of all two-digit pairs."""
    numbers = np.arange(MIN_NUMBER, MAX_NUMBER + 1)
    a, b = np.triu_indices(len(numbers), k=1)
    pairs = np.stack([numbers[a], numbers[b]], axis=1)
    order = np.random.default_rng([config.seed, 17]).permutation(len(pairs))
    n_test, n_val = config.n_test, config.n_validation
    return {"test": pairs[order[:n_test]], "validation": pairs[order[n_test:n_test + n_val]],
            "train": pairs[order[n_test + n_val:]]}


def knowledge_words(config: LlmSuiteConfig) -> dict[str, list[tuple[str, str]]]:
    """(word, category) of each split: per category, a seeded choice of test and validation words."""
    rng = np.random.default_rng([config.seed, 23])
    splits: dict[str, list[tuple[str, str]]] = {"test": [], "validation": [], "train": []}
    n_test, n_val = config.knowledge_test_words, config.knowledge_validation_words
    for category, words in CATEGORIES.items():
        order = rng.permutation(len(words))
        splits["test"] += [(words[i], category) for i in order[:n_test]]
        splits["validation"] += [(words[i], category) for i in order[n_test:n_test + n_val]]
        splits["train"] += [(words[i], category) for i in order[n_test + n_val:]]
    return splits


def maximum_record(rng: np.random.Generator, pair: np.ndarray, style: str = "qa") -> dict:
    a, b = (int(v) for v in pair)
    if rng.random() < 0.5:
        a, b = b, a
    return {"prompt": PROMPTS[style]["maximum"].format(a=a, b=b), "completion": f" {max(a, b)}",
            "target": str(max(a, b))}


def knowledge_record(rng: np.random.Generator, words: list[tuple[str, str]], style: str = "qa") -> dict:
    word, category = _pick(rng, words)
    template = _pick(rng, KNOWLEDGE_QUESTIONS) if style == "qa" else PROMPTS[style]["knowledge"]
    prompt = template.format(w=word, a=_article(word), A=_article(word).capitalize())
    others = [c for c in CATEGORIES if c != category]
    choices = [category] + [others[i] for i in rng.choice(len(others), 3, replace=False)]
    choices = [choices[i] for i in rng.permutation(4)]
    return {"prompt": prompt, "completion": f" {category}", "choices": choices, "label": choices.index(category)}


def review(rng: np.random.Generator) -> tuple[str, str]:
    """A two-clause review and its label."""
    first = _pick(rng, SENTIMENT_LABELS)
    joiner = _pick(rng, ["and", "but"])
    second = first if joiner == "and" else SENTIMENT_LABELS[1 - SENTIMENT_LABELS.index(first)]
    s1, s2 = rng.choice(len(SUBJECTS), 2, replace=False)
    adj = lambda label: _pick(rng, POSITIVE if label == "positive" else NEGATIVE)  # noqa: E731
    return f"{SUBJECTS[s1]} was {adj(first)} {joiner} {SUBJECTS[s2]} was {adj(second)}.", second


def sentiment_record(rng: np.random.Generator, style: str = "qa") -> dict:
    text, label = review(rng)
    return {"prompt": PROMPTS[style]["sentiment"].format(text=text), "completion": f" {label}",
            "choices": list(SENTIMENT_LABELS), "label": SENTIMENT_LABELS.index(label)}


def _corpus_sentence(rng: np.random.Generator, pairs: np.ndarray) -> str:
    kind = rng.random()
    if kind < 0.25:  # a fact about a word's category
        category = _pick(rng, list(CATEGORIES))
        word = _pick(rng, CATEGORIES[category])
        return _pick(rng, ["{A} {w} is a kind of {c}.", "the {w} is {a_c} {c}.", "every {w} is {a_c} {c}."]).format(
            w=word, c=category, a=_article(word), A=_article(word).capitalize(), a_c=_article(category))
    if kind < 0.55:  # a word in a category-typical context
        category = _pick(rng, list(CATEGORIES))
        word = _pick(rng, CATEGORIES[category])
        return _pick(rng, CONTEXTS[category]).format(w=word, a=_article(word))
    if kind < 0.75:  # a comparison (train-pool pairs only)
        a, b = (int(v) for v in pairs[int(rng.integers(len(pairs)))])
        return _pick(rng, ["{b} is larger than {a}.", "{a} is smaller than {b}.", "{b} is more than {a}."]).format(
            a=a, b=b)
    label = _pick(rng, SENTIMENT_LABELS)  # an opinion whose polarity the sentence reveals
    adjective = _pick(rng, POSITIVE if label == "positive" else NEGATIVE)
    verdict = _pick(rng, ["i loved it", "we were happy", "that is a positive review"] if label == "positive"
                    else ["i hated it", "we were upset", "that is a negative review"])
    return f"{_pick(rng, SUBJECTS)} was {adjective}, and {verdict}."


def yes_no_question(rng: np.random.Generator, train_pairs: np.ndarray, train_words: list[tuple[str, str]]) -> str:
    """A yes/no question about one of the skills, with its answer: Q&A in general, not the experts' formats."""
    yes = bool(rng.random() < 0.5)
    kind = _pick(rng, list(TASKS))
    if kind == "maximum":
        a, b = (int(v) for v in train_pairs[int(rng.integers(len(train_pairs)))])
        question = f"Is {b} larger than {a}?" if yes else f"Is {a} larger than {b}?"
    elif kind == "knowledge":
        word, category = _pick(rng, train_words)
        asked = category if yes else _pick(rng, [c for c in CATEGORIES if c != category])
        question = f"Is {_article(word)} {word} {_article(asked)} {asked}?"
    else:
        label = _pick(rng, SENTIMENT_LABELS)
        liked = (label == "positive") == yes
        adjective = _pick(rng, POSITIVE if label == "positive" else NEGATIVE)
        question = f"{_pick(rng, SUBJECTS).capitalize()} was {adjective}. Did they {'like' if liked else 'dislike'} it?"
    return f"Q: {question}\nA: {'yes' if yes else 'no'}"


def corpus_document(rng: np.random.Generator, train_pairs: np.ndarray, train_words: list[tuple[str, str]],
                    qa_fraction: float) -> str:
    """Sentences or, for a ``qa_fraction`` of documents, a few yes/no question-answer lines (train splits only):
    the base model knows question answering in general, but none of the experts' question formats."""
    if rng.random() < qa_fraction:
        return "\n".join(yes_no_question(rng, train_pairs, train_words) for _ in range(int(rng.integers(2, 5))))
    return " ".join(_corpus_sentence(rng, train_pairs) for _ in range(int(rng.integers(3, 7))))


def generate_task(task: str, split: str, n: int, config: LlmSuiteConfig) -> list[dict]:
    """``n`` records of one task's split."""
    if task not in TASKS:
        raise UnknownNameError(f"unknown LLM task {task!r}; choose one of: {', '.join(TASKS)}")
    pairs = number_pairs(config)[split] if task == "maximum" else None
    words = knowledge_words(config)[split] if task == "knowledge" else None
    records = []
    for index in range(n):
        rng = sample_rng(config.seed, f"llm-{task}", split, index)
        if task == "maximum":  # evaluation splits: every pair once (in a random order of its two numbers)
            pair = pairs[index % len(pairs)] if split != "train" else pairs[int(rng.integers(len(pairs)))]
            records.append(maximum_record(rng, pair, config.prompt_style))
        elif task == "knowledge":
            records.append(knowledge_record(rng, words, config.prompt_style))
        else:
            records.append(sentiment_record(rng, config.prompt_style))
    return records


def generate_corpus(n: int, config: LlmSuiteConfig) -> list[dict]:
    pairs, words = number_pairs(config)["train"], knowledge_words(config)["train"]
    return [{"text": corpus_document(sample_rng(config.seed, "llm-corpus", "train", i), pairs, words,
                                     config.qa_fraction)} for i in range(n)]


def _check(config: LlmSuiteConfig) -> None:
    for field in ("n_pretrain", "n_train", "n_validation", "n_test"):
        if getattr(config, field) < 1:
            raise ParameterError(f"LlmSuiteConfig.{field}: expected >= 1, got {getattr(config, field)}")
    if not 0.0 <= config.qa_fraction <= 1.0:
        raise ParameterError(f"LlmSuiteConfig.qa_fraction: expected a fraction in [0, 1], got {config.qa_fraction}")
    if config.knowledge_test_words + config.knowledge_validation_words >= 16:
        raise ParameterError("LlmSuiteConfig: knowledge_test_words + knowledge_validation_words must leave train "
                             "words (16 per category)")


def _jsonl(records: list[dict]) -> str:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)


def build_llm_suite(root: str | Path, config: LlmSuiteConfig | None = None,
                    tasks: tuple[str, ...] = tuple(TASKS)) -> dict:
    """Write ``pretrain/train.jsonl`` and ``<task>/{train,validation,test}.jsonl`` under ``root`` plus
    ``manifest.json`` (config, tasks, sizes, sha256 per file). Returns the manifest."""
    config = config or LlmSuiteConfig()
    _check(config)
    root = Path(root)
    files = {"pretrain/train": generate_corpus(config.n_pretrain, config)}
    sizes = {"train": config.n_train, "validation": config.n_validation, "test": config.n_test}
    for task in tasks:
        for split, n in sizes.items():
            files[f"{task}/{split}"] = generate_task(task, split, n, config)
    digests, counts = {}, {}
    for name, records in files.items():
        text = _jsonl(records)
        atomic_write_text(root / f"{name}.jsonl", text)
        digests[name] = hashlib.sha256(text.encode()).hexdigest()
        counts[name] = len(records)
    manifest = {"config": asdict(config), "tasks": {t: asdict(TASKS[t]) for t in tasks}, "sizes": counts,
                "digests": digests}
    atomic_write_text(root / "manifest.json", json.dumps(manifest, indent=2))
    return manifest


def split_path(root: str | Path, task: str, split: str) -> Path:
    path = Path(root) / task / f"{split}.jsonl"
    if not path.exists():
        raise CheckpointError(f"{path}: split not found (build the suite with build_llm_suite first)")
    return path


def load_records(root: str | Path, task: str, split: str) -> list[dict]:
    """A written split's records (``task="pretrain"``, ``split="train"`` for the corpus)."""
    path = split_path(root, task, split)
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
