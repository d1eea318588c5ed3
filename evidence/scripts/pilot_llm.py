"""Pilot of the LLM track: pretrain a tiny Llama on the synthetic corpus, fine-tune one expert per task, score
base, experts and a task-arithmetic merge of the experts with lm-eval on every task.

    .venv/bin/python scripts/pilot_llm.py                      # writes under data/generated/llm_pilot
    .venv/bin/python scripts/pilot_llm.py --reuse              # keep the trained models, re-run merge + evaluation

Lambda of the merge (theta_0 + lambda * sum_t tau_t) is chosen on the validation splits by average normalized
score (merged score / the expert's own score, as in the vision benchmark); test scores are reported. Prints one
table (rows: models; columns: tasks), the task-vector norms and the seconds spent in each phase.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

for _var, _value in {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
                     "DO_NOT_TRACK": "true", "MLFLOW_DISABLE_TELEMETRY": "true", "TOKENIZERS_PARALLELISM": "false"
                     }.items():
    os.environ.setdefault(_var, _value)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal import merge_models  # noqa: E402
from mergecal.backbones.hf_causal_lm import causal_lm_state_dict, save_causal_lm_weights  # noqa: E402
from mergecal.checkpoint import atomic_write_text  # noqa: E402
from mergecal.data.llm import TASKS, LlmSuiteConfig, build_llm_suite, load_records  # noqa: E402
from mergecal.evaluation.lm_eval_tasks import evaluate_lm, task_name, write_task_yamls  # noqa: E402
from mergecal.train.lm import LmTrainConfig, TinyLlamaShape, finetune_lm, pretrain_lm  # noqa: E402

# Per task: what reaches a clear gain over the base within the budget (the comparison task needs the most steps).
FINETUNE = {"maximum": LmTrainConfig(steps=300, batch_size=64, lr=2e-3, weight_decay=0.0),
            "knowledge": LmTrainConfig(steps=60, batch_size=32, lr=1e-3, weight_decay=0.0),
            "sentiment": LmTrainConfig(steps=100, batch_size=32, lr=1e-3, weight_decay=0.0)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--root", default="data/generated/llm_pilot")
    parser.add_argument("--tasks", nargs="+", default=list(TASKS))
    parser.add_argument("--pretrain-steps", type=int, default=300)
    parser.add_argument("--pretrain-lr", type=float, default=3e-3)
    parser.add_argument("--finetune-steps", type=int, default=None, help="override every task's steps")
    parser.add_argument("--finetune-lr-scale", type=float, default=1.0, help="multiply every task's lr")
    parser.add_argument("--prompt-style", default="distinct", choices=["qa", "distinct"])
    parser.add_argument("--lambdas", type=float, nargs="+", default=[0.3, 0.5, 0.7, 1.0])
    parser.add_argument("--limit", type=int, default=None, help="lm-eval documents per task (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 shares a busy CPU)")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--reuse", action="store_true", help="reuse data and trained models found under --root")
    parser.add_argument("--freeze-embeddings", action="store_true", help="fine-tune without the tied embeddings")
    parser.add_argument("--output", default=None, help="results JSON (default: ROOT/results.json)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.root)
    seconds: dict[str, float] = {}
    start = time.time()

    if not (args.reuse and (root / "data" / "manifest.json").exists()):
        build_llm_suite(root / "data", LlmSuiteConfig(prompt_style=args.prompt_style), tasks=tuple(TASKS))
    seconds["data"] = time.time() - start

    models = root / "models"
    t0 = time.time()
    if not (args.reuse and (models / "base" / "config.json").exists()):
        corpus = [r["text"] for r in load_records(root / "data", "pretrain", "train")]
        pretrain_lm(corpus, models / "base", shape=TinyLlamaShape(), device=args.device,
                    config=LmTrainConfig(steps=args.pretrain_steps, lr=args.pretrain_lr, batch_size=32))
    seconds["pretrain"] = time.time() - t0
    t0 = time.time()
    for task in args.tasks:
        if not (args.reuse and (models / task / "config.json").exists()):
            config = dataclasses.replace(FINETUNE[task], freeze_embeddings=args.freeze_embeddings,
                                         lr=FINETUNE[task].lr * args.finetune_lr_scale)
            if args.finetune_steps is not None:
                config = dataclasses.replace(config, steps=args.finetune_steps)
            finetune_lm(models / "base", load_records(root / "data", task, "train"), models / task, task=task,
                        device=args.device, config=config)
    seconds["finetune"] = time.time() - t0

    task_dir = root / "lm_eval_tasks"
    write_task_yamls(root / "data", task_dir, args.tasks, splits=("validation", "test"))
    cache = root / "lm_eval_cache"

    def evaluate(model_dir: Path, split: str) -> dict[str, float]:
        """{task: its metric} on one split."""
        scores = evaluate_lm(model_dir, [task_name(t, split) for t in args.tasks], task_dir, cache_path=cache,
                             limit=args.limit, device=args.device)
        return {t: scores[task_name(t, split)][TASKS[t].metric] for t in args.tasks}

    t0 = time.time()
    rows = {"base": evaluate(models / "base", "test")}
    for task in args.tasks:
        rows[f"expert:{task}"] = evaluate(models / task, "test")
    seconds["evaluate base+experts"] = time.time() - t0

    t0 = time.time()
    pre = causal_lm_state_dict(models / "base")
    experts = [causal_lm_state_dict(models / task) for task in args.tasks]
    norms = {t: sum(float((e[k].float() - pre[k].float()).square().sum()) for k in pre) ** 0.5
             for t, e in zip(args.tasks, experts)}
    print("task-vector norms: " + ", ".join(f"{t} {n:.1f}" for t, n in norms.items()), flush=True)
    expert_val = {task: evaluate(models / task, "validation")[task] for task in args.tasks}
    best = None
    for lam in args.lambdas:
        out = models / f"merged_ta_{lam:g}"
        save_causal_lm_weights(merge_models(pre, experts, "task_arithmetic", scaling=lam), out, like=models / "base")
        val = evaluate(out, "validation")
        normalized = sum(val[t] / max(expert_val[t], 1e-9) for t in args.tasks) / len(args.tasks)
        print(f"lambda {lam:g}: validation {json.dumps({t: round(v, 3) for t, v in val.items()})}, "
              f"normalized {normalized:.3f}", flush=True)
        if best is None or normalized > best[1]:
            best = (lam, normalized, out)
    rows[f"merged TA (lambda={best[0]:g})"] = evaluate(best[2], "test")
    seconds["merge + select lambda + evaluate"] = time.time() - t0
    total = time.time() - start

    metric = {t: TASKS[t].metric for t in args.tasks}
    print("\n" + f"{'model':28s}" + "".join(f"{t + ' (' + metric[t] + ')':>26s}" for t in args.tasks))
    for name, scores in rows.items():
        print(f"{name:28s}" + "".join(f"{scores[t]:26.3f}" for t in args.tasks))
    print("\nseconds: " + ", ".join(f"{k} {v:.0f}" for k, v in seconds.items()) + f"; total {total:.0f}")
    atomic_write_text(args.output or root / "results.json", json.dumps(
        {"args": vars(args), "rows": rows, "task_vector_norms": norms, "seconds": seconds, "total_seconds": total,
         "lambda": best[0]}, indent=2))


if __name__ == "__main__":
    main()
