"""Fine-tune one task of mergecal.data.vision.TASKS from a pretrained checkpoint on freshly generated data and
print its zero-shot and fine-tuned test accuracy (a quick probe of a generator's difficulty)."""
import argparse
import time

import torch

from mergecal.backbones import get_tokenizer, load_clip, zero_shot_head
from mergecal.data.vision import TASKS, generate, handwritten_splits
from mergecal.evaluation import evaluate
from mergecal.train import FinetuneConfig, finetune

p = argparse.ArgumentParser()
p.add_argument("pretrained")
p.add_argument("tasks", nargs="+")
p.add_argument("--arch", default="mergecal-vit-tiny-p8")
p.add_argument("--steps", type=int, default=120)
p.add_argument("--lr", type=float, default=3e-4)
p.add_argument("--n-train", type=int, default=3600)
p.add_argument("--n-test", type=int, default=300)
args = p.parse_args()
torch.set_num_threads(1)
model = load_clip(args.arch, args.pretrained)
tok = get_tokenizer(args.arch)
for task in args.tasks:
    spec = TASKS[task]
    if spec.dataset == "handwritten":
        hw = handwritten_splits()
        tr, te = hw["train"], hw["test"]
    else:
        tr, te = generate(spec.dataset, "train", args.n_train), generate(spec.dataset, "test", args.n_test)
    head = zero_shot_head(model, tok, spec.classnames, spec.templates)
    zs = evaluate(model, head, te["images"], te[spec.label])["accuracy"]
    t = time.time()
    state, hist = finetune(model, head, tr["images"], tr[spec.label],
                           FinetuneConfig(steps=args.steps, lr=args.lr, warmup_steps=args.steps // 10), progress=False)
    ft = evaluate(load_clip(args.arch, state), head, te["images"], te[spec.label])["accuracy"]
    print(f"{task}: zero-shot {zs:.3f}, fine-tuned {ft:.3f} ({args.steps} steps, lr {args.lr:g}, "
          f"final loss {hist['loss'][-1]:.3f}, {time.time() - t:.0f} s)", flush=True)
