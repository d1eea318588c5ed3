"""The tracks' stability diagnostics (``mergecal.pipeline.stability``, ``mergecal.pipeline.refit_stability``,
``reports/stability.json``) as the leaderboard shows them: one line per track (weight noise) and per track and
regime (a refit at another thread count) under the testbed health, and a warning under each table of an unstable
track or regime.

Pure rendering of the stage's JSON: nothing here evaluates a model.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import MergecalError

KEYS = ("relative_size", "seeds", "tracks")


def read_document(path: str | Path) -> dict | None:
    """reports/stability.json (None where the stage has not written it), or one MergecalError naming it."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise MergecalError(f"{path}: expected the stability stage's JSON ({type(err).__name__})") from None
    if not isinstance(document, dict) or any(k not in document for k in KEYS):
        raise MergecalError(f"{path}: expected a JSON object with {', '.join(KEYS)} (the stability stage's)")
    return document


def _figure(value: float) -> str:
    return f"{value:.1f}"


def _relative(document: dict) -> str:
    return f"{document['relative_size']:g}"


def track_line(entry: dict, relative: str) -> str:
    """One track's verdict: its largest move of the average accuracy against its interval's half-width."""
    name = f"{entry['track']} ({entry['backbone']} · {entry['task_set']})"
    if entry.get("stable") is None:
        return f"{name}: not measured ({entry.get('not_measured', 'no result')})"
    verdict = "stable" if entry["stable"] else "UNSTABLE"
    task = entry["largest_task_move"]
    return (f"{name}: {entry['recipe']} at scaling {entry['scaling']:g}, average accuracy moves by up to "
            f"{_figure(entry['largest_avg_move'])} points under {relative} relative perturbations against a 95 % "
            f"interval half-width of {_figure(entry['half_width'])}; largest task move {_figure(task['points'])} "
            f"({task['task']}), {100 * entry['changed_fraction']:.1f} % of test outcomes changed: {verdict}")


def section_markdown(document: dict) -> str:
    """The leaderboard's "Track stability" section (Markdown): how it is measured, then one line per track."""
    lines = ["## Track stability", "",
             f"Each track's task-arithmetic row re-evaluated with every float tensor of its merged weights perturbed "
             f"by {_relative(document)} x its RMS ({len(document['seeds'])} seeds). A track is stable when the "
             "largest move of its average accuracy is at most the half-width of that row's 95 % interval.", ""]
    lines += [f"- {track_line(entry, _relative(document))}" for entry in document["tracks"]]
    refits = document.get("refits") or []  # absent from a document written before the refit diagnostic
    if refits:
        first = refits[0]
        lines += ["", f"Training: in each track and regime, the fine-tune with the largest task vector trained again "
                  f"at {first['refit_threads']} thread(s) instead of {first['threads']} (another CPU's round-off, "
                  "measured on this one), and the regime's task-arithmetic rows re-evaluated with it. A regime is "
                  "stable when no row moves by more than its 95 % interval's half-width.", ""]
        lines += [f"- {refit_line(entry)}" for entry in refits]
    return "\n".join(lines) + "\n"


def _row_name(row: dict) -> str:
    """A row's label, with its scaling where the label does not fix one (the chosen scaling's row)."""
    return row["label"] if "scaling=" in row["label"] else f"{row['label']} (chosen scaling {row['scaling']:g})"


def refit_line(entry: dict) -> str:
    """One regime's verdict under a refit: each task-arithmetic row's move against its half-width."""
    name = f"{entry['track']} ({entry['backbone']} · {entry['task_set']}) · {entry['regime']}"
    if entry.get("stable") is None:
        return f"{name}: not measured ({entry.get('not_measured', 'no result')})"
    refit = entry["refit"]
    rows = ", ".join(f"{_row_name(r)} {_figure(r['largest_avg_move'])} of ±{_figure(r['half_width'])}"
                     for r in entry["rows"])
    same = "; the refit is bit-identical" if refit["identical"] else ""
    return (f"{name}: {refit['task']} ({refit['variant']}) refit{same}; rows move by {rows} points: "
            f"{'stable' if entry['stable'] else 'UNSTABLE'}")


def table_warning(document: dict | None, backbone: str, task_set: str, regime: str | None = None) -> str:
    """The warning under a table of ``backbone`` x ``task_set`` (x ``regime``) when its track is unstable under
    weight noise or its regime under a refit ("" otherwise)."""
    warnings = []
    for entry in (document or {}).get("tracks", []):
        if (entry.get("backbone"), entry.get("task_set")) == (backbone, task_set) and entry.get("stable") is False:
            warnings.append(f"Rows of this track move by up to {_figure(entry['largest_avg_move'])} points under "
                            f"{_relative(document)} relative perturbations, more than their interval: read "
                            "differences as unreliable.")
    for entry in (document or {}).get("refits") or []:
        if ((entry.get("backbone"), entry.get("task_set"), entry.get("regime")) == (backbone, task_set, regime)
                and entry.get("stable") is False):
            refit, worst = entry["refit"], entry["worst_row"]
            warnings.append(f"Refit at {entry['refit_threads']} thread(s) instead of {entry['threads']}, this "
                            f"regime's {refit['task']} ({refit['variant']}) fine-tune moves its {worst['label']} row "
                            f"by {_figure(worst['move'])} points, more than its interval (±"
                            f"{_figure(worst['half_width'])}): another CPU trains other models here, so differences "
                            "in this table may not replicate; read them as unreliable.")
    return " ".join(warnings)


def stability_markdown(document: dict) -> str:
    """reports/stability.md (the stability stage's document, ``mergecal.pipeline.stability``): the leaderboard's
    section, then every figure per track."""
    lines = [section_markdown(document),
             "| track | recipe | scaling | avg acc % | 95 % half-width | largest avg move | per seed | "
             "largest task move | outcomes changed % | verdict |", "|---|---|---|---:|---:|---:|---|---|---:|---|"]
    if "fine_tuning_seed" in document:
        lines[:0] = [f"Measured on the models of fine-tuning seed {document['fine_tuning_seed']} (the first of "
                     "`seeds`); the other seeds' models are not measured.", ""]
    for e in document["tracks"]:
        if e.get("stable") is None:
            continue
        seeds = ", ".join(f"{v:.1f}" for v in e["avg_acc_per_seed"])
        task = e["largest_task_move"]
        lines.append(f"| {e['track']} | {e['recipe']} | {e['scaling']:g} | {e['avg_acc']:.1f} | "
                     f"{e['half_width']:.2f} | {e['largest_avg_move']:.2f} | {seeds} | {task['points']:.2f} "
                     f"({task['task']}) | {100 * e['changed_fraction']:.2f} | "
                     f"{'stable' if e['stable'] else 'UNSTABLE'} |")
    refits = [e for e in document.get("refits") or [] if e.get("stable") is not None]
    if refits:
        lines += ["", "| track | regime | refit (task, variant) | bit-identical | row | scaling | avg acc % | "
                  "95 % half-width | move | outcomes changed % | verdict |",
                  "|---|---|---|---|---|---|---:|---:|---:|---:|---|"]
        for e in refits:
            for r in e["rows"]:
                lines.append(f"| {e['track']} | {e['regime']} | {e['refit']['task']} ({e['refit']['variant']}) | "
                             f"{'yes' if e['refit']['identical'] else 'no'} | {r['label']} | {r['scaling']:g} | "
                             f"{r['avg_acc']:.1f} | {r['half_width']:.2f} | {r['largest_avg_move']:.2f} | "
                             f"{100 * r['changed_fraction']:.2f} | {'stable' if r['stable'] else 'UNSTABLE'} |")
    return "\n".join(lines) + "\n"
