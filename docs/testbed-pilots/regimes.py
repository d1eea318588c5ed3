"""Failure-regime tables (issue #14, item 4) of pilot JSONs written by scripts/pilot_vision.py with more than the
standard regime: per-task prediction entropy of the standard and low-confidence fine-tunes, and per
norm-mismatched task the norm ratio and task arithmetic's normalized loss.

    python docs/testbed-pilots/regimes.py docs/testbed-pilots/p16-*.json
"""
import json
import sys

import numpy as np


def regimes(path: str) -> str:
    r = json.load(open(path))
    rows, rep = r["rows"], r.get("regimes", {})
    tasks = list(rows)
    std = rep.get("standard", {})
    out = [f"### {path}", "", f"standard: TA λ {std.get('best_lambda')}, normalized test "
           f"{100 * std.get('test_norm', float('nan')):.1f} %, mean entropy {std.get('entropy', float('nan')):.3f}"]
    low = rep.get("low_confidence")
    if low:
        out += ["", "| task | zero-shot entropy | standard acc | standard entropy | low-conf acc | low-conf entropy | "
                "ratio |", "|---|---|---|---|---|---|---|"]
        for t in tasks:
            x = rows[t]
            out.append(f"| {t} | {x['zeroshot_entropy']:.3f} | {x['individual']:.3f} | {x['individual_entropy']:.3f} | "
                       f"{x['individual_low_confidence']:.3f} | {x['individual_low_confidence_entropy']:.3f} | "
                       f"{x['individual_low_confidence_entropy'] / x['individual_entropy']:.1f} |")
        ta = low["ta"]
        out += [f"| **mean** | {np.mean([rows[t]['zeroshot_entropy'] for t in tasks]):.3f} | "
                f"{np.mean([rows[t]['individual'] for t in tasks]):.3f} | {std['entropy']:.3f} | "
                f"{low['individual_avg']:.3f} | {low['entropy']:.3f} | **{low['entropy_ratio']:.2f}** |", "",
                f"low-confidence TA: λ {ta['best_lambda']:g}, test {100 * ta['test']:.1f} %, normalized "
                f"{100 * ta['test_norm']:.1f} % (standard {100 * std['test_norm']:.1f} %: "
                f"{100 * low['ta_norm_loss']:+.1f} points lost)"]
    mismatch = rep.get("norm_mismatch")
    if mismatch:
        out += ["", "| mismatched task | norm ratio | its fine-tuned acc (standard) | TA norm. at standard λ | loss | "
                "own λ | TA norm. at own λ | loss |", "|---|---|---|---|---|---|---|---|"]
        for hot, m in mismatch.items():
            out.append(f"| {hot} | {m['norm_ratio']:.2f} | {m['individual']:.3f} ({m['individual_standard']:.3f}) | "
                       f"{100 * m['ta_norm_at_standard_lambda']:.1f} | {100 * m['loss_at_standard_lambda']:+.1f} | "
                       f"{m['ta']['best_lambda']:g} | {100 * m['ta']['test_norm']:.1f} | "
                       f"{100 * m['loss_at_own_lambda']:+.1f} |")
        out.append(f"| **mean of {len(mismatch)}** | {np.mean([m['norm_ratio'] for m in mismatch.values()]):.2f} | | "
                   f"| {100 * np.mean([m['loss_at_standard_lambda'] for m in mismatch.values()]):+.1f} | | | "
                   f"{100 * np.mean([m['loss_at_own_lambda'] for m in mismatch.values()]):+.1f} |")
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    print("\n".join(regimes(p) for p in sys.argv[1:]))
