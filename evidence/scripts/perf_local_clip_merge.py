"""Memory of a ``local_clip`` cell's merge on ViT-B/32 shapes, beside a plain read of the same files.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/perf_local_clip_merge.py DIR RECIPE    # RECIPE: plain, ties, ...

Writes once into DIR a random open_clip ViT-B-32-quickgelu (full CLIP, safetensors) and K = 8 fine-tuned image
encoders (pretrained + 1e-3 noise, open_clip layout, 350 MB each). ``plain`` loads the 8 encoders whole (and
the model); a recipe runs what a cell does (``mergecal.pipeline.tracks.local_clip.cells``): build the one CLIP,
stream the merge key by key from the checkpoints into its image encoder. Prints seconds and the peak extra
anonymous memory (file-backed pages of the mmap'd checkpoints excluded: the kernel drops them at will).
Run each in a fresh process.
"""

import sys
import time
from pathlib import Path

import torch

from mergecal.backbones.open_clip_vit import create_clip, save_clip
from mergecal.checkpoint import load_state_dict, save_state_dict
from mergecal.perf.memory import peak_anonymous_memory
from mergecal.pipeline.tracks.local_clip.stages import build_model, finetuned_visual, load_visual, open_checkpoint, \
    pretrained_visual
from mergecal.merge import iter_weight_space
from mergecal.recipe import Recipe
from mergecal.task_vectors import TaskVectorSet

ARCH, K = "ViT-B-32-quickgelu", 8


def write(root: Path) -> None:
    model = create_clip(ARCH, seed=0)
    save_clip(model, root / "pre.safetensors")
    state = model.state_dict()
    for i in range(K):
        g = torch.Generator().manual_seed(i)
        save_state_dict({k: v + 1e-3 * torch.randn(v.shape, generator=g) for k, v in state.items()
                         if k.startswith("visual.")}, root / f"ft{i}.safetensors")


def main(root: Path, what: str) -> None:
    torch.set_num_threads(1)
    if not (root / f"ft{K - 1}.safetensors").exists():
        root.mkdir(parents=True, exist_ok=True)
        write(root)
        print("written; run again in a fresh process to measure")
        return
    start = time.perf_counter()
    with peak_anonymous_memory() as peak:
        pre = open_checkpoint(root / "pre.safetensors")
        model = build_model(ARCH, pre)
        if what == "plain":
            states = [{k: v.clone() for k, v in load_state_dict(root / f"ft{i}.safetensors").items()}
                      for i in range(K)]
            assert len(states) == K
        else:
            tvs = TaskVectorSet([finetuned_visual(pre, root / f"ft{i}.safetensors") for i in range(K)],
                                pretrained_visual(pre))
            load_visual(model, ((k, tvs.load_pretrained(k) + u) for k, u in iter_weight_space(Recipe.parse(what), tvs)))
    print(f"{what}: {time.perf_counter() - start:.1f} s, peak anonymous memory +{peak.extra_mb:.0f} MiB "
          f"(baseline {peak.baseline_mb:.0f} MiB)")


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2])
