"""The "published" comparison of a leaderboard table built from a preset: each row's printed number beside this
run's value with its 95 % interval, whether the printed number lies inside, and a reproduction summary.

Rows are matched by recipe label (``ties>svc`` is the paper's "TIES w/ SVC"), in the table's ``standard`` regime
(the papers' setting) only. Columns: each task both report, and the average when the table's tasks are the paper's
(a ``preset_tasks`` subset has no published average). A printed number is rounded to its table's precision (0.1
point unless the table says otherwise), so "inside" allows the interval that rounding: ``lo - 0.05 <= printed <=
hi + 0.05`` (points; 0.005 for a table printed to two decimals).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..published import PublishedRow, cite
from .leaderboard import Table, points

STANDARD = "standard"


@dataclass(frozen=True)
class Comparison:
    recipe: str
    paper_row: str
    column: str  # the leaderboard's header ("avg", or a task)
    published: float  # points
    value: float | None  # points (None: the cell has no value)
    interval: tuple[float, float] | None  # points
    decimals: int = 1  # the printed precision

    @property
    def inside(self) -> bool | None:
        if self.interval is None:
            return None
        rounding = 0.5 * 10.0 ** -self.decimals
        return self.interval[0] - rounding <= self.published <= self.interval[1] + rounding


@dataclass(frozen=True)
class Reproduction:
    table: Table
    cite: str
    comparisons: tuple[Comparison, ...]
    unmatched_published: tuple[str, ...]  # the paper's rows with no row here
    unmatched_here: tuple[str, ...]  # this table's recipes with no published row

    def counts(self) -> dict[str, int]:
        inside = [c.inside for c in self.comparisons]
        return {"inside": inside.count(True), "outside": inside.count(False), "no_interval": inside.count(None),
                "published_without_row": len(self.unmatched_published),
                "rows_without_published": len(self.unmatched_here)}


def compare(table: Table, published: list[PublishedRow]) -> Reproduction | None:
    """The table's comparison with the paper's rows (None outside the standard regime or without rows)."""
    if table.regime != STANDARD or not published:
        return None
    by_recipe = {p.recipe: p for p in published if p.recipe is not None}
    comparisons, matched = [], set()
    for row in table.rows:
        paper = by_recipe.get(row.recipe)
        if paper is None:
            continue
        matched.add(row.recipe)
        columns = [(f"acc.{t}", t, paper.per_task[paper.tasks.index(t)]) for t in table.tasks if t in paper.tasks]
        if set(table.tasks) == set(paper.tasks) and paper.average is not None:
            columns.append(("avg_acc", "avg", paper.average))
        for name, header, printed in columns:
            value, interval = row.values.get(name), row.intervals.get(name)
            comparisons.append(Comparison(row.recipe, paper.row, header, printed,
                                          points(value, paper.decimals),
                                          (points(interval[0], paper.decimals), points(interval[1], paper.decimals))
                                          if interval else None, paper.decimals))
    return Reproduction(table, cite(published), tuple(comparisons),
                        tuple(p.row for p in published if p.recipe not in matched),
                        tuple(r.recipe for r in table.rows if r.recipe not in matched))


def _fmt(c: Comparison) -> str:
    if c.value is None:
        return "—"
    d = c.decimals
    return f"{c.value:.{d}f}" + (f" [{c.interval[0]:.{d}f}, {c.interval[1]:.{d}f}]" if c.interval else "")


def markdown(reproductions: list[Reproduction]) -> str:
    """One section per compared table: the average column (else every task column) of each matched row, then the
    summary over every compared column."""
    parts = []
    for rep in reproductions:
        counts = rep.counts()
        shown = [c for c in rep.comparisons if c.column == "avg"] or list(rep.comparisons)
        lines = [f"## Published: {rep.table.title}", "", f"Against {rep.cite}.", "",
                 "| recipe | paper's row | column | published | this run [95 % interval] | inside |",
                 "|---|---|---|---:|---:|---|"]
        for c in shown:
            verdict = {True: "yes", False: "**no**", None: "—"}[c.inside]
            printed = f"{c.published:.{c.decimals}f}"
            lines.append(f"| `{c.recipe}` | {c.paper_row} | {c.column} | {printed} | {_fmt(c)} | {verdict} |")
        lines += ["", f"Reproduction over {len(rep.comparisons)} compared values: {counts['inside']} inside their "
                      f"interval, {counts['outside']} outside"
                      + (f", {counts['no_interval']} without an interval" if counts["no_interval"] else "") + "; "
                      f"published rows with no row here: {', '.join(rep.unmatched_published) or 'none'}; rows here "
                      f"with no published counterpart: {', '.join(f'`{r}`' for r in rep.unmatched_here) or 'none'}.",
                  ""]
        parts.append("\n".join(lines))
    return "\n".join(parts)


def to_json(reproductions: list[Reproduction]) -> list[dict]:
    return [{"backbone": r.table.backbone, "task_set": r.table.task_set, "regime": r.table.regime,
             "seed": r.table.seed, "source": r.cite, "counts": r.counts(),
             "unmatched_published": list(r.unmatched_published), "unmatched_here": list(r.unmatched_here),
             "comparisons": [{"recipe": c.recipe, "paper_row": c.paper_row, "column": c.column,
                              "published": c.published, "decimals": c.decimals, "value": c.value,
                              "interval": list(c.interval) if c.interval else None, "inside": c.inside}
                             for c in r.comparisons]} for r in reproductions]
