"""Every merge method through the library's public path on ``device="cuda"`` against the same merge on the CPU (#17).

On synthetic ViT-B/32-shaped models (``mergecal perf``'s task vectors: low rank plus noise, K tasks), each method
of the registry at its default parameters runs ``merge_models(..., device=...)`` on the CPU and on the GPU; printed
per method: both times (the GPU's after one untimed warm-up merge, synchronised, and including the copy of
the merged state dict back to the CPU that ``merge_models`` returns) and the relative difference
||cuda - cpu||_F / ||cpu - theta_0||_F of the merged update over all keys. DARE draws its drop masks from a
generator seeded on the tensors' device (mergecal/methods/dare.py: the same merge on the same device type), so
its GPU merge drops other entries than its CPU merge: its row is printed and left out of the largest difference.
Needs a CUDA GPU; exits with one line otherwise. ``--device cpu`` runs both sides on the CPU: a check of the
script itself, which tests/test_scripts_smoke.py runs so that a change of the library that breaks it is seen.

    python scripts/check_cuda_merges.py [--blocks 2] [--tasks 8] [--device cuda]
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main(argv: list[str] | None = None) -> int:
    from mergecal.merge import merge_models
    from mergecal.methods import MERGE_METHODS
    from mergecal.perf.merging import synthetic_task_vectors, vit_b32_shapes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=2)
    parser.add_argument("--tasks", type=int, default=8)
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args(argv)
    on_cuda = args.device.startswith("cuda")
    if args.device != "cpu" and (not on_cuda or not torch.cuda.is_available()):
        raise SystemExit(f"--device {args.device}: expected cuda[:N] on a machine with a CUDA GPU "
                         f"(torch.cuda.is_available() is {torch.cuda.is_available()}), or cpu")

    def synchronize():
        if on_cuda:
            torch.cuda.synchronize(args.device)

    shapes = vit_b32_shapes(args.blocks)
    g = torch.Generator().manual_seed(1)
    pretrained = {k: 0.02 * torch.randn(s, generator=g) for k, s in shapes.items()}
    taus = synthetic_task_vectors(shapes, args.tasks)
    finetuned = [{k: pretrained[k] + tau[k] for k in pretrained} for tau in taus]
    print(f"ViT-B/32 shapes, {args.blocks} blocks, K = {args.tasks}, torch {torch.__version__}, "
          f"{torch.cuda.get_device_name(args.device) if on_cuda else 'cpu against cpu'}", flush=True)
    print(f"| method | cpu (s) | {args.device} (s) | rel. diff. of the merged update |\n|---|---:|---:|---:|")
    worst = 0.0
    for name in sorted(n for n, cls in MERGE_METHODS.items() if not cls.needs_data):  # AdaMerging needs data
        t0 = time.perf_counter()
        on_cpu = merge_models(pretrained, finetuned, name, device="cpu")
        cpu_s = time.perf_counter() - t0
        merge_models(pretrained, finetuned, name, device=args.device)  # warm-up: cuSOLVER / cuBLAS handles
        synchronize()
        t0 = time.perf_counter()
        on_gpu = merge_models(pretrained, finetuned, name, device=args.device)
        synchronize()
        gpu_s = time.perf_counter() - t0
        num = sum(float((on_gpu[k].double() - on_cpu[k].double()).norm() ** 2) for k in on_cpu) ** 0.5
        den = sum(float((on_cpu[k].double() - pretrained[k].double()).norm() ** 2) for k in on_cpu) ** 0.5
        if name != "dare":  # device-specific random masks (above)
            worst = max(worst, num / den)
        print(f"| {name} | {cpu_s:.2f} | {gpu_s:.3f} | {num / den:.1e} |", flush=True)
    print(f"largest difference (all but dare): {worst:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
