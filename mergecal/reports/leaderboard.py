"""Leaderboard tables of one invocation: per backbone x task set x regime, the reference rows, then each
base merge followed by its calibrated variants, with the change the calibration brings.

Accuracies are logged as fractions and shown as percentages with one decimal; deltas are in points
against the calibrated row's own base merge, because that is the question a calibration answers. A calibration
name may carry a protocol after ``@`` (``dsc@λ=0.3``): the row's base is then ``none@λ=0.3`` of the same merge.

Uncertainty (``mergecal.intervals``): from each cell's per-example test results, every value gets a 95 %
stratified bootstrap interval, every delta a paired one; a delta counts as a gain or a loss only when its
interval excludes 0, and a column's best row is marked only when it beats the runner-up significantly.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from ..regimes import REGIMES
from ..intervals import Interval, paired_interval, significance, stratified_interval
from .runs import GROUP, SEED, metric, seeds_of

Paired = tuple[tuple[np.ndarray, ...], tuple[float, ...]]  # per-task per-example differences and their weights

REFERENCES = ("zeroshot", "finetuned", "multitask")  # reference rows, in this order (a track may lack multitask)
MERGE_ORDER = ("weight_averaging", "task_arithmetic", "ties", "dare", "consensus", "tsv_m", "iso_c", "iso_cts")
REGIME_ORDER = REGIMES
SUMMARY = (("avg_acc", "avg"), ("avg_norm_acc", "norm. avg"))
SKIPPED = "skipped"  # the status of a chain a track cannot run (logged with its reason, never computed)
BASE_CALIBRATIONS = ("", "none")
# merges whose rows with an SVC step are shown but never ranked: why, in the table's footnote
ILL_POSED = {("iso_c", "svc"): "SVC on Iso-C is ill-posed: Iso's flat spectrum leaves SVC's basis arbitrary "
                               "(1e-6 input noise moves SVC's output by 7e-2)",
             ("iso_cts", "svc"): "SVC on Iso-CTS is ill-posed: Iso's flat spectrum leaves SVC's basis arbitrary "
                                 "(1e-6 input noise moves SVC's output by 7e-2)"}


@dataclass(frozen=True)
class Row:
    recipe: str
    merge: str
    calibration: str
    role: str  # "reference" | "base" | "calibrated"
    cell_id: str
    run_id: str
    cached: bool
    values: dict[str, float | None]  # column -> fraction as logged
    deltas: dict[str, float | None] = field(default_factory=dict)  # column -> points vs the base merge
    intervals: dict[str, Interval] = field(default_factory=dict)  # column -> 95 % interval (fractions)
    delta_intervals: dict[str, Interval] = field(default_factory=dict)  # column -> paired 95 % interval (points)
    ill_posed: str = ""  # why the row is shown but never ranked ("" when it is well-posed)
    recipe_id: str = ""  # the cell's canonical recipe (every parameter of every step; "" for a reference)
    # the averages' per-example differences against the base merge (``Paired``): what mergecal.reports.summary
    # resamples jointly across rows; not part of a row's identity
    paired: dict[str, Paired] = field(default_factory=dict, compare=False, repr=False)

    def significance(self, name: str) -> str:
        """``gain`` / ``loss`` when the delta's paired interval excludes 0, else ``none`` (always for an
        ill-posed row)."""
        return "none" if self.ill_posed else significance(self.delta_intervals.get(name))


@dataclass(frozen=True)
class Failure:
    recipe: str
    cell_id: str
    run_id: str
    status: str
    error: str


@dataclass(frozen=True)
class Table:
    backbone: str
    task_set: str
    regime: str
    seed: str  # the fine-tuning seed of its models
    tasks: tuple[str, ...]
    rows: tuple[Row, ...]
    failures: tuple[Failure, ...]
    best: dict[str, str] = field(default_factory=dict)  # column -> the recipe significantly best in it
    warning: str = ""  # shown under the title: the track is unstable (mergecal.reports.stability.table_warning)
    several_seeds: bool = False  # the invocation has several fine-tuning seeds: the title names this one's

    @property
    def columns(self) -> list[tuple[str, str]]:
        """(metric name, header) of every value column as shown: the averages first, right after the row's name,
        where they are read first (and stay on screen when the tasks' columns do not), then the tasks."""
        return list(SUMMARY) + [(f"acc.{t}", t) for t in self.tasks]

    @property
    def title(self) -> str:
        seed = f" · seed {self.seed}" if self.several_seeds else ""  # one seed: the title as it always was
        return f"{self.backbone} · {self.task_set} · {self.regime}{seed}"

    @property
    def ill_posed(self) -> list[str]:
        """The reasons of the table's ill-posed rows, once each, in row order."""
        return list(dict.fromkeys(r.ill_posed for r in self.rows if r.ill_posed))


def points(fraction: float | None, decimals: int = 1) -> float | None:
    """A fraction as percentage points rounded to ``decimals`` (one unless asked; None stays None)."""
    return None if fraction is None else round(100.0 * fraction, decimals) + 0.0


def fmt_pct(fraction: float | None) -> str:
    return "—" if fraction is None else f"{points(fraction):.1f}"


SIGN_MARKS = {"gain": "▲", "loss": "▼", "none": "≈"}


def fmt_delta(delta: float | None, sign: str | None = None) -> str:
    """`` (+1.2▲)`` a significant gain, `` (-1.2▼)`` a loss, `` (+0.3≈)`` not significant; plain
    `` (+0.3)`` when there is no interval (``sign`` None)."""
    return "" if delta is None else f" ({round(delta, 1) + 0.0:+.1f}{SIGN_MARKS.get(sign, '')})"


def fmt_interval(interval: Interval | None) -> str:
    """`` [68.2, 70.0]``: an interval of fractions in points, one decimal ("" when there is none)."""
    return "" if interval is None else f" [{points(interval[0]):.1f}, {points(interval[1]):.1f}]"


def protocol(calibration: str) -> tuple[str, str]:
    """(the calibration's steps, its protocol suffix after ``@`` or "")."""
    steps, _, suffix = calibration.partition("@")
    return steps, suffix


def is_base(calibration: str) -> bool:
    return protocol(calibration)[0] in BASE_CALIBRATIONS


def ill_posed(merge: str, calibration: str) -> str:
    """Why a (merge, calibration) row is ill-posed, or ""."""
    steps = [step.partition("(")[0] for step in protocol(calibration)[0].split(">")]  # svc(calibrate_at=...) is svc
    method = merge.partition("(")[0]
    return next((reason for (m, step), reason in ILL_POSED.items() if method == m and step in steps), "")


def rank(order: tuple[str, ...], name: str) -> tuple[int, str]:
    """Known names in their listed order, then unknown ones alphabetically."""
    return (order.index(name), "") if name in order else (len(order), name)


def recipe_order(merge: str, calibration: str, recipe: str) -> tuple:
    """Reference rows first, then merges in MERGE_ORDER; within a merge, each protocol (the suffix after ``@``;
    none first) with its base before its calibrated variants."""
    if merge in REFERENCES:
        return (0, REFERENCES.index(merge), "", "", 0, "")
    steps, suffix = protocol(calibration)
    method = merge.partition("(")[0]  # a variant (ties(top_k=0.3), mergecal.reports.labels) beside its method
    return (1, *rank(MERGE_ORDER, method), merge, suffix, 0 if is_base(calibration) else len(steps.split(">")),
            recipe)


def _row_key(row: pd.Series) -> tuple:
    return recipe_order(row["merge"], row["calibration"], row["recipe"])


def _tasks(group: pd.DataFrame) -> tuple[str, ...]:
    """Task columns in the logged order; cells that disagree add their tasks after."""
    tasks: list[str] = []
    for logged in group["tasks"]:
        tasks.extend(t for t in logged if t not in tasks)
    if not tasks:  # no tag: fall back to the accuracy metrics present
        names = {c[len("metrics.acc."):] for c in group.columns if c.startswith("metrics.acc.")}
        tasks = sorted(n for n in names if group[f"metrics.acc.{n}"].notna().any())
    return tuple(tasks)


Examples = dict[str, list]  # a cell's per-example test scores by task (the ``examples/test.json`` artifact)


def column_samples(name: str, tasks: tuple[str, ...], examples: Examples | None,
                   finetuned: dict[str, float | None]) -> tuple[list, list[float]] | None:
    """The per-task samples and weights whose weighted mean is column ``name`` (None when the cell logged no
    per-example results for it). The normalized average divides each task by its fine-tuned test accuracy,
    ``finetuned[f"acc.{task}"]`` (a constant)."""
    if not examples:
        return None
    if name.startswith("acc."):
        task = name[len("acc."):]
        return ([examples[task]], [1.0]) if task in examples else None
    if any(t not in examples for t in tasks):
        return None
    if name == "avg_acc":
        return [examples[t] for t in tasks], [1.0 / len(tasks)] * len(tasks)
    if name == "avg_norm_acc":
        denominators = [finetuned.get(f"acc.{t}") for t in tasks]
        if any(d is None or d <= 0 for d in denominators):
            return None
        return [examples[t] for t in tasks], [1.0 / (len(tasks) * d) for d in denominators]
    return None


def paired_differences(row: tuple[list, list[float]] | None, other: tuple[list, list[float]] | None) -> Paired | None:
    """``row``'s per-example scores minus ``other``'s, per task, with ``row``'s weights (None without per-example
    results on both or when they were not scored on the same examples)."""
    if row is None or other is None or len(row[0]) != len(other[0]) \
            or any(len(a) != len(b) for a, b in zip(row[0], other[0])):
        return None
    return (tuple(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64) for a, b in zip(row[0], other[0])),
            tuple(row[1]))


def paired_points(row: tuple[list, list[float]] | None, other: tuple[list, list[float]] | None) -> Interval | None:
    """The paired interval of ``row`` minus ``other`` in points (None without per-example results on both or
    when they were not scored on the same examples)."""
    if row is None or other is None:
        return None
    try:
        low, high = paired_interval(row[0], other[0], row[1])
    except ValueError:
        return None
    return 100.0 * low, 100.0 * high


def significant_best(rows: list[Row], names: list[str], samples) -> dict[str, str]:
    """Per column, the recipe of the ranked row (not a reference, not ill-posed) with the highest value, when its
    paired interval against the runner-up excludes 0; a column without a significant winner has none."""
    out = {}
    for name in names:
        ranked = sorted((r for r in rows if r.role != "reference" and not r.ill_posed
                         and r.values.get(name) is not None), key=lambda r: -r.values[name])
        if len(ranked) < 2:
            continue
        top, runner = ranked[:2]
        if significance(paired_points(samples[top.recipe].get(name), samples[runner.recipe].get(name))) == "gain":
            out[name] = top.recipe
    return out


def _role(r: pd.Series) -> str:
    if r["merge"] in REFERENCES:
        return "reference"
    return "base" if is_base(r["calibration"]) else "calibrated"


def _base_key(merge: str, calibration: str) -> tuple[str, str]:
    """The key of a row's base merge: its merge and protocol suffix."""
    return merge, protocol(calibration)[1]


def build_tables(cells: pd.DataFrame, examples: dict[str, Examples | None] | None = None) -> list[Table]:
    """One table per (backbone, task set, regime, fine-tuning seed) of the invocation's ``cells``, in a fixed order
    (a regime's seeds side by side). ``examples``: per run id, the cell's per-example test results
    (``runs.load_examples``), from which the intervals come."""
    examples = examples or {}
    tables = []
    if SEED not in cells:  # cells read without the seed's column: one (unnamed) seed
        cells = cells.assign(**{SEED: ""})
    group_by = [*GROUP, SEED]
    seeds = seeds_of(cells)
    keys = sorted({tuple(r) for r in cells[group_by].itertuples(index=False)},
                  key=lambda k: (k[0], k[1], rank(REGIME_ORDER, k[2]), seeds.index(k[3])))
    for key in keys:
        group = cells[(cells[group_by] == pd.Series(key, index=group_by)).all(axis=1)]
        tasks = _tasks(group[group["status"] == "ok"]) or _tasks(group)
        names = [f"acc.{t}" for t in tasks] + [m for m, _ in SUMMARY]
        ordered = sorted((r for _, r in group.iterrows()), key=_row_key)
        ok = [r for r in ordered if r["status"] == "ok"]
        finetuned = next(({n: metric(r, n) for n in names} for r in ok if r["merge"] == "finetuned"), {})
        samples = {r["recipe"]: {n: column_samples(n, tasks, examples.get(r["run_id"]), finetuned) for n in names}
                   for r in ok}
        base = {_base_key(r["merge"], r["calibration"]): r for r in ok if _role(r) == "base"}
        rows, failures = [], []
        for r in ordered:
            if r["status"] != "ok":
                failures.append(Failure(r["recipe"], r["cell_id"], r["run_id"], r["status"], r["error"]))
                continue
            values, role, mine = {n: metric(r, n) for n in names}, _role(r), samples[r["recipe"]]
            intervals = {n: stratified_interval(*mine[n]) for n in names if mine[n] is not None}
            deltas, delta_intervals, paired = {}, {}, {}
            ref = base.get(_base_key(r["merge"], r["calibration"])) if role == "calibrated" else None
            if ref is not None:
                ref_values, theirs = {n: metric(ref, n) for n in names}, samples[ref["recipe"]]
                deltas = {n: None if values[n] is None or ref_values[n] is None else 100.0 * (values[n] - ref_values[n])
                          for n in names}
                delta_intervals = {n: i for n in names if (i := paired_points(mine[n], theirs[n])) is not None}
                paired = {n: d for n, _ in SUMMARY if (d := paired_differences(mine[n], theirs[n])) is not None}
            rows.append(Row(r["recipe"], r["merge"], r["calibration"], role, r["cell_id"], r["run_id"],
                            bool(r["cached"]), values, deltas, intervals, delta_intervals,
                            ill_posed(r["merge"], r["calibration"]) if role != "reference" else "",
                            r.get("recipe_id") if isinstance(r.get("recipe_id"), str) else "", paired))
        tables.append(Table(*key, tasks, tuple(rows), tuple(failures), significant_best(rows, names, samples),
                            several_seeds=len(seeds) > 1))
    return tables


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _is_best(table: Table, row: Row, name: str) -> bool:
    return table.best.get(name) == row.recipe


def cell_text(row: Row, name: str) -> str:
    """A value as shown: per-task columns the value, the averages (``SUMMARY``) also their interval; ``†`` on an
    ill-posed row; the delta with its significance mark."""
    text = fmt_pct(row.values.get(name)) + ("†" if row.ill_posed else "")
    if name in dict(SUMMARY):
        text += fmt_interval(row.intervals.get(name))
    delta = row.deltas.get(name)
    sign = row.significance(name) if name in row.delta_intervals else None
    return text + fmt_delta(delta, sign)


def table_markdown(table: Table) -> str:
    head = ["recipe"] + [h for _, h in table.columns]
    lines = [f"## {table.title}", ""] + ([f"**Warning:** {_md_escape(table.warning)}", ""] if table.warning else [])
    lines += ["| " + " | ".join(_md_escape(h) for h in head) + " |", "|---" + "|---:" * len(table.columns) + "|"]
    for row in table.rows:
        cells = [f"`{row.recipe}`"]
        for name, _ in table.columns:
            text = cell_text(row, name)
            if _is_best(table, row, name):
                text = f"**{text}**"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
    if table.ill_posed:
        lines += [""] + [f"† {_md_escape(reason)}; never ranked." for reason in table.ill_posed]
    failed, skipped = _not_run(table)
    if failed:
        lines += ["", "Failed cells:", ""]
        lines += [f"- `{f.recipe}` ({f.status}, cell `{f.cell_id}`): {_md_escape(f.error)}" for f in failed]
    if skipped:
        lines += ["", "Skipped chains (not supported on this track):", ""]
        lines += [f"- {', '.join(f'`{r}`' for r in recipes)}: {_md_escape(reason)}" for reason, recipes in skipped]
    return "\n".join(lines) + "\n"


def _not_run(table: Table) -> tuple[list[Failure], list[tuple[str, list[str]]]]:
    """The failed cells, and the chains the track skips as (reason, their recipes) in table order."""
    failed = [f for f in table.failures if f.status != SKIPPED]
    skipped: dict[str, list[str]] = {}
    for f in table.failures:
        if f.status == SKIPPED:
            skipped.setdefault(f.error, []).append(f.recipe)
    return failed, list(skipped.items())


DELTA_CLASSES = {"gain": "pos", "loss": "neg", "none": "ns"}


def provenance_text(source: dict[str, str]) -> str:
    """One line of a row's provenance: who computed it, where, from which commit and parameters, when."""
    return (f"computed by {source.get('user') or '?'} on {source.get('host') or '?'} at "
            f"{source.get('code_version') or '?'}, params {(source.get('params_sha256') or '?')[:12]}, "
            f"{source.get('date') or '?'}")


def _avg_class(name: str) -> str:
    """The class of an average's header (the page's style sets the averages off from the tasks)."""
    return ' class="avg"' if name in dict(SUMMARY) else ""


def table_html(table: Table, provenance: dict[str, dict[str, str]] | None = None) -> str:
    """The table as HTML; ``provenance`` (run id -> ``provenance_text``'s fields, a lab's board) puts each row's
    provenance in its recipe cell's tooltip."""
    esc = html.escape
    out = [f"<h2>{esc(table.title)}</h2>"] + ([f'<p class="warning">Warning: {esc(table.warning)}</p>']
                                              if table.warning else [])
    out += ["<table>", "<thead><tr><th>recipe</th>"
            + "".join(f"<th{_avg_class(n)}>{esc(h)}</th>" for n, h in table.columns) + "</tr></thead>", "<tbody>"]
    for row in table.rows:
        source = (provenance or {}).get(row.run_id)
        tip = f' title="{esc(provenance_text(source))}"' if source else ""
        tds = [f'<td class="recipe"{tip}>{esc(row.recipe)}</td>']
        for name, _ in table.columns:
            value, delta = row.values.get(name), row.deltas.get(name)
            classes = (["num"] + (["avg"] if name in dict(SUMMARY) else []) + (["best"] if _is_best(table, row, name)
                                                                              else [])
                       + (["ill-posed"] if row.ill_posed else []))
            text = esc(fmt_pct(value) + ("†" if row.ill_posed else ""))
            if name in dict(SUMMARY) and name in row.intervals:
                text += f' <span class="ci">{esc(fmt_interval(row.intervals[name]).strip())}</span>'
            if delta is not None:
                known = name in row.delta_intervals
                sign = row.significance(name) if known else None
                span_class = DELTA_CLASSES[sign] if known else "zero" if round(delta, 1) == 0 else "unknown"
                title = (f' title="paired 95% interval [{row.delta_intervals[name][0]:+.1f}, '
                         f'{row.delta_intervals[name][1]:+.1f}] points"' if known else "")
                text += f' <span class="delta {span_class}"{title}>{esc(fmt_delta(delta, sign).strip())}</span>'
            tds.append(f'<td class="{" ".join(classes)}">{text}</td>')
        out.append(f'<tr class="{row.role}">' + "".join(tds) + "</tr>")
    out += ["</tbody>", "</table>"]
    if table.ill_posed:
        out += [f'<p class="footnote">† {esc(reason)}; never ranked.</p>' for reason in table.ill_posed]
    failed, skipped = _not_run(table)
    if failed:
        out.append('<p>Failed cells:</p><ul class="failed">')
        out += [f"<li><code>{esc(f.recipe)}</code> ({esc(f.status)}, cell <code>{esc(f.cell_id)}</code>): "
                f"{esc(f.error)}</li>" for f in failed]
        out.append("</ul>")
    if skipped:
        out.append('<p>Skipped chains (not supported on this track):</p><ul class="skipped">')
        out += [f"<li>{', '.join(f'<code>{esc(r)}</code>' for r in recipes)}: {esc(reason)}</li>"
                for reason, recipes in skipped]
        out.append("</ul>")
    return "\n".join(out) + "\n"


def _rounded(interval: Interval) -> list[float]:
    return [round(interval[0], 6) + 0.0, round(interval[1], 6) + 0.0]


def seed_key(seed: str) -> str:
    """leaderboard.json's key of one fine-tuning seed's tables (when there are several)."""
    return f"seed_{seed}"


def tables_json(tables: list[Table], provenance: dict[str, dict[str, str]] | None = None) -> dict:
    """``{backbone: {task_set: {regime: {recipe: row}}}}``: nested so DVC can read it as metrics; with several
    fine-tuning seeds, that structure per seed: ``{"seed_<s>": {backbone: ...}}``. ``provenance`` (run id -> who,
    where, which commit and params, when: a lab's board) adds each row's as its ``provenance``.

    No key is called ``error``: DVC takes such a key for a failure to read the file."""
    out: dict = {}
    for table in tables:
        top = out.setdefault(seed_key(table.seed), {}) if table.several_seeds else out
        slot = top.setdefault(table.backbone, {}).setdefault(table.task_set, {}).setdefault(table.regime, {})
        for row in table.rows:
            # no run id or reuse flag: they differ between two runs of the same inputs
            entry = {"role": row.role, "cell_id": row.cell_id,
                     "values": {k: v for k, v in row.values.items() if v is not None}}
            if row.intervals:
                entry["ci95"] = {k: _rounded(v) for k, v in row.intervals.items()}
            if row.deltas:
                entry["delta_points"] = {k: round(v, 6) for k, v in row.deltas.items() if v is not None}
                entry["delta_ci95"] = {k: _rounded(v) for k, v in row.delta_intervals.items()}
                entry["significant"] = {k: row.significance(k) for k, v in row.deltas.items() if v is not None}
            if row.ill_posed:
                entry["ill_posed"] = row.ill_posed
            best = sorted(k for k, recipe in table.best.items() if recipe == row.recipe)
            if best:
                entry["best"] = best
            if provenance and row.run_id in provenance:
                entry["provenance"] = provenance[row.run_id]
            slot[row.recipe] = entry
        for failure in table.failures:
            slot[failure.recipe] = {"role": "skipped" if failure.status == SKIPPED else "failed",
                                    "cell_id": failure.cell_id, "status": failure.status,
                                    "error_message": failure.error}
    return out
