"""How the causal-LM family scores a model, for every source: lm-eval on task YAMLs (``LmEval``), the suite's tasks'
configurations by content (``suite_config_digests``, ``suite_lm_eval``), and what the references hold of the base
and of each expert (``base_reference``, ``expert_reference``: scores and task-vector norms read key by key)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ....checkpoint import SafetensorsSource
from ....data.llm import TASKS, split_path
from ....errors import MergecalError
from ....evaluation.lm_eval_tasks import evaluate_lm, task_config, task_name, write_task_yamls


def suite_config_digests(data: Path, tasks) -> dict[str, str]:
    """{lm-eval task name: sha256 of its configuration}, with the data file named by its content's sha256
    (not its absolute path): equal digests, equal tasks, wherever the repository lies."""
    out = {}
    for task in tasks:
        for split in ("validation", "test"):
            path = split_path(data, task, split)
            config = task_config(task, path, split)
            config["dataset_kwargs"] = {"data_files_sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
            out[task_name(task, split)] = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
    return out


@dataclass(frozen=True)
class LmEval:
    """How a track scores models with lm-eval: the YAML directory, the lm-eval task name of each (task, split),
    the metric read per task, the response-cache directory, the validation limit (None: every document) and
    the batch size. Shared by every source of the family."""

    task_dir: Path
    names: dict[str, dict[str, str]]  # {task: {split: lm-eval task name}}
    metrics: dict[str, str]  # {task: metric}
    cache: Path
    max_validation: int | None
    batch_size: int

    def score(self, model_dir: str | Path, tasks, split: str, *, device: str = "cpu",
              cache: bool = True, examples: dict[str, list[float]] | None = None) -> dict[str, float]:
        """{task: its metric} of one model on one split. ``cache=False``: no lm-eval response cache, for a
        model scored once and deleted (a cell's merges): lm-eval's cache (sqlitedict) commits every request
        and records a stack trace per statement, about half of an LLM cell's time, for answers nothing reads
        again (the cell's own result is cached by the flow)."""
        return self.score_and_count(model_dir, tasks, split, device=device, cache=cache, examples=examples)[0]

    def score_and_count(self, model_dir: str | Path, tasks, split: str, *, device: str = "cpu",
                        cache: bool = True, examples: dict[str, list[float]] | None = None
                        ) -> tuple[dict[str, float], dict[str, int]]:
        """``score``'s {task: metric} and {task: documents scored} (lm-eval's effective count; a task for which
        lm-eval reports none is left out). ``examples``: a dict to fill with each task's per-document score of its
        metric (lm-eval's per-sample output), for the leaderboard's intervals."""
        names = [self.names[t][split] for t in tasks]
        per_document: dict | None = {} if examples is not None else None
        scores = evaluate_lm(model_dir, names, self.task_dir, cache_path=self.cache if cache else None,
                             limit=self.max_validation if split == "validation" else None, device=device,
                             batch_size=self.batch_size, per_document=per_document)
        out, counts = {}, {}
        for task, name in zip(tasks, names):
            if self.metrics[task] not in scores[name]:
                raise MergecalError(f"{self.task_dir}: lm-eval task {name!r} reports "
                                    f"{', '.join(k for k in scores[name] if k != 'n') or 'no metric'}, not "
                                    f"{self.metrics[task]!r} (the metric configured for task {task!r})")
            out[task] = scores[name][self.metrics[task]]
            if examples is not None:
                examples[task] = per_document[name][self.metrics[task]]
            if "n" in scores[name]:
                counts[task] = int(scores[name]["n"])
        return out, counts


def suite_lm_eval(data: Path, tasks, out: Path, cache: Path, evaluation, n_validation: int) -> LmEval:
    """The suite's tasks scored on their local YAMLs (written to ``out``, naming the data under ``data``)."""
    write_task_yamls(data, out, tasks, splits=("validation", "test"))
    limit = evaluation.max_validation
    if limit is not None and limit >= n_validation:
        limit = None  # the whole split: lm-eval then reports no "limit" warning
    return LmEval(out, {t: {s: task_name(t, s) for s in ("validation", "test")} for t in tasks},
                  {t: TASKS[t].metric for t in tasks}, cache, limit, evaluation.batch_size)


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


def task_vector_norms(base: Path, expert: Path, sources=None) -> dict[str, float]:
    """‖τ‖ over all keys, per layer type, and ‖τ‖ / ‖θ₀‖ (read key by key). ``sources``: the (base, expert)
    ``TensorSource`` pair to read instead of the directories' files (experts that add tokens: the aligned shapes
    the merge reads, ``mergecal.backbones.vocabulary``)."""
    pre, fine = sources if sources is not None else (SafetensorsSource(base), SafetensorsSource(expert))
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


def expert_reference(scorer: LmEval, base: Path, expert: Path, task: str, tasks, *, device: str = "cpu",
                     sources=None) -> dict:
    """An expert's score on its own task (validation and test: normalized score's denominator), its test
    scores on every task and its task vector's norms (read key by key)."""
    val = scorer.score(expert, [task], "validation", device=device)[task]
    examples: dict[str, list[float]] = {}  # the expert's per-document test scores: the finetuned row's interval
    test = scorer.score(expert, tasks, "test", device=device, examples=examples)
    return {"val_accuracy": val, "test_accuracy": test[task], "test_all_tasks": test, "test_correct": examples[task],
            **task_vector_norms(base, expert, sources)}


def base_reference(scorer: LmEval, base: Path, tasks, *, device: str = "cpu") -> dict:
    return {"validation": scorer.score(base, tasks, "validation", device=device),
            "test": scorer.score(base, tasks, "test", device=device)}

