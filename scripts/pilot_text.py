"""Pilot of the text track: fine-tune the packaged MiniLM on each text task, then compare individual accuracy
with task-arithmetic merges (lambda grid chosen on validation), every task scored with its own head.

    .venv/bin/python scripts/pilot_text.py                  # the default (TextFinetuneConfig's defaults)
    .venv/bin/python scripts/pilot_text.py --smoke          # seconds: tiny data, a few steps
    .venv/bin/python scripts/pilot_text.py --steps 150 --lr 1e-4 --n-train 2000 --max-length 48

Prints per-task fine-tuning times, the per-step cost, the machine load (``os.getloadavg``) and one table.
"""

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal import merge_models  # noqa: E402
from mergecal.backbones.hf_text import load_encoder  # noqa: E402
from mergecal.data.text import DEFAULT_TASKS, SMOKE_TEXT_SUITE, TextSuiteConfig, build_text_tasks  # noqa: E402
from mergecal.data.vision import validation_indices  # noqa: E402
from mergecal.train.finetune_text import SMOKE_TEXT_FINETUNE, TextFinetuneConfig, evaluate_text, finetune_text_task  # noqa: E402,E501


def main(argv=None):
    defaults, suite_defaults = TextFinetuneConfig(), TextSuiteConfig()
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true", help="tiny data and a few steps (CI)")
    parser.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    parser.add_argument("--steps", type=int)
    parser.add_argument("--lr", type=float)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--max-length", type=int)
    parser.add_argument("--n-train", type=int)
    parser.add_argument("--n-test", type=int)
    parser.add_argument("--lambdas", default="0.05,0.1,0.2,0.3,0.5,0.7,1.0")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = SMOKE_TEXT_FINETUNE if args.smoke else defaults
    suite = SMOKE_TEXT_SUITE if args.smoke else suite_defaults
    config = dataclasses.replace(base, **{k: v for k, v in {"steps": args.steps, "lr": args.lr,
                                                             "batch_size": args.batch_size,
                                                             "max_length": args.max_length}.items() if v is not None})
    suite = dataclasses.replace(suite, **{k: v for k, v in {"n_train": args.n_train, "n_test": args.n_test}.items()
                                          if v is not None})
    names = args.tasks.split(",")
    start, load_start = time.time(), os.getloadavg()
    tasks = {n: t for n, t in build_text_tasks(suite).items() if n in names}
    encoder, _ = load_encoder()
    pre = {k: v.clone() for k, v in encoder.state_dict().items()}
    finetuned, heads, data, ft_time = {}, {}, {}, {}
    for name, (task, splits) in tasks.items():
        train_texts = [r["text"] for r in splits["train"]]
        train_labels = np.array([r["label"] for r in splits["train"]])
        val = validation_indices(len(train_texts))
        keep = np.setdiff1d(np.arange(len(train_texts)), val)
        data[name] = {"val": ([train_texts[i] for i in val], train_labels[val]),
                      "test": ([r["text"] for r in splits["test"]], np.array([r["label"] for r in splits["test"]])),
                      "n_classes": len(task.classnames)}
        t0 = time.time()
        finetuned[name], heads[name], _ = finetune_text_task(pre, [train_texts[i] for i in keep], train_labels[keep],
                                                             len(task.classnames), config, progress=False)
        ft_time[name] = time.time() - t0
        print(f"fine-tuned {name} in {ft_time[name]:.0f} s ({ft_time[name] / config.steps:.3f} s/step), "
              f"load {os.getloadavg()[0]:.1f}", flush=True)
    t_ft = time.time()

    def score(encoder_state, name, split):
        return evaluate_text(encoder_state, heads[name], *data[name][split], data[name]["n_classes"],
                             max_length=config.max_length)["accuracy"]

    rows = {name: {"individual": score(finetuned[name], name, "test"),
                   "individual_val": score(finetuned[name], name, "val")} for name in tasks}
    best = None
    for lam in [float(v) for v in args.lambdas.split(",")]:
        merged = merge_models(pre, list(finetuned.values()), "task_arithmetic", scaling=lam)
        val_norm = np.mean([score(merged, n, "val") / max(rows[n]["individual_val"], 1e-9) for n in tasks])
        print(f"lambda {lam}: validation normalized accuracy {val_norm:.3f}", flush=True)
        if best is None or val_norm > best[1]:
            best = (lam, val_norm, merged)
    for name in tasks:
        rows[name]["merged"] = score(best[2], name, "test")
    ind = np.mean([r["individual"] for r in rows.values()])
    mer = np.mean([r["merged"] for r in rows.values()])
    print(f"\n{'task':18s} individual  merged (TA, lambda={best[0]})")
    for name, r in rows.items():
        print(f"{name:18s} {r['individual']:.3f}       {r['merged']:.3f}")
    print(f"{'average':18s} {ind:.3f}       {mer:.3f}   gap {100 * (ind - mer):.1f} points")
    print(f"time: fine-tunes {t_ft - start:.0f} s (incl. data), total {time.time() - start:.0f} s; "
          f"load at start {load_start[0]:.1f}, at end {os.getloadavg()[0]:.1f}; config {dataclasses.asdict(config)}")
    if args.output:
        Path(args.output).write_text(json.dumps({"args": vars(args), "config": dataclasses.asdict(config),
                                                 "suite": dataclasses.asdict(suite), "lambda": best[0], "rows": rows,
                                                 "average": {"individual": ind, "merged": mer},
                                                 "finetune_seconds": ft_time}, indent=2))


if __name__ == "__main__":
    main()
