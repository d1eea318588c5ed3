"""The papers' diagnostic plots from the cells' ``diagnostics/*.json`` artifacts, as deterministic SVG.

MAGIC: magnitude sensitivity per key and the per-layer calibration coefficients in weight vs feature
space. SVC: singular values of the merged task matrices before/after calibration. DisTaC: task-vector
norms and prediction entropy per task. Plus validation accuracy vs the task-vector scaling.
One figure per (backbone, task set, regime) and kind, one series per distinct artifact, labelled with
the recipes that logged it: recipes compare at a glance and a full matrix stays a few dozen figures.
Figures are built on ``matplotlib.figure.Figure`` (no pyplot state, no backend switch) and saved as SVG
with text kept as text, a fixed hash salt and no date, so the same runs give small, byte-identical files.
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass

import matplotlib
import pandas as pd
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .runs import GROUP, metric

MAX_SPECTRA = 6  # matrices shown side by side for SVC: evenly spaced over the model's depth
MAX_POINTS = 128  # points drawn per spectrum: singular values are sorted, so a thinned curve looks the same
MARKERS = ("o", "s", "^", "D", "v")


@dataclass(frozen=True)
class Plot:
    name: str  # file stem, unique within a report
    kind: str  # sensitivity | magic_coefficients | svc_spectra | task_vectors | scaling_curve | history
    group: tuple[str, str, str]  # (backbone, task_set, regime)
    title: str
    svg: str


def natural_key(name: str) -> tuple:
    """Sort ``resblocks.2`` before ``resblocks.10``."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in re.split(r"(\d+)", name))


def block_index(name: str) -> int | None:
    """The first all-digit dotted component of a key or module name (its transformer block)."""
    for part in name.split("."):
        if part.isdigit():
            return int(part)
    return None


def short_names(names: list[str]) -> list[str]:
    """Drop the dotted prefix every name shares, so axis labels stay readable."""
    if len(names) < 2:
        return list(names)
    split = [n.split(".") for n in names]
    common = 0
    while all(len(s) > common + 1 and s[common] == split[0][common] for s in split):
        common += 1
    if common and all(s[common].isdigit() for s in split):
        common -= 1  # keep the container of a block index: "resblocks.3.attn", not "3.attn"
    return [".".join(s[common:]) for s in split]


def slug(text: str, limit: int = 120) -> str:
    """A file-name-safe form of ``text``; long ones are cut and suffixed with a hash so they stay unique."""
    out = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")
    if len(out) > limit:
        import hashlib

        out = out[: limit - 13] + "-" + hashlib.sha256(out.encode()).hexdigest()[:12]
    return out


Series = Sequence[tuple[str, object]]  # (label, artifact) per distinct artifact


def to_svg(fig: Figure, salt: str) -> str:
    """SVG text of ``fig``; ids are salted per plot and the date is left out, so output is reproducible."""
    buffer = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": salt, "svg.fonttype": "none"}):
        fig.savefig(buffer, format="svg", metadata={"Date": None})
    return buffer.getvalue()


def _style(index: int, marker: str | None = None) -> dict:
    """Ten colours, then the same colours with other markers: series stay distinguishable past ten."""
    return {"color": f"C{index % 10}", "marker": marker if index < 10 else MARKERS[(index // 10 - 1) % len(MARKERS)],
            "markersize": 3}


def _height(base: float, entries: int) -> float:
    """Tall enough for a one-column legend of ``entries`` lines beside the axes."""
    return max(base, 1.0 + 0.14 * entries)


def _legend(ax, count: int) -> None:
    if count > 1:
        ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))


def sensitivity_figure(series: Series, title: str) -> Figure | None:
    """Probe score per key in model order: bars for one probe, a keys x probes heat map for several."""
    metrics = sorted({str(data.get("metric") or "score").replace("_", " ") for _, data in series})
    series = [(label, {k: float(v) for k, v in (data.get("scores") or {}).items()}) for label, data in series]
    series = [(label, scores) for label, scores in series if scores]
    if not series:
        return None
    keys = sorted({k for _, scores in series for k in scores}, key=natural_key)
    width = 7.0 if len(series) == 1 else 4.0 + 0.35 * len(series)
    fig = Figure(figsize=(width, 1.6 + 0.14 * len(keys)), layout="constrained")
    ax = fig.subplots()
    if len(series) == 1:
        scores = series[0][1]
        ax.barh(range(len(keys)), [scores.get(k, float("nan")) for k in keys], color="C0")
        ax.invert_yaxis()
        ax.set_xlabel(" / ".join(metrics))
    else:
        grid = [[scores.get(k, float("nan")) for _, scores in series] for k in keys]
        image = ax.imshow(grid, aspect="auto", cmap="viridis", interpolation="nearest")
        ax.set_xticks(range(len(series)), [label for label, _ in series], rotation=45, ha="right", fontsize=6)
        fig.colorbar(image, ax=ax, label=" / ".join(metrics), shrink=0.5)
    ax.set_yticks(range(len(keys)), short_names(keys), fontsize=6)
    ax.set_title(title, fontsize=9)
    return fig


def coefficients_figure(series: Series, title: str) -> Figure | None:
    """Per-block mean coefficient in weight space (WSC) and feature space (FSC), one line per artifact."""
    spaces = (("weight", "weight space (WSC)"), ("feature", "feature space (FSC)"))
    if not any((data.get(space) or {}) for _, data in series for space, _ in spaces):
        return None
    fig = Figure(figsize=(10, _height(3.4, len(series))), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    unplaced = set()
    for ax, (space, label) in zip(axes, spaces):
        for i, (name, data) in enumerate(series):
            per_block: dict[int, list[float]] = {}
            for key, value in (data.get(space) or {}).items():
                b = block_index(key)
                if b is None:
                    unplaced.add(key)
                else:
                    per_block.setdefault(b, []).append(float(value))
            blocks = sorted(per_block)
            if blocks:
                ax.plot(blocks, [sum(per_block[b]) / len(per_block[b]) for b in blocks], label=name,
                        **_style(i, "o"))
        ax.set_title(label + ", mean per block", fontsize=8)
        ax.set_xlabel("block")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes[0].set_ylabel("coefficient")
    _legend(axes[1], len(series))
    note = f" ({len(unplaced)} names without a block index not shown)" if unplaced else ""
    fig.suptitle(title + note, fontsize=9)
    return fig


def thin(values: list[float], limit: int = MAX_POINTS) -> tuple[list[int], list[float]]:
    """(1-based index, value) at most ``limit`` evenly spaced points, first and last kept."""
    if len(values) <= limit:
        return list(range(1, len(values) + 1)), values
    picks = sorted({round(i * (len(values) - 1) / (limit - 1)) for i in range(limit)})
    return [p + 1 for p in picks], [values[p] for p in picks]


def spectra_figure(series: Series, title: str, max_keys: int = MAX_SPECTRA) -> Figure | None:
    """Singular values before (dashed) and after (solid) SVC for up to ``max_keys`` matrices spread over
    the model's depth; one colour per artifact."""
    keys = sorted({k for _, data in series for k, v in data.items() if v.get("before") or v.get("after")},
                  key=natural_key)
    if not keys:
        return None
    if len(keys) > max_keys:
        keys = [keys[round(i * (len(keys) - 1) / (max_keys - 1))] for i in range(max_keys)]
    cols = min(3, len(keys))
    rows = -(-len(keys) // cols)
    fig = Figure(figsize=(3.4 * cols + (2.5 if len(series) > 1 else 0), _height(2.6 * rows + 0.5, len(series))),
                 layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False)
    for ax, key, short in zip(axes.flat, keys, short_names(keys)):
        for i, (label, data) in enumerate(series):
            style = _style(i)
            for name, line in (("before", "--"), ("after", "-")):
                values = [float(v) for v in (data.get(key) or {}).get(name) or []]
                if values:
                    xs, ys = thin(values)
                    legend = (label if name == "after" else None) if len(series) > 1 else f"{name} SVC"
                    ax.plot(xs, ys, linestyle=line, color=style["color"], linewidth=1, label=legend)
        ax.set_title(short, fontsize=7)
        ax.set_xlabel("index", fontsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.tick_params(labelsize=6)
    for ax in list(axes.flat)[len(keys):]:
        ax.set_visible(False)
    axes.flat[0].set_ylabel("singular value", fontsize=7)
    if len(series) > 1:
        axes.flat[cols - 1].legend(fontsize=6, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    else:
        axes.flat[0].legend(fontsize=6)
    fig.suptitle(title + " (dashed: before SVC, solid: after)", fontsize=9)
    return fig


def task_vectors_figure(series: Series, title: str) -> Figure | None:
    """Task-vector L2 norm and mean prediction entropy per task; grouped bars per artifact."""
    series = [(label, data) for label, data in series if any(isinstance(v, dict) for v in data.values())]
    if not series:
        return None
    tasks = list(dict.fromkeys(t for _, data in series for t in data if isinstance(data[t], dict)))
    fig = Figure(figsize=(max(7.0, 0.7 * len(tasks) + 2), _height(3.4, len(series))), layout="constrained")
    axes = fig.subplots(1, 2)
    width = 0.8 / len(series)
    for ax, field, label in zip(axes, ("norm", "entropy"), ("task-vector L2 norm", "mean prediction entropy")):
        for i, (name, data) in enumerate(series):
            values = [float((data.get(t) or {}).get(field, float("nan"))) for t in tasks]
            ax.bar([j + (i - (len(series) - 1) / 2) * width for j in range(len(tasks))], values, width,
                   color=f"C{i % 10}", label=name)
        ax.set_xticks(range(len(tasks)), tasks, rotation=45, ha="right", fontsize=7)
        ax.set_title(label, fontsize=8)
    _legend(axes[1], len(series))
    fig.suptitle(title, fontsize=9)
    return fig


def scaling_figure(series: Sequence[tuple[str, list[dict], float | None]], title: str) -> Figure | None:
    """``series``: (recipe, points, selected scaling or None); one line per recipe on each panel."""
    series = [c for c in series if c[1]]
    if not series:
        return None
    fig = Figure(figsize=(10, _height(3.6, len(series))), layout="constrained")
    axes = fig.subplots(1, 2)
    for ax, field, label in zip(axes, ("avg_acc", "avg_norm_acc"), ("avg accuracy (%)", "normalized avg (%)")):
        for i, (recipe, points, selected) in enumerate(series):
            pts = sorted((float(p["scaling"]), 100.0 * float(p[field])) for p in points if field in p)
            if not pts:
                continue
            ax.plot([x for x, _ in pts], [y for _, y in pts], label=recipe,
                    **_style(i, "."))
            chosen = [y for x, y in pts if selected is not None and abs(x - selected) < 1e-9]
            if chosen:
                ax.plot([selected], chosen[:1], marker="*", markersize=11, color=_style(i)["color"])
        ax.set_xlabel("scaling (λ / α / κ)")
        ax.set_ylabel(label)
    axes[1].legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(title + " (★ = selected on validation)", fontsize=9)
    return fig


# metrics every track logs per task; any other "<metric>.<task>" names the task's own metric (lm-eval's exact_match)
GENERIC_TASK_METRICS = ("acc", "norm_acc", "entropy", "ece")


def task_metric_names(group: pd.DataFrame, tasks: Sequence[str]) -> dict[str, str]:
    """{task: the name of its score}: "accuracy", or the lm-eval metric the LLM track logs beside ``acc.<task>``."""
    names = {}
    for task in tasks:
        own = sorted({c[len("metrics."):-len(task) - 1] for c in group.columns if c.startswith("metrics.")
                      and c.endswith(f".{task}") and group[c].notna().any()} - set(GENERIC_TASK_METRICS))
        names[task] = own[0] if own else "accuracy"
    return names


def task_scores_figure(group: pd.DataFrame, title: str) -> Figure | None:
    """Per task, the score (lm-eval's metric on the LLM track, accuracy elsewhere) of the reference rows and
    every uncalibrated merge; grouped bars."""
    tasks = list(dict.fromkeys(t for logged in group["tasks"] for t in logged))
    rows = [r for _, r in group.iterrows() if r["calibration"] in ("", "none")]
    if not tasks or not rows:
        return None
    names = task_metric_names(group, tasks)
    fig = Figure(figsize=(max(7.0, 1.2 * len(tasks) + 3), _height(3.6, len(rows))), layout="constrained")
    ax = fig.subplots()
    width = 0.8 / len(rows)
    for i, row in enumerate(rows):
        values = [100.0 * (metric(row, f"acc.{t}") or float("nan")) for t in tasks]
        ax.bar([j + (i - (len(rows) - 1) / 2) * width for j in range(len(tasks))], values, width,
               color=f"C{i % 10}", label=row["recipe"])
    ax.set_xticks(range(len(tasks)), [f"{t}\n({names[t]})" for t in tasks], fontsize=7)
    ax.set_ylabel("score (%)", fontsize=8)
    _legend(ax, len(rows))
    fig.suptitle(title, fontsize=9)
    return fig


def history_figure(series: dict[str, list[float | None]], labels: list[str], title: str) -> Figure | None:
    """``series``: recipe -> value per invocation (fractions, None where absent), over ``labels``."""
    if len(labels) < 2 or not series:
        return None
    fig = Figure(figsize=(max(6.0, 0.8 * len(labels) + 3), _height(3.6, len(series))), layout="constrained")
    ax = fig.subplots()
    for i, (recipe, values) in enumerate(series.items()):
        xs = [j for j, v in enumerate(values) if v is not None]
        ax.plot(xs, [100.0 * values[j] for j in xs], label=recipe, **_style(i, "o"))
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("normalized avg (%)")
    ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    ax.set_title(title, fontsize=9)
    return fig


def _recipes_label(recipes: list[str], limit: int = 3) -> str:
    more = f" (+{len(recipes) - limit})" if len(recipes) > limit else ""
    return ", ".join(recipes[:limit]) + more


FIGURES = {"sensitivity": sensitivity_figure, "magic_coefficients": coefficients_figure,
           "svc_spectra": spectra_figure, "task_vectors": task_vectors_figure}


def diagnostic_plots(cells: pd.DataFrame, diagnostics: dict[str, dict]) -> list[Plot]:
    """Every diagnostic plot of one invocation's ``cells`` (``diagnostics``: run_id -> artifacts).

    One figure per group and artifact kind. Identical artifacts logged by several cells (the fine-tuned
    models' task-vector statistics, a probe shared by recipes) are one series labelled with all their
    recipes. Absent artifacts give no plot.
    """
    plots: list[Plot] = []
    ok = cells[cells["status"] == "ok"]
    for key, group in ok.groupby(list(GROUP), sort=True):
        key = tuple(key)
        group = group.sort_values(["recipe", "run_id"], kind="stable")
        prefix = " · ".join(key)
        for kind, build in FIGURES.items():
            recipes: dict[str, list[str]] = {}
            payload: dict[str, object] = {}
            for _, row in group.iterrows():
                data = diagnostics.get(row["run_id"], {}).get(kind)
                if data:
                    text = json.dumps(data, sort_keys=True)
                    recipes.setdefault(text, []).append(row["recipe"])
                    payload[text] = data
            series = [(_recipes_label(names), payload[text]) for text, names in recipes.items()]
            title = f"{prefix} — {KIND_TITLES[kind]}"
            fig = build(series, title) if series else None
            if fig is not None:
                name = slug(f"{kind}__{'__'.join(key)}")
                plots.append(Plot(name, kind, key, title, to_svg(fig, name)))
        curves = [(row["recipe"], diagnostics.get(row["run_id"], {}).get("scaling_curve") or [],
                   metric(row, "selected_scaling")) for _, row in group.iterrows()]
        title = f"{prefix} — {KIND_TITLES['scaling_curve']}"
        fig = scaling_figure(curves, title)
        if fig is not None:
            name = slug(f"scaling_curve__{'__'.join(key)}")
            plots.append(Plot(name, "scaling_curve", key, title, to_svg(fig, name)))
        title = f"{prefix} — {KIND_TITLES['task_scores']}"
        fig = task_scores_figure(group, title)
        if fig is not None:
            name = slug(f"task_scores__{'__'.join(key)}")
            plots.append(Plot(name, "task_scores", key, title, to_svg(fig, name)))
    return plots


KIND_TITLES = {"sensitivity": "MAGIC magnitude sensitivity per key", "magic_coefficients":
               "MAGIC calibration coefficients per layer", "svc_spectra": "singular values of the merged task matrix",
               "task_vectors": "task vectors (DisTaC diagnostics)", "scaling_curve": "validation accuracy vs scaling",
               "task_scores": "per-task scores of the references and uncalibrated merges (lm-eval metric on LLMs)"}
