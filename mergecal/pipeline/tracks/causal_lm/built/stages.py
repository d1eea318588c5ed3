"""The LLM track of the pipeline: a tiny Llama pretrained on the synthetic corpus, one expert per task, merged
experts scored with lm-eval on the suite's local task YAMLs.

    data/llm/                                       the suite (mergecal.data.llm): JSON lines per task and split
    models/<backbone>/base/                         tokenizer + pretrained model (a Hugging Face directory)
    models/<backbone>/seeds/<s>/                    one fine-tuning seed's (``seeds`` in params.yaml):
      experts/<task>/                               one fine-tuned expert per task (same layout)
      task_vectors/diagnostics.json                 each expert's validation/test score (lm-eval), the base's, and
                                                    task-vector norms per layer type

Outside DVC's outputs (they hold absolute paths or run-time state): ``.mergecal/llm/lm_eval_tasks`` (the task
YAMLs, which name the data files by absolute path, as lm-eval needs), ``.mergecal/llm/lm_eval_cache``
(response caches, one file per model's weight digest) and ``.mergecal/llm/merged`` (merged models of the
running cells, deleted when a cell is done).
"""

from __future__ import annotations

import json
from pathlib import Path

from .....checkpoint import atomic_write_text
from .....data.llm import LlmSuiteConfig, build_llm_suite, load_records
from .....train.lm import LmTrainConfig, TinyLlamaShape, finetune_lm, pretrain_lm, read_metadata
from ....config import Params, fine_tuning_seed, seed_dir
from ..scoring import LmEval, base_reference, expert_reference, suite_config_digests, suite_lm_eval

WORK = Path(".mergecal") / "llm"


def data_root(root: str | Path) -> Path:
    return Path(root) / "data" / "llm"


def models_root(params: Params, root: str | Path) -> Path:
    return Path(root) / "models" / params.llm.backbone


def base_dir(params: Params, root: str | Path) -> Path:
    return models_root(params, root) / "base"


def seed_root(params: Params, root: str | Path, seed: int | None = None) -> Path:
    """Fine-tuning seed ``seed``'s experts and references (None: the first of ``params.seeds``)."""
    return seed_dir(models_root(params, root), fine_tuning_seed(params, seed))


def expert_dir(params: Params, root: str | Path, task: str, seed: int | None = None) -> Path:
    return seed_root(params, root, seed) / "experts" / task


def diagnostics_path(params: Params, root: str | Path, seed: int | None = None) -> Path:
    return seed_root(params, root, seed) / "task_vectors" / "diagnostics.json"


def work_dir(root: str | Path) -> Path:
    return Path(root) / WORK


def build_data(params: Params, root: str | Path = ".") -> dict:
    return build_llm_suite(data_root(root), LlmSuiteConfig(**{"seed": params.seed, **params.llm.data}),
                           tasks=tuple(params.llm.tasks))


def pretrain(params: Params, root: str | Path = ".", *, device: str = "cpu", progress: bool = True) -> dict:
    corpus = [r["text"] for r in load_records(data_root(root), "pretrain", "train")]
    out = pretrain_lm(corpus, base_dir(params, root), shape=TinyLlamaShape(**params.llm.shape),
                      config=LmTrainConfig(**{"seed": params.seed, **params.llm.pretrain}), progress=progress,
                      device=device)
    return read_metadata(out)


def finetune(params: Params, task: str, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu",
             progress: bool = True) -> dict:
    seed = fine_tuning_seed(params, seed)
    config = LmTrainConfig(**params.llm.finetune_config(task, seed))
    out = finetune_lm(base_dir(params, root), load_records(data_root(root), task, "train"),
                      expert_dir(params, root, task, seed), task=task, config=config, progress=progress, device=device)
    return read_metadata(out)


def task_config_digests(params: Params, root: str | Path) -> dict[str, str]:
    return suite_config_digests(data_root(root), params.llm.tasks)


def lm_eval_setup(params: Params, root: str | Path) -> LmEval:
    return suite_lm_eval(data_root(root), params.llm.tasks, work_dir(root) / "lm_eval_tasks",
                         work_dir(root) / "lm_eval_cache", params.llm.evaluation,
                         LlmSuiteConfig(**params.llm.data).n_validation)


def references(params: Params, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu") -> dict:
    """The stage ``llm_task_vectors``: each expert's score on its own task (validation and test: normalized
    score's denominator), the base model's scores and the task vectors' norms."""
    tasks = params.llm.tasks
    base = base_dir(params, root)
    scorer = lm_eval_setup(params, root)
    report = {"base": base_reference(scorer, base, tasks, device=device), "tasks": {}}
    for task in tasks:
        report["tasks"][task] = expert_reference(scorer, base, expert_dir(params, root, task, seed), task, tasks,
                                                 device=device)
    report["task_configs"] = task_config_digests(params, root)
    atomic_write_text(diagnostics_path(params, root, seed), json.dumps(report, indent=2, sort_keys=True))
    return report
