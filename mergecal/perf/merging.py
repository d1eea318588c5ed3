"""Benchmark every merge method on ViT-B/32-shaped task vectors.

12 blocks x {attn.in_proj_weight 2304x768, attn.out_proj.weight 768x768, mlp.c_fc.weight 3072x768,
mlp.c_proj.weight 768x3072} plus their 1-D biases and LayerNorm parameters, K = 8 tasks. Each task
matrix is low rank plus noise (a decaying spectrum over 32 directions and 5% isotropic noise), like
real task vectors. The merge streams key by key; each merged key is consumed and dropped, so the
memory column is the method's working memory above the task vectors already in memory.

A second table times TSV-M, Iso-C, Iso-CTS and SVC (after TA)'s default exact Gram route against their previous full-SVD
route (``solver="svd"``), alternated key by key in the same run, with the largest relative difference and the
machine's measured matmul GFLOP/s (``--no-solvers`` skips it). A FLOP-floor table then gives, per SVD-bound
method (TSV-M, Iso-C, Iso-CTS, and SVC after TA with ``--calibrations``), its time as a multiple of its FLOP floor
(``flop_floor``) at the matmul rate measured before and after the timings in the same run. ``--shapes vit-l-14``
uses ViT-L/14's 24 blocks of width 1024 (TSV-M and SVC only by default; ``--blocks`` takes a subset).

Printed per method: seconds, ratio to task arithmetic (same process, same data), peak extra memory.
With ``--calibrations``, a second table times the weight-space calibrations (SVC, WSC) applied to the
task-arithmetic merge (lambda = 1), excluding the merge itself. With ``--streaming``, a third merges K + 1
sharded safetensors checkpoints from disk into a sharded output with ``merge_checkpoints`` and reports
peak anonymous memory against the total size of the inputs.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from ..merge import iter_merge
from ..methods import get_merge_method
from ..task_vectors import TaskVectorSet
from .memory import peak_memory

WIDTH = 768

# (label, method name, params): every method at its defaults, plus the variants worth comparing
VARIANTS: list[tuple[str, str, dict]] = [
    ("weight_averaging", "weight_averaging", {}),
    ("task_arithmetic", "task_arithmetic", {}),
    ("ties (global trim)", "ties", {}),
    ("ties (per-tensor trim)", "ties", {"trim_scope": "per_tensor"}),
    ("dare (on TA)", "dare", {}),
    ("dare (on TIES)", "dare", {"base": "ties"}),
    ("consensus", "consensus", {}),
    ("tsv_m", "tsv_m", {}),
    ("iso_c", "iso_c", {}),
    ("iso_cts", "iso_cts", {}),
]


#: --shapes: (blocks, width, --only default). Both are CLIP ViT blocks (in_proj 3w x w, out_proj w x w, c_fc 4w x w,
#: c_proj w x 4w); on ViT-L/14 only TSV-M and SVC (the issue's acceptance) unless --only says otherwise.
SHAPE_SETS: dict[str, tuple[int, int, list[str] | None]] = {
    "vit-b-32": (12, 768, None),
    "vit-l-14": (24, 1024, ["tsv_m", "svc (alpha=1/K)"]),
}


def vit_b32_shapes(blocks: int, width: int = WIDTH) -> dict[str, tuple[int, ...]]:
    shapes = {}
    for b in range(blocks):
        p = f"visual.transformer.resblocks.{b}."
        shapes.update({
            p + "ln_1.weight": (width,), p + "ln_1.bias": (width,),
            p + "attn.in_proj_weight": (3 * width, width), p + "attn.in_proj_bias": (3 * width,),
            p + "attn.out_proj.weight": (width, width), p + "attn.out_proj.bias": (width,),
            p + "ln_2.weight": (width,), p + "ln_2.bias": (width,),
            p + "mlp.c_fc.weight": (4 * width, width), p + "mlp.c_fc.bias": (4 * width,),
            p + "mlp.c_proj.weight": (width, 4 * width), p + "mlp.c_proj.bias": (width,),
        })
    return shapes


def synthetic_task_vectors(shapes: dict[str, tuple[int, ...]], K: int, seed: int = 0, rank: int = 32,
                           noise: float = 0.05) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    decay = torch.linspace(1.0, 0.05, rank)
    task_vectors = []
    for _ in range(K):
        tau = {}
        for key, shape in shapes.items():
            if len(shape) == 2:
                m, n = shape
                U = torch.randn(m, rank, generator=g) * decay
                low_rank = U @ torch.randn(rank, n, generator=g) / (rank * n) ** 0.5
                tau[key] = 1e-3 * (low_rank + noise * torch.randn(m, n, generator=g) / n**0.5)
            else:
                tau[key] = 1e-4 * torch.randn(shape, generator=g)
        task_vectors.append(tau)
    return task_vectors


CALIBRATIONS: list[tuple[str, str, dict]] = [
    ("svc (alpha=1/K)", "svc", {}),
    ("svc (alpha=1, float64)", "svc", {"alpha": 1.0, "float64": True}),
    ("svc (every 2-D key + 1-D form)", "svc", {"key_rule": "matrices", "calibrate_vectors": True}),
    ("wsc (authors' projection)", "wsc", {}),
    ("wsc (least squares)", "wsc", {"projection": "least_squares"}),
]


def run_calibration(tvs: TaskVectorSet, merged: dict, name: str, params: dict) -> dict:
    from ..calibrations.base import iter_calibrated
    from ..calibrations.registry import get_calibration
    from ..methods.base import build_params

    spec = get_calibration(name)  # a weight-space calibration: data-free, key by key
    calibration = spec.build(build_params(spec.Params, name, params))
    checksum = 0.0
    with peak_memory() as mem:
        start = time.perf_counter()
        for _, update in iter_calibrated(merged.items(), tvs, [calibration]):
            checksum += float(update.norm()) ** 2
        seconds = time.perf_counter() - start
    return {"method": calibration.id, "seconds": seconds, "peak_extra_mb": mem.extra_mb, "memory_probe": mem.method,
            "merged_norm": checksum**0.5}


STREAMING = [("task_arithmetic", {}), ("ties (global trim)", {"trim_scope": "global"}), ("tsv_m", {})]


def run_streaming(task_vectors: list[dict], workdir: Path, shard_mb: int = 64) -> list[dict]:
    """Write theta_0 and K fine-tuned checkpoints as sharded safetensors, then merge from disk."""
    from ..checkpoint import save_checkpoint
    from ..merge import merge_checkpoints
    from .memory import peak_anonymous_memory

    g = torch.Generator().manual_seed(1)
    pretrained = {k: 0.02 * torch.randn(v.shape, generator=g) for k, v in task_vectors[0].items()}
    shard = shard_mb * 2**20
    pre_dir = save_checkpoint(pretrained, workdir / "pretrained", max_shard_bytes=shard)
    ft_dirs = [save_checkpoint({k: pretrained[k] + tau[k] for k in tau}, workdir / f"finetuned_{t}",
                               max_shard_bytes=shard)
               for t, tau in enumerate(task_vectors)]
    input_mb = (len(task_vectors) + 1) * sum(v.numel() * 4 for v in pretrained.values()) / 2**20
    del pretrained
    rows = []
    for label, params in STREAMING:
        name = label.split(" ")[0]
        with peak_anonymous_memory() as mem:
            start = time.perf_counter()
            merge_checkpoints(pre_dir, ft_dirs, name, workdir / "merged", max_shard_bytes=shard, **params)
            seconds = time.perf_counter() - start
        rows.append({"label": f"{label} from disk", "method": label, "seconds": seconds, "peak_extra_mb": mem.extra_mb,
                     "memory_probe": mem.method, "input_mb": input_mb})
        print(f"  {label + ' from disk':32s} {seconds:8.2f} s  peak +{mem.extra_mb:7.0f} MiB anonymous "
              f"(inputs {input_mb:.0f} MiB)", flush=True)
    return rows


SOLVER_METHODS = ["tsv_m", "iso_c", "iso_cts", "svc"]


def matmul_gflops(n: int = 1024, dtype: torch.dtype = torch.float32, repeats: int = 5, device: str = "cpu") -> float:
    """Measured matmul throughput (median of ``repeats`` n x n products after a warm-up; on a GPU each product
    synchronised inside its timing), for reading the timings."""
    import statistics

    def sync():
        if device != "cpu":
            torch.cuda.synchronize(device)

    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    a @ b
    sync()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        a @ b
        sync()
        times.append(time.perf_counter() - start)
    return 2 * n**3 / statistics.median(times) / 1e9


def flop_floor(method: str, shape: tuple[int, int], K: int, common_space_fraction: float = 0.8) -> float:
    """The FLOP floor of one 2-D key of ``shape`` = (m, n) for ``method`` with K tasks: the dense products that
    an exact route computing every kept singular direction cannot skip, each counted at its BLAS cost, and
    nothing else (no eigendecomposition, QR, polar factor or reconstruction). With M = max(m, n) and
    r = min(m, n), a Gram product A^T A (or A A^T) of an m x n matrix costs M r^2 flops (syrk):

    * ``tsv_m``: K Gram products, one per task (each task's top floor(r/K) subspace is read from it):
      K M r^2;
    * ``iso_c``: the Gram product of the task-vector sum, plus the output, the sum times an r x r matrix
      (U V^T = A (A^T A)^{-1/2}): M r^2 + 2 m n r;
    * ``iso_cts``: the Gram product of the sum, plus each task projected on the (r - k_c)-dimensional
      complement of the common space (where its residual's kept directions lie): M r^2 + K 2 m n (r - k_c);
    * ``svc``: the K projections U^T dW_i of the task matrices on the merged update's r left singular vectors,
      K 2 m n r (the issue's "about 1 TFLOP" on ViT-B/32).

    ``perf`` divides it by the measured matmul rate of the precision the default route computes in (float64
    for the Gram route of the first three, float32 for SVC) to get the floor's seconds; a method's time over
    that is its FLOP-floor multiple (1 would mean nothing but these products, at full matmul speed)."""
    m, n = shape
    M, r = max(m, n), min(m, n)
    if method == "tsv_m":
        return K * M * r**2
    if method == "iso_c":
        return M * r**2 + 2 * m * n * r
    if method == "iso_cts":
        from ..methods.iso_cts import iso_cts_ranks

        common_rank, _ = iso_cts_ranks(r, K, common_space_fraction)
        return M * r**2 + K * 2 * m * n * (r - common_rank)
    if method == "svc":
        return K * 2 * m * n * r
    raise ValueError(f"no FLOP floor defined for {method!r}")


#: the precision each method's default route computes its floor products in (see ``flop_floor``)
FLOOR_DTYPE = {"tsv_m": "float64", "iso_c": "float64", "iso_cts": "float64", "svc": "float32"}


def floor_rows(times: dict[str, float], shapes: list[tuple[int, int]], K: int, gflops: dict[str, float]) -> list[dict]:
    """Per method timed in ``times`` (seconds over the 2-D keys of ``shapes``): its FLOP floor and multiple."""
    rows = []
    for method, seconds in times.items():
        flops = sum(flop_floor(method, s, K) for s in shapes)
        dtype = FLOOR_DTYPE[method]
        floor_seconds = flops / (gflops[dtype] * 1e9)
        rows.append({"label": f"{method} (FLOP floor)", "method": method, "seconds": seconds,
                     "floor_gflop": flops / 1e9, "floor_dtype": dtype, "gflops": gflops[dtype],
                     "floor_seconds": floor_seconds, "floor_multiple": seconds / floor_seconds, "peak_extra_mb": None})
    return rows


def format_floor_table(rows: list[dict], setting: str, gflops_runs: list[dict]) -> str:
    measured = "; ".join(f"{g['float32']:.0f} / {g['float64']:.0f}" for g in gflops_runs)
    lines = [f"FLOP-floor multiples (mergecal.perf.merging.flop_floor): {setting}; matmul GFLOP/s float32 / float64 "
             f"measured {measured} (before / after the timings; the floor uses the faster)", "",
             "| method | seconds | floor GFLOP | at | floor seconds | multiple of the floor |",
             "|---|---:|---:|---|---:|---:|"]
    lines += [f"| {r['method']} | {r['seconds']:.2f} | {r['floor_gflop']:.3g} | {r['floor_dtype']} "
              f"{r['gflops']:.0f} GFLOP/s | {r['floor_seconds']:.3g} | {r['floor_multiple']:.1f} |" for r in rows]
    return "\n".join(lines)


def measure_gflops(device: str = "cpu") -> dict[str, float]:
    """float32 and float64 matmul GFLOP/s on ``device`` (1024² products on the CPU, 4096² on a GPU, whose
    smaller products are launch-bound)."""
    n = 1024 if device == "cpu" else 4096
    gflops = {name: matmul_gflops(n, dtype, device=device)
              for name, dtype in (("float32", torch.float32), ("float64", torch.float64))}
    where = "" if device == "cpu" else f" on {device}"
    print(f"  matmul{where}: {gflops['float32']:.1f} GFLOP/s float32, {gflops['float64']:.1f} GFLOP/s float64",
          flush=True)
    return gflops


def svc_after_ta(taus: list[torch.Tensor], solver: str = "gram", backend: str = "auto") -> torch.Tensor:
    """SVC at its defaults (alpha = 1/K) after task arithmetic with lambda = 1 (the merged update is the sum): what
    ``Svc.calibrate`` computes on a 2-D key, with the Gram route's backend selectable."""
    from ..calibrations.svc import svc_coefficients
    from ..methods.base import sum_of

    c = svc_coefficients(sum_of(taus), taus, 1.0 / len(taus), solver=solver, backend=backend)
    return (c["U"] * (c["gamma"] * c["sigma"])) @ c["Vh"]


#: the routes of one SVD method compared key by key: (solver, backend); "cuda" only where a GPU is present
ROUTES = {"svd": ("svd", "auto"), "gram": ("gram", "numpy"), "torch": ("gram", "torch"), "cuda": ("gram", "auto")}


def _timed(fn, taus: list[torch.Tensor], solver: str, backend: str, sync: bool) -> tuple[torch.Tensor | None, float]:
    start = time.perf_counter()
    out = fn(taus, solver=solver, backend=backend)
    if sync:
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


def run_solver_comparison(task_vectors: list[dict], methods: list[str] = SOLVER_METHODS,
                          cuda: bool | None = None) -> list[dict]:
    """Per SVD method, the default ``solver="gram"`` (numpy/scipy backend on the CPU) against the previous exact
    route ``solver="svd"`` and against the Gram route's torch-only backend (``backend="torch"``, what runs on a
    GPU) on the CPU, on the same 2-D keys, the order rotating every key in one process, so machine load hits all
    alike. Where ``torch.cuda.is_available()`` (or ``cuda=True``), the Gram route also runs on the GPU (the key's
    task matrices copied there first, outside the timing; one untimed warm-up call per method; synchronised).
    Reports summed seconds, the ratios, the median of per-key ratios and the largest per-key relative difference
    ||x - ref||_F / ||ref||_F: gram against svd (mostly the float32 SVD route's own error: on these task vectors it
    sits 1e-5 to 1e-3 from a float64 SVD where the Gram route sits ~5e-7; see tests/test_gram_solver.py), torch
    and cuda against gram (the same float64 algorithm: float32 output rounding)."""
    import statistics

    from ..methods.iso_c import iso_c_matrix
    from ..methods.iso_cts import iso_cts_matrix
    from ..methods.tsv_m import tsv_merge_matrix

    if cuda is None:
        cuda = torch.cuda.is_available()
    if not cuda:
        print("  cuda route skipped: torch.cuda.is_available() is False", flush=True)
    fns = {"tsv_m": tsv_merge_matrix, "iso_c": iso_c_matrix,
           "iso_cts": lambda taus, **kw: iso_cts_matrix(taus, 0.8, **kw), "svc": svc_after_ta}
    routes = [r for r in ROUTES if r != "cuda" or cuda]
    keys = [k for k, v in task_vectors[0].items() if v.dim() == 2]
    rows = []
    for name in methods:
        seconds = dict.fromkeys(routes, 0.0)
        ratios = {r: [] for r in routes if r != "gram"}
        diffs = {r: [] for r in routes if r != "gram"}
        if cuda and keys:  # cuSOLVER / cuBLAS initialisation stays out of the timings
            fns[name]([tv[keys[0]].cuda() for tv in task_vectors], solver="gram")
        for i, key in enumerate(keys):
            taus = [tv[key] for tv in task_vectors]
            on_gpu = [t.cuda() for t in taus] if cuda else None
            out, times = {}, {}
            for route in routes[i % len(routes):] + routes[:i % len(routes)]:
                solver, backend = ROUTES[route]
                out[route], times[route] = _timed(fns[name], on_gpu if route == "cuda" else taus, solver, backend,
                                                  sync=route == "cuda")
                seconds[route] += times[route]
            if out["svd"] is None:
                continue
            for route in ratios:
                ratios[route].append(times[route] / times["gram"])  # svd: the gram route's speed-up
                x, ref = (out["gram"], out["svd"]) if route == "svd" else (out[route].cpu(), out["gram"])
                diffs[route].append((float((x.double() - ref.double()).norm() / ref.double().norm()), key))
        row = {"label": name, "svd_seconds": seconds["svd"], "gram_seconds": seconds["gram"],
               "speedup": seconds["svd"] / seconds["gram"],
               "median_key_speedup": statistics.median(ratios["svd"]),
               "max_rel_diff": max(diffs["svd"])[0], "max_rel_diff_key": max(diffs["svd"])[1],
               "keys": len(ratios["svd"])}
        for route in [r for r in ("torch", "cuda") if r in routes]:
            row.update({f"{route}_seconds": seconds[route], f"{route}_over_gram": seconds[route] / seconds["gram"],
                        f"{route}_median_key_over_gram": statistics.median(ratios[route]),
                        f"{route}_max_rel_diff": max(diffs[route])[0]})
        rows.append(row)
        extra = "".join(f"  {route} {row[route + '_seconds']:8.2f} s (x{row[route + '_over_gram']:.2f} of gram, "
                        f"max rel diff {row[route + '_max_rel_diff']:.1e})" for route in ("torch", "cuda")
                        if route in routes)
        print(f"  {name:8s} svd {row['svd_seconds']:8.2f} s  gram {row['gram_seconds']:8.2f} s  "
              f"x{row['speedup']:.2f} (median per key x{row['median_key_speedup']:.2f})  "
              f"max rel diff {row['max_rel_diff']:.1e} ({row['max_rel_diff_key']}){extra}", flush=True)
    return rows


def format_solver_table(rows: list[dict], setting: str, gflops: dict) -> str:
    cuda = any("cuda_seconds" in r for r in rows)
    lines = [f"SVD methods, exact Gram route (default; numpy/scipy on the CPU) against the full-SVD route "
             f"(solver='svd') and the Gram route's torch-only backend (backend='torch', what a GPU runs) on the CPU"
             f"{' and on CUDA' if cuda else ''}, rotated key by key: {setting}; matmul {gflops['float32']:.0f} "
             f"GFLOP/s float32, {gflops['float64']:.0f} GFLOP/s float64 (1024^3)", "",
             "| method | svd route (s) | gram route (s) | speed-up | median per-key speed-up | max rel. difference "
             "| torch backend (s) | torch / gram time | torch vs gram max rel. diff." + (
                 " | cuda (s) | cuda / gram time | cuda vs gram max rel. diff. |" if cuda else " |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|" + ("---:|---:|---:|" if cuda else "")]
    for r in rows:
        line = (f"| {r['label']} | {r['svd_seconds']:.2f} | {r['gram_seconds']:.2f} | {r['speedup']:.2f} | "
                f"{r['median_key_speedup']:.2f} | {r['max_rel_diff']:.1e} | {r['torch_seconds']:.2f} | "
                f"{r['torch_over_gram']:.2f} | {r['torch_max_rel_diff']:.1e} |")
        if cuda:
            line += f" {r['cuda_seconds']:.3f} | {r['cuda_over_gram']:.3f} | {r['cuda_max_rel_diff']:.1e} |"
        lines.append(line)
    return "\n".join(lines)


def run_one(tvs: TaskVectorSet, name: str, params: dict) -> dict:
    method = get_merge_method(name, **params)
    checksum = 0.0
    with peak_memory() as mem:
        start = time.perf_counter()
        for _, merged in iter_merge(tvs, method):
            checksum += float(merged.norm()) ** 2
        seconds = time.perf_counter() - start
    return {"method": method.id, "seconds": seconds, "peak_extra_mb": mem.extra_mb, "memory_probe": mem.method,
            "merged_norm": checksum**0.5}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="vit-b-32",
                        help="vit-b-32 (default: 12 blocks, width 768, every method) or vit-l-14 (24 blocks, width "
                             "1024: 3072x1024, 1024x1024, 4096x1024, 1024x4096; only TSV-M and SVC unless --only)")
    parser.add_argument("--blocks", type=int, default=None, help="transformer blocks (default: the shapes' own, "
                                                                 "ViT-B/32 12, ViT-L/14 24; fewer for a subset)")
    parser.add_argument("--tasks", type=int, default=8, help="K, the number of task vectors (default 8)")
    parser.add_argument("--width", type=int, default=None, help="model width (default: the shapes' own, 768 / 1024)")
    parser.add_argument("--quick", action="store_true", help="a small setting for smoke tests: 2 blocks, width 96, K=4")
    parser.add_argument("--only", nargs="*", help="run only these variant labels (substring match)")
    parser.add_argument("--output", help="also write the table as Markdown here and a .json beside it")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch threads, and numpy/scipy BLAS threads through threadpoolctl (default: theirs)")
    parser.add_argument("--calibrations", action="store_true", help="also time SVC and WSC after task arithmetic")
    parser.add_argument("--no-merges", action="store_true", help="skip the merge-method table")
    parser.add_argument("--no-solvers", action="store_true",
                        help="skip the table of the SVD methods' Gram route against their full-SVD route")
    parser.add_argument("--models", action="store_true",
                        help="also time FSC estimation and DisTaC steps on an open_clip ViT-B/32 (random init)")
    parser.add_argument("--streaming", action="store_true",
                        help="also merge sharded checkpoints from disk and report peak memory against input size")


def format_table(rows: list[dict], header: str, what: str = "method", base_label: str = "task_arithmetic") -> str:
    base = next((r["seconds"] for r in rows if r["label"] == base_label), None)
    lines = [header, "", f"| {what} | seconds | x {base_label} | peak extra memory (MiB) |", "|---|---:|---:|---:|"]
    for r in rows:
        ratio = f"{r['seconds'] / base:.1f}" if base else "-"
        lines.append(f"| {r['label']} | {r['seconds']:.2f} | {ratio} | {r['peak_extra_mb']:.0f} |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    blocks, width, only = SHAPE_SETS[args.shapes]
    args.blocks = args.blocks or blocks
    args.width = args.width or width
    args.only = args.only if args.only is not None else only
    if args.quick:
        args.blocks, args.width, args.tasks = 2, 96, 4
    if args.threads:
        import scipy.linalg  # noqa: F401  (loads scipy's own OpenBLAS now, so that the limit below reaches it)

        torch.set_num_threads(args.threads)
        try:  # the Gram route's syrk and eigh run in numpy / scipy's OpenBLAS, which torch's setting misses
            from threadpoolctl import threadpool_limits

            threadpool_limits(args.threads)
        except ImportError:
            print("threadpoolctl missing: set OPENBLAS_NUM_THREADS too for a like-for-like thread count")
    shapes = vit_b32_shapes(args.blocks, args.width)
    n_params = sum(torch.Size(s).numel() for s in shapes.values())
    start = time.perf_counter()
    task_vectors = synthetic_task_vectors(shapes, args.tasks)
    tvs = TaskVectorSet.from_task_vectors(task_vectors)
    print(f"built {args.tasks} task vectors x {n_params / 1e6:.1f} M parameters in {time.perf_counter() - start:.1f} s",
          flush=True)
    run_one(tvs, "task_arithmetic", {})  # warm-up: the first pass pays the allocator's page faults
    gflops_runs = [measure_gflops()]
    rows = []
    for label, name, params in [] if args.no_merges else VARIANTS:
        if args.only and not any(o in label for o in args.only):
            continue
        row = {"label": label, **run_one(tvs, name, params)}
        rows.append(row)
        print(f"  {label:32s} {row['seconds']:8.2f} s  peak +{row['peak_extra_mb']:7.0f} MiB", flush=True)
    setting = (f"{args.blocks} blocks x width {args.width} ({n_params / 1e6:.1f} M params per task vector), "
               f"K = {args.tasks}, {torch.get_num_threads()} torch threads, "
               f"{platform.processor() or platform.machine()}, torch {torch.__version__}")
    tables = [format_table(rows, f"Merge benchmark: {setting}")] if rows else []
    floor_times = {r["label"]: r["seconds"] for r in rows if r["label"] in FLOOR_DTYPE}  # whole merges, 1-D keys too
    if not args.no_solvers:
        methods = [m for m in SOLVER_METHODS if not args.only or any(o in m for o in args.only)]
        solver_rows = run_solver_comparison(task_vectors, methods)
        for r in solver_rows:
            rows.append({**r, "label": f"{r['label']} (gram vs svd)", "seconds": r["gram_seconds"],
                         "peak_extra_mb": None})
            floor_times[r["label"]] = r["gram_seconds"]  # the default route on the 2-D keys alone (SVC: no merge)
        tables.append(format_solver_table(solver_rows, setting, gflops_runs[0]))
    if args.calibrations:
        merged = {k: v.clone() for k, v in iter_merge(tvs, get_merge_method("task_arithmetic", scaling=1.0))}
        calibration_rows = []
        for label, name, params in CALIBRATIONS:
            if args.only and not any(o in label for o in args.only):
                continue
            row = {"label": label, **run_calibration(tvs, merged, name, params)}
            calibration_rows.append(row)
            if label == CALIBRATIONS[0][0]:  # SVC at its defaults
                floor_times["svc"] = row["seconds"]
            rows.append(row)
            print(f"  {label:32s} {row['seconds']:8.2f} s  peak +{row['peak_extra_mb']:7.0f} MiB", flush=True)
        tables.append(format_table(calibration_rows,
                                   f"Calibration benchmark (after task arithmetic, lambda = 1): {setting}",
                                   what="calibration", base_label=CALIBRATIONS[0][0]))
    if floor_times:
        gflops_runs.append(measure_gflops())
        gflops = {d: max(g[d] for g in gflops_runs) for d in ("float32", "float64")}
        matrix_shapes = [s for s in shapes.values() if len(s) == 2]
        flop_rows = floor_rows(floor_times, matrix_shapes, args.tasks, gflops)
        for r in flop_rows:
            print(f"  {r['method']:8s} {r['seconds']:8.2f} s = {r['floor_multiple']:5.1f} x its FLOP floor "
                  f"({r['floor_gflop']:.3g} GFLOP at {r['gflops']:.0f} GFLOP/s {r['floor_dtype']})", flush=True)
        rows.extend(flop_rows)
        tables.append(format_floor_table(flop_rows, setting, gflops_runs))
    if args.streaming:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="mergecal-perf-") as tmp:
            streaming_rows = run_streaming(task_vectors, Path(tmp))
        rows.extend(streaming_rows)
        lines = [f"Streaming merge from sharded safetensors on disk (64 MiB shards): {setting}", "",
                 "| method | seconds | peak extra anonymous memory (MiB) | inputs on disk (MiB) |",
                 "|---|---:|---:|---:|"]
        lines += [f"| {r['method']} | {r['seconds']:.2f} | {r['peak_extra_mb']:.0f} | {r['input_mb']:.0f} |"
                  for r in streaming_rows]
        tables.append("\n".join(lines))
    if args.models:
        from .models import TINY_NAME
        from .models import main as bench_models

        del tvs, task_vectors  # free the task vectors before building models
        model_rows, model_table = bench_models(TINY_NAME if args.quick else "ViT-B-32", K=args.tasks,
                                               distac_batch=4 if args.quick else 32)
        rows.extend(model_rows)
        tables.append(model_table)
    table = "\n\n".join(tables)
    print()
    print(table)
    if args.output:
        out = Path(args.output)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(table + "\n")
        out.with_suffix(".json").write_text(json.dumps({"setting": vars(args), "rows": rows}, indent=2, default=str))
        print(f"\nwritten to {out}")
    return 0
