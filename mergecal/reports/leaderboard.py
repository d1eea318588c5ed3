"""Leaderboard tables of one invocation: per backbone x task set x regime, the reference rows, then each
base merge followed by its calibrated variants, with the change the calibration brings.

Accuracies are logged as fractions and shown as percentages with one decimal; deltas are in points
against the calibrated row's own base merge, because that is the question a calibration answers.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field

import pandas as pd

from ..regimes import REGIMES
from .runs import GROUP, metric

REFERENCES = ("zeroshot", "finetuned")
MERGE_ORDER = ("weight_averaging", "task_arithmetic", "ties", "dare", "consensus", "tsv_m", "iso_c", "iso_cts")
REGIME_ORDER = REGIMES
SUMMARY = (("avg_acc", "avg"), ("avg_norm_acc", "norm. avg"))
SKIPPED = "skipped"  # the status of a chain a track cannot run (logged with its reason, never computed)


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
    tasks: tuple[str, ...]
    rows: tuple[Row, ...]
    failures: tuple[Failure, ...]

    @property
    def columns(self) -> list[tuple[str, str]]:
        """(metric name, header) of every value column."""
        return [(f"acc.{t}", t) for t in self.tasks] + list(SUMMARY)

    @property
    def title(self) -> str:
        return f"{self.backbone} · {self.task_set} · {self.regime}"

    def best(self) -> dict[str, float]:
        """Per column, the best non-reference value at display precision (what gets marked)."""
        out = {}
        for name, _ in self.columns:
            shown = [points(r.values.get(name)) for r in self.rows if r.role != "reference"]
            shown = [v for v in shown if v is not None]
            if shown:
                out[name] = max(shown)
        return out


def points(fraction: float | None) -> float | None:
    """A fraction as percentage points rounded to one decimal (None stays None)."""
    return None if fraction is None else round(100.0 * fraction, 1) + 0.0


def fmt_pct(fraction: float | None) -> str:
    return "—" if fraction is None else f"{points(fraction):.1f}"


def fmt_delta(delta: float | None) -> str:
    return "" if delta is None else f" ({round(delta, 1) + 0.0:+.1f})"


def rank(order: tuple[str, ...], name: str) -> tuple[int, str]:
    """Known names in their listed order, then unknown ones alphabetically."""
    return (order.index(name), "") if name in order else (len(order), name)


def recipe_order(merge: str, calibration: str, recipe: str) -> tuple:
    """Reference rows first, then merges in MERGE_ORDER, each base method before its calibrated variants."""
    if merge in REFERENCES:
        return (0, REFERENCES.index(merge), "", 0, "")
    steps = 0 if calibration in ("", "none") else len(calibration.split(">"))
    return (1, *rank(MERGE_ORDER, merge), steps, recipe)


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


def build_tables(cells: pd.DataFrame) -> list[Table]:
    """One table per (backbone, task set, regime) of the invocation's ``cells``, in a fixed order."""
    tables = []
    keys = sorted({tuple(r) for r in cells[list(GROUP)].itertuples(index=False)},
                  key=lambda k: (k[0], k[1], rank(REGIME_ORDER, k[2])))
    for key in keys:
        group = cells[(cells[list(GROUP)] == pd.Series(key, index=list(GROUP))).all(axis=1)]
        tasks = _tasks(group[group["status"] == "ok"]) or _tasks(group)
        names = [f"acc.{t}" for t in tasks] + [m for m, _ in SUMMARY]
        ordered = sorted((r for _, r in group.iterrows()), key=_row_key)
        base = {r["merge"]: {n: metric(r, n) for n in names} for r in ordered
                if r["status"] == "ok" and r["calibration"] in ("", "none") and r["merge"] not in REFERENCES}
        rows, failures = [], []
        for r in ordered:
            if r["status"] != "ok":
                failures.append(Failure(r["recipe"], r["cell_id"], r["run_id"], r["status"], r["error"]))
                continue
            values = {n: metric(r, n) for n in names}
            if r["merge"] in REFERENCES:
                role = "reference"
            elif r["calibration"] in ("", "none"):
                role = "base"
            else:
                role = "calibrated"
            deltas = {}
            if role == "calibrated" and r["merge"] in base:
                ref = base[r["merge"]]
                deltas = {n: None if values[n] is None or ref[n] is None else 100.0 * (values[n] - ref[n])
                          for n in names}
            rows.append(Row(r["recipe"], r["merge"], r["calibration"], role, r["cell_id"], r["run_id"],
                            bool(r["cached"]), values, deltas))
        tables.append(Table(*key, tasks, tuple(rows), tuple(failures)))
    return tables


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _is_best(row: Row, name: str, best: dict[str, float]) -> bool:
    value = row.values.get(name)
    return row.role != "reference" and value is not None and points(value) == best.get(name)


def table_markdown(table: Table) -> str:
    best = table.best()
    head = ["recipe"] + [h for _, h in table.columns]
    lines = [f"## {table.title}", "", "| " + " | ".join(_md_escape(h) for h in head) + " |",
             "|---" + "|---:" * len(table.columns) + "|"]
    for row in table.rows:
        cells = [f"`{row.recipe}`"]
        for name, _ in table.columns:
            text = fmt_pct(row.values.get(name)) + fmt_delta(row.deltas.get(name))
            if _is_best(row, name, best):
                text = f"**{text}**"
            cells.append(text)
        lines.append("| " + " | ".join(cells) + " |")
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


def table_html(table: Table) -> str:
    best = table.best()
    esc = html.escape
    out = [f"<h2>{esc(table.title)}</h2>", "<table>", "<thead><tr><th>recipe</th>"
           + "".join(f"<th>{esc(h)}</th>" for _, h in table.columns) + "</tr></thead>", "<tbody>"]
    for row in table.rows:
        tds = [f'<td class="recipe">{esc(row.recipe)}</td>']
        for name, _ in table.columns:
            value, delta = row.values.get(name), row.deltas.get(name)
            classes = ["num"]
            if _is_best(row, name, best):
                classes.append("best")
            text = esc(fmt_pct(value))
            if delta is not None:
                sign = "pos" if round(delta, 1) > 0 else "neg" if round(delta, 1) < 0 else "zero"
                text += f' <span class="delta {sign}">{esc(fmt_delta(delta).strip())}</span>'
            tds.append(f'<td class="{" ".join(classes)}">{text}</td>')
        out.append(f'<tr class="{row.role}">' + "".join(tds) + "</tr>")
    out += ["</tbody>", "</table>"]
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


def tables_json(tables: list[Table]) -> dict:
    """``{backbone: {task_set: {regime: {recipe: row}}}}``: nested so DVC can read it as metrics.

    No key is called ``error``: DVC takes such a key for a failure to read the file."""
    out: dict = {}
    for table in tables:
        slot = out.setdefault(table.backbone, {}).setdefault(table.task_set, {}).setdefault(table.regime, {})
        for row in table.rows:
            # no run id or reuse flag: they differ between two runs of the same inputs
            entry = {"role": row.role, "cell_id": row.cell_id,
                     "values": {k: v for k, v in row.values.items() if v is not None}}
            if row.deltas:
                entry["delta_points"] = {k: round(v, 6) for k, v in row.deltas.items() if v is not None}
            slot[row.recipe] = entry
        for failure in table.failures:
            slot[failure.recipe] = {"role": "skipped" if failure.status == SKIPPED else "failed",
                                    "cell_id": failure.cell_id, "status": failure.status,
                                    "error_message": failure.error}
    return out
