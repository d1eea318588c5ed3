"""Over- or under-confident? Mean top-1 confidence (max softmax) against accuracy on test, per task, of saved
fine-tunes (pilot_vision.py --save-finetuned DIR: DIR/REGIME/TASK.safetensors), with the pretrained model's heads.

    python docs/testbed-pilots/confidence.py PRETRAINED.safetensors SUITE_ROOT DIR standard low_confidence
"""
import sys

import numpy as np
import torch

from mergecal.backbones import get_tokenizer, load_clip, zero_shot_head
from mergecal.backbones.open_clip_vit import logits, preprocess
from mergecal.checkpoint import load_state_dict
from mergecal.data.vision import TASK_SETS, TASKS
from mergecal.pipeline.tracks.vision.stages import task_split

ARCH = "mergecal-vit-tiny-p8"
torch.set_num_threads(1)
pretrained, root, ft_dir, *regimes = sys.argv[1:]
model = load_clip(ARCH, pretrained)
tok = get_tokenizer(ARCH)
tasks = TASK_SETS["disjoint8"]
heads = {t: zero_shot_head(model, tok, TASKS[t].classnames, TASKS[t].templates) for t in tasks}
print("| regime | " + " | ".join(tasks) + " | mean |")
print("|---|" + "---|" * (len(tasks) + 1))
for regime in regimes:
    cells, gaps = [], []
    for t in tasks:
        m = load_clip(ARCH, load_state_dict(f"{ft_dir}/{regime}/{t}.safetensors"))
        x, y = task_split(root, t, "test")
        with torch.no_grad():
            p = logits(m, heads[t], preprocess(x, 32)).softmax(-1)
        conf, acc = float(p.max(-1).values.mean()), float((p.argmax(-1) == torch.as_tensor(y)).float().mean())
        cells.append(f"{conf:.3f} / {acc:.3f}")
        gaps.append(conf - acc)
    print(f"| {regime} | " + " | ".join(cells) + f" | {np.mean(gaps):+.3f} |")
print("(cells: mean confidence / accuracy; mean: confidence minus accuracy, > 0 over-confident)")
