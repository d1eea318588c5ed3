"""Which CPU kernel settings change a model's bits here, and what pinning them costs (#30, "across machines").

Each variant of the kernel environment (``mergecal.offline.KERNELS``: MKL's reproducibility branch ``MKL_CBWR``,
oneDNN's ``ONEDNN_MAX_CPU_ISA``, ATen's ``ATEN_CPU_CAPABILITY``) and of the thread count runs in a fresh process
(the libraries read these variables once, at load) and prints, for inputs that are the same on every machine
(seeded on the CPU):

* ``sgemm``: sha256 of float32 matrix products at the shapes of the vision backbone (MKL's sgemm);
* ``pretrain``: the first three losses, to every digit, of the pipeline's CLIP pretraining on seeded random images
  and captions (``mergecal.train.pretrain_clip``, the arch of params.yaml), and sha256 of the weights after them;
* ``mm_ms``: milliseconds per 2048 x 2048 x 2048 product (median of 5), the cost of a branch.

Two machines whose rows for the pinned default (``pinned``) are equal train the same bits (given the same
threads); the committed ``dvc.lock`` was built on AMD EPYC machines (docs/pipeline.md, "Across machines").

    python scripts/kernel_bits.py [--variants pinned,cbwr_auto,...] [--arch mergecal-vit-small-p8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys

from mergecal.offline import OFFLINE_ENV

CHILD = r"""
import hashlib, json, statistics, sys, time
import numpy as np, torch
from mergecal.train.pretrain_clip import PretrainConfig, pretrain_clip
arch, threads, timing = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
torch.set_num_threads(threads)

def digest(*tensors):
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]

g = torch.Generator().manual_seed(0)
shapes = [(128, 768, 768), (1024, 384, 1536), (4097, 64, 65)]  # attention/MLP-like and an odd, unaligned one
products = [torch.randn(m, k, generator=g) @ torch.randn(k, n, generator=g) for m, k, n in shapes]
rng = np.random.default_rng(0)
images = rng.integers(0, 256, size=(64, 32, 32, 3), dtype=np.uint8)
captions = [f"a photo of thing {i % 7} number {i}" for i in range(64)]
model, history = pretrain_clip(images, captions, PretrainConfig(arch=arch, steps=3, batch_size=32, warmup_steps=1),
                               progress=False)
a, b = torch.randn(2048, 2048, generator=g), torch.randn(2048, 2048, generator=g)
times = []
for _ in range(6 if timing else 0):
    start = time.perf_counter(); a @ b; times.append(time.perf_counter() - start)
mm_ms = 1000 * statistics.median(times[1:]) if timing else None
print(json.dumps({"sgemm": digest(*products), "losses": [repr(x) for x in history["loss"]],
                  "weights": digest(*model.state_dict().values()), "mm_ms": mm_ms}))
"""

PINNED = {name: OFFLINE_ENV[name] for name in ("MKL_CBWR", "ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
# name -> (changes to the pinned kernel environment, threads); None removes a variable (the library's own choice)
VARIANTS = {
    "pinned": ({}, 2),
    "threads_1": ({}, 1),
    "cbwr_auto": ({"MKL_CBWR": "AUTO"}, 2),
    "cbwr_unset": ({"MKL_CBWR": None}, 2),
    "cbwr_avx2_strict": ({"MKL_CBWR": "AVX2,STRICT"}, 2),
    "cbwr_compatible": ({"MKL_CBWR": "COMPATIBLE"}, 2),
    "aten_default": ({"ATEN_CPU_CAPABILITY": "default"}, 2),
    "onednn_unset": ({"ONEDNN_MAX_CPU_ISA": None}, 2),
}


def run_variant(changes: dict, threads: int, arch: str, *, timing: bool = True) -> dict:
    env = {**os.environ, **PINNED}
    for name, value in changes.items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    out = subprocess.run([sys.executable, "-c", CHILD, arch, str(threads), str(int(timing))], env=env,
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "unknown"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, of: " + ", ".join(VARIANTS))
    parser.add_argument("--arch", default="mergecal-vit-small-p8")
    args = parser.parse_args()
    names = args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    print(f"# {cpu_name()}; pinned: {PINNED}")
    rows = {name: run_variant(*VARIANTS[name], args.arch) for name in names}
    base = rows.get("pinned")
    print("| variant | sgemm | first losses | weights after 3 steps | 2048^3 mm ms | x pinned |")
    print("|---|---|---|---|---:|---:|")
    for name, row in rows.items():
        same = "" if base is None else (" (= pinned)" if row["weights"] == base["weights"] else " (differs)")
        ratio = "" if base is None else f"{row['mm_ms'] / base['mm_ms']:.2f}"
        print(f"| {name} | {row['sgemm']} | {', '.join(row['losses'])} | {row['weights']}{same} | "
              f"{row['mm_ms']:.1f} | {ratio} |")


if __name__ == "__main__":
    main()
