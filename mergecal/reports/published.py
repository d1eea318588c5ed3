"""The "published" comparison of a leaderboard table built from a preset: each row's printed number beside this run's
value with its 95 % interval, whether the printed number lies inside, and a reproduction summary.

Rows are matched by the protocol they run: the recipe label (``ties(scaling=1.0)>svc`` is the SVC paper's "TIES w/
SVC": its merge at lambda 1, no search), then the merge's settings the source states (``params``) against the cell's
canonical recipe; a row of another protocol, of other checkpoints or of a merge of another task set
(``PublishedRow.unlike``) is shown beside the run's value with the reason and no verdict. The table's ``standard``
regime (the papers' setting) only. Columns: each task both report, and the average when the table's tasks are the
paper's (a ``preset_tasks`` subset has no published average). A printed number is rounded to its table's precision
(0.1 point unless the table says otherwise), so "inside" allows the interval that rounding: ``lo - 0.05 <= printed <=
hi + 0.05`` (points; 0.005 for a table printed to two decimals).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..published import REFERENCE_METHODS, PublishedRow, cite
from ..recipe import Recipe
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
    unlike: str = ""  # why the run reproduces no such number (other checkpoints, protocol, task set): no verdict

    @property
    def inside(self) -> bool | None:
        if self.interval is None or self.unlike:
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
        inside = [c.inside for c in self.comparisons if not c.unlike]
        return {"inside": inside.count(True), "outside": inside.count(False), "no_interval": inside.count(None),
                "not_comparable": sum(1 for c in self.comparisons if c.unlike),
                "published_without_row": len(self.unmatched_published),
                "rows_without_published": len(self.unmatched_here)}


def other_protocol(paper: PublishedRow, recipe_id: str) -> str:
    """How the cell's merge differs from the settings the source states for its row ("" when it runs them)."""
    if not paper.params:
        return ""
    try:
        merge = next(s for s in Recipe.parse(recipe_id).steps if s.phase == "merge").params.model_dump()
    except Exception:  # a recipe id this version cannot read: its settings are unknown
        return "another protocol (the cell's settings cannot be read)"
    differ = [f"{name} {merge.get(name)!r} here, {value!r} printed" for name, value in paper.params
              if merge.get(name) != value]
    return f"another protocol ({'; '.join(differ)})" if differ else ""


def _protocol(label: str) -> tuple[str, tuple[str, ...], float | None]:
    """(merge, calibration steps, fixed scaling or None when searched) of a row's recipe label."""
    merge, *steps = label.split(">")
    scaling = re.search(r"\bscaling=([0-9.eE+-]+)", merge)
    return merge.partition("(")[0], tuple(steps), float(scaling.group(1)) if scaling else None


def _counterpart(paper: PublishedRow, rows) -> tuple:
    """The table's row that runs ``paper``'s protocol (its merge, calibrations, fixed or searched scaling, and the
    settings it states), else the row of its label (shown with how its protocol differs), else None."""
    if paper.recipe in REFERENCE_METHODS:
        return next(((r, "") for r in rows if r.recipe == paper.recipe), (None, ""))
    same = [r for r in rows if _protocol(r.recipe) == _protocol(paper.recipe)]
    exact = [r for r in same if not other_protocol(paper, r.recipe_id)]
    if exact:
        return min(exact, key=lambda r: (r.recipe != paper.recipe, r.recipe)), ""
    labelled = next((r for r in same if r.recipe == paper.recipe), None)
    return (labelled, other_protocol(paper, labelled.recipe_id)) if labelled else (None, "")


def compare(table: Table, published: list[PublishedRow]) -> Reproduction | None:
    """The table's comparison with the paper's rows (None outside the standard regime or without rows)."""
    if table.regime != STANDARD or not published:
        return None
    comparisons, matched, unmatched = [], set(), []
    for paper in published:
        row, differs = _counterpart(paper, table.rows) if paper.recipe is not None else (None, "")
        if row is None:
            unmatched.append(f"{paper.row} (`{paper.recipe}`)" if paper.recipe else paper.row)
            continue
        matched.add(row.recipe)
        unlike = paper.unlike or differs
        columns = [(f"acc.{t}", t, paper.per_task[paper.tasks.index(t)]) for t in table.tasks if t in paper.tasks]
        if set(table.tasks) == set(paper.tasks) and paper.average is not None:
            columns.append(("avg_acc", "avg", paper.average))
        for name, header, printed in columns:
            value, interval = row.values.get(name), row.intervals.get(name)
            comparisons.append(Comparison(row.recipe, paper.row, header, printed,
                                          points(value, paper.decimals),
                                          (points(interval[0], paper.decimals), points(interval[1], paper.decimals))
                                          if interval else None, paper.decimals, unlike))
    order = {r.recipe: i for i, r in enumerate(table.rows)}  # the table's row order, as before
    comparisons.sort(key=lambda c: order[c.recipe])
    return Reproduction(table, cite(published), tuple(comparisons), tuple(unmatched),
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
            verdict = f"— {c.unlike}" if c.unlike else {True: "yes", False: "**no**", None: "—"}[c.inside]
            printed = f"{c.published:.{c.decimals}f}"
            lines.append(f"| `{c.recipe}` | {c.paper_row} | {c.column} | {printed} | {_fmt(c)} | {verdict} |")
        lines += ["", f"Reproduction over {len(rep.comparisons)} compared values: {counts['inside']} inside their "
                      f"interval, {counts['outside']} outside"
                      + (f", {counts['no_interval']} without an interval" if counts["no_interval"] else "")
                      + (f", {counts['not_comparable']} not comparable (other checkpoints, protocol or task set)"
                         if counts["not_comparable"] else "") + "; "
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
                              "interval": list(c.interval) if c.interval else None, "inside": c.inside,
                              "unlike": c.unlike}
                             for c in r.comparisons]} for r in reproductions]
