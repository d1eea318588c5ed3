"""The LLM track of the pipeline: a tiny Llama pretrained on the synthetic corpus, one expert per task, merged
experts scored with lm-eval on the suite's local task YAMLs.

    data/llm/                                       the suite (mergecal.data.llm): JSON lines per task and split
    models/<backbone>/base/                         tokenizer + pretrained model (a Hugging Face directory)
    models/<backbone>/experts/<task>/               one fine-tuned expert per task (same layout)
    models/<backbone>/task_vectors/diagnostics.json each expert's validation/test score (lm-eval), the base's, and
                                                    task-vector norms per layer type

Outside DVC's outputs (they hold absolute paths or run-time state): ``.mergecal/llm/lm_eval_tasks`` (the task
YAMLs, which name the data files by absolute path, as lm-eval needs), ``.mergecal/llm/lm_eval_cache``
(response caches, one file per model's weight digest) and ``.mergecal/llm/merged`` (merged models of the
running cells, deleted when a cell is done).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from ..checkpoint import atomic_write_text
from .config import Params

WORK = Path(".mergecal") / "llm"


def data_root(root: str | Path) -> Path:
    return Path(root) / "data" / "llm"


def models_root(params: Params, root: str | Path) -> Path:
    return Path(root) / "models" / params.llm.backbone


def base_dir(params: Params, root: str | Path) -> Path:
    return models_root(params, root) / "base"


def expert_dir(params: Params, root: str | Path, task: str) -> Path:
    return models_root(params, root) / "experts" / task


def diagnostics_path(params: Params, root: str | Path) -> Path:
    return models_root(params, root) / "task_vectors" / "diagnostics.json"


def work_dir(root: str | Path) -> Path:
    return Path(root) / WORK


def build_data(params: Params, root: str | Path = ".") -> dict:
    from ..data.llm import LlmSuiteConfig, build_llm_suite

    return build_llm_suite(data_root(root), LlmSuiteConfig(**{"seed": params.seed, **params.llm.data}),
                           tasks=tuple(params.llm.tasks))


def pretrain(params: Params, root: str | Path = ".", *, device: str = "cpu", progress: bool = True) -> dict:
    from ..data.llm import load_records
    from ..train.lm import LmTrainConfig, TinyLlamaShape, pretrain_lm, read_metadata

    corpus = [r["text"] for r in load_records(data_root(root), "pretrain", "train")]
    out = pretrain_lm(corpus, base_dir(params, root), shape=TinyLlamaShape(**params.llm.shape),
                      config=LmTrainConfig(**{"seed": params.seed, **params.llm.pretrain}), progress=progress,
                      device=device)
    return read_metadata(out)


def finetune(params: Params, task: str, root: str | Path = ".", *, device: str = "cpu",
             progress: bool = True) -> dict:
    from ..data.llm import load_records
    from ..train.lm import LmTrainConfig, finetune_lm, read_metadata

    config = LmTrainConfig(**params.llm.finetune_config(task, params.seed))
    out = finetune_lm(base_dir(params, root), load_records(data_root(root), task, "train"),
                      expert_dir(params, root, task), task=task, config=config, progress=progress, device=device)
    return read_metadata(out)


def task_yamls(params: Params, root: str | Path) -> Path:
    """Write the lm-eval task YAMLs (validation and test of every task) under the work directory."""
    from ..evaluation.lm_eval_tasks import write_task_yamls

    out = work_dir(root) / "lm_eval_tasks"
    write_task_yamls(data_root(root), out, params.llm.tasks, splits=("validation", "test"))
    return out


def task_config_digests(params: Params, root: str | Path) -> dict[str, str]:
    """{lm-eval task name: sha256 of its configuration}, with the data file named by its content's sha256
    (not its absolute path): equal digests, equal tasks, wherever the repository lies."""
    from ..data.llm import split_path
    from ..evaluation.lm_eval_tasks import task_config, task_name

    out = {}
    for task in params.llm.tasks:
        for split in ("validation", "test"):
            path = split_path(data_root(root), task, split)
            config = task_config(task, path, split)
            config["dataset_kwargs"] = {"data_files_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            out[task_name(task, split)] = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return out


def evaluate(params: Params, root: str | Path, model_dir: str | Path, tasks, split: str, *,
             device: str = "cpu") -> dict[str, float]:
    """{task: its lm-eval metric (exact_match or acc)} of one model on one split; validation is limited to
    ``llm.evaluation.max_validation`` documents per task."""
    from ..data.llm import TASKS, LlmSuiteConfig
    from ..evaluation.lm_eval_tasks import evaluate_lm, task_name

    evaluation = params.llm.evaluation
    limit = evaluation.max_validation if split == "validation" else None
    if limit is not None and limit >= LlmSuiteConfig(**params.llm.data).n_validation:
        limit = None  # the whole split: lm-eval then reports no "limit" warning
    names = [task_name(t, split) for t in tasks]
    scores = evaluate_lm(model_dir, names, task_yamls(params, root), cache_path=work_dir(root) / "lm_eval_cache",
                         limit=limit, device=device, batch_size=evaluation.batch_size)
    return {t: scores[task_name(t, split)][TASKS[t].metric] for t in tasks}


def layer_type(key: str) -> str:
    """A Llama key's layer type, for norms per type: attention, mlp, norm, embedding, other."""
    if "embed_tokens" in key or key == "lm_head.weight":
        return "embedding"
    if ".self_attn." in key:
        return "attention"
    if ".mlp." in key:
        return "mlp"
    if "norm" in key:
        return "norm"
    return "other"


def task_vector_norms(base: Path, expert: Path) -> dict[str, float]:
    """‖τ‖ over all keys, per layer type, and ‖τ‖ / ‖θ₀‖ (read key by key)."""
    from ..checkpoint import SafetensorsSource

    pre, fine = SafetensorsSource(base), SafetensorsSource(expert)
    total, base_sq, per_type = 0.0, 0.0, {}
    for key in pre.keys():
        p = pre.get(key).double()
        if not p.is_floating_point():
            continue
        sq = float((fine.get(key).double() - p).square().sum())
        total += sq
        base_sq += float(p.square().sum())
        per_type[layer_type(key)] = per_type.get(layer_type(key), 0.0) + sq
    return {"norm": total ** 0.5, "relative_norm": (total / base_sq) ** 0.5,
            "norm_by_layer_type": {k: v ** 0.5 for k, v in sorted(per_type.items())}}


def references(params: Params, root: str | Path = ".", *, device: str = "cpu") -> dict:
    """The stage ``llm_task_vectors``: each expert's score on its own task (validation and test: normalized
    score's denominator), the base model's scores and the task vectors' norms."""
    tasks = params.llm.tasks
    base = base_dir(params, root)
    report = {"base": {"validation": evaluate(params, root, base, tasks, "validation", device=device),
                       "test": evaluate(params, root, base, tasks, "test", device=device)},
              "tasks": {}}
    for task in tasks:
        expert = expert_dir(params, root, task)
        val = evaluate(params, root, expert, [task], "validation", device=device)[task]
        test = evaluate(params, root, expert, tasks, "test", device=device)
        report["tasks"][task] = {"val_accuracy": val, "test_accuracy": test[task], "test_all_tasks": test,
                                 **task_vector_norms(base, expert)}
    report["task_configs"] = task_config_digests(params, root)
    atomic_write_text(diagnostics_path(params, root), json.dumps(report, indent=2, sort_keys=True))
    return report
