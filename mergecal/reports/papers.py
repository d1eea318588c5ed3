"""One report per paper (``reports/papers/<paper>.{md,html,json}`` and ``plots/``): each experiment of
``mergecal.pipeline.experiments`` on the testbed, beside the paper's printed numbers, with its claims checked.

A value is the average normalized accuracy in % with its 95 % percentile-bootstrap interval (the leaderboard's:
``mergecal.intervals``, test examples resampled within each task); a variant's change against its base (or
another variant) is the paired interval of the per-example differences, in points. A claim's verdict per merge
(per regime and seed) is computed from that interval alone: ``agrees`` where it excludes 0 on the paper's side,
``disagrees`` where it excludes 0 on the other, ``inconclusive`` where it holds 0; the sentence under each claim
counts them and is never written by hand. Nothing here depends on when or where the cells ran (no run ids,
dates, seconds), so the same cells give the same bytes; a method's time or memory comes from a committed
measurement file (a dependency of the stage), read as it is.
"""

from __future__ import annotations

import html
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from ..errors import MergecalError
from ..intervals import paired_interval, stratified_interval
from ..methods import MERGE_METHODS
from ..recipe import Recipe
from . import paper_distac
from .claims import (REFERENCE_ROWS, VERDICTS, fmt_change, fmt_interval, interval_points, overall, sentence,
                     verdict)
from .leaderboard import column_samples
from .plots import Plot, to_svg
from .write import CSS, _figure



@dataclass(frozen=True)
class Outcome:
    """A cell's result as a report reads it: its metrics and per-example test scores by task (None: not kept)."""

    metrics: Mapping[str, float]
    examples: Mapping[str, list] | None


@dataclass
class Group:
    """One (regime, seed) of an experiment: per merge, each variant's outcome; the fine-tuned reference."""

    regime: str
    seed: int
    tasks: tuple[str, ...]
    finetuned: dict[str, float]
    outcomes: dict[str, dict[str, Outcome]] = field(default_factory=dict)  # merge -> variant -> outcome
    references: dict[str, Outcome] = field(default_factory=dict)  # the reference rows: finetuned, multitask, zeroshot


def value(group: Group, outcome: Outcome | None, name: str = "avg_norm_acc") -> tuple[float | None, list | None]:
    """A column's value in % and its 95 % interval (None without the cell or its per-example scores)."""
    if outcome is None or name not in outcome.metrics:
        return None, None
    samples = column_samples(name, group.tasks, outcome.examples, group.finetuned)
    interval = stratified_interval(*samples) if samples is not None else None
    return round(100 * outcome.metrics[name], 2), interval_points(interval)


def change(group: Group, outcome: Outcome | None, other: Outcome | None, name: str = "avg_norm_acc") -> list | None:
    """The paired 95 % interval of ``outcome`` minus ``other`` in points (None where either lacks examples)."""
    if outcome is None or other is None:
        return None
    mine = column_samples(name, group.tasks, outcome.examples, group.finetuned)
    theirs = column_samples(name, group.tasks, other.examples, group.finetuned)
    if mine is None or theirs is None:
        return None
    try:
        return interval_points(paired_interval(mine[0], theirs[0], mine[1]))
    except ValueError:
        return None


def diagonal_interval(group: Group, merge: str, targets: Sequence[str], task: str, than: str = "others"
                      ) -> list | None:
    """Task ``task``'s accuracy when the calibration targets it minus its mean accuracy under the other targets
    (``than="others"``), under the best other target (``"best_other"``) or under the base: the paired interval over
    its test examples, in points."""
    outcomes = group.outcomes.get(merge, {})
    wanted = targets if than in ("others", "best_other") else [task, than]
    scores = {t: (outcomes[t].examples or {}).get(task) for t in wanted if t in outcomes}
    if task not in scores or scores[task] is None or any(s is None for s in scores.values()) or len(scores) < 2:
        return None
    if than == "best_other":  # the other target that scores the task highest (point estimate; ties: the first)
        scores = {task: scores[task], **dict([max(((t, s) for t, s in scores.items() if t != task),
                                                  key=lambda item: float(np.mean(item[1])))])}
    others = np.mean([np.asarray(s, dtype=np.float64) for t, s in scores.items() if t != task], axis=0)
    return interval_points(paired_interval([np.asarray(scores[task], dtype=np.float64)], [others], [1.0]))


def claim_verdicts(experiment, groups: Sequence[Group], claim, variant_names: Sequence[str]) -> list[dict]:
    """Each unit's verdict on ``claim``: per (regime, seed, merge), or per task for ``diagonal``; a claim with a
    ``than_merge`` pairs each merge's ``variant`` with that merge's ``than`` on the same test examples."""
    out = []
    for group in groups:
        for merge in (m for m in experiment.merges if not claim.merges or m in claim.merges):
            outcomes = group.outcomes.get(merge, {})
            if claim.kind == "diagonal":
                for task in variant_names:
                    interval = diagonal_interval(group, merge, variant_names, task, claim.than)
                    out.append({"regime": group.regime, "seed": group.seed, "merge": merge, "task": task,
                                "interval": interval, "verdict": verdict(interval, "gain")})
                continue
            mine, other = (variant_names[-1], variant_names[0]) if claim.kind == "increase" else (claim.variant,
                                                                                                  claim.than)
            than_merge = claim.than_merge or merge
            interval = change(group, outcomes.get(mine), group.outcomes.get(than_merge, {}).get(other))
            unit = {"regime": group.regime, "seed": group.seed, "merge": merge, "variant": mine, "than": other}
            if than_merge != merge:
                unit["than_merge"] = than_merge
            out.append({**unit, "interval": interval,
                        "verdict": verdict(interval, "loss" if claim.kind == "loss" else "gain")})
    return out


def samples_per_task(chain: str) -> str:
    """The unlabelled samples per task a chain's calibrations read, from its recipe: 0 for data-free steps, FSC's
    ``n_samples_per_task`` (task-agnostic ones said so)."""
    steps = Recipe.parse(chain.replace("{merge}", "task_arithmetic")).steps
    for step in steps:
        if step.name == "fsc":
            n = step.params.n_samples_per_task
            return f"0 ({n} task-agnostic)" if step.params.data == "task_agnostic" else str(n)
    return "0"


# ------------------------------------------------------------------------------------------------------- plots

def line_figure(experiment, group: Group, names: Sequence[str], axis: str) -> Figure:
    """Each variant's change against the merge (points, paired 95 % interval), one series per merge."""
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    x = np.arange(len(names))
    for i, merge in enumerate(experiment.merges):
        outcomes = group.outcomes.get(merge, {})
        mids, lows, highs = [], [], []
        for name in names:
            found, base = outcomes.get(name), outcomes.get("base")
            if found is None or base is None:
                mids.append(np.nan), lows.append(0.0), highs.append(0.0)
                continue
            mid = 100 * (found.metrics["avg_norm_acc"] - base.metrics["avg_norm_acc"])
            interval = change(group, found, base)
            mids.append(mid)
            lows.append(max(0.0, mid - interval[0]) if interval else 0.0)  # the interval is rounded, mid is not
            highs.append(max(0.0, interval[1] - mid) if interval else 0.0)
        offset = (i - (len(experiment.merges) - 1) / 2) * 0.05
        ax.errorbar(x + offset, mids, yerr=[lows, highs], label=merge, color=f"C{i % 10}", marker="o", markersize=3,
                    capsize=2, linewidth=1)
    ax.axhline(0, color="#888", linewidth=0.8)
    ax.set_xticks(x, list(names))
    ax.set_xlabel(axis)
    ax.set_ylabel("change vs the merge (points)")
    ax.set_title(f"{experiment.item}: {group.regime}, seed {group.seed}", fontsize=9)
    if len(experiment.merges) > 1:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig


def heatmap_figure(experiment, group: Group, merge: str, names: Sequence[str]) -> Figure:
    """Row i: the calibration targeting task i; column j: accuracy on task j (%), coloured within each column
    from its lowest (light) to its highest (dark) value, as the paper normalises."""
    outcomes = group.outcomes.get(merge, {})
    matrix = np.array([[outcomes[i].metrics.get(f"acc.{j}", np.nan) * 100 if i in outcomes else np.nan
                        for j in group.tasks] for i in names])
    low, high = np.nanmin(matrix, axis=0), np.nanmax(matrix, axis=0)
    shade = (matrix - low) / np.where(high > low, high - low, 1.0)
    fig = Figure(figsize=(1.0 + 0.75 * len(group.tasks), 0.8 + 0.45 * len(names)))
    ax = fig.add_subplot()
    ax.imshow(shade, cmap="Blues", vmin=0, vmax=1.3, aspect="auto")
    for r in range(matrix.shape[0]):
        for c in range(matrix.shape[1]):
            ax.text(c, r, f"{matrix[r, c]:.1f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(group.tasks)), list(group.tasks), rotation=45, ha="right", fontsize=7)
    ax.set_yticks(range(len(names)), list(names), fontsize=7)
    ax.set_xlabel("evaluated task")
    ax.set_ylabel("targeted task")
    ax.set_title(f"{experiment.item}: {merge}, {group.regime}, seed {group.seed}", fontsize=9)
    fig.tight_layout()
    return fig


# ------------------------------------------------------------------------------------------------------ report
# A report is a list of blocks, rendered as Markdown and as HTML: ("h1" | "h2" | "h3" | "p", text),
# ("table", header, rows: each cell a list of lines), ("ul", items), ("plot", Plot). Text may hold `code` and
# **bold**.

def protocol_text(experiment) -> str:
    """How the experiment's merges are scaled, in words."""
    fixed: dict[float, list[str]] = {}
    for merge in experiment.merges:
        if (value := experiment.scaling_of(merge)) is not None:
            fixed.setdefault(value, []).append(merge)
    learned = [m for m in experiment.merges
               if experiment.scaling_of(m) is None and m in MERGE_METHODS and MERGE_METHODS[m].needs_data]
    searched = [m for m in experiment.merges if experiment.scaling_of(m) is None and m not in learned]
    def named(merges: list[str]) -> str:
        return "every merge" if len(merges) == len(experiment.merges) else ", ".join(f"`{m}`" for m in merges)

    parts = [f"λ = {value:g} fixed (no search) for {named(merges)}" for value, merges in fixed.items()]
    if learned:  # AdaMerging: its coefficients are its scale, learned on unlabelled inputs; its grid is 1
        parts.append(f"{named(learned)} with coefficients learned on unlabelled inputs (no λ searched)")
    if searched:
        parts.append(f"{named(searched)} at the scaling searched on validation, a calibration at the scaling its "
                     "merge chose")
    text = "; ".join(parts)
    if fixed and experiment.base_scaling == "searched":
        text += "; the base is each merge at its own searched scaling (the board's), as the paper's original rows"
    return text


def experiment_section(experiment, groups: Sequence[Group], names: Sequence[str], chains: Mapping[str, str],
                       plot_prefix: str, times: tuple[list[tuple], list[dict]] | None = None
                       ) -> tuple[list[tuple], dict]:
    """One experiment's blocks and JSON document; ``times`` (``time_section``: the variants' measured time, where
    the paper prints one) after the testbed's tables."""
    protocol = protocol_text(experiment)
    blocks: list[tuple] = [
        ("h2", f"{experiment.id}: {experiment.item}"),
        ("p", f"**The paper**: {experiment.shows}."),
        ("p", f"**On the testbed**: track {experiment.track}, {protocol}; variants: "
              + ", ".join(f"`{n}` = `{chains[n]}`" for n in ["base", *names]) + ".")]
    document: dict[str, Any] = {"id": experiment.id, "item": experiment.item, "shows": experiment.shows,
                                "variants": {n: chains[n] for n in ["base", *names]}, "groups": [], "claims": []}
    for group in groups:
        blocks += [("h3", f"{group.regime}, seed {group.seed}"),
                   ("p", "Average normalized accuracy (%) [95 % interval]; under it the change against the base in "
                         "points [paired 95 % interval]: ▲ above 0, ▼ below, ≈ inside the noise.")]
        table_rows, rows = [], {}
        for merge in experiment.merges:
            outcomes = group.outcomes.get(merge, {})
            base_value, base_interval = value(group, outcomes.get("base"))
            cells = [[f"`{merge}`"], [fmt_interval(base_value, base_interval)]]
            row = {"base": {"value": base_value, "interval": base_interval}}
            for name in names:
                v, interval = value(group, outcomes.get(name))
                delta = change(group, outcomes.get(name), outcomes.get("base"))
                mid = None if v is None or base_value is None else round(v - base_value, 2)
                cells.append([fmt_interval(v, interval)] + ([fmt_change(delta, mid)] if delta else []))
                row[name] = {"value": v, "interval": interval, "change": mid, "change_interval": delta}
            rows[merge] = row
            table_rows.append(cells)
        blocks.append(("table", ["merge", "base", *names], table_rows))
        if (references := references_text(group)) is not None:
            blocks.append(("p", references))
        if any(samples_per_task(chains[n]) != "0" for n in names):
            blocks.append(("p", "Unlabelled samples per task: " + ", ".join(
                f"`{n}` {samples_per_task(chains[n])}" for n in ["base", *names]) + "."))
        document["groups"].append({"regime": group.regime, "seed": group.seed, "rows": rows,
                                   "references": {n: dict(zip(("value", "interval"), value(group, o)))
                                                  for n, o in group.references.items()}})
        figures = []
        if experiment.plot == "line":
            axis = experiment.sweep.parameter if experiment.sweep else experiment.axis
            figures.append((f"{plot_prefix}-{group.regime}-seed{group.seed}",
                            f"{experiment.item}: change against the merge, {group.regime}",
                            line_figure(experiment, group, names, axis)))
        if experiment.plot == "heatmap":
            for merge in experiment.merges:
                figures.append((f"{plot_prefix}-{merge}-{group.regime}-seed{group.seed}",
                                f"{experiment.item}: {merge}, accuracy per targeted task",
                                heatmap_figure(experiment, group, merge, names)))
        blocks += [("plot", Plot(stem, "paper", (experiment.track, "", group.regime), title, to_svg(fig, stem)))
                   for stem, title, fig in figures]
    if times is not None:
        blocks += times[0]
        document["time"] = times[1]
    if experiment.printed:
        blocks += printed_blocks(experiment, groups, names)
    for claim in experiment.claims:
        found = claim_verdicts(experiment, groups, claim, names)
        unit = "tasks" if claim.kind == "diagonal" else "merges" if len(groups) == 1 else "merge × regime × seed rows"
        counts = verdict_counts(found)
        document["claims"].append(checked(claim, found, sentence(claim.text, counts, unit,
                                                                  sum(1 for r in found if r["verdict"] is None))))
    return blocks + claims_blocks(document["claims"]), document


#: the experiments whose paper prints each method's time beside its accuracy (MAGIC's Table VII), and the committed
#: measurement their time is read from (``mergecal report --costs``): ``make paper`` never times anything
TIMED = {"magic.tab7": "docs/measurements/cell-costs.json"}


def time_section(experiment, names: Sequence[str], chains: Mapping[str, str], root) -> tuple[list[tuple], list[dict]]:
    """Each variant's unlabelled data per task and time, per regime and merge: one pass of its merge and calibration
    steps, the sum of each step's median per-pass seconds in the committed cost file (``TIMED``); "not measured"
    where the file or a step's row is absent."""
    from pathlib import Path

    from .costs import chain_seconds, read_costs

    file = TIMED[experiment.id]
    measured = read_costs(Path(root) / file)
    rows, document = [], []
    for regime in experiment.regimes:
        for merge in experiment.merges:
            for name in ["base", *names]:
                recipe = chains[name].replace("{merge}", merge)
                seconds = None if measured is None else chain_seconds(measured["rows"], experiment.track, regime,
                                                                       recipe)
                seconds = None if seconds is None else round(seconds, 2)
                rows.append([[regime], [f"`{merge}`"], [f"`{name}`"], [samples_per_task(chains[name])],
                             [_fmt_value(seconds) if seconds is not None else "not measured"]])
                document.append({"regime": regime, "merge": merge, "variant": name,
                                 "samples_per_task": samples_per_task(chains[name]), "seconds": seconds})
    where = (f"read from `{file}`, measured on {measured.get('machine') or 'an unnamed machine'}"
             if measured is not None and measured["rows"] else f"`{file}` holds no measurement yet: not measured")
    blocks = [("p", f"**Time**, measured, not recomputed by `make paper` ({where}; `mergecal report --costs` writes "
                    "it from the benchmark's cells): one pass of the merge and its calibration steps, each step's "
                    f"median over the cells of track {experiment.track} that ran it (evaluation and the scaling "
                    f"search excluded). The paper's times, in {experiment.printed_where}, are another device's, not "
                    "compared."),
              ("table", ["regime", "merge", "variant", "unlabelled data per task", "seconds"], rows)]
    return blocks, document


def verdict_counts(units: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    return {v: sum(1 for u in units if u["verdict"] == v) for v in VERDICTS}


def checked(claim, units: list[dict], text: str) -> dict:
    """A claim as a report's JSON holds it: its kind and text, the computed sentence, the counts and each unit."""
    return {"kind": claim.kind, "text": claim.text, "sentence": text, "counts": verdict_counts(units), "units": units}


def claims_blocks(claims: Sequence[Mapping[str, Any]]) -> list[tuple]:
    """The checked claims' sentences under their item (none: nothing)."""
    if not claims:
        return []
    return [("p", "**The paper's claims, checked on the testbed:**"), ("ul", [c["sentence"] for c in claims])]


def printed_blocks(experiment, groups: Sequence[Group], names: Sequence[str]) -> list[tuple]:
    """The paper's printed averages beside the testbed's change, per merge and variant, and whether the testbed's
    paired interval agrees with the printed change's direction (in the first regime and seed)."""
    group = groups[0]
    rows, counts = [], {v: 0 for v in VERDICTS}
    for merge, printed in experiment.printed.items():
        outcomes = group.outcomes.get(merge, {})
        for name in names:
            if name not in printed or "base" not in printed:
                continue
            paper_change = round(printed[name] - printed["base"], 1)
            interval = change(group, outcomes.get(name), outcomes.get("base"))
            found = verdict(interval, "gain" if paper_change > 0 else "loss") if paper_change else None
            if found:
                counts[found] += 1
            shown = f"[{interval[0]:+.1f}, {interval[1]:+.1f}]" if interval else "—"
            rows.append([[f"`{merge}`"], [f"`{name}`"], [f"{printed['base']:.1f} → {printed[name]:.1f}"],
                         [f"{paper_change:+.1f}"], [shown],
                         [found or ("no printed change" if not paper_change else "—")]])
    return [("p", f"**Printed** in {experiment.printed_where}, on other checkpoints and another backbone: their "
                  f"directions compare with the testbed's ({group.regime}, seed {group.seed}), their values do not."),
            ("table", ["merge", "variant", "paper: base → variant", "paper's change", "testbed's change (points)",
                       "direction"], rows),
            ("p", "The printed changes' directions: " + sentence("", counts, "printed changes").split("”: ", 1)[1])]


def paper_blocks(title: str, arxiv: str, sections: Sequence[list[tuple]]) -> list[tuple]:
    head = [("h1", f"{title} (arXiv:{arxiv}): its experiments on the testbed"),
            ("p", "Regenerated by `make paper` from `mergecal/experiments` (a measurement excepted: it is read from "
                  "its committed file); docs/papers.md lists every table and "
                  "figure of the paper and what mergecal does with each. The testbed is mergecal's small ViT and its "
                  "eight tasks, not the paper's checkpoints: a claim is checked by the direction of a paired 95 % "
                  "interval, never by values.")]
    return head + [block for section in sections for block in section]


def to_markdown(blocks: Sequence[tuple]) -> str:
    out = []
    for kind, *rest in blocks:
        if kind in ("h1", "h2", "h3"):
            out += ["#" * int(kind[1]) + " " + rest[0], ""]
        elif kind == "p":
            out += [rest[0], ""]
        elif kind == "ul":
            out += [f"- {item}" for item in rest[0]] + [""]
        elif kind == "table":
            header, rows = rest
            out += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            out += ["| " + " | ".join("<br>".join(cell) for cell in row) + " |" for row in rows] + [""]
        elif kind == "plot":
            out += [f"![{rest[0].title}](plots/{rest[0].name}.svg)", ""]
    return "\n".join(out).rstrip() + "\n"


def _inline(text: str) -> str:
    """`code` and **bold** of escaped text as HTML."""
    import re

    text = html.escape(text, quote=False)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def to_html(title: str, blocks: Sequence[tuple]) -> str:
    """The report as one self-contained HTML page (plots inline)."""
    body = []
    for kind, *rest in blocks:
        if kind in ("h1", "h2", "h3"):
            body.append(f"<{kind}>{_inline(rest[0])}</{kind}>")
        elif kind == "p":
            body.append(f"<p>{_inline(rest[0])}</p>")
        elif kind == "ul":
            body.append("<ul>" + "".join(f"<li>{_inline(i)}</li>" for i in rest[0]) + "</ul>")
        elif kind == "table":
            header, rows = rest
            body.append("<table><tr>" + "".join(f"<th>{_inline(h)}</th>" for h in header) + "</tr>" + "".join(
                "<tr>" + "".join("<td class=\"num\">" + "<br>".join(_inline(x) for x in cell) + "</td>"
                                 for cell in row) + "</tr>" for row in rows) + "</table>")
        elif kind == "plot":
            body.append(_figure(rest[0]))
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


def plots_of(blocks: Sequence[tuple]) -> list[Plot]:
    return [rest[0] for kind, *rest in blocks if kind == "plot"]


def to_json(document: dict) -> str:
    return json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n"


def shown_chains(experiment, found, probed_top: int) -> dict[str, str]:
    """Each variant's chain as the report shows it: a sweep over the probed ranking says which keys in words (they
    differ per regime and seed)."""
    sweep = experiment.sweep
    if sweep is None or sweep.over != "sensitive_top":
        return {v.name: v.chain for v in found}
    return {v.name: v.chain if v.name == "base" else sweep.probed if v.value == probed_top else
            sweep.chain.replace("{sensitive}", f"[the first {v.value} probed keys]") for v in found}


def references_text(group: Group) -> str | None:
    """The group's reference rows in one sentence (average normalized accuracy, % [95 % interval]), None without."""
    shown = [f"`{name}` ({about}) {fmt_interval(*value(group, group.references[name]))}"
             for name, about in REFERENCE_ROWS.items() if name in group.references]
    return "References: " + "; ".join(shown) + "." if shown else None


def experiment_groups(experiment, listed, ids: Mapping, outcomes: Mapping[str, Outcome]) -> list[Group]:
    """The experiment's (regime, seed) groups, in its regimes' order, filled from the cells' outcomes."""
    groups: dict[tuple[str, int], Group] = {}
    for entry in (e for e in listed if e.experiment == experiment.id):
        cell = entry.cell
        group = groups.setdefault((cell.regime, cell.seed), Group(cell.regime, cell.seed, cell.tasks, {}))
        outcome = outcomes.get(ids[cell])
        if outcome is None:
            continue
        if entry.variant in REFERENCE_ROWS:  # the tables compare to finetuned; each is shown under them
            group.references[entry.variant] = outcome
        if entry.variant == "finetuned":
            group.finetuned = {k: v for k, v in outcome.metrics.items() if k.startswith("acc.")}
        elif entry.variant not in REFERENCE_ROWS:
            group.outcomes.setdefault(cell.merge, {})[entry.variant] = outcome
    return [groups[k] for k in sorted(groups, key=lambda k: (experiment.regimes.index(k[0]), k[1]))]


def comparison_scores(comparison, listed, ids: Mapping, outcomes: Mapping[str, Outcome]) -> dict:
    """A comparison's outcomes per fine-tuning seed (``paper_comparisons.Scores``), seeds in order."""
    from .paper_comparisons import Scores

    names = {"base": next(iter(comparison.chains))}
    found: dict[int, tuple[tuple, dict, dict]] = {}
    for entry in (e for e in listed if e.experiment == comparison.id):
        cell = entry.cell
        tasks, by_cell, finetuned, references = found.setdefault(cell.seed, (cell.tasks, {}, {}, {}))
        outcome = outcomes.get(ids[cell])
        if outcome is None:
            continue
        if entry.variant in REFERENCE_ROWS:  # the tables compare to finetuned; each is shown under them
            references[cell.regime, entry.variant] = outcome
        if entry.variant == "finetuned":
            finetuned[cell.regime] = {k: v for k, v in outcome.metrics.items() if k.startswith("acc.")}
        elif entry.variant not in REFERENCE_ROWS:
            by_cell[cell.regime, cell.merge, names.get(entry.variant, entry.variant)] = outcome
    return {seed: Scores(*found[seed]) for seed in sorted(found)}


def write_paper_reports(params, root, outcomes: Mapping[str, Outcome], out_dir,
                        analysis: Mapping[str, Any] | None = None,
                        significance: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``<paper>.md``, ``.html``, ``.json`` and ``plots/<item>-*.svg`` under ``out_dir`` for every paper of
    ``mergecal/experiments``, its sections in the catalogue's order: the experiments from ``outcomes`` (by cell id;
    a missing cell shows as —, outside every count), the analyses from ``analysis`` (results/papers/analysis.json)
    and the significance tests from ``significance`` (results/papers/significance.json; an analysis or a test it
    lacks is said to be missing). SVGs in ``plots/`` that no report drew are removed."""
    from pathlib import Path

    from ..checkpoint import atomic_write_text
    from ..experiments import read
    from ..pipeline.cells import matrix_ids
    from ..pipeline.experiments import (load_analyses, load_comparisons, load_experiments, load_measurements,
                                        paper_cells, variants)
    from ..pipeline.paper_significance import load_significance
    from .paper_comparisons import comparison_section
    from .plots import slug

    out = Path(out_dir)
    cells, listed = paper_cells(params, root)
    ids = dict(zip(cells, matrix_ids(cells, params, root)))
    order = {item["id"]: i for i, item in enumerate(read("catalogue")["items"])}
    analyses, measurements, comparisons = load_analyses(), load_measurements(), load_comparisons()
    tests = load_significance()
    files: dict[str, str] = {}
    for paper, experiments in load_experiments().items():
        about = read(paper)["paper"]
        sections: list[tuple[str, list[tuple], dict]] = []
        for experiment in experiments:
            groups = experiment_groups(experiment, listed, ids, outcomes)
            found = variants(experiment, groups[0].tasks if groups else ())
            names, chains = [v.name for v in found[1:]], shown_chains(experiment, found, params.probing.top)
            times = time_section(experiment, names, chains, root) if experiment.id in TIMED else None
            blocks, document = experiment_section(experiment, groups, names, chains, slug(experiment.id), times)
            sections.append((experiment.id, blocks, document))
        for item in analyses.get(paper, []):
            if analysis is None or item.id not in analysis:
                sections.append((item.id, [("h2", f"{item.id}: {item.item}"),
                                           ("p", "Not computed: results/papers/analysis.json has no entry for it.")],
                                 {"id": item.id, "missing": True}))
                continue
            blocks, document = analysis_section(item, analysis[item.id], slug(item.id))
            sections.append((item.id, blocks, document))
        for item in measurements.get(paper, []):
            sections.append((item.id, *measurement_section(item, Path(root))))
        for item in comparisons.get(paper, []):
            blocks, document = comparison_section(item, comparison_scores(item, listed, ids, outcomes), slug(item.id))
            sections.append((item.id, blocks, document))
        for item in tests.get(paper, []):
            if significance is None or item.id not in significance:
                sections.append((item.id, [("h2", f"{item.id}: {item.item}"), (
                    "p", "Not computed: results/papers/significance.json has no entry for it.")],
                                 {"id": item.id, "missing": True}))
                continue
            blocks, document = significance_section(item, significance[item.id], slug(item.id))
            sections.append((item.id, blocks, document))
        sections.sort(key=lambda s: order.get(s[0], len(order)))
        blocks = paper_blocks(about["title"], about["arxiv"], [b for _, b, _ in sections])
        for plot in plots_of(blocks):
            files[f"plots/{plot.name}.svg"] = plot.svg
        files[f"{paper}.md"] = to_markdown(blocks)
        files[f"{paper}.html"] = to_html(about["title"], blocks)
        files[f"{paper}.json"] = to_json({"paper": about, "items": [d for _, _, d in sections]})
    # every paper rendered before any file is written: a failure leaves the reports as they were
    written = {name: atomic_write_text(out / name, text) for name, text in files.items()}
    for stale in sorted((out / "plots").glob("*.svg")):
        if f"plots/{stale.name}" not in written:
            stale.unlink()
    return dict(sorted(written.items()))


def measurement_section(item, root) -> tuple[list[tuple], dict]:
    """A method's own cost from committed `mergecal perf` files, beside the paper's printed figures (another
    device: no claim is checked)."""
    from pathlib import Path

    rows, document = [], {"id": item.id, "item": item.item, "shows": item.shows, "rows": []}
    setting = ""
    for measured in item.measured:
        path = Path(root) / measured.file
        found = None
        if path.is_file():
            try:
                data = json.loads(path.read_text())
                found = next((r for r in data["rows"] if r["label"] == measured.row), None)
                setting = f"K = {data['setting']['tasks']}, {data['setting']['threads']} thread(s)"
                if found is not None:
                    found = {"seconds": float(found["seconds"]), "peak_extra_mb": float(found["peak_extra_mb"])}
            except (ValueError, KeyError, TypeError) as err:
                raise MergecalError(f"{measured.file}: not a `mergecal perf` JSON with `setting` and `rows` of "
                                    f"seconds and peak_extra_mb ({type(err).__name__}: {err})") from None
        printed = item.printed.get(measured.shape, {})
        seconds = None if found is None else round(found["seconds"], 2)
        mib = None if found is None else round(found["peak_extra_mb"], 1)
        rows.append([[measured.shape], [_fmt_value(seconds)], [_fmt_value(mib)], [_fmt_value(printed.get("seconds"))],
                     [_fmt_value(printed.get("mib"))], [f"`{measured.file}`" if found else "not measured"]])
        document["rows"].append({"shape": measured.shape, "seconds": seconds, "peak_extra_mib": mib,
                                 "printed": printed or None})
    for shape, printed in item.printed.items():
        if shape not in {m.shape for m in item.measured}:
            rows.append([[shape], ["—"], ["—"], [_fmt_value(printed["seconds"])], [_fmt_value(printed["mib"])],
                         ["not measured here"]])
    blocks = [("h2", f"{item.id}: {item.item}"), ("p", f"**The paper**: {item.shows}."),
              ("p", f"**Measured**, not recomputed by `make paper` (`{item.command}`, {setting or 'no file yet'}): "
                    "the calibration alone on task vectors of each backbone's shapes, on this project's CPU; the "
                    f"paper's figures ({item.printed_where}) are another device's, shown beside and not compared, "
                    "so no claim is checked."),
              ("table", ["shape", "seconds", "peak extra MiB", "paper: seconds", "paper: MiB", "measured in"], rows)]
    return blocks, document


# ---------------------------------------------------------------------------------------------------- analyses
# Figures computed from the testbed's models (results/papers/analysis.json, mergecal.pipeline.paper_analysis): exact
# functions of one set of fine-tunes, so their claims are counted without an interval, and say so.

SHOWN_RANKS = 32  # subspaces r drawn in a spectrum plot (the top ones the papers discuss)
TOP_SUBSPACES = 3  # "a few top subspaces" (SVC's Fig. 1; Fig. 3 shows r = 1..3)
NOISE = 1e-3  # a gap smaller than this share of its singular value counts as none
STRONG = 0.5  # MAGIC's "strong consistency" of two tasks' layer sensitivities: Spearman's rho at least this


EXACT = ("an exact quantity of one set of fine-tunes: no interval; another seed's fine-tunes are another draw")


def analysis_sentence(text: str, counts: Mapping[str, int], unit: str, basis: str = EXACT) -> str:
    """A claim on an analysis: the units that agree or disagree, counted (``basis``: by default no sampling, no
    interval)."""
    total = sum(counts.get(v, 0) for v in VERDICTS)
    if not total:
        return f"“{text}”: nothing on the testbed measures it."
    return (f"“{text}”: on the testbed's models it {overall(counts)} — {counts.get('agrees', 0)} of {total} {unit} "
            f"agree, {counts.get('disagrees', 0)} disagree, {counts.get('inconclusive', 0)} undecided ({basis}).")


def _spectrum_figure(title: str, classes: Mapping[str, Any]) -> Figure:
    names = list(classes)
    fig = Figure(figsize=(3.2 * len(names), 3.0))
    for i, name in enumerate(names, 1):
        ax = fig.add_subplot(1, len(names), i)
        spectrum = classes[name]["spectrum"]
        r = spectrum["r"][:SHOWN_RANKS]
        for j, (series, label) in enumerate((("sigma", "σ"), ("sigma_star", "σ*"), ("gamma_sigma", "γσ (SVC)"))):
            values = [np.nan if v is None else v for v in spectrum[series][:SHOWN_RANKS]]
            ax.plot(r, values, label=label, color=f"C{j}", linewidth=1, marker="o" if j == 1 else None, markersize=2)
        ax.set_title(name, fontsize=8)
        ax.set_xlabel("subspace r", fontsize=7)
        ax.tick_params(labelsize=6)
        if i == 1:
            ax.set_ylabel("singular value (class mean)", fontsize=7)
            ax.legend(fontsize=6)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def _cross_figure(title: str, classes: Mapping[str, Any], tasks: Sequence[str]) -> Figure:
    names = list(classes)
    fig = Figure(figsize=(3.0 * len(names), 3.3))
    for i, name in enumerate(names, 1):
        ax = fig.add_subplot(1, len(names), i)
        matrix = np.array(classes[name]["cross_terms"][0], dtype=float)
        bound = float(np.nanmax(np.abs(matrix))) or 1.0
        ax.imshow(matrix, cmap="RdBu_r", vmin=-bound, vmax=bound)
        ax.set_xticks(range(len(tasks)), list(tasks), rotation=90, fontsize=5)
        ax.set_yticks(range(len(tasks)), list(tasks), fontsize=5)
        ax.set_title(f"{name}, r = 1", fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def _verdict_of(sign: float | None) -> str:
    return "inconclusive" if sign is None or sign == 0 else "agrees" if sign > 0 else "disagrees"


def _svc_units(claim, merges: Sequence[str], data: Mapping[str, Any]) -> list[dict]:
    out = []
    for merge, found in ((m, data[m]) for m in merges if m in data):
        for name, entry in found["classes"].items():
            if claim.kind == "top_gap":
                gap = entry["spectrum"]["gap"][0]
                out.append({"merge": merge, "class": name, "gap_1": gap, "verdict": _verdict_of(gap)})
            elif claim.kind == "top_concentrated":  # the scale-free inflation 1 - sigma*/sigma (sigma falls with r)
                inflation = [1 - g for g in entry["spectrum"]["gamma_star"] if g is not None]
                top, rest = inflation[:TOP_SUBSPACES], inflation[TOP_SUBSPACES:]
                margin = None if not top or not rest else round(float(np.mean(top) - np.mean(rest)), 6)
                out.append({"merge": merge, "class": name, "top_minus_rest": margin, "verdict": _verdict_of(margin)})
            elif claim.kind == "both_signs":
                sigma = entry["spectrum"]["sigma"]
                gaps = [g for g, s in zip(entry["spectrum"]["gap"][:SHOWN_RANKS], sigma) if g is not None
                        and abs(g) > NOISE * s]  # beyond round-off
                both = any(g > 0 for g in gaps) and any(g < 0 for g in gaps)
                out.append({"merge": merge, "class": name, "verdict": "agrees" if both else "disagrees"})
            elif claim.kind == "positive_cross":
                for r, matrix in enumerate(entry["cross_terms"], 1):
                    m = np.array(matrix, dtype=float)
                    off = m[~np.eye(len(m), dtype=bool)]
                    share = float(np.mean(off > 0))
                    out.append({"merge": merge, "class": name, "r": r, "positive_share": round(share, 4),
                                "verdict": _verdict_of(share - 0.5)})
    return out


def _side(value: float | None) -> int | None:
    return None if value is None else (value > 1) - (value < 1)


def _magic_units(claim, merges: Sequence[str], data: Mapping[str, Any]) -> list[dict]:
    out = []
    if claim.kind == "smaller_magnitude":
        for merge in (m for m in merges if m in data["magnitude_ratio"]):
            for task, ratio in zip(data["tasks"], data["magnitude_ratio"][merge]):
                out.append({"merge": merge, "task": task, "ratio": ratio,
                            "verdict": _verdict_of(None if ratio is None else 1 - ratio)})
    elif claim.kind in ("follows_weight", "opposite_to_weight"):
        for name, op in data["operations"].items():
            for layer, weights, features in zip(data["layers"], op["weight_ratio"], op["feature_ratio"]):
                for task, w, f in zip(data["tasks"], weights, features):
                    if claim.kind == "follows_weight":
                        found = (None if _side(w) in (None, 0) or _side(f) in (None, 0) else
                                 "agrees" if _side(w) == _side(f) else "disagrees")
                    elif _side(w) != 1:
                        continue  # the claim is about the points whose weight magnitude grew
                    else:
                        found = _verdict_of(None if f is None else 1 - f)
                    out.append({"operation": name, "layer": layer, "task": task, "weight_ratio": w,
                                "feature_ratio": f, "verdict": found or "inconclusive"})
    elif claim.kind in ("own_layer_gains", "own_layer_gains_most"):
        for merge in (m for m in merges if m in data):
            for layer, swap in data[merge]["swaps"].items():
                gain = np.array(swap["gain"], dtype=float)
                for i, task in enumerate(data[merge]["tasks"]):
                    own = float(gain[i, i])
                    margin = own if claim.kind == "own_layer_gains" else own - float(np.nanmean(np.delete(gain[i], i)))
                    out.append({"merge": merge, "layer": layer, "task": task, "gain": own,
                                "verdict": _verdict_of(margin)})
    elif claim.kind == "similar_layers":
        rho = np.array(data["spearman"], dtype=float)
        for i in range(len(rho)):
            for j in range(i + 1, len(rho)):
                r = float(rho[i, j])
                out.append({"tasks": [data["tasks"][i], data["tasks"][j]], "spearman": round(r, 4),
                            "verdict": "agrees" if r >= STRONG else "disagrees" if r <= 0 else "inconclusive"})
    elif claim.kind == "between_tasks":
        for merge in (m for m in merges if m in data):
            for layer, entry in data[merge]["coefficients"].items():
                between = float(np.std(np.array(entry["task_mean"], dtype=float)))
                for task, within in zip(data[merge]["tasks"], entry["task_std"]):
                    out.append({"merge": merge, "layer": layer, "task": task, "within": within,
                                "between": round(between, 6), "verdict": _verdict_of(between - within)})
    return out


UNITS = {"top_gap": "(merge, key class) units", "both_signs": "(merge, key class) units",
         "top_concentrated": "(merge, key class) units",
         "positive_cross": "(merge, key class, r) units", "smaller_magnitude": "(merge, task) units",
         "follows_weight": "(layer, task) points", "opposite_to_weight": "(layer, task) points whose weights grew",
         "own_layer_gains": "(merge, layer, task) units", "own_layer_gains_most": "(merge, layer, task) units",
         "similar_layers": "pairs of tasks",
         "between_tasks": "(merge, layer, task) units"}


UNITS.update(paper_distac.UNITS)


def analysis_claim_units(claim, merges: Sequence[str], data: Mapping[str, Any]) -> list[dict]:
    """Each unit's verdict on an analysis claim (``UNITS`` says what a unit is for each kind)."""
    if claim.kind in ("top_gap", "top_concentrated", "both_signs", "positive_cross"):  # the SVC analyses
        return _svc_units(claim, merges, data)
    if claim.kind in paper_distac.UNITS:
        return paper_distac.claim_units(claim, merges, data)
    return _magic_units(claim, merges, data)


def _svc_blocks(analysis, data: Mapping[str, Any], prefix: str, regime: str) -> list[tuple]:
    blocks: list[tuple] = []
    for merge, found in ((m, data[m]) for m in analysis.merges if m in data):
        stem = f"{prefix}-{merge}"
        if analysis.kind == "svc_spectrum":
            rows = [[[f"`{name}`"], [str(c["keys"])], *[[_fmt_value(c["spectrum"][s][0])] for s in
                                                          ("sigma", "sigma_star", "gamma_sigma", "gap")],
                     [f"{sum(1 for g in c['spectrum']['gap'] if g is not None and g > 0)} of "
                      f"{sum(1 for g in c['spectrum']['gap'] if g is not None)}"]]
                    for name, c in found["classes"].items()]
            blocks += [("h3", f"`{merge}` (SVC's α = {found['alpha']:g})"),
                       ("table", ["key class", "layers", "σ₁", "σ₁*", "γσ₁", "σ₁ − σ₁*", "subspaces with σ > σ*"],
                        rows),
                       _plot(stem, f"{analysis.item}: {merge}", regime,
                             _spectrum_figure(f"{analysis.item}: {merge}, σ, σ* and γσ per subspace",
                                              found["classes"]))]
        else:
            rows = []
            for name, c in found["classes"].items():
                for r, matrix in enumerate(c["cross_terms"], 1):
                    m = np.array(matrix, dtype=float)
                    off = m[~np.eye(len(m), dtype=bool)]
                    rows.append([[f"`{name}`"], [str(r)], [_fmt_value(float(np.trace(m)))],
                                 [_fmt_value(float(off.sum()))], [f"{np.mean(off > 0):.0%}"]])
            blocks += [("h3", f"`{merge}`"),
                       ("p", "Each subspace's cross terms divided by σ_r² (under addition they sum to 1: the diagonal "
                             "is each task's own share, the rest what pairs of tasks add on top)."),
                       ("table", ["key class", "r", "diagonal (own)", "off-diagonal (cross)", "positive pairs"], rows),
                       _plot(stem, f"{analysis.item}: {merge}", regime,
                             _cross_figure(f"{analysis.item}: {merge}, cross terms / σ₁²", found["classes"],
                                           found["tasks"]))]
    return blocks


def _plot(stem: str, title: str, regime: str, fig: Figure) -> tuple:
    return ("plot", Plot(stem, "paper", ("vision", "", regime), title, to_svg(fig, stem)))


def _projection_blocks(analysis, data, prefix, regime) -> list[tuple]:
    tasks, merges = data["tasks"], [m for m in analysis.merges if m in data["magnitude_ratio"]]
    rows = [[[task], *[[_fmt_value(data["magnitude_ratio"][m][t])] for m in merges],
             *[[_fmt_value(float(np.mean(data["cosine"][m][t])))] for m in merges]] for t, task in enumerate(tasks)]
    fig = Figure(figsize=(3.4 * len(merges), 3.4))
    for k, merge in enumerate(merges, 1):
        ax = fig.add_subplot(1, len(merges), k)
        for t, task in enumerate(tasks):
            for model, marker in ((merge, "o"), ("specialised", "x")):
                xy = np.array(data["points"][model][t], dtype=float)
                ax.scatter(xy[:, 0], xy[:, 1], s=6, marker=marker, color=f"C{t % 10}",
                           label=task if model == merge else None)
        ax.set_title(f"{merge} (o) and specialised (x)", fontsize=8)
        ax.tick_params(labelsize=6)
        if k == len(merges):
            ax.legend(fontsize=6, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.suptitle(f"{analysis.item}: task features at {data['layer']}, PCA", fontsize=9)
    fig.tight_layout()
    return [("p", f"Layer `{data['layer']}`; magnitude ratio = the merged task feature's L2 norm over the "
                  "specialised model's, averaged over the task's images (below 1: the merge's feature is smaller); "
                  "cosine = their direction's agreement."),
            ("table", ["task", *[f"`{m}` magnitude ratio" for m in merges], *[f"`{m}` cosine" for m in merges]],
             rows),
            _plot(prefix, analysis.item, regime, fig)]


def _magnitude_blocks(analysis, data, prefix, regime) -> list[tuple]:
    (name, op), = data["operations"].items()
    rows = [[[f"`{layer}`"], [_fmt_value(w)], [_fmt_value(f)]]
            for layer, w, f in zip(data["layers"], op["layer_mean"]["weight_ratio"], op["layer_mean"]["feature_ratio"])]
    fig = Figure(figsize=(4.2, 3.8))
    ax = fig.add_subplot()
    w = np.array(op["weight_ratio"], dtype=float).ravel()
    f = np.array(op["feature_ratio"], dtype=float).ravel()
    ax.scatter(w, f, s=6, color="C0")
    ax.axhline(1, color="#888", linewidth=0.8)
    ax.axvline(1, color="#888", linewidth=0.8)
    ax.set_xlabel("weight magnitude ratio (after / before)", fontsize=8)
    ax.set_ylabel("feature magnitude ratio (after / before)", fontsize=8)
    ax.set_title(f"{analysis.item}: each point a (layer, task)", fontsize=9)
    fig.tight_layout()
    return [("p", f"Operation `{name}`: `{op['method']}` with {op['params']}"
                  f"{', on each task vector alone' if op['per_task'] else ''}. Per layer, the mean over tasks of the "
                  "ratio after / before the operation, in weight space (L2 of the layer's task vector) and in "
                  "feature space (L1 of its task feature on the task's images)."),
            ("table", ["layer", "weight ratio", "feature ratio"], rows), _plot(prefix, analysis.item, regime, fig)]


def _swap_blocks(analysis, data, prefix, regime) -> list[tuple]:
    blocks = []
    for merge in (m for m in analysis.merges if m in data):
        found = data[merge]
        gains = np.array([s["gain"] for s in found["swaps"].values()], dtype=float)
        mean = np.nanmean(gains, axis=0)
        k = len(found["tasks"])
        diagonal = [float(np.mean(np.diag(g))) for g in gains]
        off = [float(np.mean(g[~np.eye(k, dtype=bool)])) for g in gains]
        rows = [[[f"`{layer}`"], [_fmt_value(d)], [_fmt_value(o)]] for layer, d, o in zip(found["swaps"], diagonal,
                                                                                           off)]
        fig = Figure(figsize=(4.6, 4.0))
        ax = fig.add_subplot()
        bound = float(np.nanmax(np.abs(mean))) or 1.0
        ax.imshow(mean, cmap="RdBu_r", vmin=-bound, vmax=bound)
        ax.set_xticks(range(k), found["tasks"], rotation=90, fontsize=6)
        ax.set_yticks(range(k), found["tasks"], fontsize=6)
        ax.set_xlabel("substituted task vector", fontsize=8)
        ax.set_ylabel("inference task", fontsize=8)
        ax.set_title(f"{analysis.item}: {merge}, gain averaged over layers", fontsize=9)
        fig.tight_layout()
        blocks += [("h3", f"`{merge}`"),
                   ("p", "Per layer, the mean task-feature gain (L1) when the merge's layer is replaced by the "
                         "inference task's own (diagonal) and by another task's (off-diagonal)."),
                   ("table", ["layer", "own task's layer", "another task's"], rows),
                   _plot(f"{prefix}-{merge}", f"{analysis.item}: {merge}", regime, fig)]
    return blocks


def _sensitivity_blocks(analysis, data, prefix, regime) -> list[tuple]:
    tasks, keys = data["tasks"], data["keys"]
    values = np.array(data["sensitivity"], dtype=float)
    fig = Figure(figsize=(1.2 + 0.32 * len(keys), 1.0 + 0.3 * len(tasks)))
    ax = fig.add_subplot()
    bound = float(np.nanmax(np.abs(values))) or 1.0
    ax.imshow(values, cmap="RdBu_r", vmin=-bound, vmax=bound, aspect="auto")
    short = [k.replace("visual.transformer.resblocks.", "b").replace("visual.", "") for k in keys]
    ax.set_xticks(range(len(keys)), short, rotation=90, fontsize=5)
    ax.set_yticks(range(len(tasks)), tasks, fontsize=6)
    ax.set_title(f"{analysis.item}: probe change when one layer's task vector is scaled by {data['scale']}", fontsize=8)
    fig.tight_layout()
    rho = np.array(data["spearman"], dtype=float)
    rows = [[[task], *[[f"{rho[i, j]:+.2f}"] for j in range(len(tasks))]] for i, task in enumerate(tasks)]
    return [("p", f"Each specialised model probed as the pipeline probes the merge (probe set `letters`, "
                  f"{len(keys)} candidate layers); the table is the Spearman correlation of two tasks' sensitivities "
                  "over the layers."),
            ("table", ["task", *tasks], rows), _plot(prefix, analysis.item, regime, fig)]


def _xi_blocks(analysis, data, prefix, regime) -> list[tuple]:
    blocks = []
    for merge in (m for m in analysis.merges if m in data):
        found = data[merge]
        for layer, entry in found["coefficients"].items():
            rows = [[[task], [_fmt_value(m)], [_fmt_value(sd)], [str(len(x))]]
                    for task, m, sd, x in zip(found["tasks"], entry["task_mean"], entry["task_std"], entry["xi"])]
            fig = Figure(figsize=(5.0, 3.2))
            ax = fig.add_subplot()
            for t, xs in enumerate(entry["xi"]):
                ax.scatter([t] * len(xs), xs, s=8, color=f"C{t % 10}")
            ax.set_xticks(range(len(found["tasks"])), found["tasks"], rotation=45, ha="right", fontsize=7)
            ax.set_ylabel("ξ (FSC's ratio)", fontsize=8)
            ax.set_title(f"{analysis.item}: {merge}, {layer}", fontsize=8)
            fig.tight_layout()
            blocks += [("h3", f"`{merge}`, `{layer}`"),
                       ("table", ["task", "mean ξ", "sd across samples", "samples"], rows),
                       _plot(f"{prefix}-{merge}", f"{analysis.item}: {merge}", regime, fig)]
    return blocks


def _inflation_blocks(analysis, data, prefix, regime) -> list[tuple]:
    blocks = []
    for merge in (m for m in analysis.merges if m in data):
        classes = data[merge]["classes"]
        rows, fig = [], Figure(figsize=(5.0, 3.2))
        ax = fig.add_subplot()
        for i, (name, c) in enumerate(classes.items()):
            inflation = [None if g is None else 1 - g for g in c["spectrum"]["gamma_star"]]
            known = [v for v in inflation if v is not None]
            rows.append([[f"`{name}`"], [_fmt_value(float(np.mean(known[:TOP_SUBSPACES])) if known else None)],
                         [_fmt_value(float(np.mean(known[TOP_SUBSPACES:])) if known[TOP_SUBSPACES:] else None)]])
            ax.plot(c["spectrum"]["r"][:SHOWN_RANKS], [np.nan if v is None else v for v in inflation[:SHOWN_RANKS]],
                    label=name, color=f"C{i}", linewidth=1)
        ax.axhline(0, color="#888", linewidth=0.8)
        ax.set_xlabel("subspace r", fontsize=8)
        ax.set_ylabel("inflation 1 − σ*/σ (class mean)", fontsize=8)
        ax.legend(fontsize=6)
        ax.set_title(f"{analysis.item}: {merge}", fontsize=9)
        fig.tight_layout()
        blocks += [("p", "Inflation 1 − σ*/σ per subspace: the share of σ_r the tasks' own projections do not call "
                         "for (0: none; negative: σ below σ*), scale-free, so top and lower subspaces compare."),
                   ("table", ["key class", f"mean, r ≤ {TOP_SUBSPACES}", f"mean, r > {TOP_SUBSPACES}"], rows),
                   _plot(f"{prefix}-{merge}", f"{analysis.item}: {merge}", regime, fig)]
    return blocks


RENDER = {"svc_inflation": _inflation_blocks, "svc_spectrum": _svc_blocks, "svc_cross_terms": _svc_blocks,
          "magic_projection": _projection_blocks, "magic_magnitude": _magnitude_blocks, "magic_swap": _swap_blocks,
          "magic_sensitivity": _sensitivity_blocks, "magic_xi": _xi_blocks, **paper_distac.RENDER}


def analysis_section(analysis, entry: Mapping[str, Any], plot_prefix: str) -> tuple[list[tuple], dict]:
    """One analysis's blocks and JSON document (``entry``: its part of results/papers/analysis.json)."""
    data = entry["data"]
    how = {"magic_magnitude": "each operation at its own scaling (below), each task's first test images",
           "magic_sensitivity": "each specialised model probed alone (no merge)",
           **paper_distac.HOW}.get(analysis.kind, (
        "each merge read at λ = 1 with the matrix's own settings; means over the layers of each key class"
        if analysis.kind.startswith("svc") else
        "each merge at the scaling the default run chose for it, each task's first test images"))
    blocks: list[tuple] = [
        ("h2", f"{analysis.id}: {analysis.item}"), ("p", f"**The paper**: {analysis.shows}."),
        ("p", f"**On the testbed**: the vision track's fine-tunes (seed {entry['seed']}, {entry['regime']} regime), "
              f"{how}.")]
    document: dict[str, Any] = {"id": analysis.id, "item": analysis.item, "shows": analysis.shows, "claims": []}
    try:
        blocks += RENDER[analysis.kind](analysis, data, plot_prefix, entry["regime"])
        units_of = [analysis_claim_units(claim, analysis.merges, data) for claim in analysis.claims]
    except (KeyError, TypeError, IndexError, ValueError) as err:
        raise MergecalError(f"results/papers/analysis.json: {analysis.id}: not the data of a {analysis.kind} analysis "
                            f"({type(err).__name__}: {err}); run stages/paper_analysis.py again") from None
    for claim, units in zip(analysis.claims, units_of):
        basis = paper_distac.BASIS.get(claim.kind, EXACT)
        document["claims"].append(checked(claim, units, analysis_sentence(claim.text, verdict_counts(units),
                                                                          UNITS[claim.kind], basis)))
    return blocks + claims_blocks(document["claims"]), document


def _fmt_value(value: float | None) -> str:
    return "—" if value is None else f"{value:.4g}"


# ------------------------------------------------------------------------------------------------- significance
# MAGIC's all-subsets test of a calibration (results/papers/significance.json, mergecal.pipeline.paper_significance):
# each subset of the experts a pair of cells, each with its paired interval; the t-test over the subsets.

SIGNIFICANCE_LEVEL = 0.05  # a t-test agrees with the paper where its two-sided p is below this, t on its side


def _t_test_verdict(summary: Mapping[str, Any]) -> str | None:
    if summary.get("t") is None or summary.get("p") is None:
        return None
    if summary["p"] >= SIGNIFICANCE_LEVEL:
        return "inconclusive"
    return "agrees" if summary["t"] > 0 else "disagrees"


def _fmt_p(p: float | None) -> str:
    return "—" if p is None else f"{p:.2g}"


def _fmt_t(t: float | None) -> str:
    return "—" if t is None else f"{t:.2f}"


def significance_claim_units(claim, entry: Mapping[str, Any]) -> list[dict]:
    """Each unit's verdict on a significance claim: per subset, its paired interval (``subsets``); the t-test over
    the subsets (``t_test``: one unit)."""
    if claim.kind == "subsets":
        return [{"tasks": row["tasks"], "change": round(row["calibrated"] - row["base"], 4),
                 "interval": row["interval"], "verdict": verdict(row["interval"], "gain")} for row in entry["subsets"]]
    summary = entry["summary"]
    return [{"t": summary["t"], "p": summary["p"], "n": summary["n"], "verdict": _t_test_verdict(summary)}]


def significance_sentence(claim, units: Sequence[Mapping[str, Any]], summary: Mapping[str, Any]) -> str:
    """The sentence under a significance claim (``claims.sentence``: the counts and their rule)."""
    counts, unmeasured = verdict_counts(units), sum(1 for u in units if u["verdict"] is None)
    if claim.kind == "subsets":
        return sentence(claim.text, counts, "subsets", unmeasured)
    return sentence(claim.text, counts, "paired t-tests over the subsets", unmeasured,
                    rule=f"two-sided p below {SIGNIFICANCE_LEVEL:g} with t on the paper's side: t = "
                         f"{_fmt_t(summary['t'])}, p = {_fmt_p(summary['p'])} over {summary['n']} subsets")


def by_size(entry: Mapping[str, Any]) -> list[dict]:
    """Per number of experts merged: the subsets, each side's mean and the calibration's mean change (points) and
    how many subsets it improves."""
    out = []
    for size in sorted({len(r["tasks"]) for r in entry["subsets"]}):
        rows = [r for r in entry["subsets"] if len(r["tasks"]) == size]
        changes = [r["calibrated"] - r["base"] for r in rows]
        out.append({"experts": size, "subsets": len(rows),
                    "base": round(float(np.mean([r["base"] for r in rows])), 2),
                    "calibrated": round(float(np.mean([r["calibrated"] for r in rows])), 2),
                    "change": round(float(np.mean(changes)), 2), "improved": sum(c > 0 for c in changes),
                    "worse": sum(c < 0 for c in changes)})
    return out


def differences_figure(title: str, entry: Mapping[str, Any]) -> Figure:
    """Each subset's paired change (calibrated minus base, points) against the number of experts it merges, the
    subsets of one size spread side by side, their mean marked."""
    fig = Figure(figsize=(6.0, 3.4))
    ax = fig.add_subplot()
    for size in sorted({len(r["tasks"]) for r in entry["subsets"]}):
        changes = [r["calibrated"] - r["base"] for r in entry["subsets"] if len(r["tasks"]) == size]
        offsets = np.linspace(-0.3, 0.3, len(changes)) if len(changes) > 1 else np.zeros(1)
        ax.scatter(size + offsets, changes, s=6, color="C0", alpha=0.6, linewidths=0)
        ax.plot([size - 0.35, size + 0.35], [np.mean(changes)] * 2, color="C3", linewidth=1.5)
    ax.axhline(0, color="#888", linewidth=0.8)
    ax.set_xlabel("experts merged (subset size)", fontsize=8)
    ax.set_ylabel("change: calibrated − merge (points)", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    return fig


def _holding(entry: Mapping[str, Any]) -> str:
    """", each holding `symbols` (the lengthened task)" where the test keeps only such subsets, else ""."""
    found = entry.get("includes") or []
    return f", each holding {', '.join(f'`{t}`' for t in found)} (the lengthened task)" if found else ""


def significance_section(test, entry: Mapping[str, Any], plot_prefix: str) -> tuple[list[tuple], dict]:
    """One significance test's blocks and JSON document (``entry``: its part of results/papers/significance.json)."""
    try:
        summary, sizes = entry["summary"], by_size(entry)
        n, k = summary["n"], len(entry["tasks"])
        base, calibrated = entry["base"], entry["calibrated"]
        units_of = [significance_claim_units(claim, entry) for claim in test.claims]
        fig = differences_figure(f"{test.item}: {calibrated} − {base}, {entry['regime']}", entry)
    except (KeyError, TypeError, IndexError, ValueError) as err:
        raise MergecalError(f"results/papers/significance.json: {test.id}: not a significance test's data "
                            f"({type(err).__name__}: {err}); run stages/paper_significance.py again") from None
    blocks: list[tuple] = [
        ("h2", f"{test.id}: {test.item}"), ("p", f"**The paper**: {test.shows}."),
        ("p", f"**On the testbed**: the vision track's fine-tunes (seed {entry['seed']}, {entry['regime']} regime): "
              f"every subset of at least {entry['min_size']} of its {k} experts{_holding(entry)} ({n} subsets) "
              f"merged as `{base}` "
              f"and as `{calibrated}` (λ = {entry['scaling']:g} fixed, no search), each the benchmark's own cell "
              "on the subset's tasks; a subset's value is its average accuracy over its own tasks (%), its change "
              "the calibrated merge's minus the merge's, with the paired 95 % interval over its test examples."),
        ("table", ["subsets", "merge (mean %)", "calibrated (mean %)", "mean change (points)", "t", "p",
                   "improved", "worse", "equal"],
         [[[str(n)], [f"{summary['mean_base']:.1f}"], [f"{summary['mean_calibrated']:.1f}"],
           [f"{summary['mean_difference']:+.2f}"], [_fmt_t(summary["t"])], [_fmt_p(summary["p"])],
           [f"{summary['improved']} ({summary['improved_share']:.0%})"],
           [f"{summary['worse']} ({summary['worse_share']:.0%})"], [str(summary["equal"])]]]),
        ("p", "Per number of experts merged (the paired two-sided t-test above is over every subset, each subset "
              "one pair):"),
        ("table", ["experts", "subsets", "merge (mean %)", "calibrated (mean %)", "mean change (points)",
                   "improved", "worse"],
         [[[str(s["experts"])], [str(s["subsets"])], [f"{s['base']:.1f}"], [f"{s['calibrated']:.1f}"],
           [f"{s['change']:+.2f}"], [str(s["improved"])], [str(s["worse"])]] for s in sizes]),
        _plot(plot_prefix, f"{test.item}: each subset's change", entry["regime"], fig)]
    if test.printed:
        printed = ", ".join(f"{name} = {_fmt_p(value) if name == 'p' else f'{value:g}'}"
                            for name, value in test.printed.items())
        blocks.append(("p", f"**Printed** in {test.printed_where}: {printed}; on other checkpoints and another "
                            "backbone, so the direction compares with the testbed's, the values do not."))
    document: dict[str, Any] = {"id": test.id, "item": test.item, "shows": test.shows, "base": base,
                                "calibrated": calibrated, "summary": dict(summary), "by_size": sizes,
                                "printed": dict(test.printed) or None, "claims": []}
    for claim, units in zip(test.claims, units_of):
        document["claims"].append(checked(claim, units, significance_sentence(claim, units, summary)))
    return blocks + claims_blocks(document["claims"]), document
