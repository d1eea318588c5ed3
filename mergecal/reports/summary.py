"""What the run found, in a few lines: the leaderboard's opening summary.

Per table (track x regime, and seed when there are several) and calibration, the merges it calibrates: how many of
their changes against the uncalibrated merge are a gain, inside the noise or a loss (▲ / ≈ / ▼, each row's paired
95 % interval of the average accuracy, ``METRIC``), and the median change in points across those merges with a 95 %
interval. That interval is a percentile bootstrap over the test examples, resampled jointly for all rows of the table
(the same draws as every row's own paired interval, ``mergecal.intervals``: each task's examples within the task):
in each resample, each row's paired change, then their median. With one merge it is that row's paired interval.

Then the headline claims (``CLAIMS``, once per protocol), each sentence computed from the verdicts of its
calibrated rows with the wording of ``mergecal.reports.claims``: a claim whose rows all lie inside the noise is
inconclusive. Ill-posed rows (never ranked) are left out of both; a row without per-example results counts as not
measured.
"""

from __future__ import annotations

import html
import re
from dataclasses import dataclass

import numpy as np

from ..intervals import LEVEL, Interval, resample_counts, significance
from .claims import VERDICTS, overall, sentence, verdict
from .leaderboard import Paired, Table, protocol, rank
from .plots import slug

METRIC = "avg_acc"  # the change the summary counts and takes the median of: average accuracy, in points
SIGNS = ("gain", "none", "loss")
MARKS = {"gain": "▲", "none": "≈", "loss": "▼"}
FAMILY_ORDER = ("svc", "wsc", "fsc", "dsc", "distac")  # the summary's calibrations: this order, then by name
# (the claim, the calibrations it is about as their steps' names): the default board's calibrations; a claim is
# checked once per protocol its calibrations are run with (at the chosen scaling, at a paper's fixed scaling)
CLAIMS = (("SVC improves the merges it calibrates", (("svc",),)),
          ("MAGIC's calibrations (WSC, FSC, DSC) improve the merges they calibrate", (("wsc",), ("fsc",), ("dsc",))),
          ("DisTaC's conditioning improves the merges it precedes", (("distac",),)),
          ("DisTaC, then SVC and DSC, improves the merges it calibrates", (("distac", "svc", "dsc"),)))
CLAIM_UNIT = "calibrated rows"
CLAIM_RULE = "paired 95 % interval above 0"
METHOD = ("Each cell: the merges the calibration calibrates on that table, counted by their change in average "
          "accuracy against the same merge uncalibrated (▲ gain / ≈ inside the noise / ▼ loss: the row's paired 95 % "
          "interval), then the median change in points across them with its 95 % interval: a percentile bootstrap "
          "over the test examples, 2,000 resamples drawn jointly for every row of the table (each task's examples "
          "within the task), the median of the rows' paired changes in each resample. name@λ=x: the calibration "
          "of the merge at the fixed scaling x, against that merge at x. Ill-posed rows (†n) are left out; ?n counts "
          "rows kept without per-example results (no verdict); ⚠ marks a table flagged unstable. A header links to "
          "its table.")


@dataclass(frozen=True)
class Entry:
    """One calibration on one table: the merges it calibrates there and their changes."""

    table: str  # the table's title
    key: tuple[str, str, str, str]  # backbone, task set, regime, seed
    calibration: str  # as tagged: steps, then the protocol after @ ("svc@λ=1")
    changes: tuple[tuple[str, Interval], ...]  # (recipe, paired 95 % interval, points) of the measured rows
    unmeasured: tuple[str, ...]  # recipes without a paired interval
    ill_posed: tuple[str, ...]  # recipes shown but never ranked: left out
    median: float | None  # points, across the rows with a change
    median_interval: Interval | None  # points; None unless every such row kept per-example results
    unstable: bool  # the table carries a stability warning

    @property
    def verdicts(self) -> tuple[tuple[str, str], ...]:
        """(recipe, gain / none / loss) of the measured rows, in table order."""
        return tuple((recipe, significance(interval)) for recipe, interval in self.changes)

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(1 for _, v in self.verdicts if v == s) for s in SIGNS}


@dataclass(frozen=True)
class Claim:
    text: str
    sentence: str
    counts: dict[str, int]  # claims.VERDICTS -> rows
    unmeasured: int
    calibrations: tuple[str, ...]  # the calibrations (with protocol) whose rows it counts


@dataclass(frozen=True)
class Summary:
    tables: tuple[Table, ...]
    entries: tuple[Entry, ...]
    claims: tuple[Claim, ...]

    @property
    def calibrations(self) -> list[str]:
        return sorted({e.calibration for e in self.entries}, key=calibration_order)


def steps_of(calibration: str) -> tuple[str, ...]:
    """The names of a calibration's steps, without parameters or protocol (``wsc(granularity=layer)@λ=0.3``: wsc)."""
    return tuple(step.partition("(")[0] for step in protocol(calibration)[0].split(">"))


def calibration_order(calibration: str) -> tuple:
    steps, suffix = protocol(calibration)
    return (*rank(FAMILY_ORDER, steps_of(calibration)[0]), len(steps.split(">")), steps != steps_of(calibration)[0],
            suffix, calibration)


def median_interval(changes: list[Paired]) -> Interval | None:
    """The 95 % percentile-bootstrap interval of the median of the rows' paired changes (points), every row's
    per-example differences resampled with the same draws; None when the rows were not scored on the same examples."""
    sizes = {tuple(d.size for d in diffs) for diffs, _ in changes}
    if len(sizes) != 1:
        return None
    from scipy.stats import quantile

    counts = resample_counts(sizes.pop())  # the draws of every row's own paired interval
    weights = np.array([w for _, w in changes])  # rows x tasks
    # per task, every row's resampled means at once (one product); the expression is the paired interval's, so
    # with one row the resamples are its own bit for bit
    resampled = sum(weights[:, [t]] * ((c @ np.stack([diffs[t] for diffs, _ in changes], axis=1)).T / c.shape[1])
                    for t, c in enumerate(counts))  # rows x resamples
    alpha = (1 - LEVEL) / 2
    low, high = quantile(np.median(resampled, axis=0), np.array([alpha, 1 - alpha]))
    return 100.0 * float(low), 100.0 * float(high)


def table_entries(table: Table) -> list[Entry]:
    """Each calibration of ``table`` with the merges it calibrates, in ``calibration_order``."""
    rows: dict[str, list] = {}
    for row in table.rows:
        if row.role == "calibrated" and row.deltas.get(METRIC) is not None:
            rows.setdefault(row.calibration, []).append(row)
    entries = []
    for calibration in sorted(rows, key=calibration_order):
        ranked = [r for r in rows[calibration] if not r.ill_posed]
        measured = [r for r in ranked if METRIC in r.delta_intervals]
        paired = [r.paired.get(METRIC) for r in ranked]
        entries.append(Entry(
            table.title, (table.backbone, table.task_set, table.regime, table.seed), calibration,
            tuple((r.recipe, r.delta_intervals[METRIC]) for r in measured),
            tuple(r.recipe for r in ranked if METRIC not in r.delta_intervals),
            tuple(r.recipe for r in rows[calibration] if r.ill_posed),
            float(np.median([r.deltas[METRIC] for r in ranked])) if ranked else None,
            median_interval(paired) if ranked and all(p is not None for p in paired) else None,
            bool(table.warning)))
    return entries


def protocol_phrase(suffix: str) -> str:
    return f"at the fixed scaling {suffix}" if suffix else "at their validation-chosen scaling"


def check_claim(text: str, families: tuple[tuple[str, ...], ...], suffix: str, entries: list[Entry]) -> Claim:
    """The claim's sentence from the verdicts of its rows: the calibrations of ``families`` with protocol
    ``suffix``."""
    mine = [e for e in entries if steps_of(e.calibration) in families and protocol(e.calibration)[1] == suffix]
    found = [verdict(list(interval), "gain") for e in mine for _, interval in e.changes]
    counts = {v: found.count(v) for v in VERDICTS}
    unmeasured = sum(len(e.unmeasured) for e in mine)
    return Claim(text, sentence(text, counts, CLAIM_UNIT, unmeasured, CLAIM_RULE), counts, unmeasured,
                 tuple(sorted({e.calibration for e in mine}, key=calibration_order)))


def summarize(tables: list[Table]) -> Summary:
    entries = [e for t in tables for e in table_entries(t)]
    claims = []
    for text, families in CLAIMS:
        suffixes = sorted({protocol(e.calibration)[1] for e in entries if steps_of(e.calibration) in families})
        claims += [check_claim(text + (f", {protocol_phrase(s)}" if len(suffixes) > 1 else ""), families, s, entries)
                   for s in suffixes]
    return Summary(tuple(tables), tuple(entries), tuple(claims))


def fmt_median(entry: Entry) -> str:
    """``+1.2 [+0.3, +2.0]▲`` (no mark without an interval, ``—`` without a change)."""
    if entry.median is None:
        return "—"
    text = f"{round(entry.median, 1) + 0.0:+.1f}"
    interval = entry.median_interval
    if interval is None:
        return text
    mark = "▲" if interval[0] > 0 else "▼" if interval[1] < 0 else "≈"
    return f"{text} [{round(interval[0], 1) + 0.0:+.1f}, {round(interval[1], 1) + 0.0:+.1f}]{mark}"


def count_parts(entry: Entry) -> list[tuple[str, str]]:
    """(gain / none / loss / "", text): ``▲3``, ``≈4``, ``▼1``, then ``?2`` for rows not measured and ``†1`` for
    ill-posed ones left out, where there are any."""
    counts = entry.counts
    parts = [(s, f"{MARKS[s]}{counts[s]}") for s in SIGNS]
    parts += [("", f"?{len(entry.unmeasured)}")] if entry.unmeasured else []
    return parts + ([("", f"†{len(entry.ill_posed)}")] if entry.ill_posed else [])


def fmt_counts(entry: Entry) -> str:
    return " ".join(text for _, text in count_parts(entry))


def heading_anchor(title: str) -> str:
    """The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def _grid(summary: Summary) -> list[tuple[str, list[Entry | None]]]:
    """Rows of the summary's table: each calibration with its entry per table (None where it has no row)."""
    by_key = {(e.table, e.calibration): e for e in summary.entries}
    return [(c, [by_key.get((t.title, c)) for t in summary.tables]) for c in summary.calibrations]


def _bold_verdict(claim: Claim, text: str, start: str, end: str) -> str:
    """``text`` (the claim's sentence, escaped as shown) with the testbed's verdict in bold, for the eye."""
    found = f"the testbed {overall(claim.counts)}"
    return text.replace(found, f"{start}{found}{end}", 1)


def markdown(summary: Summary, status: list[str] | None = None) -> str:
    """The summary as Markdown: the claims, then per calibration and table the counts and the median change.
    ``status``: lines (Markdown) on the diagnostics, under the claims."""
    lines = ["## What this run found", ""]
    if summary.claims:
        lines += [f"- {_bold_verdict(c, c.sentence, '**', '**')}" for c in summary.claims] + [""]
    lines += [*(status or []), ""] if status else []
    if not summary.entries:
        return "\n".join(lines + ["No calibrated row on this board.", ""])
    head = [f"[{t.title}{' ⚠' if t.warning else ''}](#{heading_anchor(t.title)})" for t in summary.tables]
    lines += ["| calibration | " + " | ".join(head) + " |", "|---" + "|---" * len(head) + "|"]
    for calibration, entries in _grid(summary):
        cells = ["—" if e is None else f"{fmt_counts(e)} · {fmt_median(e)}" for e in entries]
        lines.append(f"| `{calibration}` | " + " | ".join(cells) + " |")
    return "\n".join(lines + ["", METHOD, ""])


def _tooltip(entry: Entry) -> str:
    """Which merges went which way, for the cell's title."""
    parts = [f"{MARKS[s]} " + ", ".join(r for r, v in entry.verdicts if v == s) for s in SIGNS
             if any(v == s for _, v in entry.verdicts)]
    parts += ["not measured: " + ", ".join(entry.unmeasured)] if entry.unmeasured else []
    parts += ["ill-posed, left out: " + ", ".join(entry.ill_posed)] if entry.ill_posed else []
    return "; ".join(parts)


def _counts_html(entry: Entry) -> str:
    """``fmt_counts`` with the gains and losses in their colours (where there are any)."""
    classes = {"gain": "pos", "loss": "neg"}
    return " ".join(f'<span class="delta {classes[s]}">{html.escape(text)}</span>'
                    if s in classes and entry.counts[s] else html.escape(text) for s, text in count_parts(entry))


def to_html(summary: Summary, status: list[str] | None = None) -> str:
    """The summary as HTML (``status``: HTML paragraphs on the diagnostics, under the claims); each header links to
    its table's section (``plots.slug`` of its title, as the page names it)."""
    esc = html.escape
    out = ['<section id="summary">', "<h2>What this run found</h2>"]
    if summary.claims:
        out += ['<ul class="claims">'] + [f"<li>{_bold_verdict(c, esc(c.sentence), '<strong>', '</strong>')}</li>"
                                         for c in summary.claims] + ["</ul>"]
    out += status or []
    if not summary.entries:
        return "\n".join(out + ["<p>No calibrated row on this board.</p>", "</section>"]) + "\n"
    out.append('<table class="summary"><thead><tr><th>calibration</th>')
    for t in summary.tables:
        flag = f' <span class="warning" title="{esc(t.warning)}">⚠</span>' if t.warning else ""
        out.append(f'<th><a href="#{slug(t.title)}">{esc(t.title)}</a>{flag}</th>')
    out.append("</tr></thead><tbody>")
    for calibration, entries in _grid(summary):
        tds = [f'<td class="recipe">{esc(calibration)}</td>']
        for e in entries:
            if e is None:
                tds.append('<td class="num">—</td>')
                continue
            sign = ("pos" if e.median_interval[0] > 0 else "neg" if e.median_interval[1] < 0 else "ns") \
                if e.median_interval else "unknown"
            tds.append(f'<td class="num" title="{esc(_tooltip(e))}">{_counts_html(e)}<br>'
                       f'<span class="delta {sign}">{esc(fmt_median(e))}</span></td>')
        out.append("<tr>" + "".join(tds) + "</tr>")
    out += ["</tbody></table>", f'<p class="footnote">{esc(METHOD)}</p>', "</section>"]
    return "\n".join(out) + "\n"


def _rounded(interval: Interval | None) -> list[float] | None:
    return None if interval is None else [round(interval[0], 6) + 0.0, round(interval[1], 6) + 0.0]


def to_json(summary: Summary) -> dict:
    """The summary as leaderboard.json holds it (points; no key is called ``error``, which DVC would take for a
    failure to read the file)."""
    return {"metric": METRIC, "method": METHOD,
            "claims": [{"text": c.text, "sentence": c.sentence, "counts": c.counts, "unmeasured": c.unmeasured,
                        "calibrations": list(c.calibrations)} for c in summary.claims],
            "calibrations": [{"backbone": e.key[0], "task_set": e.key[1], "regime": e.key[2], "seed": e.key[3],
                              "calibration": e.calibration, "counts": e.counts, "verdicts": dict(e.verdicts),
                              "unmeasured": list(e.unmeasured), "ill_posed": list(e.ill_posed),
                              "median_points": None if e.median is None else round(e.median, 6) + 0.0,
                              "median_ci95": _rounded(e.median_interval), "unstable": e.unstable}
                             for e in summary.entries]}
