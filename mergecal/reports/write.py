"""The reports of an invocation, from the MLflow store: leaderboard (Markdown, self-contained HTML, JSON for
DVC), the papers' diagnostic plots and the history across invocations.

``write_reports`` is the one entry point: it reads the store, renders everything in memory and writes
each file atomically, so a report directory is never half old, half new. The leaderboard files and plots
hold only what the cells computed (no invocation id, date or code version), so a cold run of the same inputs
writes the same bytes and DVC records the same hashes; the history (``history.md``, ``history.html``), which
lists invocations with their dates and is time-varying by nature, is written beside them and versioned by
neither git nor DVC.
"""

from __future__ import annotations

import base64
import hashlib
import html
import json
from dataclasses import replace
from pathlib import Path

from ..checkpoint import atomic_write_text
from .history import DEFAULT_METRIC, DEFAULT_THRESHOLD, find_regressions, history_frame, history_html, \
    history_markdown, history_plots
from .leaderboard import Table, build_tables, table_html, table_markdown, tables_json
from .plots import Plot, diagnostic_plots, slug
from .published import compare as compare_published
from .published import markdown as published_markdown
from .published import to_json as published_json
from .runs import SEED, cells_of, invocations, load_diagnostics, load_examples, load_runs, pick_invocation, seeds_of
from .seeds import documents_by_seed, rows_json, seed_rows
from .seeds import markdown as seeds_markdown
from .stability import section_markdown, table_warning
from .summary import Summary, heading_anchor, summarize
from .summary import markdown as summary_markdown
from .summary import to_html as summary_html
from .summary import to_json as summary_json

HISTORY_FILES = ("history.md", "history.html")  # beside the leaderboard, not DVC outputs

__all__ = ["write_reports", "load_runs", "build_tables", "find_regressions", "history_frame", "diagnostic_plots"]

LEGEND = ("Accuracy in %, one decimal; the two averages with their 95 % confidence interval in brackets (percentile "
          "bootstrap, 2,000 resamples of the test examples within each task; per-task intervals are in "
          "leaderboard.json). Calibrated rows show in parentheses the change in points against their base merge "
          "(the same merge with calibration none and the same protocol after @): ▲ a gain and ▼ a loss where the "
          "paired 95 % interval of the change excludes 0, ≈ where it does not, no mark where the cells kept no "
          "per-example results. A column's best non-reference value is marked only where its paired interval "
          "against the runner-up excludes 0. † marks an ill-posed row (footnote under its table), never ranked.")

CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; color: #222; max-width: 1400px; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 0.9em; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; }
th { background: #f2f2f2; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.recipe { font-family: monospace; }
td.best { font-weight: bold; background: #e6f4e6; }
tr.reference td { color: #666; font-style: italic; }
tr.base td.recipe { font-weight: bold; }
span.delta { font-size: 0.85em; }
span.delta.pos { color: #1a7f37; }
span.delta.neg { color: #c62828; }
span.delta.ns, span.ci { color: #777; }
span.ci { font-size: 0.8em; }
td.ill-posed { color: #999; }
p.footnote { font-size: 0.85em; color: #555; }
p.warning { color: #c62828; font-weight: bold; }
ul.failed li, ul.regressions li { color: #c62828; }
figure { display: inline-block; margin: 0.5em; vertical-align: top; }
figure img { max-width: 100%; }
figcaption { font-size: 0.8em; color: #555; }
p.meta { color: #555; }
th.avg + th:not(.avg), td.avg + td:not(.avg) { border-left: 2px solid #888; }
section#summary { border: 1px solid #ccc; background: #fafafa; padding: 0 1em; margin-bottom: 1.5em; }
ul.claims li { margin: 0.3em 0; }
table.summary th { font-weight: normal; font-size: 0.9em; }
table.summary td.recipe { white-space: nowrap; }
table.summary td.num { text-align: center; }
p.status { color: #444; }
"""


def _meta(runs, invocation: str, cells) -> dict:
    """What identifies the leaderboard's results reproducibly: the cell ids (content hashes of every input and
    of the library's code) and the counts; the invocation's id, date and git version stay in the history."""
    row = invocations(runs).set_index("invocation_id").loc[invocation]
    digest = hashlib.sha256("\n".join(sorted(map(str, cells["cell_id"]))).encode()).hexdigest()[:12]
    return {"results": digest, "n_computed": int(row["n_cells"] - row["n_skipped"]), "n_failed": int(row["n_failed"]),
            "n_skipped": int(row["n_skipped"])}


def _meta_line(meta: dict) -> str:
    return (f"Results `{meta['results']}` (a digest of the cell ids, which hash every input and the code): "
            f"{meta['n_computed']} cells computed, {meta['n_failed']} not ok; skipped chains (not supported on their "
            f"track): {meta['n_skipped']}. Invocations, dates and reruns: history.md / "
            "history.html beside this file.")


def _figure(plot: Plot) -> str:
    data = base64.b64encode(plot.svg.encode()).decode()
    title = html.escape(plot.title)
    return (f'<figure><img src="data:image/svg+xml;base64,{data}" alt="{title}">'
            f"<figcaption>{title}</figcaption></figure>")


def markdown_html(text: str) -> str:
    """The small Markdown the testbed and stability reports use (## headings, pipe tables, "- " lists,
    paragraphs) as HTML."""
    esc, out, table, items = html.escape, [], [], []

    def cells(line: str) -> list[str]:
        return [esc(c.strip().replace("**", "")) for c in line.strip().strip("|").split("|")]

    def flush() -> None:
        if table:
            head, *body = [r for r in table if not set(r.replace("|", "").strip()) <= {"-"}]
            out.append("<table><tr>" + "".join(f"<th>{c}</th>" for c in cells(head)) + "</tr>"
                       + "".join("<tr>" + "".join(f"<td>{c}</td>" for c in cells(r)) + "</tr>" for r in body)
                       + "</table>")
            table.clear()
        if items:
            out.append("<ul>" + "".join(f"<li>{esc(item)}</li>" for item in items) + "</ul>")
            items.clear()

    for line in text.splitlines():
        if line.startswith("|"):
            table.append(line)
            continue
        if line.startswith("- "):
            items.append(line[2:])
            continue
        flush()
        if line.startswith("## "):
            out.append(f"<h2>{esc(line[3:])}</h2>")
        elif line.startswith("### "):
            out.append(f"<h3>{esc(line[4:])}</h3>")
        elif line.strip():
            out.append(f"<p>{esc(line)}</p>")
    flush()
    return "\n".join(out)


def _testbed_heading(testbed: str | None) -> str | None:
    """The testbed report's verdict: its first heading ("Testbed health (...): healthy")."""
    return next((line[3:].strip() for line in (testbed or "").splitlines() if line.startswith("## ")), None)


def _stability_verdict(tables: list[Table]) -> str:
    flagged = [t.title for t in tables if t.warning]
    if not flagged:
        return f"Track stability: no table flagged unstable ({len(tables)} tables)"
    return f"Track stability: {len(flagged)} of {len(tables)} tables flagged unstable ({'; '.join(flagged)})"


def _status_markdown(testbed: str | None, stability: str | None, tables: list[Table]) -> list[str]:
    """The diagnostics' verdicts in a line each, linking to their sections below the summary."""
    heading = _testbed_heading(testbed)
    lines = [f"Diagnostics: [{heading}](#{heading_anchor(heading)})."] if heading else []
    if stability:
        lines += [f"[{_stability_verdict(tables)}](#track-stability)."]
    return [" ".join(lines)] if lines else []


def _status_html(testbed: str | None, stability: str | None, tables: list[Table]) -> list[str]:
    esc, heading = html.escape, _testbed_heading(testbed)
    parts = [f'Diagnostics: <a href="#testbed">{esc(heading)}</a>.'] if heading else []
    if stability:
        parts += [f'<a href="#stability">{esc(_stability_verdict(tables))}</a>.']
    return [f'<p class="status">{" ".join(parts)}</p>'] if parts else []


def _html_page(meta: dict, tables: list[Table], plots: list[Plot], testbed: str | None = None,
               stability: str | None = None, across_seeds: str | None = None, published: str | None = None,
               summary: Summary | None = None) -> str:
    esc = html.escape
    anchors = [(slug(t.title), t.title) for t in tables]
    body = ["<h1>mergecal leaderboard</h1>", f'<p class="meta">{esc(_meta_line(meta).replace("`", ""))}</p>']
    if summary:  # what the run found opens the page; the diagnostics and the tables follow
        body.append(summary_html(summary, _status_html(testbed, stability, tables)).rstrip("\n"))
    body.append(f"<p>{esc(LEGEND)}</p>")
    if testbed:
        body.append(f'<section id="testbed">\n{markdown_html(testbed)}</section>')
    if stability:
        body.append(f'<section id="stability">\n{markdown_html(stability)}</section>')
    body.append("<ul>")
    body += [f'<li><a href="#{a}">{esc(t)}</a></li>' for a, t in anchors]
    if published:
        body.append('<li><a href="#published">Published</a></li>')
    if across_seeds:
        body.append('<li><a href="#across-seeds">Across seeds</a></li>')
    body += ['<li><a href="#diagnostics">Diagnostics</a></li>', '<li><a href="history.html">History</a></li>', "</ul>"]
    for (anchor, _), table in zip(anchors, tables):
        body.append(f'<section id="{anchor}">\n{table_html(table)}</section>')
    if published:
        body.append(f'<section id="published">\n{markdown_html(published)}</section>')
    if across_seeds:
        body.append(f'<section id="across-seeds">\n{markdown_html(across_seeds)}</section>')
    body.append('<section id="diagnostics"><h2>Diagnostics</h2>')
    if not plots:
        body.append("<p>No diagnostic artifacts in this invocation.</p>")
    for group in sorted({p.group for p in plots}):
        body.append(f"<h3>{esc(' · '.join(group))}</h3>")
        body += [_figure(p) for p in plots if p.group == group]
    body.append("</section>")
    return _page("mergecal leaderboard", body)


def _page(title: str, body: list[str]) -> str:
    return ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n"
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n"
            + "\n".join(body) + "\n</body>\n</html>\n")


def _markdown(meta: dict, tables: list[Table], plots: list[Plot], testbed: str | None = None,
              stability: str | None = None, across_seeds: str | None = None, published: str | None = None,
              summary: Summary | None = None) -> str:
    parts = ["# mergecal leaderboard", "", _meta_line(meta), ""]
    if summary:  # what the run found opens the board; the diagnostics and the tables follow
        parts += [summary_markdown(summary, _status_markdown(testbed, stability, tables))]
    parts += [LEGEND.replace("is marked", "is in bold"), ""]
    if testbed:
        parts += [testbed]
    if stability:
        parts += [stability]
    parts += [table_markdown(t) for t in tables]
    if published:
        parts += [published]
    if across_seeds:
        parts += [across_seeds]
    if plots:
        parts += ["## Diagnostics", ""] + [f"![{p.title}](plots/{p.name}.svg)\n" for p in plots]
    return "\n".join(parts)


def write_reports(tracking_uri: str, experiment: str = "mergecal", out_dir: str | Path = "reports",
                  invocation: str | None = None, *, metric: str = DEFAULT_METRIC,
                  threshold: float = DEFAULT_THRESHOLD, testbed: str | None = None,
                  stability: dict | None = None, published: dict[str, list[list]] | None = None) -> dict[str, Path]:
    """Write leaderboard.md/.html/.json and plots/*.svg for ``invocation`` (default: the latest with cells),
    and history.md/.html over every invocation, under ``out_dir``; returns {relative name: path}.
    The leaderboard opens with what the run found (``mergecal.reports.summary``: each calibration's verdicts
    across the merges it calibrates, the median change, the headline claims); ``testbed`` (the testbed-health
    Markdown of ``mergecal.pipeline.testbed``) follows it, before any table. SVGs in plots/ that this report did
    not produce are removed, so the directory matches the report. ``published``: {backbone: per paper, the
    published rows its preset reproduces} (``mergecal.published.for_tracks``): each of its standard-regime tables
    gets one comparison per paper."""
    out = Path(out_dir)
    runs = load_runs(tracking_uri, experiment)
    chosen = pick_invocation(runs, invocation)
    cells = cells_of(runs, chosen)
    meta = _meta(runs, chosen, cells)
    ok = cells[cells["status"] == "ok"]
    # a reused cell's row carries the artifact URI of the run that computed it (runs._reused_cells)
    examples = {rid: load_examples(tracking_uri, uri) for rid, uri in zip(ok["run_id"], ok["artifact_uri"])}
    tables = [replace(t, warning=table_warning(stability, t.backbone, t.task_set, t.regime))
              for t in build_tables(cells, examples)]
    section = section_markdown(stability) if stability else None
    summary = summarize(tables)
    seeds = seeds_of(cells)
    # with several fine-tuning seeds the diagnostic plots show the first seed's cells (one series per recipe)
    shown = cells[cells[SEED] == seeds[0]] if len(seeds) > 1 else cells
    first = shown[shown["status"] == "ok"]
    diagnostics = {rid: load_diagnostics(tracking_uri, uri) for rid, uri in zip(first["run_id"], first["artifact_uri"])}
    plots = diagnostic_plots(shown, diagnostics)
    trend = history_plots(runs, metric)

    written: dict[str, Path] = {}
    for plot in plots:
        written[f"plots/{plot.name}.svg"] = atomic_write_text(out / "plots" / f"{plot.name}.svg", plot.svg)
    for stale in sorted((out / "plots").glob("*.svg")):
        if f"plots/{stale.name}" not in written:
            stale.unlink()
    document = {"results": meta, "leaderboard": tables_json(tables), "summary": summary_json(summary),
                # the stability verdicts the tables carry (reports/stability.json has the figures)
                "warnings": [{"backbone": t.backbone, "task_set": t.task_set, "regime": t.regime, "seed": t.seed,
                              "warning": t.warning} for t in tables if t.warning]}
    reproductions = [r for t in tables for paper in (published or {}).get(t.backbone, [])
                     if (r := compare_published(t, paper))]
    if reproductions:
        document["published"] = published_json(reproductions)
    shown_published = published_markdown(reproductions) if reproductions else None
    across = None
    if len(seeds) > 1:  # mean and spread across the fine-tuning seeds, each calibration's verdict across them
        rows = seed_rows(documents_by_seed(document["leaderboard"]))
        document["across_seeds"] = {"seeds": [int(s) for s in seeds], "rows": rows_json(rows)}
        across = seeds_markdown(rows, [int(s) for s in seeds])
    written["leaderboard.json"] = atomic_write_text(out / "leaderboard.json",
                                                    json.dumps(document, indent=2, sort_keys=True) + "\n")
    written["leaderboard.md"] = atomic_write_text(out / "leaderboard.md",
                                                  _markdown(meta, tables, plots, testbed, section, across,
                                                            shown_published, summary))
    written["leaderboard.html"] = atomic_write_text(out / "leaderboard.html",
                                                    _html_page(meta, tables, plots, testbed, section, across,
                                                               shown_published, summary))
    written["history.md"] = atomic_write_text(out / "history.md", history_markdown(runs, metric, threshold))
    history_body = ['<p><a href="leaderboard.html">Leaderboard</a></p>', history_html(runs, metric, threshold)]
    written["history.html"] = atomic_write_text(out / "history.html", _page(
        "mergecal history", history_body + [_figure(p) for p in trend]))
    return dict(sorted(written.items()))
