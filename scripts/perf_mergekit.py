"""`mergecal merge` side by side with MergeKit on the same Llama-shaped checkpoints (issue #43).

    python scripts/perf_mergekit.py --mergekit /path/to/venv/bin/mergekit-yaml --size 1.6b --work /tmp/mk \\
        [--experts 3] [--repeats 2] [--methods task_arithmetic ties dare_linear dare_ties] [--threads 2]

MergeKit is a benchmark dependency, never a runtime one: install it in a venv of its own
(``uv venv /tmp/mkvenv && VIRTUAL_ENV=/tmp/mkvenv uv pip install mergekit==0.1.5``) and pass its
``mergekit-yaml``. The checkpoints are written once by ``mergecal.perf.llm_checkpoints`` (random weights,
bfloat16 safetensors shards, a base and K experts). Each merge runs in a fresh process, the two tools alternated,
``--repeats`` times; the process tree's resident memory (anonymous and file-backed) is polled from /proc every
100 ms (every 20 ms cost the poller a third of a core on the 2-core machine). Both tools compute in float32 and
write bfloat16, 1 B parameters (2 GB) a shard. The outputs are compared tensor by tensor against each other
and, for the random methods (DARE), by what a draw leaves invariant.

Matched settings (each convention difference named):
- task_arithmetic: mergecal ``scaling=0.3``; MergeKit ``weight: 1``, ``lambda: 0.3`` (``normalize`` off: its default).
- ties: mergecal ``top_k=0.2, trim_scope=per_tensor, sign_vote=mass, disjoint=mean, scaling=1``; MergeKit
  ``density: 0.2, weight: 1`` (top 20 % per tensor, sign by summed mass, ``normalize`` on: the disjoint mean).
  mergecal's default trims over the whole model (the TIES paper's code); MergeKit per tensor. Two conventions
  still differ and every differing element is attributed to one (``ties_conventions``): entries tied with a task's
  threshold (mergecal keeps them all; MergeKit exactly ``int(k n)``), and a sign vote of exactly zero (mergecal:
  the tensor's majority sign; MergeKit: +1).
- dare_linear / dare_ties: mergecal ``dare(drop_rate=0.9, rescale=l1, base=task_arithmetic | ties with top_k=1,
  trim_scope=per_tensor)``; MergeKit ``density: 0.1, weight: 1`` (L1-norm rescale: its ``rescale`` default).
  The random masks differ (each tool's generator), so the check is statistical: the merged delta's L1 norm
  (both keep each task vector's L1 norm per tensor) and the fraction of coordinates changed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
import yaml

from mergecal.checkpoint import SafetensorsSource
from mergecal.perf.llm_checkpoints import parameters, write_family

TIES_TOP_K = 0.2
MERGECAL_SETTINGS = {
    "task_arithmetic": ["--method", "task_arithmetic", "--set", "scaling=0.3"],
    "ties": ["--method", "ties", "--set", f"top_k={TIES_TOP_K}", "--set", "trim_scope=per_tensor",
             "--set", "scaling=1.0"],
    "dare_linear": ["--method", "dare", "--set", "drop_rate=0.9", "--set", "rescale=l1", "--set", "scaling=1.0"],
    "dare_ties": ["--method", "dare", "--set", "drop_rate=0.9", "--set", "rescale=l1", "--set", "base=ties",
                  "--set", "top_k=1.0", "--set", "trim_scope=per_tensor", "--set", "scaling=1.0"],
}
MERGEKIT_PARAMETERS = {
    "task_arithmetic": ({"weight": 1.0}, {"lambda": 0.3}),
    "ties": ({"weight": 1.0, "density": TIES_TOP_K}, {}),
    "dare_linear": ({"weight": 1.0, "density": 0.1}, {}),
    "dare_ties": ({"weight": 1.0, "density": 0.1}, {}),
}


def mergekit_config(method: str, base: Path, experts: list[Path]) -> dict:
    per_model, shared = MERGEKIT_PARAMETERS[method]
    return {"merge_method": method, "base_model": str(base), "dtype": "float32", "out_dtype": "bfloat16",
            "parameters": shared, "models": [{"model": str(e), "parameters": per_model} for e in experts]}


def _tree_memory_mb(pid: int) -> tuple[float, float, float]:
    """(RSS, anonymous, file-backed) resident memory of ``pid`` and its descendants, in MB."""
    totals, stack = [0, 0, 0], [pid]
    while stack:
        p = stack.pop()
        try:
            fields = dict(line.split(":", 1) for line in Path(f"/proc/{p}/status").read_text().splitlines())
            for i, name in enumerate(("VmRSS", "RssAnon", "RssFile")):
                totals[i] += int(fields.get(name, "0 kB").split()[0])
            for task in Path(f"/proc/{p}/task").iterdir():
                stack += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError, ValueError):
            continue
    return tuple(t / 1024 for t in totals)


def measured(command: list[str], env: dict) -> dict:
    """Run ``command`` in a fresh process: wall seconds and peak tree memory (MB)."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    peak = [0.0, 0.0, 0.0]

    def poll():
        while proc.poll() is None:
            peak[:] = [max(a, b) for a, b in zip(peak, _tree_memory_mb(proc.pid))]
            time.sleep(0.1)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    _, err = proc.communicate()
    poller.join()
    if proc.returncode:
        raise SystemExit(f"{command[0]} failed ({proc.returncode}): {err.strip().splitlines()[-1:]}")
    return {"seconds": time.perf_counter() - start, "rss_mb": peak[0], "anon_mb": peak[1], "file_mb": peak[2]}


def compare(ours: Path, theirs: Path, base: Path, method: str) -> dict:
    """Deterministic methods: the largest relative difference of a key (Frobenius) and the share of equal
    elements. DARE: the merged delta's L1 norm and changed share, ours over theirs, over all keys. One key of each
    checkpoint in memory at a time."""
    sources = [SafetensorsSource(d) for d in (ours, theirs, base)]
    if set(sources[0].keys()) != set(sources[1].keys()):
        raise SystemExit(f"keys only one tool wrote: {sorted(set(sources[0].keys()) ^ set(sources[1].keys()))[:3]}")
    worst, equal, total, l1, changed = 0.0, 0, 0, [0.0, 0.0], [0, 0]
    for key in sorted(sources[0].keys()):
        a, b, o = (s.get(key).float() for s in sources)
        worst = max(worst, float((a - b).norm() / b.norm().clamp_min(1e-12)))
        equal, total = equal + int((a == b).sum()), total + a.numel()
        for i, t in enumerate((a, b)):
            l1[i] += float((t - o).abs().sum())
            changed[i] += int((t != o).sum())
    return {"max_rel_diff": worst, "equal_share": equal / total, "delta_l1_ratio": l1[0] / l1[1],
            "changed_share_ours": changed[0] / total, "changed_share_theirs": changed[1] / total}


def ties_conventions(ours: Path, theirs: Path, base: Path, experts: list[Path], top_k: float) -> dict:
    """Where two per-tensor TIES outputs differ, the named convention that explains each element: a task's
    magnitude tied with its own threshold at that coordinate (mergecal keeps every tied entry, MergeKit exactly
    ``int(k n)`` in argsort order; bfloat16 deltas tie often), else a sign vote of exactly zero with entries kept
    (mergecal takes the tensor's majority sign, as the TIES code; MergeKit +1). ``unexplained``: neither."""
    from mergecal.magnitude import kth_largest_magnitudes
    from mergecal.methods.ties import trim

    sources = [SafetensorsSource(d) for d in (ours, theirs, base, *experts)]
    counts = {"differing": 0, "tied_threshold": 0, "zero_vote": 0, "unexplained": 0}
    for key in sorted(sources[0].keys()):
        a, b, o = (s.get(key).float() for s in sources[:3])
        differ = a != b
        if not differ.any():
            continue
        taus = [s.get(key).float() - o for s in sources[3:]]
        thresholds = kth_largest_magnitudes(lambda: [taus], [int(top_k * taus[0].numel())] * len(taus))
        tied = torch.stack([tau.abs() == t for tau, t in zip(taus, thresholds)]).any(0)
        trimmed = trim(taus, thresholds)
        zero_vote = (trimmed.sum(0) == 0) & (trimmed != 0).any(0) & ~tied
        counts["differing"] += int(differ.sum())
        counts["tied_threshold"] += int((differ & tied).sum())
        counts["zero_vote"] += int((differ & zero_vote).sum())
        counts["unexplained"] += int((differ & ~tied & ~zero_vote).sum())
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mergekit", required=True, help="MergeKit's mergekit-yaml executable")
    parser.add_argument("--size", default="smoke", choices=["smoke", "1.6b", "7b"])
    parser.add_argument("--work", type=Path, required=True, help="a folder for the checkpoints and outputs")
    parser.add_argument("--experts", type=int, default=3)
    parser.add_argument("--layers", type=int, help="decoder layers, if not the size's own: every key keeps the size's "
                        "shape, so the peak memory of a key-by-key merge is the full model's (7B's family at full "
                        "depth is 4 x 13.5 GB, beyond the 2-core machine's disk with both outputs)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--methods", nargs="+", default=list(MERGECAL_SETTINGS), choices=list(MERGECAL_SETTINGS))
    parser.add_argument("--output", type=Path, help="write the figures as JSON here too")
    args = parser.parse_args()

    family = args.work / f"family-{args.size}-k{args.experts}"
    base, experts = write_family(family, args.size, args.experts, layers=args.layers, reuse=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "MKL_NUM_THREADS": str(args.threads)}
    mergecal_cli = [sys.executable, "-m", "mergecal.cli"]
    print(f"{args.size}: {parameters(args.size, args.layers) / 1e9:.2f} B parameters"
          f"{'' if args.layers is None else f' ({args.layers} decoder layers)'}, base + {len(experts)} experts, "
          f"{args.threads} threads, {args.repeats} repeats")
    rows = {}
    for method in args.methods:
        ours, theirs = args.work / f"out-mergecal-{method}", args.work / f"out-mergekit-{method}"
        config = args.work / f"mergekit-{method}.yml"
        config.write_text(yaml.safe_dump(mergekit_config(method, base, experts)))
        runs = {"mergecal": [], "mergekit": []}
        for _ in range(args.repeats):  # alternated: both tools see the same drift of the machine
            runs["mergecal"].append(measured(
                [*mergecal_cli, "merge", "--pretrained", str(base), "--finetuned", *map(str, experts),
                 *MERGECAL_SETTINGS[method], "--dtype", "bfloat16", "--max-shard-size", "2GB", "--out", str(ours),
                 "--weights-only"], env))  # an earlier repeat's output is mergecal's: replaced without --overwrite
            runs["mergekit"].append(measured(
                [args.mergekit, str(config), str(theirs), "--lazy-unpickle", "--out-shard-size", "1B",
                 "--no-copy-tokenizer", "--quiet", "--random-seed", "0", "-j", str(args.threads)], env))
        row = {tool: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for tool, rs in runs.items()}
        row["difference"] = compare(ours, theirs, base, method)
        if method == "ties":
            row["difference"] |= ties_conventions(ours, theirs, base, experts, TIES_TOP_K)
        rows[method] = row
        m, k = row["mergecal"], row["mergekit"]
        print(f"{method:16s} mergecal {m['seconds']:7.1f} s {m['anon_mb']:7.0f} MB anon {m['rss_mb']:7.0f} MB rss | "
              f"MergeKit {k['seconds']:7.1f} s {k['anon_mb']:7.0f} MB anon {k['rss_mb']:7.0f} MB rss | "
              f"time x{k['seconds'] / m['seconds']:.2f}, anon x{m['anon_mb'] / k['anon_mb']:.2f} | "
              + ", ".join(f"{name} {value:.3g}" for name, value in row["difference"].items()), flush=True)
    if args.output:
        args.output.write_text(json.dumps({"size": args.size, "layers": args.layers, "experts": len(experts),
                                           "threads": args.threads,
                                           "repeats": args.repeats, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
