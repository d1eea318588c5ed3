"""P27: each task lengthened at 3, 5 and 7x the fine-tuning lr (the 10x models are the papers' profile's, as
committed before P27): validation accuracy against the task's standard fine-tune and the task vector's norm
against the standard one's. Run from a populated checkout (the default run's models in place):
    python docs/testbed-pilots/p27_multiples.py 5 objects digits ...  -> /tmp/p27/m5-objects.json"""

import json
import sys
from pathlib import Path

from mergecal.checkpoint import load_state_dict
from mergecal.pipeline.config import load_params
from mergecal.pipeline.threads import pin_threads
from mergecal.pipeline.tracks.clip.built import stages as vision

multiple, tasks, root = float(sys.argv[1]), sys.argv[2:], Path(".")
pin_threads(1)
params = load_params(root / "params.yaml")
params = params.model_copy(update={"vision": params.vision.model_copy(
    update={"norm_mismatch_lr_multiplier": multiple})})
pretrained = load_state_dict(root / "models/clip-small/pretrained.safetensors")


def norm(path: Path) -> float:
    state = load_state_dict(path)
    return sum(float(((state[k].double() - pretrained[k].double()) ** 2).sum()) for k in state) ** 0.5


found = {}
for task in tasks:
    out = Path(f"/tmp/p27/m{multiple:g}/{task}.safetensors")
    meta = vision.finetune(params, task, "norm_mismatch", root, progress=False, out=out)
    standard = root / f"models/clip-small/seeds/0/finetuned/standard/{task}.safetensors"
    found[task] = {"val": meta["val_accuracy"], "std_val": json.loads(standard.with_suffix(".json").read_text())[
        "val_accuracy"], "norm_ratio": norm(out) / norm(standard)}
    print(multiple, task, found[task], flush=True)
Path(f"/tmp/p27/m{multiple:g}-{tasks[0]}.json").write_text(json.dumps(found, indent=1))
