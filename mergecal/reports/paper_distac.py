"""The DisTaC paper's analysis figures as report blocks ("DisTaC: Conditioning Task Vectors via Distillation for
Robust Model Merging", arXiv:2508.01148): the data of ``mergecal.pipeline.distac_analysis`` as tables and plots, and
each claim's units (``mergecal.reports.papers`` counts them into a sentence). Exact quantities of one set of
fine-tunes, except the reliability diagrams' confidence gap, whose 95 % interval resamples test examples."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from .plots import Plot, to_svg


def _fmt(value: float | None, digits: str = ".3g") -> str:
    return "—" if value is None else format(value, digits)


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{100 * value:.1f}"


def _plot(stem: str, title: str, regime: str, fig: Figure) -> tuple:
    return ("plot", Plot(stem, "paper", ("vision", "", regime), title, to_svg(fig, stem)))


def _verdict(sign: float | None) -> str:
    return "inconclusive" if sign is None or sign == 0 else "agrees" if sign > 0 else "disagrees"


# ------------------------------------------------------------------------------------------------------ blocks

def _norms_blocks(analysis, data, prefix: str, regime: str) -> list[tuple]:
    tasks, norms = data["tasks"], data["norms"]
    rows = [[[f"`{t}`"], [f"{norms[t]['lr_multiplier']:g}×"], [_fmt(norms[t]["standard"])],
             [_fmt(norms[t]["lengthened"])], [f"{norms[t]['ratio']:.2f}×"], [_pct(norms[t].get("standard_accuracy"))],
             [_pct(norms[t].get("lengthened_accuracy"))]] for t in tasks]
    fig = Figure(figsize=(6.4, 3.2))
    ax = fig.add_subplot()
    x = np.arange(len(tasks))
    ax.bar(x - 0.2, [norms[t]["standard"] for t in tasks], 0.4, label="base lr", color="#999")
    ax.bar(x + 0.2, [norms[t]["lengthened"] for t in tasks], 0.4, label="lengthened (lr multiple)", color="C0")
    ax.set_xticks(x, tasks, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("task-vector norm")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return [("p", "Each task's task-vector norm fine-tuned at the base lr and lengthened (at its lr multiple, "
                  "`vision.norm_mismatch_lr_multiplier`: the regime that lengthens that task), and each fine-tune's "
                  "own test accuracy: the paper's lengthened models stay as accurate (its Table 1's Individual row), "
                  "so a low one here is a fine-tune the multiple broke, whose merge's normalized accuracy divides by "
                  "it."),
            ("table", ["task", "lr multiple", "norm, base lr", "norm, lengthened", "ratio",
                       "test accuracy (%), base lr", "test accuracy (%), lengthened"], rows),
            _plot(prefix, f"{analysis.item}: task-vector norms", regime, fig)]


def _entropy_blocks(analysis, data, prefix: str, regime: str) -> list[tuple]:
    tasks, found = data["tasks"], data["entropy"]
    rows = [[[f"`{t}`"], [_fmt(found[t]["standard"])], [_fmt(found[t]["low_confidence"])],
             [f"{found[t]['low_confidence'] / found[t]['standard']:.1f}×" if found[t]["standard"] else "—"]]
            for t in tasks]
    fig = Figure(figsize=(6.4, 3.2))
    ax = fig.add_subplot()
    x = np.arange(len(tasks))
    ax.bar(x - 0.2, [found[t]["standard"] for t in tasks], 0.4, label="standard", color="#999")
    ax.bar(x + 0.2, [found[t]["low_confidence"] for t in tasks], 0.4, label="low confidence", color="C1")
    ax.set_yscale("log")
    ax.set_xticks(x, tasks, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("mean prediction entropy (nats)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return [("table", ["task", "standard", "low confidence", "ratio"], rows),
            _plot(prefix, f"{analysis.item}: prediction entropy", regime, fig)]


SERIES = (("relative_accuracy", "accuracy / teacher (%)"), ("norm_change_percent", "‖τ‖ change (%)"),
          ("entropy", "entropy (nats)"))


def _trajectory_blocks(analysis, data, prefix: str, regime: str) -> list[tuple]:
    blocks: list[tuple] = []
    for setting, found in data.items():
        steps = found["steps"]
        rows = [[[str(step)]] + [[f"{found[s]['mean'][i]:.3g} ± {_fmt(found[s]['sd'][i], '.2g')}"] for s, _ in SERIES]
                for i, step in enumerate(steps)]
        fig = Figure(figsize=(9.0, 2.8))
        for j, (series, label) in enumerate(SERIES, 1):
            ax = fig.add_subplot(1, len(SERIES), j)
            mean = np.array(found[series]["mean"], dtype=float)
            sd = np.array([np.nan if v is None else v for v in found[series]["sd"]], dtype=float)
            ax.plot(steps, mean, color=f"C{j - 1}", linewidth=1.2)
            ax.fill_between(steps, mean - sd, mean + sd, color=f"C{j - 1}", alpha=0.2, linewidth=0)
            ax.set_xlabel("DisTaC step", fontsize=7)
            ax.set_title(label, fontsize=8)
            ax.tick_params(labelsize=6)
        fig.suptitle(f"{analysis.item}: {setting} (mean over {len(found['tasks'])} conditioned models, band ± sd)",
                     fontsize=9)
        fig.tight_layout()
        blocks += [("h3", setting.replace("_", " ")),
                   ("p", f"Mean ± sd over the {len(found['tasks'])} conditioned models "
                         f"({', '.join(f'`{t}`' for t in found['tasks'])}); step 0 is DisTaC's start θ₀ + κτ."),
                   ("table", ["step", *[label for _, label in SERIES]], rows),
                   _plot(f"{prefix}-{setting}", f"{analysis.item}: {setting}", regime, fig)]
    return blocks


def _kappa_blocks(analysis, data, prefix: str, regime: str) -> list[tuple]:
    tasks = list(data["per_task"])
    kappas = data["per_task"][tasks[0]]["kappas"]
    rows = [[[f"`{t}`"]] + [[f"{100 * a:.1f}"] for a in data["per_task"][t]["accuracy"]] for t in tasks]
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    for i, task in enumerate(tasks):
        entry = data["per_task"][task]
        ax.plot(entry["kappas"], [100 * a for a in entry["accuracy"]], label=task, color=f"C{i % 10}", linewidth=1,
                marker="o", markersize=2)
    ax.axvline(1.0, color="#888", linewidth=0.8, linestyle="--")
    ax.set_xlabel("κ (θ₀ + κτ)")
    ax.set_ylabel("test accuracy (%)")
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return [("p", "Each task's test accuracy (%) of θ₀ + κτ (κ = 0: the pretrained model, 1: the fine-tune)."),
            ("table", ["task", *[f"κ {k:g}" for k in kappas]], rows),
            _plot(prefix, f"{analysis.item}: accuracy against κ", regime, fig)]


def _reliability_blocks(analysis, data, prefix: str, regime: str) -> list[tuple]:
    rows = []
    fig = Figure(figsize=(4.2, 4.0))
    ax = fig.add_subplot()
    ax.plot([0, 1], [0, 1], color="#888", linewidth=0.8, linestyle="--", label="perfectly calibrated")
    for i, name in enumerate(data["regimes"]):
        found = data["diagrams"][name]
        gap = found["gap"]
        rows.append([[f"`{name}`"], [f"{found['alpha']:g}"], [_fmt(found["average"]["ece"])],
                     [f"{100 * gap['gap']:+.1f} [{100 * gap['low']:+.1f}, {100 * gap['high']:+.1f}]"]])
        bins = [b for b in found["average"]["bins"] if b["confidence"] is not None]
        ax.plot([b["confidence"] for b in bins], [b["accuracy"] for b in bins], marker="o", markersize=3,
                color=f"C{i}", linewidth=1, label=f"α = {found['alpha']:g}")
    ax.set_xlabel("confidence (bin mean)")
    ax.set_ylabel("accuracy (bin mean)")
    ax.set_xlim(0, 1), ax.set_ylim(0, 1)
    ax.legend(fontsize=7)
    fig.tight_layout()
    return [("p", "Reliability of each task's fine-tune on its test split (10 equal-width confidence bins, averaged "
                  "over the tasks); the gap is mean confidence minus accuracy in points (above 0: over-confident) "
                  "with its 95 % interval over test examples."),
            ("table", ["regime", "label smoothing α", "ECE (mean over tasks)", "confidence − accuracy (points)"],
             rows),
            _plot(prefix, f"{analysis.item}: reliability diagrams", regime, fig)]


PANELS = ("mlp", "attention", "layernorm")


def _layer_norm_blocks(analysis, data, prefix: str, regime: str) -> list[tuple]:
    kind = analysis.merges[0]
    rows = [[[s["panel"]], [_fmt(s["ratio_mean"])], [_fmt(s["ratio_min"])], [_fmt(s["ratio_max"])],
             [_fmt(s["ratio_cv"])]] for s in data["summary"] if s["kind"] == kind]
    overall = data["overall"][kind]
    fig = Figure(figsize=(9.0, 3.0))
    for j, panel in enumerate(PANELS, 1):
        ax = fig.add_subplot(1, len(PANELS), j)
        chosen = [r for r in data["rows"] if r["panel"] == panel and r["kind"] == kind]
        x = np.arange(len(chosen))
        ax.bar(x - 0.2, [r["standard"] for r in chosen], 0.4, color="#999", label="base lr")
        ax.bar(x + 0.2, [r["lengthened"] for r in chosen], 0.4, color="C0", label="lengthened")
        ax.set_xticks(x, [f"{r['layer']}.{r['module']}" for r in chosen], rotation=90, fontsize=5)
        ax.set_title(panel, fontsize=8)
        ax.tick_params(labelsize=6)
        if j == 1:
            ax.set_ylabel("task-vector norm (mean over tasks)", fontsize=7)
            ax.legend(fontsize=6)
    fig.tight_layout()
    return [("p", f"Per {kind} key of the image encoder, the task vectors' norm averaged over the tasks, base lr "
                  f"against lengthened (each task at the lr multiple): ratio median "
                  f"{_fmt(overall['ratio_median'])}, coefficient of variation {_fmt(overall['ratio_cv'])} over "
                  f"{overall['rows']} keys ({overall['rows_above_one']} above 1)."),
            ("table", ["panel", "ratio mean", "min", "max", "cv"], rows),
            _plot(prefix, f"{analysis.item}: per-layer norms ({kind})", regime, fig)]


RENDER: dict[str, Callable[..., list[tuple]]] = {
    "distac_norms": _norms_blocks, "distac_entropy": _entropy_blocks, "distac_trajectory": _trajectory_blocks,
    "distac_kappa": _kappa_blocks, "distac_reliability": _reliability_blocks,
    "distac_layer_norms": _layer_norm_blocks}

HOW = {"distac_norms": "the standard regime's fine-tunes against each task's lengthened one",
       "distac_entropy": "the standard and low-confidence regimes' fine-tunes on their test splits",
       "distac_trajectory": "DisTaC's step as the board runs it (docs/protocols.md#distac), observed every 10 steps "
                            "on the test split",
       "distac_kappa": "each task's standard fine-tune, scaled",
       "distac_reliability": "the fine-tunes of each label-smoothing strength",
       "distac_layer_norms": "the standard regime's fine-tunes against each task's lengthened one"}


# ------------------------------------------------------------------------------------------------------- units

def claim_units(claim, merges: Sequence[str], data: Mapping[str, Any]) -> list[dict]:
    """Each unit's verdict on a DisTaC analysis claim (``UNITS`` says what a unit is)."""
    kind = claim.kind
    if kind == "larger_norm":
        return [{"task": t, "ratio": round(v["ratio"], 4), "verdict": _verdict(v["ratio"] - 1)}
                for t, v in data["norms"].items()]
    if kind == "higher_entropy":
        return [{"task": t, "standard": v["standard"], "low_confidence": v["low_confidence"],
                 "verdict": _verdict(v["low_confidence"] - v["standard"])} for t, v in data["entropy"].items()]
    if kind in ("above_start", "entropy_falls"):
        found = data[claim.setting]
        series = "relative_accuracy" if kind == "above_start" else "entropy"
        out = []
        for task, entry in found["per_task"].items():
            start, end = entry[series][0], entry[series][-1]
            change = end - start if kind == "above_start" else start - end
            out.append({"task": task, "start": start, "end": end, "verdict": _verdict(change)})
        return out
    if kind in ("below_zero_shot", "shrink_better"):
        key = "below_zero_shot_at_max" if kind == "below_zero_shot" else "shrink_better"
        return [{"task": t, key: v[key], "verdict": "agrees" if v[key] else "disagrees"}
                for t, v in data["per_task"].items()]
    if kind in ("over_confident", "under_confident"):
        gap = data["diagrams"][claim.setting]["gap"]
        sign = 1 if gap["low"] > 0 else -1 if gap["high"] < 0 else 0
        return [{"regime": claim.setting, "gap": gap, "verdict": _verdict(sign if kind == "over_confident" else -sign)}]
    if kind == "best_calibrated":
        ece = {name: d["average"]["ece"] for name, d in data["diagrams"].items()}
        others = [v for name, v in ece.items() if name != claim.setting]
        return [{"regime": claim.setting, "ece": ece, "verdict": _verdict(min(others) - ece[claim.setting])}]
    if kind == "every_layer_larger":
        chosen = merges[0]
        return [{"key": r["key"], "ratio": r["ratio"],
                 "verdict": _verdict(None if r["ratio"] is None else r["ratio"] - 1)}
                for r in data["rows"] if r["kind"] == chosen]
    raise KeyError(kind)


#: claims decided by an interval rather than an exact quantity: how (``papers.analysis_sentence``)
BASIS = {kind: "the gap's 95 % interval over the test examples: above 0 over-confident, below 0 under-confident, "
               "holding 0 undecided; one set of fine-tunes"
         for kind in ("over_confident", "under_confident")}

UNITS = {"larger_norm": "tasks", "higher_entropy": "tasks", "above_start": "conditioned models",
         "entropy_falls": "conditioned models", "below_zero_shot": "tasks", "shrink_better": "tasks",
         "over_confident": "regime", "under_confident": "regime", "best_calibrated": "regime",
         "every_layer_larger": "keys"}
