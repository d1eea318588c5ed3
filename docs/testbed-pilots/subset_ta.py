"""Task arithmetic over a SUBSET of a pilot's saved standard fine-tunes (pilot_vision.py --save-finetuned):
lambda chosen on average normalized validation accuracy, test accuracies reported, as pilot_vision.py does."""
import argparse
import json

import numpy as np
import torch

from mergecal import merge_models
from mergecal.backbones import get_tokenizer, load_clip, zero_shot_head
from mergecal.checkpoint import load_state_dict
from mergecal.data.vision import TASKS
from mergecal.evaluation import evaluate
from mergecal.pipeline.tracks.vision.stages import task_split

p = argparse.ArgumentParser()
p.add_argument("pilot_json")
p.add_argument("pretrained")
p.add_argument("finetuned_dir")
p.add_argument("root")
p.add_argument("tasks", nargs="+")
p.add_argument("--arch", default="mergecal-vit-tiny-p8")
p.add_argument("--lambdas", default="0.05,0.1,0.2,0.3,0.5,0.7,1.0")
args = p.parse_args()
torch.set_num_threads(1)
rows = json.load(open(args.pilot_json))["rows"]
pre = load_state_dict(args.pretrained)
model = load_clip(args.arch, pre)
tok = get_tokenizer(args.arch)
fts = [load_state_dict(f"{args.finetuned_dir}/standard/{t}.safetensors") for t in args.tasks]
heads = {t: zero_shot_head(model, tok, TASKS[t].classnames, TASKS[t].templates) for t in args.tasks}
data = {t: {s: task_split(args.root, t, s) for s in ("validation", "test")} for t in args.tasks}
out = {}
for lam in [float(v) for v in args.lambdas.split(",")]:
    m = load_clip(args.arch, merge_models(pre, fts, "task_arithmetic", scaling=lam))
    val = np.mean([evaluate(m, heads[t], *data[t]["validation"])["accuracy"] / rows[t]["individual_val"]
                   for t in args.tasks])
    test = {t: evaluate(m, heads[t], *data[t]["test"])["accuracy"] for t in args.tasks}
    out[lam] = (val, test)
    print(f"lambda {lam:g}: normalized val {val:.3f}, test avg {np.mean(list(test.values())):.3f}  "
          + " ".join(f"{t[:5]} {a:.2f}" for t, a in test.items()), flush=True)
best = max(out, key=lambda lam: out[lam][0])
zs = np.mean([rows[t]["zeroshot"] for t in args.tasks])
ft = np.mean([rows[t]["individual"] for t in args.tasks])
ta = np.mean(list(out[best][1].values()))
print(f"K={len(args.tasks)} {args.tasks}: zero-shot {zs:.3f}, fine-tuned {ft:.3f} (min "
      f"{min(rows[t]['individual'] for t in args.tasks):.3f}), TA {ta:.3f} at lambda {best:g} "
      f"(TA - zs {ta - zs:+.3f}, ft - TA {ft - ta:+.3f})")
