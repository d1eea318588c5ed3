"""The LLM track of the pipeline: a tiny Llama pretrained on the synthetic corpus, one expert per task, merged
experts scored with lm-eval on the suite's local task YAMLs.

    data/llm/                                       the suite (mergecal.data.llm): JSON lines per task and split
    models/<backbone>/base/                         tokenizer + pretrained model (a Hugging Face directory)
    models/<backbone>/seeds/<s>/                    one fine-tuning seed's (``seeds`` in params.yaml):
      experts/<task>/                               one fine-tuned expert per task (same layout)
      task_vectors/diagnostics.json                 each expert's validation/test score (lm-eval), the base's, and
                                                    task-vector norms per layer type
    models/<backbone>/papers/seeds/<s>/lora/        the papers' profile's regime ``lora`` (stage paper_llm_lora):
      experts/<task>/                               one peft LoRA adapter per task (adapter_config.json names the
                                                    base relative to the checkout)
      task_vectors/diagnostics.json                 as above, each adapter scored merged into the base

Outside DVC's outputs (they hold absolute paths or run-time state): ``.mergecal/llm/lm_eval_tasks`` (the task
YAMLs, which name the data files by absolute path, as lm-eval needs), ``.mergecal/llm/lm_eval_cache``
(response caches, one file per model's weight digest) and ``.mergecal/llm/merged`` (merged models of the
running cells, deleted when a cell is done).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

from .....checkpoint import atomic_write_text
from .....backbones.hf_causal_lm import load_causal_lm, save_causal_lm
from .....data.llm import LlmSuiteConfig, build_llm_suite, load_records
from .....train.lm import LmTrainConfig, LoraSettings, TinyLlamaShape, finetune_lm, pretrain_lm, read_metadata
from ....config import Params, fine_tuning_seed, seed_dir
from ..scoring import LmEval, base_reference, expert_reference, suite_config_digests, suite_lm_eval

WORK = Path(".mergecal") / "llm"


def data_root(root: str | Path) -> Path:
    return Path(root) / "data" / "llm"


def models_root(params: Params, root: str | Path) -> Path:
    return Path(root) / "models" / params.llm.backbone


def base_dir(params: Params, root: str | Path) -> Path:
    return models_root(params, root) / "base"


def seed_root(params: Params, root: str | Path, seed: int | None = None, regime: str = "standard") -> Path:
    """Fine-tuning seed ``seed``'s experts and references (None: the first of ``params.seeds``); a regime of the
    papers' profile's under ``papers/``."""
    if regime == "standard":
        return seed_dir(models_root(params, root), fine_tuning_seed(params, seed))
    return papers_seed_root(params, root, seed) / regime


def papers_seed_root(params: Params, root: str | Path, seed: int | None = None) -> Path:
    """What the papers' profile builds for fine-tuning seed ``seed`` (stage paper_llm_lora's output)."""
    return seed_dir(models_root(params, root) / "papers", fine_tuning_seed(params, seed))


def expert_dir(params: Params, root: str | Path, task: str, seed: int | None = None,
               regime: str = "standard") -> Path:
    return seed_root(params, root, seed, regime) / "experts" / task


def diagnostics_path(params: Params, root: str | Path, seed: int | None = None, regime: str = "standard") -> Path:
    return seed_root(params, root, seed, regime) / "task_vectors" / "diagnostics.json"


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
             progress: bool = True, regime: str = "standard") -> dict:
    """One task's expert: the whole model fine-tuned (``standard``) or a peft LoRA adapter (``lora``)."""
    seed = fine_tuning_seed(params, seed)
    config = LmTrainConfig(**params.llm.finetune_config(task, seed, regime))
    lora = LoraSettings(**params.llm.lora) if regime == "lora" else None
    out = finetune_lm(base_dir(params, root), load_records(data_root(root), task, "train"),
                      expert_dir(params, root, task, seed, regime), task=task, config=config, lora=lora,
                      base_name=base_dir(params, root).relative_to(root).as_posix() if lora else None,
                      progress=progress, device=device)
    return read_metadata(out)


def task_config_digests(params: Params, root: str | Path) -> dict[str, str]:
    return suite_config_digests(data_root(root), params.llm.tasks)


def lm_eval_setup(params: Params, root: str | Path) -> LmEval:
    return suite_lm_eval(data_root(root), params.llm.tasks, work_dir(root) / "lm_eval_tasks",
                         work_dir(root) / "lm_eval_cache", params.llm.evaluation,
                         LlmSuiteConfig(**params.llm.data).n_validation)


def references(params: Params, root: str | Path = ".", *, seed: int | None = None, device: str = "cpu",
               regime: str = "standard") -> dict:
    """The stage ``llm_task_vectors`` (and ``paper_llm_lora``'s last step): each expert's score on its own task
    (validation and test: normalized score's denominator), the base model's scores and the task vectors' norms.
    A LoRA expert is scored and measured as peft runs it: merged into the base by ``merge_and_unload`` (a scratch
    directory, deleted; the cells' merges equal base + the sum of these deltas, tests/test_llm_lora_track.py)."""
    tasks = params.llm.tasks
    base = base_dir(params, root)
    scorer = lm_eval_setup(params, root)
    report = {"base": base_reference(scorer, base, tasks, device=device), "tasks": {}}
    for task in tasks:
        expert = expert_dir(params, root, task, seed, regime)
        if regime == "standard":
            report["tasks"][task] = expert_reference(scorer, base, expert, task, tasks, device=device)
            continue
        work_dir(root).mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="expert-", dir=work_dir(root)))
        try:
            whole = _merged_adapter(base, expert, scratch / task)
            report["tasks"][task] = expert_reference(scorer, base, whole, task, tasks, device=device)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    report["task_configs"] = task_config_digests(params, root)
    atomic_write_text(diagnostics_path(params, root, seed, regime), json.dumps(report, indent=2, sort_keys=True))
    return report


def _merged_adapter(base: Path, adapter: Path, out: Path) -> Path:
    """The model peft runs for ``adapter``, merged into the base (``merge_and_unload``) and saved to ``out``."""
    from peft import PeftModel

    model, tokenizer = load_causal_lm(base)
    return save_causal_lm(PeftModel.from_pretrained(model, str(adapter)).merge_and_unload(), tokenizer, out)


def build_paper_regimes(params: Params, root: str | Path = ".", *, seed: int, device: str = "cpu",
                        progress: bool = False) -> dict[str, dict]:
    """The stage ``paper_llm_lora``: every regime of ``llm.paper_regimes`` for fine-tuning seed ``seed``, its
    experts then its references ({regime: references})."""
    papers_seed_root(params, root, seed).mkdir(parents=True, exist_ok=True)  # the stage's output, even if empty
    out = {}
    for regime in params.llm.paper_regimes:
        for task in params.llm.tasks:
            finetune(params, task, root, seed=seed, device=device, progress=progress, regime=regime)
        out[regime] = references(params, root, seed=seed, device=device, regime=regime)
    return out
