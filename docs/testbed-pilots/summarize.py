"""Criteria table (issue #14) of a pilot JSON written by scripts/pilot_vision.py --json."""
import json
import sys

import numpy as np

GRID = [0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 1.0]


def summarize(path: str) -> str:
    r = json.load(open(path))
    rows = r["rows"]
    tasks = list(rows)
    ft = {t: rows[t]["individual"] for t in tasks}
    zs = {t: rows[t]["zeroshot"] for t in tasks}
    lam = r["best_lambda"]
    ta = np.mean([rows[t]["ta_best"] for t in tasks])
    ft_avg, zs_avg = np.mean(list(ft.values())), np.mean(list(zs.values()))
    out = [f"### {path}", "",
           "| task | chance | zero-shot | fine-tuned | TA (chosen λ) | ‖τ‖/‖θ₀‖ |", "|---|---|---|---|---|---|"]
    for t in tasks:
        out.append(f"| {t} | {rows[t]['chance']:.3f} | {zs[t]:.3f} | {ft[t]:.3f} | {rows[t]['ta_best']:.3f} | "
                   f"{rows[t].get('relative_norm', float('nan')):.4f} |")
    out.append(f"| **average** | | {zs_avg:.3f} | {ft_avg:.3f} | {ta:.3f} | |")
    out.append("")
    validation = r["ta_normalized_validation"]
    out.append("TA per λ (test avg / normalized validation avg): " + ", ".join(
        f"{lam:g}: {np.mean([rows[t][f'ta_{lam:g}'] for t in tasks]):.3f} / {validation[f'{lam:g}']:.3f}"
        for lam in GRID if f"ta_{lam:g}" in rows[tasks[0]]))
    p = r.get("probe", {})
    checks = [
        ("1. min fine-tuned ≥ 0.80", min(ft.values()), min(ft.values()) >= 0.80),
        ("1. avg fine-tuned ≥ 0.88", ft_avg, ft_avg >= 0.88),
        ("1. zero-shot avg ≤ fine-tuned avg − 0.25", ft_avg - zs_avg, ft_avg - zs_avg >= 0.25),
        ("2. TA ≤ fine-tuned − 0.10", ft_avg - ta, ft_avg - ta >= 0.10),
        ("2. TA ≥ zero-shot + 0.08", ta - zs_avg, ta - zs_avg >= 0.08),
        ("2. chosen λ inside the grid (not its min/max)", lam, GRID[0] < lam < GRID[-1]),
        ("3. ‖τ‖/‖θ₀‖ a few percent (mean)", np.mean([rows[t].get("relative_norm", np.nan) for t in tasks]), None),
        ("5. letters probe, weight-averaged ≥ 3× chance", p.get("weight_averaged", np.nan) / p.get("chance", np.nan),
         p.get("weight_averaged", 0) >= 3 * p.get("chance", 1)),
    ]
    out += ["", "| criterion | measured | met |", "|---|---|---|"]
    out += [f"| {c} | {v:.3f} | {'—' if ok is None else ('yes' if ok else 'NO')} |" for c, v, ok in checks]
    out.append(f"\nletters probe: {p}")
    out.append("timings (s, one thread): " + ", ".join(f"{k} {v:.0f}" for k, v in r["timings"].items()))
    if "damage" in r:
        out += ["", "damage acc_t(θ₀+λτ_u) − zs_t (rows u = vector added, columns t = task scored):", "",
                "| u \\ t | " + " | ".join(t[:8] for t in tasks) + " |", "|---" * (len(tasks) + 1) + "|"]
        out += [f"| {u} | " + " | ".join(f"{r['damage'][u][t]:+.3f}" for t in tasks) + " |" for u in tasks]
    if "cosines" in r:
        out += ["", "task-vector cosines:", "", "| | " + " | ".join(t[:8] for t in tasks) + " |",
                "|---" * (len(tasks) + 1) + "|"]
        out += [f"| {a} | " + " | ".join(f"{r['cosines'][a][b]:+.2f}" for b in tasks) + " |" for a in tasks]
    return "\n".join(out)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(summarize(path))
        print()
