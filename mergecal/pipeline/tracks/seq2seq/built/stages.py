"""The seq2seq track of the papers' profile: a tiny T5 pretrained by span corruption on the LLM suite's corpus, one
expert per task and regime (``standard``: fully fine-tuned; ``ia3``: a peft IA³ adapter), scored T0-style by rank
classification on the suite's tasks in text-to-text form (``mergecal.data.seq2seq``).

    data/seq2seq/<task>/<split>.jsonl                  the examples ({"input", "target", "choices", "label"})
    data/seq2seq/manifest.json                         the suite's config and each file's sha256
    models/<backbone>/base/                            tokenizer + pretrained T5 (a Hugging Face directory)
    models/<backbone>/seeds/<s>/<regime>/              one fine-tuning seed's, per regime:
      experts/<task>/                                  a model directory (standard) or an IA³ adapter (ia3)
      references.json                                  the base's and each expert's rank-classification scores
                                                       (per-example on test) and task-vector norms

Outside DVC's outputs: ``.mergecal/seq2seq/merged`` (the merges of the running cells, deleted when a cell is done).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from .....checkpoint import atomic_write_text
from .....data.llm import LlmSuiteConfig
from .....data.seq2seq import SPLITS, pretraining_documents, seq2seq_splits
from .....train.seq2seq import Seq2SeqTrainConfig, TinyT5Shape, finetune_t5, pretrain_t5
from ....config import Params, fine_tuning_seed, seed_dir
from .. import scoring

WORK = Path(".mergecal") / "seq2seq"
#: the fine-tuning method of each regime's experts (``mergecal.train.seq2seq.finetune_t5``)
METHOD = {"standard": "full", "ia3": "ia3"}


def data_root(root: str | Path) -> Path:
    return Path(root) / "data" / "seq2seq"


def manifest_path(root: str | Path) -> Path:
    return data_root(root) / "manifest.json"


def split_path(root: str | Path, task: str, split: str) -> Path:
    return data_root(root) / task / f"{split}.jsonl"


def models_root(params: Params, root: str | Path) -> Path:
    return Path(root) / "models" / params.seq2seq.backbone


def base_dir(params: Params, root: str | Path) -> Path:
    return models_root(params, root) / "base"


def regime_root(params: Params, root: str | Path, regime: str, seed: int | None = None) -> Path:
    return seed_dir(models_root(params, root), fine_tuning_seed(params, seed)) / regime


def expert_dir(params: Params, root: str | Path, regime: str, task: str, seed: int | None = None) -> Path:
    return regime_root(params, root, regime, seed) / "experts" / task


def references_path(params: Params, root: str | Path, regime: str, seed: int | None = None) -> Path:
    return regime_root(params, root, regime, seed) / "references.json"


def work_dir(root: str | Path) -> Path:
    return Path(root) / WORK


def suite(params: Params) -> LlmSuiteConfig:
    return LlmSuiteConfig(**{"seed": params.seed, **params.seq2seq.data})


def build_data(params: Params, root: str | Path = ".") -> dict:
    """Every split of every task as JSON lines, and a manifest of the config and the files' digests."""
    config = suite(params)
    files = {}
    for task in params.seq2seq.tasks:
        for split, examples in seq2seq_splits(task, config).items():
            path = split_path(root, task, split)
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(path, "".join(json.dumps(e, sort_keys=True) + "\n" for e in examples))
            files[f"{task}/{split}.jsonl"] = {"examples": len(examples),
                                              "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    manifest = {"suite": {k: getattr(config, k) for k in config.__dataclass_fields__}, "files": files}
    atomic_write_text(manifest_path(root), json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def load_split(root: str | Path, task: str, split: str) -> list[dict]:
    if split not in SPLITS:
        raise ValueError(f"split {split!r}: one of {SPLITS}")
    return [json.loads(line) for line in split_path(root, task, split).read_text().splitlines() if line]


def pretrain(params: Params, root: str | Path = ".", *, device: str = "cpu", progress: bool = True) -> dict:
    config = suite(params)
    out = pretrain_t5(pretraining_documents(config.n_pretrain, config), base_dir(params, root),
                      shape=TinyT5Shape(**params.seq2seq.shape),
                      config=Seq2SeqTrainConfig(**{"seed": params.seed, **params.seq2seq.pretrain}),
                      progress=progress, device=device)
    return json.loads((out / "training.json").read_text())


def finetune(params: Params, regime: str, task: str, root: str | Path = ".", *, seed: int | None = None,
             device: str = "cpu", progress: bool = True) -> dict:
    seed = fine_tuning_seed(params, seed)
    config = Seq2SeqTrainConfig(**params.seq2seq.finetune_config(regime, seed))
    out = finetune_t5(base_dir(params, root), load_split(root, task, "train"),
                      expert_dir(params, root, regime, task, seed), task=task, method=METHOD[regime],
                      config=config, base_name=base_dir(params, root).relative_to(root).as_posix(), progress=progress,
                      device=device)
    return json.loads((out / "training.json").read_text())


def scorer(params: Params, root: str | Path) -> scoring.Scorer:
    """Rank classification of the suite's tasks (``data/seq2seq``), as the track's evaluation settings say."""
    evaluation = params.seq2seq.evaluation
    return scoring.Scorer(lambda task, split: load_split(root, task, split), evaluation.batch_size,
                         evaluation.max_validation)


def references(params: Params, root: str | Path = ".", *, regime: str, seed: int | None = None,
               device: str = "cpu") -> dict:
    """A regime's references (``scoring.references``), written to its references.json."""
    experts = {task: expert_dir(params, root, regime, task, seed) for task in params.seq2seq.tasks}
    report = scoring.references(scorer(params, root), base_dir(params, root), experts, regime, device=device)
    atomic_write_text(references_path(params, root, regime, seed), json.dumps(report, indent=2, sort_keys=True))
    return report


def build_regime(params: Params, root: str | Path, regime: str, *, seed: int, device: str = "cpu",
                 progress: bool = False) -> dict:
    """A regime's experts of one fine-tuning seed, then its references."""
    for task in params.seq2seq.tasks:
        finetune(params, regime, task, root, seed=seed, device=device, progress=progress)
    return references(params, root, regime=regime, seed=seed, device=device)
