"""Why SVC helps or hurts a merge: its per-key rescaling gamma_r = sigma~_r / sigma_r, read from the MLflow store.

    .venv/bin/python scripts/analyze_svc.py                      # the latest invocation, every track and regime
    .venv/bin/python scripts/analyze_svc.py --regime standard --track vision

For each `{merge}>svc` cell: its change against the base merge (points), and over its calibrated keys the mean
gamma on the top singular direction, the mean number of tasks whose s on the top direction exceeds 1,
on the top 10% of the rank, overall, the fraction of directions shrunk
(gamma < 1) and the energy ratio ||sigma~|| / ||sigma|| (above 1: SVC enlarges the merged update, as a larger
lambda would). The SVC paper's Fig. on spectra shows gamma < 1 on the top (over-counted, shared) directions and
gamma > 1 on the tail.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal.pipeline.config import load_params  # noqa: E402
from mergecal.pipeline.tracking import resolve_uri  # noqa: E402
from mergecal.reports.runs import cells_of, load_diagnostics, load_runs, pick_invocation  # noqa: E402


def gamma_summary(spectra: dict[str, dict[str, list[float]]]) -> dict[str, float]:
    top1, top10, every, shrunk, energy, over = [], [], [], [], [], []
    for values in spectra.values():
        if values.get("s_top"):  # tasks whose top-direction coefficient exceeds 1 (logged since 2026-11-26)
            over.append(float(np.sum(np.asarray(values["s_top"], float) > 1)))
        before, after = np.asarray(values["before"], float), np.asarray(values["after"], float)
        keep = before > 1e-12 * max(before.max(initial=0.0), 1e-30)
        if not keep.any():
            continue
        gamma = after[keep] / before[keep]
        k = max(1, int(round(0.1 * len(gamma))))
        top1.append(gamma[0])
        top10.append(gamma[:k].mean())
        every.append(gamma.mean())
        shrunk.append(float((gamma < 1).mean()))
        energy.append(float(np.linalg.norm(after) / np.linalg.norm(before)))
    return {"keys": len(top1), "gamma_top1": float(np.mean(top1)), "gamma_top10pct": float(np.mean(top10)),
            "gamma_mean": float(np.mean(every)), "shrunk": float(np.mean(shrunk)), "energy": float(np.mean(energy)),
            "tasks_over_1": float(np.mean(over)) if over else float("nan")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".")
    parser.add_argument("--invocation")
    parser.add_argument("--track")
    parser.add_argument("--regime")
    args = parser.parse_args(argv)
    params = load_params(Path(args.root) / "params.yaml")
    uri = resolve_uri(args.root, params.tracking)
    runs = load_runs(uri, params.tracking.experiment)
    cells = cells_of(runs, pick_invocation(runs, args.invocation))
    cells = cells[cells["status"] == "ok"]
    print("| track | regime | recipe | Δ avg (points) | keys | tasks with s > 1 (top dir.) | γ top-1 | γ top 10% "
          "| γ mean | shrunk | ‖σ̃‖/‖σ‖ |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for _, row in cells.sort_values(["regime", "recipe"]).iterrows():
        track = row.get("params.track", "")
        svc = re.search(r">svc(\(.*\))?$", row["recipe"])  # the chain {merge}>svc, with or without parameters
        if svc is None or (args.track and track != args.track) or (args.regime and row["regime"] != args.regime):
            continue
        base = cells[(cells["regime"] == row["regime"]) & (cells["recipe"] == row["recipe"][: svc.start()])
                     & (cells["backbone"] == row["backbone"])]
        delta = (100 * (row["metrics.avg_acc"] - base["metrics.avg_acc"].iloc[0])) if len(base) else float("nan")
        spectra = load_diagnostics(uri, row["artifact_uri"]).get("svc_spectra")
        if not spectra:
            continue
        s = gamma_summary(spectra)
        print(f"| {track} | {row['regime']} | `{row['recipe']}` | {delta:+.1f} | {s['keys']} | "
              f"{s['tasks_over_1']:.1f} | {s['gamma_top1']:.2f} | {s['gamma_top10pct']:.2f} | "
              f"{s['gamma_mean']:.2f} | {s['shrunk']:.2f} | {s['energy']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
