"""A lab's board: one leaderboard from every finished invocation of every checkout that logged to one tracking
store (``mergecal report --lab``), each row with its provenance.

The board covers every experiment of the store (``tracking.experiment`` of each checkout that logged to it), or
those named (``--experiment``, repeatable). A row is a cell identity: the experiment, track, backbone, task set,
regime, fine-tuning seed and the recipe with every non-default hyperparameter in its label
(``mergecal.reports.labels``: ``ties(top_k=0.3)`` is never ``ties``). Identities of different experiments are kept
apart, never merged: an experiment is a lab's own partition of its results (a smoke run, a study at other sizes),
and its cell cache is its own (``mergecal.pipeline.flow``), so the same label in two experiments may be two
different computations. The JSON nests the tables under their experiment (``leaderboard: {experiment: {backbone:
...}}``), and each row's provenance names it; the Markdown and HTML head each experiment's tables with its name
when the board has more than one, and the history compares an identity with itself only, within its experiment.
Where several runs computed one identity (other commits, other members, a rerun), the newest that finished ok is
shown and every computation is listed in the lab history. A run reused from the cell cache is not a computation:
only the run that computed a cell counts, with the provenance it was logged with (user, host, commit, params
digest; the date is its start). Every finished invocation is a source, with how many cells it computed and how
many it reused: one that computed nothing (every cell cached) is listed too, as the invocation's own provenance
(its parent run's), and counts no computation.

Each row also shows what its cell's method cost (``mergecal.cost``, logged on the run): the merge's seconds, its
calibration steps' summed (one pass each) and its largest peak MiB; blank for a reference row or a run logged before
the cost metrics. The board is read live from MLflow, never a DVC output, so timings may be shown here.
"""

from __future__ import annotations

import html
import json
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import pandas as pd

from ..checkpoint import atomic_write_text
from ..errors import MergecalError, ParameterError
from ..pipeline.tracking import PROVENANCE, redact
from .history import DEFAULT_METRIC, DEFAULT_THRESHOLD
from .costs import cell_costs
from .leaderboard import build_tables, fmt_pct, provenance_text, seed_key, table_html, table_markdown, tables_json
from .runs import FINISHED, GROUP, SEED, invocations, load_examples, load_runs, qualified

EXPERIMENT = "experiment"  # the column each run's experiment name is read into (the board covers several)
IDENTITY = (EXPERIMENT, "track", *GROUP, SEED, "recipe")
SOURCE_FIELDS = PROVENANCE  # the provenance tags every run carries (mergecal.pipeline.tracking)
FILES = ("lab-leaderboard.md", "lab-leaderboard.html", "lab-leaderboard.json", "lab-history.md")


@dataclass(frozen=True)
class Filters:
    """What a lab narrows its board to; None: everything."""

    since: str | None = None  # a date (2026-11-01) or a time (2026-11-01T12:00); UTC
    track: str | None = None  # a track (vision, llm, local_clip: every local_clip entry, or local_clip:<name>)
    user: str | None = None
    commit: str | None = None  # a commit prefix (the first characters of code_version)

    def since_ms(self) -> int | None:
        if self.since is None:
            return None
        try:
            moment = datetime.fromisoformat(self.since)
        except ValueError:
            raise ParameterError(f"--since {self.since!r}: expected a date or time such as 2026-11-01 or "
                                 "2026-11-01T12:00 (UTC)") from None
        if moment.tzinfo is None:
            moment = moment.replace(tzinfo=timezone.utc)
        return int(moment.timestamp() * 1000)

    def describe(self) -> str:
        given = [f"{name} {value}" for name, value in (("since", self.since), ("track", self.track),
                                                        ("user", self.user), ("commit", self.commit)) if value]
        return ", ".join(given) or "none"


def date(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def experiment_names(tracking_uri: str, wanted: tuple[str, ...] | list[str] | None = None) -> list[str]:
    """The experiments a lab board reads: ``wanted`` (each must exist in the store), else every active experiment
    of the store, by name."""
    from mlflow import MlflowClient

    client, names, token = MlflowClient(tracking_uri=tracking_uri), [], None
    while True:
        page = client.search_experiments(max_results=1000, page_token=token)
        names += [experiment.name for experiment in page]
        token = page.token
        if not token:
            break
    if not wanted:
        return sorted(names)
    missing = [name for name in wanted if name not in names]
    if missing:
        raise MergecalError(f"--experiment {missing[0]}: no such experiment in {redact(tracking_uri)} (it has: "
                            f"{', '.join(sorted(names)) or 'none'})")
    return list(dict.fromkeys(wanted))


def _narrowed(frame: pd.DataFrame, filters: Filters, *, track: bool = True) -> pd.DataFrame:
    """The rows of ``frame`` (start_time, user, code_version and, with ``track``, track columns) the filters
    keep."""
    since = filters.since_ms()
    if since is not None:
        frame = frame[frame["start_time"] >= since]
    if track and filters.track:
        frame = frame[(frame["track"] == filters.track) | frame["track"].str.startswith(filters.track + ":")]
    if filters.user:
        frame = frame[frame["user"] == filters.user]
    if filters.commit:
        frame = frame[frame["code_version"].str.startswith(filters.commit)]
    return frame


def _finished(runs: pd.DataFrame) -> set[str]:
    table = invocations(runs)
    return set(table.loc[table["state"] == FINISHED, "invocation_id"])


def _parents(runs: pd.DataFrame) -> pd.DataFrame:
    return runs[runs["kind"] == "invocation"].drop_duplicates("invocation_id").set_index("invocation_id")


def computations(runs: pd.DataFrame, filters: Filters = Filters(), finished: set[str] | None = None
                 ) -> pd.DataFrame:
    """Every cell run that computed its cell (not a cache reuse) in a finished invocation, with qualified labels
    and provenance columns (a run logged before provenance tags takes its invocation's code version), filtered.
    ``runs``: one experiment's (``runs.load_runs``); ``finished``: its finished invocations, when known."""
    finished = _finished(runs) if finished is None else finished
    cells = runs[(runs["kind"] == "cell") & ~runs["cached"].astype(bool) & runs["invocation_id"].isin(finished)]
    cells = cells[cells["status"].isin(["ok", "failed", "skipped"])]
    parents = _parents(runs)
    cells = cells.copy()
    for name in SOURCE_FIELDS:
        inherited = cells["invocation_id"].map(parents[name]) if len(parents) else ""
        cells[name] = cells[name].where(cells[name] != "", inherited).fillna("")
    cells = _narrowed(cells, filters)
    return qualified(cells).sort_values(["start_time", "run_id"], kind="stable").reset_index(drop=True)


def newest(done: pd.DataFrame) -> pd.DataFrame:
    """Per identity (within its experiment) the newest run that finished ok, else (never ok) its newest run."""
    if done.empty:
        return done
    ranked = done.assign(_ok=(done["status"] == "ok").astype(int))
    ranked = ranked.sort_values(["_ok", "start_time", "run_id"], kind="stable")
    return ranked.drop_duplicates(list(IDENTITY), keep="last").drop(columns="_ok").reset_index(drop=True)


def provenance_of(row: pd.Series) -> dict[str, str]:
    return {**{name: str(row[name]) for name in SOURCE_FIELDS}, "date": date(int(row["start_time"])),
            "invocation_id": str(row["invocation_id"]), EXPERIMENT: str(row[EXPERIMENT])}


def sources(runs: pd.DataFrame, experiment: str, shown: pd.DataFrame, filters: Filters = Filters(),
            finished: set[str] | None = None) -> list[dict]:
    """Every finished invocation of one experiment's ``runs`` that the filters keep (by its own provenance, and by
    track when it has a cell of the track, computed or reused), with how many cells it computed, how many it
    reused from earlier runs (chains a track skips are neither: their runs are reasons, not results), and how many
    rows of the board (``shown``) are its computations, and its ``start_time`` (ms). One that computed nothing is a
    source too; it counts no computation."""
    finished = _finished(runs) if finished is None else finished
    parents = _parents(runs).reset_index()
    parents = _narrowed(parents[parents["invocation_id"].isin(finished)], filters, track=False)
    cells = runs[(runs["kind"] == "cell") & runs["invocation_id"].isin(set(parents["invocation_id"]))]
    if filters.track:
        cells = cells[(cells["track"] == filters.track) | cells["track"].str.startswith(filters.track + ":")]
        parents = parents[parents["invocation_id"].isin(set(cells["invocation_id"]))]
    reused = cells["cached"].astype(bool)
    computed = cells[~reused & cells["status"].isin(["ok", "failed"])].groupby("invocation_id").size()
    cached = cells[reused].groupby("invocation_id").size()
    rows = shown[shown[EXPERIMENT] == experiment].groupby("invocation_id").size()
    out = []
    for _, parent in parents.iterrows():
        invocation = str(parent["invocation_id"])
        out.append({**{name: str(parent[name]) for name in SOURCE_FIELDS}, "date": date(int(parent["start_time"])),
                    "invocation_id": invocation, EXPERIMENT: experiment,
                    "computed": int(computed.get(invocation, 0)), "reused": int(cached.get(invocation, 0)),
                    "rows": int(rows.get(invocation, 0)), "start_time": int(parent["start_time"])})
    return out


def _value(row: pd.Series, column: str) -> float | None:
    value = row.get(column)
    return None if value is None or pd.isna(value) else float(value)


def history_markdown(done: pd.DataFrame, metric: str = DEFAULT_METRIC, threshold: float = DEFAULT_THRESHOLD) -> str:
    """Every identity computed more than once, each computation with its provenance, and the regressions: an
    identity whose newer computation scores more than ``threshold`` points below the one before it (an identity
    is compared with itself only, within its experiment)."""
    column = f"metrics.{metric}"
    several = done[EXPERIMENT].nunique() > 1
    lines, regressions = ["# mergecal lab history", ""], []
    ok = done[done["status"] == "ok"]
    # the columns read here, as plain records sorted once (#62: a lab's store has 100+ columns, tens of thousands
    # of runs; a Series per row and a sort per identity cost more than the rest of the board)
    ok = ok[list(dict.fromkeys([*IDENTITY, "start_time", "run_id", "user", "host", "code_version",
                                *([column] if column in ok.columns else [])]))].sort_values(["start_time", "run_id"])
    repeated = [(key, group) for key, group in ok.groupby(list(IDENTITY), sort=True) if len(group) > 1]
    for key, group in repeated:
        rows = group.to_dict("records")
        # the experiment leads the title only where the board has several
        named = key[:-1] if several else key[1:-1]
        title = f"{' · '.join(str(k) for k in named)} · `{key[-1]}`"
        lines += [f"## {title}", "", f"| date | user | host | commit | {metric} |", "|---|---|---|---|---:|"]
        lines += [f"| {date(r['start_time'])} | {r['user']} | {r['host']} | `{r['code_version']}` | "
                  f"{fmt_pct(_value(r, column))} |" for r in rows]
        lines.append("")
        for before, now in zip(rows, rows[1:]):
            old, new = _value(before, column), _value(now, column)
            if old is not None and new is not None and round(100.0 * (old - new), 9) > threshold:
                regressions.append(f"- {title}: {fmt_pct(old)} → {fmt_pct(new)} ({before['code_version']} → "
                                   f"{now['code_version']}, {now['user']}, {date(now['start_time'])})")
    head = [f"Regressions (an identity more than {threshold:g} points below its previous computation):", ""]
    head += regressions or ["- none"]
    if not repeated:
        head += ["", "No cell identity was computed more than once."]
    return "\n".join(lines[:2] + head + [""] + lines[2:]) + "\n"


def _sources_markdown(listed: list[dict]) -> list[str]:
    lines = ["| experiment | invocation | user | host | commit | date | computed | reused | rows shown |",
             "|---|---|---|---|---|---|---:|---:|---:|"]
    lines += [f"| {s[EXPERIMENT]} | `{s['invocation_id']}` | {s['user']} | {s['host']} | `{s['code_version']}` | "
              f"{s['date']} | {s['computed']} | {s['reused']} | {s['rows']} |" for s in listed]
    return lines


def _sources_html(listed: list[dict]) -> list[str]:
    esc = html.escape
    heads = ("experiment", "invocation", "user", "host", "commit", "date", "computed", "reused", "rows shown")
    body = ["<table><tr>" + "".join(f"<th>{h}</th>" for h in heads) + "</tr>"]
    body += [f"<tr><td>{esc(s[EXPERIMENT])}</td><td><code>{esc(s['invocation_id'])}</code></td>"
             f"<td>{esc(s['user'])}</td><td>{esc(s['host'])}</td><td><code>{esc(s['code_version'])}</code></td>"
             f"<td>{esc(s['date'])}</td><td>{s['computed']}</td><td>{s['reused']}</td><td>{s['rows']}</td></tr>"
             for s in listed]
    return body + ["</table>"]


def write_lab_reports(tracking_uri: str, experiments: str | list[str] | tuple[str, ...] | None, out_dir: str | Path,
                      filters: Filters = Filters(), *, metric: str = DEFAULT_METRIC,
                      threshold: float = DEFAULT_THRESHOLD, cache_dir: str | Path | None = None) -> dict[str, Path]:
    """Write the lab's board (``FILES``) under ``out_dir`` from the ``experiments`` of the store (one name, several,
    or None: every experiment); returns {name: path}. ``cache_dir``: keep what was read there and ask the store only
    for what is new (``run_cache``)."""
    out = Path(out_dir)
    names = experiment_names(tracking_uri, [experiments] if isinstance(experiments, str) else experiments)
    read = {name: load_runs(tracking_uri, name, cache_dir) for name in names}
    read = {name: runs for name, runs in read.items() if not runs.empty}
    finished = {name: _finished(runs) for name, runs in read.items()}
    found = [computations(runs, filters, finished[name]).assign(**{EXPERIMENT: name}) for name, runs in read.items()]
    found = [frame for frame in found if not frame.empty]
    if not found:
        raise MergecalError(f"lab board: no finished cell runs in {_covered(names)} (filters: {filters.describe()})")
    done = pd.concat(found, ignore_index=True)
    shown = newest(done)
    every = [s for name, runs in read.items() for s in sources(runs, name, shown, filters, finished[name])]
    listed = [{k: v for k, v in s.items() if k != "start_time"}  # in time order; the date says when
              for s in sorted(every, key=lambda s: (s["start_time"], s[EXPERIMENT], s["invocation_id"]))]
    ok = shown[shown["status"] == "ok"]
    examples = {rid: load_examples(tracking_uri, uri, cache_dir, rid)
                for rid, uri in zip(ok["run_id"], ok["artifact_uri"])}
    tables = {name: build_tables(group, examples) for name, group in shown.groupby(EXPERIMENT, sort=True)}
    several = len(tables) > 1
    provenance = {row["run_id"]: provenance_of(row) for _, row in shown.iterrows()}
    users = sorted({s["user"] for s in listed})
    idle = sum(1 for s in listed if not s["computed"])
    summary = (f"{len(shown)} rows of {len(tables)} experiment(s) ({', '.join(tables)}) from {len(listed)} "
               f"invocation(s) by {', '.join(users)}" + (f", {idle} of which computed nothing (every cell reused)"
                                                        if idle else "") +
               f"; filters: {filters.describe()}. A row is the newest computation of its cell identity in its "
               "experiment; each row's provenance is in lab-leaderboard.json and in the HTML's tooltips, earlier "
               "computations in lab-history.md.")
    costs = {row["run_id"]: found for _, row in shown.iterrows() if (found := cell_costs(row)) is not None}
    document = {"filters": {k: v for k, v in vars(filters).items() if v},
                "experiments": list(tables), "sources": listed,
                "leaderboard": {name: with_costs_json(tables_json(group, provenance), group, costs)
                                for name, group in tables.items()}}
    markdown = ["# mergecal lab leaderboard", "", summary, "", "## Sources", "", *_sources_markdown(listed), ""]
    esc = html.escape
    body = ["<h1>mergecal lab leaderboard</h1>", f'<p class="meta">{esc(summary)}</p>', "<h2>Sources</h2>",
            *_sources_html(listed)]
    for name, group in tables.items():
        if several:  # one experiment: the tables as a checkout's board shows them
            markdown += [f"## Experiment `{name}`", ""]
            body.append(f"<h2>Experiment <code>{esc(name)}</code></h2>")
        markdown += [with_costs_markdown(table_markdown(t), t, costs) for t in group]
        body += [with_costs_html(table_html(t, provenance), t, costs) for t in group]
    from .write import _page  # the leaderboard's page frame and style

    written = {
        "lab-leaderboard.json": atomic_write_text(out / "lab-leaderboard.json",
                                                  json.dumps(document, indent=2, sort_keys=True) + "\n"),
        "lab-leaderboard.md": atomic_write_text(out / "lab-leaderboard.md", "\n".join(markdown)),
        "lab-leaderboard.html": atomic_write_text(out / "lab-leaderboard.html",
                                                  _page("mergecal lab leaderboard", body)),
        "lab-history.md": atomic_write_text(out / "lab-history.md", history_markdown(done, metric, threshold)),
    }
    return written


# --- each row's own cost (mergecal.cost): live timings, allowed here (the board is read from MLflow, never cached) ---

COST_COLUMNS = (("merge_s", "merge s"), ("calibration_s", "calibration s"), ("peak_mib", "peak MiB"))


def cost_texts(found: dict[str, float | None] | None) -> list[str]:
    """A row's cost cells: the merge's seconds, its calibration steps' (one pass each), its largest peak MiB; blank
    for a reference or a run logged without cost metrics."""
    if found is None:
        return [""] * len(COST_COLUMNS)
    return ["" if found.get(key) is None else f"{found[key]:.1f}" if key == "peak_mib" else f"{found[key]:.2f}"
            for key, _ in COST_COLUMNS]


def with_costs_markdown(text: str, table, costs: dict[str, dict]) -> str:
    """``table_markdown``'s text with the cost columns after the values (its rows in ``table.rows``' order)."""
    lines = text.split("\n")
    head = next(i for i, line in enumerate(lines) if line.startswith("| recipe |"))
    lines[head] += " " + " | ".join(title for _, title in COST_COLUMNS) + " |"
    lines[head + 1] += "---:|" * len(COST_COLUMNS)
    for i, row in enumerate(table.rows, start=head + 2):
        lines[i] += " " + " | ".join(cost_texts(costs.get(row.run_id))) + " |"
    return "\n".join(lines)


def with_costs_html(text: str, table, costs: dict[str, dict]) -> str:
    """``table_html``'s text with the cost columns after the values (one ``<tr class=...>`` line per row)."""
    esc = html.escape
    heads = "".join(f'<th class="cost">{esc(title)}</th>' for _, title in COST_COLUMNS)
    rows = iter(table.rows)
    lines = []
    for line in text.split("\n"):
        if line.startswith("<thead><tr><th>recipe</th>"):
            line = line.removesuffix("</tr></thead>") + heads + "</tr></thead>"
        elif line.startswith('<tr class="'):
            cells = "".join(f'<td class="num cost">{esc(t)}</td>' for t in cost_texts(costs.get(next(rows).run_id)))
            line = line.removesuffix("</tr>") + cells + "</tr>"
        lines.append(line)
    return "\n".join(lines)


def with_costs_json(document: dict, tables, costs: dict[str, dict]) -> dict:
    """``tables_json``'s document with each row's ``cost`` (``costs.cell_costs``) where its run logged one."""
    for table in tables:
        top = document.get(seed_key(table.seed), {}) if table.several_seeds else document
        slot = top.get(table.backbone, {}).get(table.task_set, {}).get(table.regime, {})
        for row in table.rows:
            found = costs.get(row.run_id)
            if found is not None and row.recipe in slot:
                slot[row.recipe]["cost"] = {k: round(v, 4) for k, v in found.items() if v is not None}
    return document


def _covered(names: list[str]) -> str:
    """The experiments a board read, for its one-line error."""
    if len(names) == 1:
        return f"experiment {names[0]!r}"
    return f"experiments {', '.join(map(repr, names))}" if names else "the store (it has no experiment)"


__all__ = ["Filters", "computations", "experiment_names", "newest", "sources", "write_lab_reports",
           "provenance_text"]
