"""Our TSV-M, Iso-C, Iso-CTS and SVC (after TA) against FusionBench 0.2.33's and the float64 reference (#17).

On the 2-D keys of ``mergecal perf``'s synthetic task vectors (ViT-B/32 or ViT-L/14 shapes, K tasks), per key and
method: our default route and FusionBench's function of the same method run ``--repeats`` times each, alternated
(the order flips every repetition and every key), and the median per implementation is kept; the float64 numpy
reference (tests/crosscheck/reference_merging.py, the test suite's oracle) runs once, untimed. Printed per method:
our seconds and FusionBench's (sums of per-key medians), the ratio theirs / ours (> 1: ours is faster) and its
median over keys, the largest relative difference ||x - ref||_F / ||ref||_F of each to the reference, and each
time as a multiple of the method's FLOP floor (``mergecal.perf.merging.flop_floor``) at the matmul GFLOP/s
measured in the same run (before and after; the faster). The load average is recorded before and after each
method: another job on the machine slows both sides, so read the ratios, not the seconds (though not always alike:
with 2 threads on a loaded machine our numpy/scipy OpenBLAS route slowed far more than FusionBench's torch SVDs;
docs/performance.md, 2026-11-25). Per-key times are printed as they come.

FusionBench is not a dependency. ``--fusion-bench`` takes its wheel (``pip download --no-deps fusion-bench==0.2.33``)
or the wheel's unpacked folder; only the four source files with these functions are loaded (its package
``__init__`` pulls in lightning, hydra and more), with two small stand-ins for the helpers they import
(``fusion_bench.utils.timeit_context``, ``fusion_bench.utils.type.StateDictType``):
``task_singular_vector/utils/TSVM_utils.py::compute_and_sum_svd_mem_reduction`` (TSV-M),
``isotropic_merging/iso_utils.py::iso_c`` and ``iso_cts`` (common_space_fraction 0.8, as ours), and
``singular_value_calibration/utils.py::subspace_consistency_spectral_calibration_accelerated`` (SVC; FusionBench's
default implementation, which computes in float64; base weights zero, merged = the task-vector sum, alpha = 1/K).
Without ``--fusion-bench`` those columns are skipped (one line says so).

``--device cuda`` times both on the GPU: the task matrices are copied there outside the timing, FusionBench's
functions get ``accelerator="cuda"``, ours take the torch route they take off the CPU (mergecal.linalg), every call
ends with ``torch.cuda.synchronize()`` inside its timing, and one untimed call of each on the first key comes first
(cuSOLVER / cuBLAS initialisation). The FLOP floors are then read at the GPU's measured matmul GFLOP/s. The float64
oracle stays numpy on the CPU; ``--reference-keys N`` runs it on the first N keys only (it dominates the run time),
and the difference columns are then the largest over those keys.

This is a script, not a ``mergecal perf`` option: it needs the test suite's reference module and an outside wheel,
and ``mergecal/`` stays untouched (the benchmark stage depends on all of it).

    python scripts/perf_fusionbench.py [--fusion-bench WHEEL_OR_DIR] [--shapes vit-b-32|vit-l-14] [--blocks N]
                                       [--methods tsv_m iso_c iso_cts svc] [--repeats 3] [--threads 2]
                                       [--device cpu|cuda] [--reference-keys N] [--output FILE.md]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import importlib.util
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import types
import zipfile
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["tsv_m", "iso_c", "iso_cts", "svc"]
COMMON_SPACE_FRACTION = 0.8  # Iso-CTS, ours and theirs

#: FusionBench source files (under fusion_bench/method/) and the function taken from each, per method
FB_SOURCES = {
    "tsv_m": ("task_singular_vector/utils/TSVM_utils.py", "compute_and_sum_svd_mem_reduction"),
    "iso_c": ("isotropic_merging/iso_utils.py", "iso_c"),
    "iso_cts": ("isotropic_merging/iso_utils.py", "iso_cts"),
    "svc": ("singular_value_calibration/utils.py", "subspace_consistency_spectral_calibration_accelerated"),
}


def _fusion_bench_root(path: Path) -> Path:
    """The folder holding ``fusion_bench/`` (the wheel unpacked into a temporary folder if a .whl is given)."""
    if path.is_file() and path.suffix == ".whl":
        tmp = Path(tempfile.mkdtemp(prefix="fusion-bench-"))
        atexit.register(shutil.rmtree, tmp, ignore_errors=True)
        with zipfile.ZipFile(path) as whl:
            whl.extractall(tmp, [n for n in whl.namelist() if n.startswith("fusion_bench/method/")])
        return tmp
    if path.is_dir():
        return path
    raise SystemExit(f"--fusion-bench {path}: expected a fusion_bench wheel (.whl) or its unpacked folder")


def load_fusion_bench(path: str | Path,
                      accelerator: str = "cpu") -> dict[str, Callable[[list[torch.Tensor]], torch.Tensor]]:
    """Per method, FusionBench's function wrapped to take one key's K task matrices and return the merged matrix,
    computed on ``accelerator`` (their functions' own argument)."""
    method_dir = _fusion_bench_root(Path(path)) / "fusion_bench" / "method"
    stubs = {"fusion_bench": types.ModuleType("fusion_bench"),
             "fusion_bench.utils": types.ModuleType("fusion_bench.utils"),
             "fusion_bench.utils.type": types.ModuleType("fusion_bench.utils.type")}
    stubs["fusion_bench.utils"].timeit_context = lambda *a, **k: contextlib.nullcontext()
    stubs["fusion_bench.utils.type"].StateDictType = dict
    saved = {name: sys.modules.get(name) for name in stubs}
    sys.modules.update(stubs)
    modules = {}
    try:
        for rel, _ in FB_SOURCES.values():
            if rel not in modules:
                file = method_dir / rel
                if not file.is_file():
                    raise SystemExit(f"--fusion-bench {path}: {file} missing (expected FusionBench 0.2.33's layout)")
                spec = importlib.util.spec_from_file_location(f"_fusion_bench_{len(modules)}", file)
                modules[rel] = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(modules[rel])
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)
            else:
                sys.modules[name] = module
    fn = {m: getattr(modules[rel], name) for m, (rel, name) in FB_SOURCES.items()}

    def per_key(call):  # FusionBench merges state dicts and prints per key: one key, output discarded
        def run(taus):
            with contextlib.redirect_stdout(io.StringIO()):
                return call([{"w": t} for t in taus])["w"]
        return run

    def svc(taus):
        merged = torch.stack(taus).sum(0)
        return fn["svc"](base_weight=torch.zeros_like(merged), task_weights=taus, merged_weight=merged,
                         alpha=1.0 / len(taus), accelerator=accelerator)

    return {"tsv_m": per_key(lambda tvs: fn["tsv_m"](tvs, accelerator=accelerator)),
            "iso_c": per_key(lambda tvs: fn["iso_c"](tvs, accelerator=accelerator)),
            "iso_cts": per_key(lambda tvs: fn["iso_cts"](tvs, COMMON_SPACE_FRACTION, accelerator=accelerator)),
            "svc": svc}


def ours() -> dict[str, Callable[[list[torch.Tensor]], torch.Tensor]]:
    """Our default route of each method on one key (what a merge or SVC calibration runs)."""
    from mergecal.methods.iso_c import iso_c_matrix
    from mergecal.methods.iso_cts import iso_cts_matrix
    from mergecal.methods.tsv_m import tsv_merge_matrix
    from mergecal.perf.merging import svc_after_ta

    return {"tsv_m": tsv_merge_matrix, "iso_c": iso_c_matrix,
            "iso_cts": lambda taus: iso_cts_matrix(taus, COMMON_SPACE_FRACTION), "svc": svc_after_ta}


def references() -> dict[str, Callable[[list[np.ndarray]], np.ndarray]]:
    sys.path.insert(0, str(ROOT / "tests"))
    from crosscheck import reference_merging as ref

    return {"tsv_m": ref.tsv_m_matrix, "iso_c": ref.iso_c_matrix,
            "iso_cts": lambda mats: ref.iso_cts_matrix(mats, COMMON_SPACE_FRACTION), "svc": ref.svc_matrix}


def rel_diff(x: torch.Tensor, ref: np.ndarray) -> float:
    return float(np.linalg.norm(x.double().cpu().numpy() - ref) / np.linalg.norm(ref))


def time_alternated(impls: dict[str, Callable], taus: list[torch.Tensor], repeats: int, start: int = 0,
                    sync: Callable[[], None] | None = None) -> tuple[dict[str, float], dict[str, torch.Tensor]]:
    """Median seconds of ``repeats`` calls per implementation, the order flipping every repetition (``start``
    offsets it, so that keys alternate which goes first), and each one's last output. ``sync`` (a GPU's
    synchronize) ends every call inside its timing, so that queued kernels count."""
    names = list(impls)
    times: dict[str, list[float]] = {n: [] for n in names}
    out = {}
    for rep in range(repeats):
        for name in names if (rep + start) % 2 == 0 else names[::-1]:
            t0 = time.perf_counter()
            out[name] = impls[name](taus)
            if sync is not None:
                sync()
            times[name].append(time.perf_counter() - t0)
    return {n: statistics.median(t) for n, t in times.items()}, out


def summarize(method: str, per_key: list[dict], shapes: list[tuple[int, int]], K: int,
              gflops: dict[str, float]) -> dict:
    """One method's row from its per-key records ({"ours": s, "theirs": s or None, "ours_diff", "theirs_diff"}):
    summed seconds, ratio theirs / ours and its median over keys, largest differences, FLOP-floor multiples."""
    from mergecal.perf.merging import floor_rows

    ours_s = sum(k["ours"] for k in per_key)
    checked = [k for k in per_key if k["ours_diff"] is not None]  # keys the float64 oracle ran on
    row = {"method": method, "keys": len(per_key), "reference_keys": len(checked), "ours_seconds": ours_s,
           "ours_max_rel_diff": max(k["ours_diff"] for k in checked)}
    (floor,) = floor_rows({method: ours_s}, shapes, K, gflops)
    row.update({"floor_gflop": floor["floor_gflop"], "floor_dtype": floor["floor_dtype"], "gflops": floor["gflops"],
                "floor_seconds": floor["floor_seconds"], "ours_floor_multiple": floor["floor_multiple"]})
    if all(k["theirs"] is not None for k in per_key):
        theirs_s = sum(k["theirs"] for k in per_key)
        row.update({"theirs_seconds": theirs_s, "ratio": theirs_s / ours_s,
                    "median_key_ratio": statistics.median(k["theirs"] / k["ours"] for k in per_key),
                    "theirs_max_rel_diff": max(k["theirs_diff"] for k in checked),
                    "theirs_floor_multiple": theirs_s / floor["floor_seconds"]})
    return row


def format_table(rows: list[dict], setting: str) -> str:
    lines = [f"Ours vs FusionBench 0.2.33 vs the float64 reference: {setting}", "",
             "| method | ours (s) | FusionBench (s) | ratio theirs / ours | median per key | max rel. diff. ours "
             "| max rel. diff. FusionBench | floor GFLOP | ours × floor | FusionBench × floor | load avg. |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        fb = "theirs_seconds" in r
        lines.append(
            f"| {r['method']} | {r['ours_seconds']:.2f} | {r['theirs_seconds']:.2f} | {r['ratio']:.2f} | "
            f"{r['median_key_ratio']:.2f} | {r['ours_max_rel_diff']:.1e} | {r['theirs_max_rel_diff']:.1e} | "
            if fb else f"| {r['method']} | {r['ours_seconds']:.2f} | - | - | - | {r['ours_max_rel_diff']:.1e} | - | ")
        lines[-1] += (f"{r['floor_gflop']:.3g} | {r['ours_floor_multiple']:.1f} | "
                      f"{r['theirs_floor_multiple']:.1f} | " if fb else
                      f"{r['floor_gflop']:.3g} | {r['ours_floor_multiple']:.1f} | - | ")
        lines[-1] += f"{r['load_before']:.1f} → {r['load_after']:.1f} |"
    return "\n".join(lines)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)


def set_threads(threads: int) -> None:
    import scipy.linalg  # noqa: F401  (loads scipy's own OpenBLAS first, so that the limit below reaches it)
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(threads)
    threadpool_limits(threads)  # numpy / scipy's BLAS, where the Gram route's syrk and eigh run


def main(argv: list[str] | None = None) -> int:
    from mergecal.perf.merging import SHAPE_SETS, measure_gflops, synthetic_task_vectors, vit_b32_shapes

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fusion-bench", help="FusionBench 0.2.33's wheel or its unpacked folder (else skipped)")
    parser.add_argument("--shapes", choices=sorted(SHAPE_SETS), default="vit-b-32")
    parser.add_argument("--blocks", type=int, help="transformer blocks (default: all, 12 / 24)")
    parser.add_argument("--width", type=int, help="model width (default: the shapes' own; small for a smoke test)")
    parser.add_argument("--tasks", type=int, default=8, help="K (default 8)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=METHODS)
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per key and implementation (median)")
    parser.add_argument("--threads", type=int, default=2, help="torch and numpy/scipy BLAS threads (default 2)")
    parser.add_argument("--device", default="cpu", help="where both run: cpu (default) or cuda[:N]")
    parser.add_argument("--reference-keys", type=int, help="run the float64 oracle on the first N keys only "
                        "(default: every key)")
    parser.add_argument("--output", help="write the table here (Markdown, rewritten after each method) and a .json")
    args = parser.parse_args(argv)
    if args.device != "cpu" and not (args.device.startswith("cuda") and torch.cuda.is_available()):
        raise SystemExit(f"--device {args.device}: expected cpu, or cuda[:N] on a machine with a CUDA GPU")
    if args.reference_keys is not None and args.reference_keys < 1:
        raise SystemExit(f"--reference-keys {args.reference_keys}: expected at least 1")

    set_threads(args.threads)
    blocks, width, _ = SHAPE_SETS[args.shapes]
    shapes = vit_b32_shapes(args.blocks or blocks, args.width or width)
    task_vectors = synthetic_task_vectors({k: s for k, s in shapes.items() if len(s) == 2}, args.tasks)
    keys = list(task_vectors[0])
    matrix_shapes = [tuple(task_vectors[0][k].shape) for k in keys]
    if args.fusion_bench:
        theirs = load_fusion_bench(args.fusion_bench, accelerator=args.device)
    else:
        theirs = None
        print("FusionBench columns skipped: no --fusion-bench given (its wheel: pip download --no-deps "
              "fusion-bench==0.2.33)", flush=True)
    mine, refs = ours(), references()
    on_gpu = args.device != "cpu"
    where = (f"on {torch.cuda.get_device_name(args.device)}" if on_gpu else f"{args.threads} threads")
    setting = (f"{args.shapes}, {args.blocks or blocks} blocks ({len(keys)} matrices), K = {args.tasks}, "
               f"{where}, medians of {args.repeats} alternated calls per key, torch {torch.__version__}"
               + (f", float64 oracle on the first {args.reference_keys} keys" if args.reference_keys else ""))
    print(setting, flush=True)
    sync = (lambda: torch.cuda.synchronize(args.device)) if on_gpu else None
    gflops_runs = [measure_gflops(args.device)]
    records, rows = {}, []
    for method in args.methods:
        load_before = os.getloadavg()[0]
        records[method] = []
        impls = {"ours": mine[method], **({"theirs": theirs[method]} if theirs else {})}
        if on_gpu:  # library and kernel initialisation outside the timings
            time_alternated(impls, [tv[keys[0]].to(args.device) for tv in task_vectors], 1, sync=sync)
        for i, key in enumerate(keys):
            taus = [tv[key].to(args.device) for tv in task_vectors]
            times, out = time_alternated(impls, taus, args.repeats, start=i, sync=sync)
            checked = args.reference_keys is None or i < args.reference_keys
            ref = refs[method]([t.double().cpu().numpy() for t in taus]) if checked else None
            records[method].append({"key": key, "ours": times["ours"], "theirs": times.get("theirs"),
                                    "ours_diff": rel_diff(out["ours"], ref) if checked else None,
                                    "theirs_diff": rel_diff(out["theirs"], ref) if theirs and checked else None})
            r = records[method][-1]
            print(f"  {method} {i + 1}/{len(keys)} {tuple(taus[0].shape)}: ours {r['ours']:.3f} s"
                  + (f", FusionBench {r['theirs']:.3f} s" if theirs else "") + f", load {os.getloadavg()[0]:.1f}",
                  flush=True)
        gflops_runs.append(measure_gflops(args.device))
        gflops = {d: max(g[d] for g in gflops_runs) for d in ("float32", "float64")}
        row = {**summarize(method, records[method], matrix_shapes, args.tasks, gflops),
               "load_before": load_before, "load_after": os.getloadavg()[0]}
        rows.append(row)
        print(format_table([row], setting).splitlines()[-1], flush=True)
        table = format_table(rows, setting) + "\n\nmatmul GFLOP/s float32 / float64 measured: " + "; ".join(
            f"{g['float32']:.0f} / {g['float64']:.0f}" for g in gflops_runs)
        if args.output:
            out_path = Path(args.output)
            write_atomic(out_path, table + "\n")
            write_atomic(out_path.with_suffix(".json"), json.dumps(
                {"setting": vars(args), "rows": rows, "per_key": records, "gflops": gflops_runs}, indent=2))
    print()
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
