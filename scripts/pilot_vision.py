"""End-to-end vision pilot: pretrain a tiny CLIP, fine-tune it on the eight tasks, merge by task arithmetic.

    .venv/bin/python scripts/pilot_vision.py            # about 10 minutes on 2 idle CPU cores (17 min measured on 2 shared ones)
    .venv/bin/python scripts/pilot_vision.py --pretrained /tmp/clip.safetensors   # reuse (or create) a pretrained model

Steps: generate the suite at small n; contrastive pretraining on ``pretrain`` captions; zero-shot accuracy per
task; Ilharco et al.'s fine-tuning (image encoder only, frozen zero-shot head, regime ``standard``); individual
accuracy; task arithmetic theta_0 + lambda * sum_t tau_t for lambda in a grid, lambda chosen by average
normalized VALIDATION accuracy (reference-details.md), test accuracies reported. Prints one table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal import merge_models  # noqa: E402
from mergecal.backbones import create_clip, get_tokenizer, load_clip, save_clip, zero_shot_head  # noqa: E402
from mergecal.data.vision import TASKS, generate, handwritten_splits, validation_indices  # noqa: E402
from mergecal.evaluation import evaluate  # noqa: E402
from mergecal.train import FinetuneConfig, PretrainConfig, finetune, pretrain_clip  # noqa: E402


def task_data(n_train: int, n_test: int, seed: int) -> dict[str, dict[str, dict[str, np.ndarray]]]:
    """{task: {"train": {"images", "labels"}, "test": {...}}} for the eight tasks."""
    cache = {(ds, split): generate(ds, split, n, seed=seed)
             for ds in ("scenes", "glyphs") for split, n in (("train", n_train), ("test", n_test))}
    hw = handwritten_splits(seed=seed)
    out = {}
    for name, spec in TASKS.items():
        if spec.dataset == "handwritten":
            train = {"images": hw["train"]["images"][:n_train], "labels": hw["train"]["digit"][:n_train]}
            test = {"images": hw["test"]["images"][:n_test], "labels": hw["test"]["digit"][:n_test]}
        else:
            tr, te = cache[(spec.dataset, "train")], cache[(spec.dataset, "test")]
            train = {"images": tr["images"], "labels": tr[spec.label]}
            test = {"images": te["images"], "labels": te[spec.label]}
        out[name] = {"train": train, "test": test}
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="mergecal-vit-tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--n-pretrain", type=int, default=8000)
    p.add_argument("--pretrain-steps", type=int, default=500)
    p.add_argument("--pretrain-lr", type=float, default=2e-3)
    p.add_argument("--pretrain-batch", type=int, default=128)
    p.add_argument("--pretrained", help="safetensors path: loaded if it exists, else written after pretraining")
    p.add_argument("--n-train", type=int, default=1000)
    p.add_argument("--n-test", type=int, default=300)
    p.add_argument("--ft-steps", type=int, default=150)
    p.add_argument("--ft-lr", type=float, default=1e-3)
    p.add_argument("--ft-batch", type=int, default=64)
    p.add_argument("--lambdas", default="0.1,0.2,0.3,0.5,0.7,1.0")
    p.add_argument("--json", help="write the measured figures here")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    t0 = time.time()

    data = task_data(args.n_train, args.n_test, args.seed)
    if args.pretrained and Path(args.pretrained).exists():
        model = load_clip(args.arch, args.pretrained)
        print(f"loaded pretrained model from {args.pretrained}")
    else:
        pre = generate("pretrain", "train", args.n_pretrain, seed=args.seed)
        config = PretrainConfig(arch=args.arch, steps=args.pretrain_steps, lr=args.pretrain_lr,
                                batch_size=args.pretrain_batch, seed=args.seed)
        model, hist = pretrain_clip(pre["images"], pre["captions"], config)
        print(f"pretrain loss {np.mean(hist['loss'][:10]):.3f} -> {np.mean(hist['loss'][-10:]):.3f}, "
              f"logit scale {hist['logit_scale'][-1]:.1f}")
        if args.pretrained:
            save_clip(model, args.pretrained, {"arch": args.arch, "steps": args.pretrain_steps})
    t_pre = time.time()
    tokenizer = get_tokenizer(args.arch)
    pre_sd = {k: v.clone() for k, v in model.state_dict().items()}
    heads = {name: zero_shot_head(model, tokenizer, spec.classnames, spec.templates) for name, spec in TASKS.items()}

    def split_eval(m, name):
        tr, te = data[name]["train"], data[name]["test"]
        val = validation_indices(len(tr["labels"]))
        return (evaluate(m, heads[name], tr["images"][val], tr["labels"][val])["accuracy"],
                evaluate(m, heads[name], te["images"], te["labels"]))

    rows = {name: {"chance": 1.0 / len(spec.classnames)} for name, spec in TASKS.items()}
    for name in TASKS:
        rows[name]["zeroshot"] = split_eval(model, name)[1]["accuracy"]

    ft_sds = []
    ft_cfg = FinetuneConfig(steps=args.ft_steps, lr=args.ft_lr, batch_size=args.ft_batch,
                            warmup_steps=max(1, args.ft_steps // 10), seed=args.seed)
    for name in TASKS:
        tr = data[name]["train"]
        sd, _ = finetune(model, heads[name], tr["images"], tr["labels"], ft_cfg, progress=False)
        ft_sds.append(sd)
        val_acc, test = split_eval(load_clip(args.arch, sd), name)
        rows[name].update(individual=test["accuracy"], individual_val=val_acc, individual_entropy=test["entropy"])
        print(f"  fine-tuned {name:<12} test acc {test['accuracy']:.3f}", flush=True)
    t_ft = time.time()

    lambdas = [float(v) for v in args.lambdas.split(",")]
    merged = {}
    for lam in lambdas:
        m = load_clip(args.arch, merge_models(pre_sd, ft_sds, "task_arithmetic", scaling=lam))
        merged[lam] = {name: split_eval(m, name) for name in TASKS}
    norm_val = {lam: np.mean([merged[lam][n][0] / max(rows[n]["individual_val"], 1e-9) for n in TASKS])
                for lam in lambdas}
    best = max(lambdas, key=lambda lam: norm_val[lam])
    for name in TASKS:
        for lam in lambdas:
            rows[name][f"ta_{lam:g}"] = merged[lam][name][1]["accuracy"]
        rows[name]["ta_best"] = rows[name][f"ta_{best:g}"]

    cols = ["chance", "zeroshot", "individual", "ta_best"] + [f"ta_{lam:g}" for lam in lambdas]
    print(f"\narch {args.arch}; TA lambda chosen on validation: {best:g}")
    print(f"{'task':<12}" + "".join(f"{c:>11}" for c in cols))
    for name in TASKS:
        print(f"{name:<12}" + "".join(f"{rows[name][c]:>11.3f}" for c in cols))
    avg = {c: float(np.mean([rows[n][c] for n in TASKS])) for c in cols}
    print(f"{'average':<12}" + "".join(f"{avg[c]:>11.3f}" for c in cols))
    print(f"time: pretrain {t_pre - t0:.0f}s (incl. data), fine-tune {t_ft - t_pre:.0f}s, "
          f"merge+eval {time.time() - t_ft:.0f}s")
    result = {"args": vars(args), "best_lambda": best, "rows": rows, "average": avg}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
