"""A lab's board: one leaderboard from every finished invocation of every checkout that logged to one tracking
store (``mergecal report --lab``), each row with its provenance.

A row is a cell identity: track, backbone, task set, regime, fine-tuning seed and the recipe with every
non-default hyperparameter in its label (``mergecal.reports.labels``: ``ties(top_k=0.3)`` is never ``ties``).
Where several runs computed one identity (other commits, other members, a rerun), the newest that finished ok is
shown and every computation is listed in the lab history, which compares an identity with itself only. A run
reused from the cell cache is not a computation: only the run that computed a cell counts, with the provenance
it was logged with (user, host, commit, params digest; the date is its start).
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
from ..pipeline.tracking import PROVENANCE
from .history import DEFAULT_METRIC, DEFAULT_THRESHOLD
from .leaderboard import build_tables, fmt_pct, provenance_text, table_html, table_markdown, tables_json
from .runs import FINISHED, GROUP, SEED, invocations, load_examples, load_runs, qualified

IDENTITY = ("track", *GROUP, SEED, "recipe")
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


def computations(runs: pd.DataFrame, filters: Filters = Filters()) -> pd.DataFrame:
    """Every cell run that computed its cell (not a cache reuse) in a finished invocation, with qualified labels
    and provenance columns (a run logged before provenance tags takes its invocation's code version), filtered."""
    table = invocations(runs)
    finished = set(table.loc[(table["state"] == FINISHED) & (table["n_cells"] > 0), "invocation_id"])
    cells = runs[(runs["kind"] == "cell") & ~runs["cached"].astype(bool) & runs["invocation_id"].isin(finished)]
    cells = cells[cells["status"].isin(["ok", "failed", "skipped"])]
    parents = runs[runs["kind"] == "invocation"].drop_duplicates("invocation_id").set_index("invocation_id")
    cells = cells.copy()
    for name in SOURCE_FIELDS:
        inherited = cells["invocation_id"].map(parents[name]) if len(parents) else ""
        cells[name] = cells[name].where(cells[name] != "", inherited).fillna("")
    since = filters.since_ms()
    if since is not None:
        cells = cells[cells["start_time"] >= since]
    if filters.track:
        cells = cells[(cells["track"] == filters.track) | cells["track"].str.startswith(filters.track + ":")]
    if filters.user:
        cells = cells[cells["user"] == filters.user]
    if filters.commit:
        cells = cells[cells["code_version"].str.startswith(filters.commit)]
    return qualified(cells).sort_values(["start_time", "run_id"], kind="stable").reset_index(drop=True)


def newest(done: pd.DataFrame) -> pd.DataFrame:
    """Per identity the newest run that finished ok, else (never ok) its newest run."""
    if done.empty:
        return done
    ranked = done.assign(_ok=(done["status"] == "ok").astype(int))
    ranked = ranked.sort_values(["_ok", "start_time", "run_id"], kind="stable")
    return ranked.drop_duplicates(list(IDENTITY), keep="last").drop(columns="_ok").reset_index(drop=True)


def provenance_of(row: pd.Series) -> dict[str, str]:
    return {**{name: str(row[name]) for name in SOURCE_FIELDS}, "date": date(int(row["start_time"])),
            "invocation_id": str(row["invocation_id"])}


def _value(row: pd.Series, column: str) -> float | None:
    value = row.get(column)
    return None if value is None or pd.isna(value) else float(value)


def history_markdown(done: pd.DataFrame, metric: str = DEFAULT_METRIC, threshold: float = DEFAULT_THRESHOLD) -> str:
    """Every identity computed more than once, each computation with its provenance, and the regressions: an
    identity whose newer computation scores more than ``threshold`` points below the one before it (an identity
    is compared with itself only)."""
    column = f"metrics.{metric}"
    lines, regressions = ["# mergecal lab history", ""], []
    repeated = [(key, group) for key, group in done[done["status"] == "ok"].groupby(list(IDENTITY), sort=True)
                if len(group) > 1]
    for key, group in repeated:
        rows = [r for _, r in group.sort_values(["start_time", "run_id"]).iterrows()]
        title = f"{' · '.join(str(k) for k in key[:-1])} · `{key[-1]}`"
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


def _sources(shown: pd.DataFrame) -> list[dict]:
    """One entry per invocation whose runs the board shows: its provenance and how many rows."""
    out = []
    for invocation, group in shown.groupby("invocation_id", sort=False):
        first = group.iloc[0]
        out.append({**provenance_of(first), "rows": int(len(group)), "invocation_id": str(invocation)})
    return sorted(out, key=lambda s: (s["date"], s["invocation_id"]))


def _sources_markdown(sources: list[dict]) -> list[str]:
    lines = ["| invocation | user | host | commit | date | rows shown |", "|---|---|---|---|---|---:|"]
    lines += [f"| `{s['invocation_id']}` | {s['user']} | {s['host']} | `{s['code_version']}` | {s['date']} | "
              f"{s['rows']} |" for s in sources]
    return lines


def write_lab_reports(tracking_uri: str, experiment: str, out_dir: str | Path, filters: Filters = Filters(), *,
                      metric: str = DEFAULT_METRIC, threshold: float = DEFAULT_THRESHOLD) -> dict[str, Path]:
    """Write the lab's board (``FILES``) under ``out_dir``; returns {name: path}."""
    out = Path(out_dir)
    runs = load_runs(tracking_uri, experiment)
    done = computations(runs, filters)
    if done.empty:
        raise MergecalError(f"lab board: no finished cell runs in experiment {experiment!r} (filters: "
                            f"{filters.describe()})")
    shown = newest(done)
    ok = shown[shown["status"] == "ok"]
    examples = {rid: load_examples(tracking_uri, uri) for rid, uri in zip(ok["run_id"], ok["artifact_uri"])}
    tables = build_tables(shown, examples)
    provenance = {row["run_id"]: provenance_of(row) for _, row in shown.iterrows()}
    sources = _sources(shown)
    users = sorted({s["user"] for s in sources})
    summary = (f"{len(shown)} rows from {len(sources)} invocation(s) by {', '.join(users)}; filters: "
               f"{filters.describe()}. A row is the newest computation of its cell identity; each row's provenance "
               "is in lab-leaderboard.json and in the HTML's tooltips, earlier computations in lab-history.md.")
    document = {"filters": {k: v for k, v in vars(filters).items() if v}, "sources": sources,
                "leaderboard": tables_json(tables, provenance)}
    markdown = ["# mergecal lab leaderboard", "", summary, "", "## Sources", "", *_sources_markdown(sources), ""]
    markdown += [table_markdown(t) for t in tables]
    esc = html.escape
    body = ["<h1>mergecal lab leaderboard</h1>", f'<p class="meta">{esc(summary)}</p>',
            "<h2>Sources</h2>", "<table><tr><th>invocation</th><th>user</th><th>host</th><th>commit</th><th>date</th>"
            "<th>rows shown</th></tr>"]
    body += [f"<tr><td><code>{esc(s['invocation_id'])}</code></td><td>{esc(s['user'])}</td><td>{esc(s['host'])}</td>"
             f"<td><code>{esc(s['code_version'])}</code></td><td>{esc(s['date'])}</td><td>{s['rows']}</td></tr>"
             for s in sources]
    body.append("</table>")
    body += [table_html(t, provenance) for t in tables]
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


__all__ = ["Filters", "computations", "newest", "write_lab_reports", "provenance_text"]
