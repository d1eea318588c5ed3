"""SVC, TSV-M and Iso-CTS at Llama sizes, key class by key class, against their FLOP floors (issue #43).

    python scripts/perf_svd_llama.py --size 7b --tasks 2 --threads 1 --output reports/perf/svd-llama-7b.md \\
        [--end-to-end task_arithmetic>svc --layers 1 --work /tmp/svd7b]

A Llama model's 2-D keys come in a few shapes (Llama-2-7B: q/k/v/o 4096 x 4096, gate/up 11008 x 4096, down
4096 x 11008, embed_tokens and lm_head 32000 x 4096), so one key of each class, timed once per method, gives the
whole model's time: the sum over classes of (keys of the class the method covers) x (seconds per key). Each key's
K task matrices are synthetic (``mergecal.perf.merging.synthetic_task_vectors``: low rank plus noise); the time of
an exact route does not depend on the values. Per method and class:
- seconds and peak resident memory above the start (VmHWM) of the method's matrix function on that key: SVC after
  task arithmetic (``svc_after_ta``, alpha = 1/K), ``tsv_merge_matrix``, ``iso_cts_matrix`` (common space 0.8);
- where the time goes, from cProfile: LAPACK's eigensolver (scipy.linalg.eigh), Householder QR (torch.linalg.qr),
  and the rest (the products: BLAS syrk and gemm, and elementwise work);
- the FLOP floor (``mergecal.perf.merging.flop_floor``: the dense products an exact route cannot skip) at the
  matmul rate measured in this run, and the time over it; and the *exact-route floor*: the FLOP floor plus one
  eigendecomposition per Gram matrix the route needs, each at the eigensolver's time measured here on an r x r
  matrix (the FLOP floor counts no eigendecomposition, which at r = 4096 costs ~8x its Gram product).

With ``--end-to-end RECIPE ...`` a Llama-shaped family of the same size with ``--layers`` decoder layers (every
key shape of the full model; ``mergecal.perf.llm_checkpoints``) is written and merged by ``merge_checkpoints``
key by key, for the recipe's measured peak anonymous memory above the start (the streamed merge holds one key at
a time, so fewer layers change its time, not its peak) and its time beside the sum the per-key table predicts.

The SVC paper's Table 4 ("Singular Value Calibration...", arXiv:2602.05536): SVC on Llama-2-7B in 517.2 s and
1,898.7 MiB on an A800 GPU; a CPU core's seconds are not comparable to it, only shown beside it.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import json
import platform
import pstats
import shutil
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import torch

from mergecal.keys import get_key_rule
from mergecal.methods.iso_cts import iso_cts_matrix, iso_cts_ranks
from mergecal.methods.tsv_m import tsv_merge_matrix
from mergecal.perf.llm_checkpoints import SIZES, SVC_PAPER_7B, shapes
from mergecal.perf.memory import peak_anonymous_memory, peak_memory
from mergecal.perf.merging import FLOOR_DTYPE, flop_floor, measure_gflops, svc_after_ta, synthetic_task_vectors

COMMON_SPACE = 0.8
#: method -> (the matrix function on K task matrices, the key rule it covers at its defaults)
METHODS = {
    "svc": (svc_after_ta, "svc_authors"),
    "tsv_m": (tsv_merge_matrix, "matrices_except_text_projection"),
    "iso_cts": (lambda taus: iso_cts_matrix(taus, COMMON_SPACE), "matrices_except_text_projection"),
}
#: where a key of a class sits in the Hugging Face Llama layout; its shape comes from the size
CLASS_MARKERS = {"attention": ("self_attn.",), "mlp up/gate": ("mlp.up_proj", "mlp.gate_proj"),
                 "mlp down": ("mlp.down_proj",), "embedding / lm_head": ("embed_tokens", "lm_head")}


def key_classes(size: str) -> list[dict]:
    """Each class of 2-D keys of the size's full model: a representative key, its shape, and how many keys of the
    class each method's key rule covers. Classes are keys of one shape and role; every 2-D key is in one."""
    table = shapes(size)
    matrices = {k: s for k, s in table.items() if len(s) == 2}
    classes = []
    for label, markers in CLASS_MARKERS.items():
        members = [k for k in matrices if any(marker in k for marker in markers)]
        by_shape: dict[tuple[int, int], list[str]] = {}
        for k in members:
            by_shape.setdefault(matrices[k], []).append(k)
        for shape, keys in by_shape.items():
            counts = {m: sum(get_key_rule(rule).matches(k, torch.Size(shape), torch.float32) for k in keys)
                      for m, (_, rule) in METHODS.items()}
            classes.append({"class": label if len(by_shape) == 1 else f"{label} {shape[0]}x{shape[1]}",
                            "key": keys[0], "shape": shape, "keys": len(keys), "covered": counts})
    assert sum(c["keys"] for c in classes) == len(matrices), "a 2-D key in no class"
    return classes


def decomposed_sizes(method: str, shape: tuple[int, int], K: int) -> list[int]:
    """The sizes of the Gram matrices the method's default (Gram) route eigendecomposes on one key, each counted
    as r x r: exact but for Iso-CTS's wide keys (m < n), whose residuals' problems are (r - k_c)-sized, so their
    exact-route floor is an upper bound."""
    r = min(shape)
    if method == "svc":
        return [r]  # the merged update's
    if method == "tsv_m":
        return [r] * K + [r, r]  # each task's (top r/K), then the two polar factors' of [U_1..U_K] and [V_1..V_K]
    if method == "iso_cts":
        _, task_rank = iso_cts_ranks(r, K, COMMON_SPACE)
        return [r] + ([r] * K if task_rank else []) + [r, r]  # the sum's, each residual's, the two polar factors'
    raise ValueError(method)


def eigh_seconds(n: int) -> float:
    """One float64 eigendecomposition (scipy's dsyevd, the full route's driver) of an n x n Gram matrix."""
    import numpy as np
    import scipy.linalg

    a = np.random.default_rng(0).standard_normal((n + n // 2, n))
    gram = a.T @ a
    start = time.perf_counter()
    scipy.linalg.eigh(gram, driver="evd", check_finite=False, overwrite_a=True)
    return time.perf_counter() - start


def profiled(fn, taus) -> tuple[float, float, dict[str, float]]:
    """(seconds, peak MiB above the start, {eigh, qr, rest}: seconds) of one call."""
    profile = cProfile.Profile()
    with peak_memory() as mem:
        start = time.perf_counter()
        profile.enable()
        fn(taus)
        profile.disable()
        seconds = time.perf_counter() - start
    parts = {"eigh": 0.0, "qr": 0.0}
    for (filename, _, name), (_, _, tottime, cumtime, _) in pstats.Stats(profile).stats.items():
        if name == "eigh" and "scipy" in filename:
            parts["eigh"] += cumtime
        elif "linalg_qr" in name:
            parts["qr"] += tottime
    parts["rest"] = max(0.0, seconds - parts["eigh"] - parts["qr"])
    return seconds, mem.extra_mb, parts


def measure(size: str, K: int, methods: list[str]) -> dict:
    gflops_before = measure_gflops()
    classes = key_classes(size)
    eigh_at = {n: eigh_seconds(n) for n in sorted({min(c["shape"]) for c in classes})}
    rows = []
    for c in classes:
        taus = [tv[c["key"]] for tv in synthetic_task_vectors({c["key"]: c["shape"]}, K)]
        for method in methods:
            seconds, peak_mb, parts = profiled(METHODS[method][0], taus)
            rows.append({**c, "method": method, "seconds": seconds, "peak_extra_mb": peak_mb, "parts": parts,
                         "floor_flop": flop_floor(method, c["shape"], K),
                         "eighs": decomposed_sizes(method, c["shape"], K)})
            print(f"  {method:8s} {c['class']:22s} {c['shape']}: {seconds:7.2f} s (eigh {parts['eigh']:.2f}, "
                  f"qr {parts['qr']:.2f}), peak +{peak_mb:.0f} MiB", flush=True)
        del taus
    gflops_after = measure_gflops()
    gflops = {d: max(gflops_before[d], gflops_after[d]) for d in gflops_before}
    for r in rows:
        r["floor_seconds"] = r["floor_flop"] / (gflops[FLOOR_DTYPE[r["method"]]] * 1e9)
        r["exact_floor_seconds"] = r["floor_seconds"] + sum(eigh_at[n] for n in r["eighs"])
    return {"size": size, "tasks": K, "threads": torch.get_num_threads(), "gflops": [gflops_before, gflops_after],
            "eigh_seconds": eigh_at, "rows": rows}


def totals(result: dict) -> list[dict]:
    """Per method, the whole model: sum over classes of covered keys x the class's per-key figures."""
    out = []
    for method in dict.fromkeys(r["method"] for r in result["rows"]):
        rows = [r for r in result["rows"] if r["method"] == method]
        total = {k: sum(r["covered"][method] * r[k] for r in rows)
                 for k in ("seconds", "floor_seconds", "exact_floor_seconds")}
        parts = {p: sum(r["covered"][method] * r["parts"][p] for r in rows) for p in ("eigh", "qr", "rest")}
        out.append({"method": method, **total, "parts": parts, "keys": sum(r["covered"][method] for r in rows),
                    "peak_extra_mb": max(r["peak_extra_mb"] for r in rows if r["covered"][method])})
    return out


def top_pairs_by_evr_only():
    """The eigensolver rule before ``mergecal.linalg.EVD_FOR_MANY_PAIRS_FROM``: a top k always by dsyevr."""
    from mergecal import linalg

    return mock.patch.object(linalg, "EVD_FOR_MANY_PAIRS_FROM", sys.maxsize)


def eigh_sizes_table(sizes: list[int], shares=(0.125, 0.25, 1 / 3, 0.5, 0.8)) -> str:
    """dsyevd (every pair) against dsyevr (the top k) on the Gram matrix of a synthetic sum of two task matrices
    (n x 11n/4, low rank plus noise: the tail eigenvalues cluster), one call each: what ``eigh_driver`` is set
    by."""
    import numpy as np
    import scipy.linalg

    lines = ["| n | dsyevd, all pairs (s) | " + " | ".join(f"dsyevr, top {s:.2g} n (s)" for s in shares) + " |",
             "|---:|---:|" + "---:|" * len(shares)]
    for n in sizes:
        taus = synthetic_task_vectors({"w": (n * 11 // 4, n)}, 2)
        total = (taus[0]["w"] + taus[1]["w"]).double().numpy()
        gram = total.T @ total
        cells = []
        for share in (None, *shares):
            k = None if share is None else int(share * n)
            start = time.perf_counter()
            scipy.linalg.eigh(np.array(gram), driver="evd" if k is None else "evr", check_finite=False,
                              subset_by_index=None if k is None else [n - k, n - 1])
            cells.append(f"{time.perf_counter() - start:.2f}")
        lines.append(f"| {n} | " + " | ".join(cells) + " |")
        print("  " + lines[-1], flush=True)
    return "\n".join(lines)


def svc_responses_by_product():
    """SVC's rule before ``mergecal.calibrations.svc.MERGED_RESPONSE_FROM``: a_m always the product u_r^T dW_m."""
    from mergecal.calibrations import svc

    return mock.patch.object(svc, "MERGED_RESPONSE_FROM", sys.maxsize)


#: --compare: the rule before each change, as a context manager, and its label
RULES_BEFORE = {"drivers": (top_pairs_by_evr_only, "evr only"), "svc-responses": (svc_responses_by_product, "product")}


def compare_drivers(size: str, K: int, methods: list[str], classes: list[str] | None,
                    rule: str = "drivers") -> list[dict]:
    """Per method and key class, the default route against the rule before a change (``RULES_BEFORE``: dsyevr for
    every top k; SVC's a_m as a product), alternated in one process (the order swapped each class): seconds, their
    ratio, and the largest relative difference of the outputs (both exact routes; they differ in round-off, and the
    eigensolvers by a rotation inside an eigenvalue cluster that the kept rank cuts)."""
    before_rule, before = RULES_BEFORE[rule]
    rows = []
    for i, c in enumerate(key_classes(size)):
        if classes and c["class"] not in classes:
            continue
        taus = [tv[c["key"]] for tv in synthetic_task_vectors({c["key"]: c["shape"]}, K)]
        for method in methods:
            fn, times, out = METHODS[method][0], {}, {}
            for route in ((before, "default") if i % 2 == 0 else ("default", before)):
                with before_rule() if route == before else contextlib.nullcontext():
                    start = time.perf_counter()
                    out[route] = fn(taus)
                    times[route] = time.perf_counter() - start
            ref = out[before].double()
            diff = float((out["default"].double() - ref).norm() / ref.norm())
            rows.append({"method": method, "class": c["class"], "shape": c["shape"], "before": before,
                         "before_seconds": times[before], "default_seconds": times["default"],
                         "speedup": times[before] / times["default"], "rel_diff": diff})
            print(f"  {rule} {method:8s} {c['class']:22s}: {before} {times[before]:7.2f} s, default "
                  f"{times['default']:7.2f} s (x{rows[-1]['speedup']:.2f}), rel. diff {diff:.1e}", flush=True)
        del taus
    return rows


def end_to_end(size: str, K: int, recipes: list[str], layers: int, work: Path) -> list[dict]:
    """Each recipe's streamed merge of a base and K experts with ``layers`` decoder layers of the size."""
    from mergecal.merge import merge_checkpoints
    from mergecal.perf.llm_checkpoints import parameters, write_family
    from mergecal.recipe import Recipe

    need = (K + 2) * 2 * parameters(size, layers)  # bfloat16 inputs and the output
    if shutil.disk_usage(work).free < need:
        raise SystemExit(f"--work {work}: {need / 2**30:.1f} GiB needed for the end-to-end merge, "
                         f"{shutil.disk_usage(work).free / 2**30:.1f} GiB free")
    base, experts = write_family(work / "family", size, experts=K, layers=layers)
    rows = []
    for recipe in recipes:
        target = work / "merged"
        with peak_anonymous_memory(sample_interval=0.02) as mem:
            start = time.perf_counter()
            merge_checkpoints(base, experts, Recipe.parse(recipe), target, hf_directory=False)
            seconds = time.perf_counter() - start
        rows.append({"recipe": recipe, "layers": layers, "seconds": seconds, "peak_anon_extra_mb": mem.extra_mb})
        print(f"  end to end {recipe} ({layers} layer(s)): {seconds:.1f} s, peak +{mem.extra_mb:.0f} MiB anonymous",
              flush=True)
        shutil.rmtree(target)
    return rows


def predicted_seconds(result: dict, recipe_method: str, layers: int) -> float:
    """What the per-key table predicts for the method's keys in a model with ``layers`` decoder layers."""
    full = SIZES[result["size"]]["num_hidden_layers"]
    total = 0.0
    for r in (r for r in result["rows"] if r["method"] == recipe_method):
        per_layer = r["class"] != "embedding / lm_head"
        total += r["covered"][recipe_method] * (layers / full if per_layer else 1) * r["seconds"]
    return total


def drivers_markdown(rows: list[dict], rule: str = "drivers") -> str:
    intro = {"drivers": "The eigensolver rule (`mergecal.linalg.eigh_driver`) against dsyevr for every top k",
             "svc-responses": "SVC's merged responses read off the decomposition "
                              "(`mergecal.calibrations.svc.MERGED_RESPONSE_FROM`) against the product"}[rule]
    before = RULES_BEFORE[rule][1]
    lines = [f"{intro}, alternated in one process:", "",
             f"| method | key class | {before} (s) | default (s) | speed-up | rel. difference |",
             "|---|---|---:|---:|---:|---:|"]
    lines += [f"| {r['method']} | {r['class']} | {r['before_seconds']:.2f} | {r['default_seconds']:.2f} "
              f"| {r['speedup']:.2f} | {r['rel_diff']:.1e} |" for r in rows]
    return "\n".join(lines)


def markdown(result: dict, e2e: list[dict]) -> str:
    g = result["gflops"]
    setting = (f"Llama-shaped {result['size']}, K = {result['tasks']} task matrices per key, "
               f"{result['threads']} torch thread(s), {platform.processor() or platform.machine()}, "
               f"torch {torch.__version__}; matmul GFLOP/s float32 / float64: "
               + "; ".join(f"{x['float32']:.0f} / {x['float64']:.0f}" for x in g)
               + " (before / after; floors use the faster); float64 eigh (dsyevd): "
               + ", ".join(f"{n}: {s:.2f} s" for n, s in result["eigh_seconds"].items()))
    lines = [f"SVD methods per key class: {setting}", "",
             "| method | key class | shape | keys covered | s per key | eigh / qr / rest (s) | peak +MiB "
             "| FLOP floor (s) | x floor | exact-route floor (s) | x exact floor |",
             "|---|---|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        p = r["parts"]
        lines.append(f"| {r['method']} | {r['class']} | {r['shape'][0]}x{r['shape'][1]} | {r['covered'][r['method']]} "
                     f"| {r['seconds']:.2f} | {p['eigh']:.2f} / {p['qr']:.2f} / {p['rest']:.2f} "
                     f"| {r['peak_extra_mb']:.0f} | {r['floor_seconds']:.2f} | {r['seconds'] / r['floor_seconds']:.1f} "
                     f"| {r['exact_floor_seconds']:.2f} | {r['seconds'] / r['exact_floor_seconds']:.2f} |")
    lines += ["", "The whole model (covered keys x per-key figures):", "",
              "| method | 2-D keys | seconds | eigh / qr / rest (s) | largest key's peak +MiB | x FLOP floor "
              "| x exact-route floor |", "|---|---:|---:|---|---:|---:|---:|"]
    for t in totals(result):
        p = t["parts"]
        lines.append(f"| {t['method']} | {t['keys']} | {t['seconds']:.0f} | {p['eigh']:.0f} / {p['qr']:.0f} / "
                     f"{p['rest']:.0f} | {t['peak_extra_mb']:.0f} | {t['seconds'] / t['floor_seconds']:.1f} "
                     f"| {t['seconds'] / t['exact_floor_seconds']:.2f} |")
    if e2e:
        lines += ["", "Streamed end to end (`merge_checkpoints`, base + K experts, bfloat16 shards):", "",
                  "| recipe | decoder layers | seconds | predicted by the table | peak anonymous +MiB |",
                  "|---|---:|---:|---:|---:|"]
        for row in e2e:
            method = row["recipe"].split(">")[-1]
            predicted = predicted_seconds(result, method, row["layers"]) if method in METHODS else float("nan")
            lines.append(f"| {row['recipe']} | {row['layers']} | {row['seconds']:.0f} | {predicted:.0f} "
                         f"| {row['peak_anon_extra_mb']:.0f} |")
    paper = SVC_PAPER_7B
    lines += ["", f"SVC paper, Table 4 (Llama-2-7B, {paper['device']}): {paper['seconds']} s, {paper['peak_mib']} MiB "
              "(another device: shown beside, not compared)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="7b", choices=sorted(SIZES))
    parser.add_argument("--tasks", type=int, default=2, help="K (default 2: the SVC paper's 7B pair)")
    parser.add_argument("--threads", type=int, default=1, help="torch and BLAS threads (default 1)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--end-to-end", nargs="*", default=[], metavar="RECIPE",
                        help="also merge a Llama-shaped family with these recipes key by key "
                             "(e.g. task_arithmetic>svc)")
    parser.add_argument("--layers", type=int, default=1, help="decoder layers of the end-to-end family (default 1)")
    parser.add_argument("--work", type=Path, help="scratch folder for the end-to-end family (default: a temporary one)")
    parser.add_argument("--output", type=Path, help="write the tables as Markdown here and a .json beside it")
    parser.add_argument("--compare-drivers", action="store_true",
                        help="only the eigensolver rule against dsyevr for every top k, alternated (no per-key table)")
    parser.add_argument("--compare-svc-responses", action="store_true",
                        help="only SVC's merged responses read off the decomposition against the product, alternated")
    parser.add_argument("--classes", nargs="*", help="with --compare-*: these key classes only")
    parser.add_argument("--eigh-sizes", nargs="+", type=int, metavar="N",
                        help="only dsyevd against dsyevr's top-k ranges on n x n Gram matrices of these sizes")
    args = parser.parse_args(argv)
    import scipy.linalg  # noqa: F401  (scipy's own OpenBLAS loaded first, so that the limit below reaches it)
    from threadpoolctl import threadpool_limits

    torch.set_num_threads(args.threads)
    threadpool_limits(args.threads)
    if args.eigh_sizes:
        print(eigh_sizes_table(args.eigh_sizes))
        return 0
    if args.compare_drivers or args.compare_svc_responses:
        rule = "drivers" if args.compare_drivers else "svc-responses"
        rows = compare_drivers(args.size, args.tasks, args.methods, args.classes, rule)
        text = drivers_markdown(rows, rule)
        print()
        print(text)
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(text + "\n")
            args.output.with_suffix(".json").write_text(json.dumps({"size": args.size, "tasks": args.tasks,
                                                                    "rows": rows}, indent=2, default=str))
        return 0
    result = measure(args.size, args.tasks, args.methods)
    e2e = []
    if args.end_to_end:
        with tempfile.TemporaryDirectory(dir=args.work, prefix="mergecal-svd-") as scratch:
            e2e = end_to_end(args.size, args.tasks, args.end_to_end, args.layers, Path(scratch))
    text = markdown(result, e2e)
    print()
    print(text)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
        args.output.with_suffix(".json").write_text(json.dumps({**result, "totals": totals(result),
                                                                "end_to_end": e2e}, indent=2, default=str))
        print(f"\nwritten to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
