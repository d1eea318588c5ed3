"""Why MAGIC's and DisTaC's steps help or hurt on the vision track: evidence read from the run, not guessed.

    .venv/bin/python scripts/analyze_calibrations.py                  # latest invocation, every regime
    .venv/bin/python scripts/analyze_calibrations.py --regime standard --no-distac

1. MAGIC coefficients, from the MLflow store: for every chain ending in `>wsc` or `>dsc`, its change against its
   merge alone (points) and, over the calibrated keys, the mean, min and max of the per-key coefficient (WSC: ξ, the
   mean row coefficient of a key; FSC: the mean feature-norm ratio of a layer) and the fraction of keys enlarged
   (coefficient > 1). MAGIC's picture is a merge whose magnitudes fell (coefficients > 1 restore them).
2. DisTaC, from the checkpoints on disk (`models/<backbone>/{finetuned,distac}`): per regime and conditioned task,
   ‖τ‖ before and after, test accuracy and mean prediction entropy before and after. DisTaC's intent: the
   longest vector shrunk to the others' mean norm (norm mismatch), entropy lowered (low confidence), accuracy kept.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal.checkpoint import load_state_dict  # noqa: E402
from mergecal.pipeline.config import load_params  # noqa: E402
from mergecal.pipeline.tracking import resolve_uri  # noqa: E402
from mergecal.reports.runs import cells_of, load_diagnostics, load_runs, pick_invocation  # noqa: E402

CALIBRATED = re.compile(r">(wsc|dsc)(\(.*\))?$")  # {merge}>wsc, {merge}>dsc: MAGIC's weight / both steps


def coefficient_summary(values: dict[str, float]) -> str:
    c = np.asarray(list(values.values()), float)
    return f"{len(c)} | {c.mean():.3f} | {c.min():.3f} | {c.max():.3f} | {(c > 1).mean():.2f}"


def magic_table(uri: str, cells, backbone: str, regime: str | None) -> None:
    print("| regime | recipe | Δ avg (points) | space | keys | mean | min | max | enlarged |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|")
    vision = cells[cells["backbone"] == backbone]
    for _, row in vision.sort_values(["regime", "recipe"]).iterrows():
        step = CALIBRATED.search(row["recipe"])
        if step is None or (regime and row["regime"] != regime):
            continue
        base = vision[(vision["regime"] == row["regime"]) & (vision["recipe"] == row["merge"])]  # the merge alone
        delta = 100 * (row["metrics.avg_acc"] - base["metrics.avg_acc"].iloc[0]) if len(base) else float("nan")
        coefficients = load_diagnostics(uri, row["artifact_uri"]).get("magic_coefficients", {})
        for space in ("weight", "feature"):
            if coefficients.get(space):
                print(f"| {row['regime']} | `{row['recipe']}` | {delta:+.1f} | {space} | "
                      f"{coefficient_summary(coefficients[space])} |")


def distac_table(params, root: Path, regime: str | None) -> None:
    import json

    import torch

    from mergecal.pipeline.tracks.vision.stages import VisionModels, evaluate_tasks, is_visual
    from mergecal.task_vectors import task_vector

    torch.set_num_threads(1)
    models = VisionModels(params, root)
    pre = models.visual_pretrained()
    batch = params.benchmark.evaluation.batch_size
    print("| regime | task | κ | ‖τ‖ before | ‖τ‖ after | mean ‖τ‖ of the others | test acc before | after | "
          "entropy before | after |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in params.vision.regimes:
        if regime and name != regime:
            continue
        info = json.loads((models.paths.distac(name) / "distac.json").read_text())
        before = models.finetuned(name)
        norms = {t: _norm(task_vector(s, pre)) for t, s in zip(params.vision.tasks, before)}
        for t, state in zip(params.vision.tasks, before):
            if t not in info["conditioned"]:
                continue
            after = {k: v for k, v in state.items() if not is_visual(k)}
            after |= load_state_dict(models.paths.distac(name) / f"{t}.safetensors")
            scores = [evaluate_tasks(models.model(s), models.heads, models.paths.data, [t], "test",
                                     batch_size=batch)[t] for s in (state, after)]
            others = np.mean([n for u, n in norms.items() if u != t])
            kappa = info["kappas"][params.vision.tasks.index(t)]
            print(f"| {name} | {t} | {kappa:.2f} | {norms[t]:.3f} | {_norm(task_vector(after, pre)):.3f} | "
                  f"{others:.3f} | {100 * scores[0]['accuracy']:.1f} | {100 * scores[1]['accuracy']:.1f} | "
                  f"{scores[0]['entropy']:.4f} | {scores[1]['entropy']:.4f} |")


def _norm(tau) -> float:
    return float(sum(v.double().pow(2).sum() for v in tau.values()) ** 0.5)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".")
    parser.add_argument("--invocation")
    parser.add_argument("--regime")
    parser.add_argument("--no-distac", action="store_true", help="skip the DisTaC table (it evaluates models)")
    args = parser.parse_args(argv)
    root = Path(args.root)
    params = load_params(root / "params.yaml")
    uri = resolve_uri(args.root, params.tracking)
    runs = load_runs(uri, params.tracking.experiment)
    cells = cells_of(runs, pick_invocation(runs, args.invocation))
    magic_table(uri, cells[cells["status"] == "ok"], params.vision.backbone, args.regime)
    if not args.no_distac:
        print()
        distac_table(params, root, args.regime)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
