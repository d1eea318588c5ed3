"""A paper's comparisons across settings (``mergecal.pipeline.experiments.Comparison``: DisTaC's tables and
figures) as report blocks: each merge's chains in each setting with 95 % intervals, paired changes against the
reference setting (the paper's Original) and within the setting, a setting of several regimes as their mean (its
members shown too), the paper's printed numbers beside, and the claims' sentences computed from the intervals.

A setting's value is the average normalized accuracy: per task, each regime's per-example scores divided by that
regime's own fine-tuned accuracy, averaged over the setting's regimes example by example (every regime is scored on
the same test examples), then averaged over tasks; its interval resamples the examples within each task, and a
change between two settings or chains is the paired interval of the per-example differences.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from matplotlib.figure import Figure

from ..intervals import paired_interval, stratified_interval
from .claims import REFERENCE_ROWS, VERDICTS, fmt_change, fmt_interval, interval_points, sentence, verdict
from .plots import Plot, to_svg

Samples = list[np.ndarray]


class Scores:
    """One seed's outcomes of a comparison: (regime, merge, chain) -> Outcome, each regime's fine-tuned test
    accuracy per task (its finetuned reference cell) and its reference rows' outcomes, (regime, name) -> Outcome
    (``claims.REFERENCE_ROWS``: finetuned, multitask, zeroshot where the regime has them)."""

    def __init__(self, tasks: Sequence[str], outcomes: Mapping[tuple[str, str, str], Any],
                 finetuned: Mapping[str, Mapping[str, float]],
                 references: Mapping[tuple[str, str], Any] | None = None):
        self.tasks, self.outcomes, self.finetuned = tuple(tasks), outcomes, finetuned
        self.references = dict(references or {})

    def regime_samples(self, regime: str, merge: str, chain: str) -> Samples | None:
        """Per task, the per-example scores over the regime's fine-tuned accuracy (None without them)."""
        return self._normalized(self.outcomes.get((regime, merge, chain)), regime)

    def reference_value(self, regimes: Sequence[str], name: str) -> tuple[float | None, list | None]:
        """A reference row's average normalized accuracy (%) and 95 % interval over ``regimes`` (None where a
        regime has no such row)."""
        found = [self._normalized(self.references.get((r, name)), r) for r in regimes]
        return _mean_value(None if any(f is None for f in found) else _example_mean(found))

    def _normalized(self, outcome, regime: str) -> Samples | None:
        reference = self.finetuned.get(regime, {})
        if outcome is None or not outcome.examples or any(t not in outcome.examples for t in self.tasks):
            return None
        if any(not reference.get(f"acc.{t}") for t in self.tasks):
            return None
        return [np.asarray(outcome.examples[t], dtype=np.float64) / reference[f"acc.{t}"] for t in self.tasks]

    def samples(self, regimes: Sequence[str], merge: str, chain: str) -> Samples | None:
        """A setting's samples: its regimes' normalized scores averaged example by example."""
        found = [self.regime_samples(r, merge, chain) for r in regimes]
        return None if any(f is None for f in found) else _example_mean(found)

    def value(self, regimes: Sequence[str], merge: str, chain: str) -> tuple[float | None, list | None]:
        """The setting's average normalized accuracy (%) and its 95 % interval."""
        return _mean_value(self.samples(regimes, merge, chain))

    def change(self, a: tuple[Sequence[str], str, str], b: tuple[Sequence[str], str, str]) -> list | None:
        """The paired 95 % interval (points) of setting/merge/chain ``a`` minus ``b``."""
        mine, theirs = self.samples(*a), self.samples(*b)
        if mine is None or theirs is None:
            return None
        return interval_points(paired_interval(mine, theirs, [1.0 / len(mine)] * len(mine)))


def _example_mean(found: list[Samples]) -> Samples:
    """Several regimes' normalized scores averaged example by example, per task."""
    return [np.mean([f[t] for f in found], axis=0) for t in range(len(found[0]))]


def _mean_value(samples: Samples | None) -> tuple[float | None, list | None]:
    """The average over tasks (%) and its 95 % interval, resampling the examples within each task."""
    if samples is None:
        return None, None
    weights = [1.0 / len(samples)] * len(samples)
    mean = sum(w * float(s.mean()) for w, s in zip(weights, samples))
    return round(100 * mean, 2), interval_points(stratified_interval(samples, weights))


def claim_verdict(kind: str, interval: list | None) -> str | None:
    """``gain`` / ``loss``: agrees where the interval excludes 0 on the paper's side, disagrees on the other,
    inconclusive inside; ``par`` ("restores to par"): agrees where it reaches 0 or above (not below), disagrees
    where it lies below 0."""
    if kind == "par" and interval is not None:
        return "agrees" if interval[1] >= 0 else "disagrees"
    return verdict(interval, kind)


RULES = {"gain": "paired 95 % interval excludes 0 on the paper's side",
         "loss": "paired 95 % interval excludes 0 on the paper's side",
         "par": "paired 95 % interval reaches 0 or above: not below the reference"}


def comparison_section(comparison, seeds: Mapping[int, Scores], plot_prefix: str) -> tuple[list, dict]:
    """A comparison's blocks and JSON document."""
    chains, settings, ref = list(comparison.chains), comparison.settings, comparison.reference
    described = "; ".join(f"`{name}` = " + (f"`{rs[0]}`" if len(rs) == 1 else
                                            f"the mean of {len(rs)} regimes ({', '.join(f'`{r}`' for r in rs)})")
                          for name, rs in settings.items())
    blocks: list[tuple] = [
        ("h2", f"{comparison.id}: {comparison.item}"),
        ("p", f"**The paper**: {comparison.shows}."),
        ("p", f"**On the testbed**: track {comparison.track}, each merge at the scaling searched on validation (a "
              f"DisTaC or rescaling step before it); settings: {described}; chains: "
              + ", ".join(f"`{n}` = `{c}`" for n, c in comparison.chains.items()) + f". Reference: `{ref}`."),
    ]
    document: dict[str, Any] = {"id": comparison.id, "item": comparison.item, "shows": comparison.shows,
                                "settings": dict(settings), "chains": dict(comparison.chains), "seeds": [],
                                "claims": []}
    for seed, scores in seeds.items():
        blocks += [("h3", f"seed {seed}"),
                   ("p", f"Average normalized accuracy (%) [95 % interval]; below it the change in points [paired "
                         f"95 % interval] against `{ref}`'s merge alone (vs {ref}) and against the merge alone in the "
                         "same setting (vs merge): ▲ above 0, ▼ below, ≈ inside the noise.")]
        rows, table = {}, []
        for merge in comparison.merges:
            for chain in chains:
                cells = [[f"`{merge}`"], [f"`{chain}`"]]
                for name, regimes in settings.items():
                    lines, found = _entry(scores, regimes, settings[ref], merge, chain, name == ref, chains[0], ref)
                    cells.append(lines)
                    rows.setdefault(f"{merge}/{chain}", {})[name] = found
                table.append(cells)
        blocks.append(("table", ["merge", "chain", *settings], table))
        references = {name: scores.reference_value(settings[ref], name) for name in REFERENCE_ROWS}
        shown = [f"`{name}` ({REFERENCE_ROWS[name]}) {fmt_interval(*found)}"
                 for name, found in references.items() if found[0] is not None]
        if shown:
            blocks.append(("p", f"References in `{ref}`: " + "; ".join(shown) + "."))
        members = {name: rs for name, rs in settings.items() if len(rs) > 1}
        member_rows: dict[str, Any] = {}
        for name, regimes in members.items():
            member_table = []
            for merge in comparison.merges:
                for chain in chains:
                    cells = [[f"`{merge}`"], [f"`{chain}`"]]
                    for regime in regimes:
                        lines, found = _entry(scores, [regime], settings[ref], merge, chain, False, chains[0], ref)
                        cells.append(lines)
                        member_rows.setdefault(f"{name}/{merge}/{chain}", {})[regime] = found
                    member_table.append(cells)
            blocks += [("p", f"`{name}`, each regime of its mean; each regime's own fine-tunes (the normalization's "
                             "denominators), mean test accuracy and the lowest task: " + "; ".join(
                                 _denominators(scores, r) for r in regimes) + "."),
                       ("table", ["merge", "chain", *[f"`{r}`" for r in regimes]], member_table)]
        document["seeds"].append({"seed": seed, "rows": rows, "members": member_rows,
                                  "references": {name: {"setting": ref, "value": v, "interval": interval}
                                                 for name, (v, interval) in references.items() if v is not None}})
        figure = _figure(comparison, scores, seed)
        if figure is not None:
            stem = f"{plot_prefix}-seed{seed}"
            blocks.append(("plot", Plot(stem, "paper", (comparison.track, "", ref), f"{comparison.item}, seed {seed}",
                                        to_svg(figure, stem))))
    if comparison.printed:
        blocks += _printed_blocks(comparison, next(iter(seeds.values()), None))
    for claim in comparison.claims:
        units = []
        for seed, scores in seeds.items():
            for name in claim.settings or [n for n in settings if n != ref]:
                other = claim.than_setting or name
                for merge in (m for m in comparison.merges if not claim.merges or m in claim.merges):
                    interval = scores.change((settings[name], merge, claim.chain), (settings[other], merge, claim.than))
                    units.append({"seed": seed, "setting": name, "merge": merge, "chain": claim.chain,
                                  "than_setting": other, "than": claim.than, "interval": interval,
                                  "verdict": claim_verdict(claim.kind, interval)})
        counts = {v: sum(1 for u in units if u["verdict"] == v) for v in VERDICTS}
        unit = "merges" if len({(u["seed"], u["setting"]) for u in units}) == 1 else "merge × setting rows"
        text = sentence(claim.text, counts, unit, sum(1 for u in units if u["verdict"] is None), RULES[claim.kind])
        document["claims"].append({"kind": claim.kind, "text": claim.text, "sentence": text, "counts": counts,
                                   "units": units})
    if document["claims"]:
        blocks += [("p", "**The paper's claims, checked on the testbed:**"),
                   ("ul", [c["sentence"] for c in document["claims"]])]
    return blocks, document


def _denominators(scores: Scores, regime: str) -> str:
    found = {t: scores.finetuned.get(regime, {}).get(f"acc.{t}") for t in scores.tasks}
    if any(v is None for v in found.values()):
        return f"`{regime}` —"
    lowest = min(found, key=found.get)
    return f"`{regime}` {100 * np.mean(list(found.values())):.1f} %, `{lowest}` {100 * found[lowest]:.1f} %"


def _entry(scores: Scores, regimes, reference_regimes, merge: str, chain: str, is_reference: bool, merge_chain: str,
           ref: str) -> tuple[list[str], dict]:
    """One table cell: the value, its change against the reference's merge alone and against the merge alone in the
    same setting; and those figures for the JSON document."""
    v, interval = scores.value(regimes, merge, chain)
    lines = [fmt_interval(v, interval)]
    found: dict[str, Any] = {"value": v, "interval": interval}
    if not is_reference:
        base, _ = scores.value(reference_regimes, merge, merge_chain)
        delta = scores.change((regimes, merge, chain), (reference_regimes, merge, merge_chain))
        mid = None if v is None or base is None else round(v - base, 2)
        found.update(vs_reference=mid, vs_reference_interval=delta)
        if delta:
            lines.append(f"vs {ref} {fmt_change(delta, mid)}")
    if chain != merge_chain:
        base, _ = scores.value(regimes, merge, merge_chain)
        delta = scores.change((regimes, merge, chain), (regimes, merge, merge_chain))
        mid = None if v is None or base is None else round(v - base, 2)
        found.update(vs_merge=mid, vs_merge_interval=delta)
        if delta:
            lines.append(f"vs merge {fmt_change(delta, mid)}")
    return lines, found


def _printed_blocks(comparison, scores: Scores | None) -> list[tuple]:
    rows = []
    for merge, printed in comparison.printed.items():
        for key, paper in printed.items():
            name, chain = key.split("/", 1)
            v, interval = scores.value(comparison.settings[name], merge, chain) if scores else (None, None)
            rows.append([[f"`{merge}`"], [f"`{name}`"], [f"`{chain}`"], [f"{paper:.1f}"], [fmt_interval(v, interval)]])
    return [("p", f"**Printed** in {comparison.printed_where}, on the paper's checkpoints: beside the testbed's "
                  "(first seed); values do not compare across backbones, the claims above check directions."),
            ("table", ["merge", "setting", "chain", "paper (%)", "testbed (%)"], rows)]


def _bars(ax, groups: Sequence[str], series: Sequence[str], value, errors) -> None:
    width = 0.8 / max(1, len(series))
    x = np.arange(len(groups))
    for i, name in enumerate(series):
        mids, low, high = [], [], []
        for group in groups:
            v, interval = value(group, name)
            mids.append(np.nan if v is None else v)
            low.append(0.0 if interval is None or v is None else max(0.0, v - interval[0]))
            high.append(0.0 if interval is None or v is None else max(0.0, interval[1] - v))
        ax.bar(x + (i - (len(series) - 1) / 2) * width, mids, width, label=name, color=f"C{i % 10}",
               yerr=[low, high] if errors else None, capsize=2, error_kw={"linewidth": 0.8})
    ax.set_xticks(x, list(groups), rotation=30 if len(groups) > 5 else 0, ha="right" if len(groups) > 5 else "center",
                  fontsize=7)


def _figure(comparison, scores: Scores, seed: int) -> Figure | None:
    """``bars``: per merge, the merge alone in each setting; ``line``: each merge against the settings' values;
    ``members``: per regime of the first setting of several (and their mean), each chain (first merge)."""
    settings, chains = comparison.settings, list(comparison.chains)
    if comparison.plot == "none":
        return None
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    if comparison.plot == "bars":
        _bars(ax, comparison.merges, list(settings), lambda merge, s: scores.value(settings[s], merge, chains[0]),
              True)
    elif comparison.plot == "line":
        names = list(settings)
        x = [comparison.values[n] for n in names]
        for i, merge in enumerate(comparison.merges):
            found = [scores.value(settings[n], merge, chains[0]) for n in names]
            mids = [np.nan if v is None else v for v, _ in found]
            low = [0.0 if c is None or v is None else max(0.0, v - c[0]) for v, c in found]
            high = [0.0 if c is None or v is None else max(0.0, c[1] - v) for v, c in found]
            ax.errorbar(x, mids, yerr=[low, high], label=merge, color=f"C{i % 10}", marker="o", markersize=3,
                        capsize=2, linewidth=1)
        ax.set_xscale("symlog", linthresh=0.01)
        ax.set_xticks(x, names)
        ax.set_xlabel(comparison.axis)
    else:  # members
        name, regimes = next((n, rs) for n, rs in settings.items() if len(rs) > 1)
        merge = comparison.merges[0]
        groups = [*regimes, "mean"]
        ref = settings[comparison.reference]

        def value(group, chain):
            return scores.value(regimes if group == "mean" else [group], merge, chain)

        _bars(ax, groups, chains, value, True)
        original, _ = scores.value(ref, merge, chains[0])
        if original is not None:
            ax.axhline(original, color="#555", linewidth=0.8, linestyle="--", label=f"{comparison.reference}")
    ax.set_ylabel("normalized accuracy (%)")
    ax.set_title(f"{comparison.item} on the testbed, seed {seed}", fontsize=9)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.0, 0.5))
    fig.tight_layout()
    return fig
