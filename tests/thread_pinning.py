"""A stage script as stages/finetune.py starts (``run(stage, threads=True)``), whose stage is a few smoke-size steps
of the fine-tuning function the finetune stage runs, on a seeded micro CLIP and seeded images (no files to build
first). It prints the thread count torch trains with and the fine-tuned state dict's sha256: used by
tests/test_threads.py, which starts it with several default thread counts."""

from __future__ import annotations

import hashlib
import sys


def finetune_digest(params) -> str:
    """sha256 of the state dict that ``params.vision.finetune`` steps give from a seeded ``params.vision.arch``."""
    import numpy as np
    import torch

    from mergecal.backbones.open_clip_vit import create_clip
    from mergecal.train.finetune import FinetuneConfig, finetune

    rng = np.random.default_rng(0)
    images, labels = rng.integers(0, 256, (64, 32, 32, 3), dtype=np.uint8), rng.integers(0, 4, 64)
    model = create_clip(params.vision.arch, seed=params.seed)
    head = torch.nn.functional.normalize(torch.randn(model.text_projection.shape[1], 4,
                                                     generator=torch.Generator().manual_seed(0)), dim=0)
    config = FinetuneConfig(**{"seed": params.seed, **params.vision.finetune})
    state, _ = finetune(model, head, images, labels, config, progress=False)
    digest = hashlib.sha256()
    for key in sorted(state):
        digest.update(key.encode())
        digest.update(state[key].numpy().tobytes())
    return digest.hexdigest()


def stage(params, root, args) -> None:
    import torch

    print(torch.get_num_threads(), finetune_digest(params))


if __name__ == "__main__":
    from stages._common import run

    raise SystemExit(run(stage, ["--root", sys.argv[1]], threads=True))
