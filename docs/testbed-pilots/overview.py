"""One line per pilot JSON: the criteria figures side by side."""
import json
import sys

import numpy as np

print("| pilot | zero-shot | fine-tuned avg (min) | TA (λ) | TA − zs | ft − TA | mean ‖τ‖/‖θ₀‖ | letters WA / chance |")
print("|---|---|---|---|---|---|---|---|")
for path in sys.argv[1:]:
    r = json.load(open(path))
    rows = r["rows"]
    zs = np.mean([v["zeroshot"] for v in rows.values()])
    ft = np.mean([v["individual"] for v in rows.values()])
    ta = np.mean([v["ta_best"] for v in rows.values()])
    p = r.get("probe", {})
    print(f"| {path.split('/')[-1][:-5]} | {zs:.3f} | {ft:.3f} ({min(v['individual'] for v in rows.values()):.3f}) | "
          f"{ta:.3f} ({r['best_lambda']:g}) | {100 * (ta - zs):+.1f} | {100 * (ft - ta):.1f} | "
          f"{np.mean([v.get('relative_norm', np.nan) for v in rows.values()]):.3f} | "
          f"{p.get('weight_averaged', np.nan) / p.get('chance', np.nan):.1f}× |")
