"""The same cells across benchmark invocations: a metric per (backbone, task set, regime, fine-tuning seed,
recipe) over time, and the regressions — cells that got worse than the previous invocation that ran them. With
one seed the groups and lines name no seed; with several each seed's cells are their own group.

A cell reused from the cache is logged again under every invocation, so an unchanged value is the
normal case and a drop means the code, data or parameters behind that cell changed.
"""

from __future__ import annotations

import html
from dataclasses import dataclass
from datetime import datetime, timezone

import pandas as pd

from .leaderboard import REGIME_ORDER, fmt_pct, rank, recipe_order
from .plots import Plot, history_figure, slug, to_svg
from .runs import FINISHED, GROUP, SEED, invocations, qualified, seed_order

DEFAULT_METRIC = "avg_norm_acc"
DEFAULT_THRESHOLD = 1.0  # percentage points


@dataclass(frozen=True)
class Regression:
    backbone: str
    task_set: str
    regime: str
    recipe: str
    invocation_id: str
    previous_invocation_id: str
    previous: float  # fraction
    current: float | None  # fraction; None when the cell failed
    status: str  # the cell's status in this invocation
    seed: str = ""  # the fine-tuning seed, named only when the history has several

    @property
    def drop_points(self) -> float | None:
        return None if self.current is None else 100.0 * (self.previous - self.current)

    def describe(self) -> str:
        if self.current is None:
            change = f"{fmt_pct(self.previous)} → {self.status}"
        else:
            change = f"{fmt_pct(self.previous)} → {fmt_pct(self.current)} (−{self.drop_points:.1f})"
        seed = f" · seed {self.seed}" if self.seed else ""
        return (f"{self.backbone} · {self.task_set} · {self.regime}{seed} · {self.recipe}: {change} in "
                f"{self.invocation_id} (previous {self.previous_invocation_id})")


def _rule(threshold: float) -> str:
    return (f"a drop of more than {threshold:g} percentage point{'' if threshold == 1 else 's'}, or a failure, "
            "against the previous invocation that ran the cell")


def stamp(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000.0, tz=timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _results(table: pd.DataFrame) -> list[str]:
    """The invocations (rows of ``invocations``) that are results: with cells, and finished."""
    return list(table[(table["n_cells"] > 0) & (table["state"] == FINISHED)]["invocation_id"])


NOT_COMPARED = ("A killed or unfinished invocation is listed with its state but is no result: only finished ones are "
                "compared below.")


def history_frame(runs: pd.DataFrame, metric: str = DEFAULT_METRIC) -> pd.DataFrame:
    """Long table: one row per cell and finished invocation, invocations in time order (``order`` 0, 1, ...);
    a killed or unfinished invocation is no result, so none of its cells is compared."""
    order = {inv: i for i, inv in enumerate(_results(invocations(runs)))}
    # like with like: a recipe's label names every non-default hyperparameter, so ties(top_k=0.3) of one invocation
    # is never compared with ties of another
    cells = qualified(runs[(runs["kind"] == "cell") & runs["invocation_id"].isin(order)])
    cells = cells.drop_duplicates(["invocation_id", *GROUP, SEED, "recipe"], keep="last")
    column = f"metrics.{metric}"
    values = cells[column] if column in cells else pd.Series(float("nan"), index=cells.index)
    frame = pd.DataFrame({
        **{c: cells[c] for c in (*GROUP, SEED, "recipe", "merge", "calibration", "invocation_id", "status",
                                 "cached")},
        "order": cells["invocation_id"].map(order),
        "value": values.where(cells["status"] == "ok"),
    })
    return frame.sort_values([*GROUP, SEED, "recipe", "order"], kind="stable").reset_index(drop=True)


def _several_seeds(history: pd.DataFrame) -> bool:
    return history[SEED].nunique() > 1


def find_regressions(history: pd.DataFrame, threshold: float = DEFAULT_THRESHOLD) -> list[Regression]:
    """Cells that, against the previous invocation that ran them, dropped by more than ``threshold``
    points or failed (a cell that failed before has nothing to be compared with)."""
    found, several = [], _several_seeds(history)
    for (*group, seed, recipe), cell in history.groupby([*GROUP, SEED, "recipe"], sort=True):
        rows = list(cell.sort_values("order").itertuples())
        for before, now in zip(rows, rows[1:]):
            if pd.isna(before.value):
                continue
            current = None if pd.isna(now.value) else float(now.value)
            if current is None and now.status == "ok":
                continue  # ran, but without this metric: nothing to compare
            if current is None or round(100.0 * (before.value - current), 9) > threshold:
                found.append((now.order, Regression(*group, recipe, now.invocation_id, before.invocation_id,
                                                    float(before.value), current, now.status,
                                                    seed if several else "")))
    found.sort(key=lambda f: (f[0], f[1].backbone, f[1].task_set, rank(REGIME_ORDER, f[1].regime),
                              seed_order(f[1].seed), f[1].recipe))
    return [r for _, r in found]


def _groups(history: pd.DataFrame):
    """(title parts, the group's rows, its recipes in leaderboard order) per backbone · task set · regime, and
    per fine-tuning seed when there are several."""
    several = _several_seeds(history)
    keys = sorted({tuple(k) for k in history[[*GROUP, SEED]].itertuples(index=False)},
                  key=lambda k: (k[0], k[1], rank(REGIME_ORDER, k[2]), seed_order(k[3])))
    for key in keys:
        group = history[(history["backbone"] == key[0]) & (history["task_set"] == key[1])
                        & (history["regime"] == key[2]) & (history[SEED] == key[3])]
        recipes = sorted({(r.merge, r.calibration, r.recipe) for r in group.itertuples()},
                         key=lambda r: recipe_order(*r))
        yield (*key[:3], f"seed {key[3]}") if several else key[:3], group, [r[2] for r in recipes]


def _cell_text(group: pd.DataFrame, recipe: str, invocation: str) -> str:
    hit = group[(group["recipe"] == recipe) & (group["invocation_id"] == invocation)]
    if hit.empty:
        return ""
    row = hit.iloc[-1]
    return row["status"] if row["status"] != "ok" else fmt_pct(None if pd.isna(row["value"]) else row["value"])


def history_markdown(runs: pd.DataFrame, metric: str = DEFAULT_METRIC,
                     threshold: float = DEFAULT_THRESHOLD) -> str:
    history, table = history_frame(runs, metric), invocations(runs)
    table, ids = table[table["n_cells"] > 0], _results(table)
    lines = [f"# History: {metric} per invocation", "", "Invocations, oldest first:", "",
             "| invocation | started | code version | cells | failed | state |", "|---|---|---|---:|---:|---|"]
    lines += [f"| `{r.invocation_id}` | {stamp(r.start_time)} | `{r.code_version}` | {r.n_cells} | {r.n_failed} | "
              f"{r.state} |" for r in table.itertuples()]
    if len(ids) < len(table):
        lines += ["", NOT_COMPARED]
    regressions = find_regressions(history, threshold)
    lines += ["", f"## Regressions ({_rule(threshold)})", ""]
    lines += [f"- {r.describe()}" for r in regressions] or ["None."]
    for key, group, recipes in _groups(history):
        lines += ["", f"## {' · '.join(key)}", "", "| recipe | " + " | ".join(f"`{i}`" for i in ids) + " |",
                  "|---" + "|---:" * len(ids) + "|"]
        lines += ["| " + " | ".join([f"`{recipe}`"] + [_cell_text(group, recipe, i) for i in ids]) + " |"
                  for recipe in recipes]
    return "\n".join(lines) + "\n"


def history_plots(runs: pd.DataFrame, metric: str = DEFAULT_METRIC) -> list[Plot]:
    """One line chart per group over the invocations (when there are at least two)."""
    history, ids = history_frame(runs, metric), _results(invocations(runs))
    plots = []
    for key, group, recipes in _groups(history):
        series = {}
        for recipe in recipes:
            mine = group[group["recipe"] == recipe].set_index("invocation_id")["value"]
            series[recipe] = [None if i not in mine.index or pd.isna(mine[i]) else float(mine[i]) for i in ids]
        title = f"{' · '.join(key)} — {metric} per invocation"
        fig = history_figure(series, ids, title)
        if fig is not None:
            name = slug(f"history__{'__'.join(key)}")
            plots.append(Plot(name, "history", key, title, to_svg(fig, name)))
    return plots


def history_html(runs: pd.DataFrame, metric: str = DEFAULT_METRIC, threshold: float = DEFAULT_THRESHOLD) -> str:
    """The history as an HTML fragment (tables and regressions; plots are added by the caller)."""
    esc = html.escape
    history, table = history_frame(runs, metric), invocations(runs)
    table, ids = table[table["n_cells"] > 0], _results(table)
    head = "".join(f"<th>{h}</th>" for h in ("invocation", "started", "code version", "cells", "failed", "state"))
    out = [f"<h2>History: {esc(metric)} per invocation</h2>", "<table>", f"<thead><tr>{head}</tr></thead>", "<tbody>"]
    out += [f"<tr><td><code>{esc(r.invocation_id)}</code></td><td>{esc(stamp(r.start_time))}</td>"
            f"<td><code>{esc(r.code_version)}</code></td><td class=\"num\">{r.n_cells}</td>"
            f"<td class=\"num\">{r.n_failed}</td><td>{esc(r.state)}</td></tr>" for r in table.itertuples()]
    out += ["</tbody>", "</table>"]
    if len(ids) < len(table):
        out.append(f"<p>{esc(NOT_COMPARED)}</p>")
    out += [f"<h3>Regressions ({_rule(threshold)})</h3>"]
    regressions = find_regressions(history, threshold)
    if regressions:
        out += ['<ul class="regressions">'] + [f"<li>{esc(r.describe())}</li>" for r in regressions] + ["</ul>"]
    else:
        out.append("<p>None.</p>")
    for key, group, recipes in _groups(history):
        out += [f"<h3>{esc(' · '.join(key))}</h3>", "<table>", "<thead><tr><th>recipe</th>"
                + "".join(f"<th>{esc(i)}</th>" for i in ids) + "</tr></thead>", "<tbody>"]
        for recipe in recipes:
            out.append(f'<tr><td class="recipe">{esc(recipe)}</td>'
                       + "".join(f'<td class="num">{esc(_cell_text(group, recipe, i))}</td>' for i in ids) + "</tr>")
        out += ["</tbody>", "</table>"]
    return "\n".join(out) + "\n"
