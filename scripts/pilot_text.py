"""Pilot of the text track: fine-tune the packaged MiniLM on each text task, then compare individual accuracy
with task-arithmetic merges (lambda grid chosen on validation), every task scored with its own head.

    .venv/bin/python scripts/pilot_text.py --steps 200 --lr 1e-4 --n-train 2000 --n-test 600
"""

import argparse
import json
import time

import numpy as np

from mergecal import merge_models
from mergecal.backbones.hf_text import load_encoder
from mergecal.data.text import TextSuiteConfig, build_text_tasks
from mergecal.data.vision import validation_indices
from mergecal.train.finetune_text import TextFinetuneConfig, evaluate_text, finetune_text_task


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--n-train", type=int, default=2000)
    parser.add_argument("--n-test", type=int, default=600)
    parser.add_argument("--max-length", type=int, default=48)
    parser.add_argument("--output", default=None)
    args = parser.parse_args()
    start = time.time()
    tasks = build_text_tasks(TextSuiteConfig(n_train=args.n_train, n_test=args.n_test))
    encoder, _ = load_encoder()
    pre = {k: v.clone() for k, v in encoder.state_dict().items()}
    config = TextFinetuneConfig(steps=args.steps, batch_size=args.batch_size, lr=args.lr, max_length=args.max_length)
    finetuned, heads, data = {}, {}, {}
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
        print(f"fine-tuned {name} in {time.time() - t0:.0f} s", flush=True)
    rows = {}
    for name in tasks:
        texts, labels = data[name]["test"]
        rows[name] = {"individual": evaluate_text(finetuned[name], heads[name], texts, labels, data[name]["n_classes"],
                                                  max_length=args.max_length)["accuracy"]}
    best = None
    for lam in (0.2, 0.3, 0.5, 0.7, 1.0):
        merged = merge_models(pre, list(finetuned.values()), "task_arithmetic", scaling=lam)
        val_norm = np.mean([evaluate_text(merged, heads[n], *data[n]["val"], data[n]["n_classes"],
                                          max_length=args.max_length)["accuracy"] / rows[n]["individual"] for n in tasks])
        print(f"lambda {lam}: validation normalized accuracy {val_norm:.3f}", flush=True)
        if best is None or val_norm > best[1]:
            best = (lam, val_norm, merged)
    for name in tasks:
        texts, labels = data[name]["test"]
        rows[name]["merged"] = evaluate_text(best[2], heads[name], texts, labels, data[name]["n_classes"],
                                             max_length=args.max_length)["accuracy"]
    ind = np.mean([r["individual"] for r in rows.values()])
    mer = np.mean([r["merged"] for r in rows.values()])
    print(f"\n{'task':18s} individual  merged (TA, lambda={best[0]})")
    for name, r in rows.items():
        print(f"{name:18s} {r['individual']:.3f}       {r['merged']:.3f}")
    print(f"{'average':18s} {ind:.3f}       {mer:.3f}   gap {100 * (ind - mer):.1f} points; {time.time() - start:.0f} s")
    if args.output:
        with open(args.output, "w") as fh:
            json.dump({"args": vars(args), "lambda": best[0], "rows": rows}, fh, indent=2)


if __name__ == "__main__":
    main()
