"""FSC's task feature, the authors' code (module replay) against the paper's Eq. 3 (whole network), measured (#29).

    .venv/bin/python scripts/measure_fsc_task_feature.py --root <a finished run of the default>

Reads a finished run's models and data (nothing is written there) and computes, as the pipeline's vision cells
do (``tracks.vision.run``: the committed sensitivity ranking, the FSC step's samples), MAGIC's fixed-scaling rows
of one merge: the merge at λ (0.3, MAGIC's), then FSC with ``task_feature=module_replay`` (the default) and with
``task_feature=network``. Prints each row's average test accuracy, the change network − module_replay with its
paired 95 % bootstrap interval (``mergecal.reports.intervals``), and per hooked module the mean ξ of both forms,
as measured (Eq. 18, before the conservative rule) and as applied (after it).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mergecal.calibrations import fsc as fsc_module  # noqa: E402
from mergecal.pipeline.cells import run_cell  # noqa: E402
from mergecal.pipeline.chains import calibration_name  # noqa: E402
from mergecal.pipeline.config import parse_params  # noqa: E402
from mergecal.pipeline.tracks.vision import cells as vision  # noqa: E402
from mergecal.reports.intervals import paired_interval  # noqa: E402

CHAINS = {"merge": "{merge}", "module_replay": "{merge}>fsc", "network": "{merge}>fsc(task_feature=network)"}


def protocol_params(root: Path, merge: str, scaling: float):
    """The run's params.yaml with one fixed-scaling protocol: ``CHAINS`` around ``merge`` at ``scaling``."""
    data = yaml.safe_load((root / "params.yaml").read_text())
    data["benchmark"]["fixed_scaling"] = [{"scaling": scaling, "merges": [merge], "chains": list(CHAINS.values())}]
    return parse_params(data, str(root / "params.yaml"))


def measured_ratios(calibrate, measured: list):
    """``calibrate_fsc`` that also keeps each module's measured ratio (the cell's diagnostics keep the applied one)."""
    def wrapper(*args, **kwargs):
        model = calibrate(*args, **kwargs)
        measured.append({name: float(record.raw_ratio.float().mean()) for name, record in model.records.items()})
        return model
    return wrapper


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=".", help="a finished run (its params.yaml, data/ and models/)")
    parser.add_argument("--regime", default="standard")
    parser.add_argument("--merge", default="task_arithmetic")
    parser.add_argument("--scaling", type=float, default=0.3)
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    root = Path(args.root)
    params = protocol_params(root, args.merge, args.scaling)
    cells = {c.calibration: c for c in vision.cells(params) if c.regime == args.regime and c.merge == args.merge}
    measured: list[dict[str, float]] = []
    calibrate = fsc_module.calibrate_fsc
    fsc_module.calibrate_fsc = measured_ratios(calibrate, measured)  # run_recipe imports it at each FSC step
    try:
        results = {}
        for form, chain in CHAINS.items():
            cell = cells[calibration_name(chain.replace("{merge}", f"{{merge}}(scaling={args.scaling})"))]
            results[form] = run_cell(cell, params, root, device=args.device)
            print(f"{form}: {cell.recipe}", flush=True)
    finally:
        fsc_module.calibrate_fsc = calibrate
    tasks = list(params.vision.tasks)
    weights = [1 / len(tasks)] * len(tasks)
    print(f"\n{args.merge} at λ = {args.scaling:g}, vision, {args.regime} regime, test split ({len(tasks)} tasks)")
    print("| row | average accuracy (%) |\n|---|---:|")
    for form, result in results.items():
        print(f"| {form} | {100 * result.metrics['avg_acc']:.2f} |")

    def change(row: str, base: str) -> str:
        a, b = results[row], results[base]
        low, high = paired_interval([a.examples[t] for t in tasks], [b.examples[t] for t in tasks], weights)
        return (f"{100 * (a.metrics['avg_acc'] - b.metrics['avg_acc']):+.2f} points, paired 95 % interval "
                f"[{100 * low:+.2f}, {100 * high:+.2f}]")

    print(f"\nnetwork − module_replay: {change('network', 'module_replay')}")
    print(f"module_replay − merge: {change('module_replay', 'merge')}")
    print(f"network − merge: {change('network', 'merge')}")

    applied = {form: results[form].diagnostics["magic_coefficients"]["feature"]
               for form in ("module_replay", "network")}
    replay_raw, network_raw = measured
    print("\nξ per module, mean over its entries (measured: Eq. 18; applied: after the conservative rule)")
    print("| module | module_replay measured | network measured | module_replay applied | network applied |")
    print("|---|---:|---:|---:|---:|")
    for name in replay_raw:
        print(f"| {name} | {replay_raw[name]:.4f} | {network_raw[name]:.4f} | "
              f"{applied['module_replay'][name]:.4f} | {applied['network'][name]:.4f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
