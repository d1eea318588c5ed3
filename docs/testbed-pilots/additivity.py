"""Is the merge's damage additive? zs_t + sum_u damage[u][t] (the damage matrix at lambda) against TA at lambda."""
import json
import sys

r = json.load(open(sys.argv[1]))
lam = sys.argv[2] if len(sys.argv) > 2 else "0.3"
rows, dmg = r["rows"], r["damage"]
print(f"{'task':<12}{'zs':>7}{'own':>7}{'others':>8}{'pred':>7}{'TA':>7}")
for t in rows:
    own = dmg[t][t]
    others = sum(dmg[u][t] for u in rows if u != t)
    print(f"{t:<12}{rows[t]['zeroshot']:7.3f}{own:+7.3f}{others:+8.3f}{rows[t]['zeroshot'] + own + others:7.3f}"
          f"{rows[t][f'ta_{lam}']:7.3f}")
