"""What a lent GPU is spent on (#43), as one prepared run within a time budget; on the CPU at smoke size it is the
same code, which the slow test tier runs so that it works the day a GPU is lent.

    python -m scripts.gpu_session --device cuda --size 7b --budget 540 --out $OUT         # on the lent machine
    python -m scripts.gpu_session --device cpu --size smoke --budget 900 --out /tmp/gpu   # what CI runs

Steps, each started only while the budget allows (the rest are recorded as skipped):
1. the smoke profile's `dvc repro` with `device: <device>`: every cell's MLflow `mergecal.device` tag must name it;
2. Llama-shaped checkpoints (``mergecal.perf.llm_checkpoints``: base + 3 experts, 2 where the disk holds no more;
   bfloat16) merged key by key with
   ``task_arithmetic>svc`` and ``tsv_m`` on the device: seconds and peak memory (CUDA: allocated on the device;
   CPU: anonymous, above the baseline), beside the SVC paper's Table 4 (SVC on Llama-2-7B: 517.2 s, 1,898.7 MiB on
   an A800; "Singular Value Calibration...", arXiv:2602.05536);
3. with ``--default-benchmark``: the default profile's `dvc repro benchmark` on the device (pretraining and
   fine-tuning included), as far as the budget goes.
Writes ``summary.json`` and ``summary.md`` to ``--out``; exits non-zero when a step that ran failed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = ("task_arithmetic>svc", "tsv_m")
# rough lower bounds on a step's time, so that a step is not started with too little budget left
NEEDS_S = {"smoke_repro": 120, "merges": 30, "default_benchmark": 300}


def _log(text: str) -> None:
    print(f"[gpu_session] {text}", flush=True)


def smoke_repro(device: str, work: Path, timeout: float) -> dict:
    """The smoke workspace's `dvc repro` on ``device``; the device tag of every cell it logged."""
    from mlflow.tracking import MlflowClient

    from mergecal.pipeline.config import load_params
    from mergecal.pipeline.tracking import resolve_uri, tag
    from mergecal.pipeline.workspace import create_workspace, smoke_overrides

    workspace = create_workspace(work / "smoke", {**smoke_overrides(), "device": device}, root=REPO)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=workspace, timeout=timeout)
    seconds = time.perf_counter() - start
    params = load_params(workspace / "params.yaml")
    client = MlflowClient(resolve_uri(workspace, params.tracking))
    experiment = client.get_experiment_by_name(params.tracking.experiment)
    runs = client.search_runs([experiment.experiment_id], max_results=5000) if experiment else []
    devices = sorted({r.data.tags.get(tag("device"), "") for r in runs if tag("device") in r.data.tags})
    kind = device.split(":")[0]
    ok = done.returncode == 0 and bool(devices) and all(d.split(":")[0] == kind for d in devices)
    return {"ok": ok, "rc": done.returncode, "seconds": round(seconds, 1), "cells": len(runs), "devices": devices}


def _peak(device: str):
    """A context measuring peak memory in MiB above the start: on CUDA allocated on the device, else anonymous."""
    import contextlib

    import torch

    from mergecal.perf.memory import peak_anonymous_memory

    if device.startswith("cuda"):
        @contextlib.contextmanager
        def cuda_peak():
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            result = {}
            yield result
            torch.cuda.synchronize()
            result["extra_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
        return cuda_peak()

    @contextlib.contextmanager
    def cpu_peak():
        result = {}
        with peak_anonymous_memory() as peak:
            yield result
        result["extra_mb"] = peak.extra_mb
    return cpu_peak()


def merges(device: str, size: str, work: Path) -> dict:
    """Each recipe's streamed merge of base + 3 experts: seconds, peak memory, the output's size."""
    from mergecal.merge import merge_checkpoints
    from mergecal.perf.llm_checkpoints import parameters, write_family
    from mergecal.recipe import Recipe

    model_bytes = 2 * parameters(size)  # bfloat16
    k = min(3, shutil.disk_usage(work).free // model_bytes - 2)  # base + K experts + the merged output on disk
    if k < 2:
        raise RuntimeError(f"{work}: {shutil.disk_usage(work).free / 2**30:.0f} GiB free; base, 2 experts and the "
                           f"output at {size} need {4 * model_bytes / 2**30:.0f} GiB")
    start = time.perf_counter()
    base, experts = write_family(work / f"llm-{size}", size, experts=int(k), device=device)
    out: dict = {"size": size, "parameters": parameters(size), "experts": int(k),
                 "write_seconds": round(time.perf_counter() - start, 1), "rows": []}
    for recipe in RECIPES:
        target = work / f"merged-{size}"
        start = time.perf_counter()
        with _peak(device) as peak:
            merge_checkpoints(base, experts, Recipe.parse(recipe), target, device=device, hf_directory=False)
        row = {"recipe": recipe, "seconds": round(time.perf_counter() - start, 1), "peak_mib": round(peak["extra_mb"])}
        out["rows"].append(row)
        _log(f"{recipe} at {size} on {device}: {row['seconds']} s, peak +{row['peak_mib']} MiB")
        shutil.rmtree(target)
    out["ok"] = True
    return out


def default_benchmark(device: str, work: Path, timeout: float) -> dict:
    import yaml

    from mergecal.pipeline.workspace import create_workspace

    overrides = {**yaml.safe_load((REPO / "params.yaml").read_text()), "device": device}
    workspace = create_workspace(work / "default", overrides, root=REPO)
    start = time.perf_counter()
    try:
        done = subprocess.run([sys.executable, "-m", "dvc", "repro", "benchmark"], cwd=workspace, timeout=timeout)
        rc = done.returncode
    except subprocess.TimeoutExpired:
        rc = "timed out"
    return {"ok": rc == 0, "rc": rc, "seconds": round(time.perf_counter() - start, 1)}


def markdown(summary: dict) -> str:
    lines = [f"# GPU session: device {summary['device']}, size {summary['size']}", ""]
    for name, step in summary["steps"].items():
        lines.append(f"- **{name}**: " + json.dumps({k: v for k, v in step.items() if k != "rows"}))
        for row in step.get("rows", []):
            lines.append(f"  - `{row['recipe']}`: {row['seconds']} s, peak +{row['peak_mib']} MiB")
    from mergecal.perf.llm_checkpoints import SVC_PAPER_7B as paper
    lines += ["", f"SVC paper, Table 4 (Llama-2-7B, {paper['device']}): {paper['seconds']} s, {paper['peak_mib']} MiB.",
              ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    parser.add_argument("--size", default="7b", choices=["smoke", "1.6b", "7b"], help="the merged checkpoints' size")
    parser.add_argument("--budget", type=float, default=540, help="seconds for all steps (default 540)")
    parser.add_argument("--out", required=True, help="where summary.json and summary.md go")
    parser.add_argument("--work", help="scratch folder (default: a temporary one, removed after)")
    parser.add_argument("--default-benchmark", action="store_true", help="also the default profile's benchmark stage")
    parser.add_argument("--skip", nargs="*", default=[], choices=sorted(NEEDS_S), help="steps not to run")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.budget
    summary: dict = {"device": args.device, "size": args.size, "budget": args.budget, "steps": {}}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=args.work) as scratch:
        work = Path(scratch)
        steps = [("smoke_repro", lambda left: smoke_repro(args.device, work, left)),
                 ("merges", lambda left: merges(args.device, args.size, work))]
        if args.default_benchmark:
            steps.append(("default_benchmark", lambda left: default_benchmark(args.device, work, left)))
        for name, run in steps:
            left = deadline - time.monotonic()
            if name in args.skip:
                summary["steps"][name] = {"ok": None, "skipped": "--skip"}
                continue
            if left < NEEDS_S[name]:
                summary["steps"][name] = {"ok": None, "skipped": f"{left:.0f} s of budget left"}
                continue
            _log(f"{name} ({left:.0f} s of budget left)")
            try:
                summary["steps"][name] = run(left)
            except Exception as err:  # noqa: BLE001 - recorded; the next step still runs
                summary["steps"][name] = {"ok": False, "error": f"{type(err).__name__}: {err}"[:500]}
            _log(f"{name}: {json.dumps(summary['steps'][name])[:300]}")
            (out / "summary.json").write_text(json.dumps(summary, indent=2))  # what is done survives a kill
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    (out / "summary.md").write_text(markdown(summary))
    return 1 if any(step.get("ok") is False for step in summary["steps"].values()) else 0


if __name__ == "__main__":
    sys.exit(main())
