"""Published rows: the numbers papers print for the published model pools, transcribed once as data.

One YAML file per source in this folder (``SOURCES``): the paper's title and arXiv id, the checkpoints' origin as
the source states it, the protocol, and ``tables`` of rows — each with the paper's row name, mergecal's recipe for
it (``method`` and ``chain``; null where mergecal has none), the per-task accuracies and the average as printed (in
percent), and the printed gain of a calibrated row over its base (``gains``: one a column, where a table prints them
so). A table may name tasks of its own (``tasks``: the LLM tables' AlpacaEval and GSM8K columns) and its printed
precision (``decimals``, 1 unless given: FusionBench's 20-task tables print 2); its average may be null (not
printed). A source that is not a paper's table names the document it comes from (``document``: FusionBench's
documentation page, at a commit) and its tables by caption. tests/test_published.py checks each table's arithmetic.
A preset names the tables its pool reproduces (``published:`` in ``mergecal/presets/*.yaml``), and the leaderboard
of a track built from it shows the published number beside the run's (``mergecal.reports.published``).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import yaml

from ..errors import ParameterError

FOLDER = Path(__file__).resolve().parent
SOURCES = tuple(sorted(p.stem for p in FOLDER.glob("*.yaml")))
# the row of a reference model: mergecal's reference recipes
REFERENCE_METHODS = ("zeroshot", "finetuned")


@dataclass(frozen=True)
class PublishedRow:
    source: str  # the data file (e.g. "svc")
    title: str
    arxiv: str
    table: str  # as the paper numbers it ("5", "II")
    backbone: str
    task_set: str
    row: str  # as the paper prints it
    recipe: str | None  # mergecal's recipe label (None: a method mergecal does not implement)
    tasks: tuple[str, ...]
    per_task: tuple[float, ...]  # percent, as printed
    average: float | None  # percent, as printed (None: the table prints none, e.g. the SVC paper's LLM columns)
    decimals: int = 1  # the printed precision
    document: str | None = None  # the document, where the source is not the paper itself

    @property
    def cite(self) -> str:
        return cite([self])


def cite(published: list[PublishedRow]) -> str:
    """One source's rows, cited with every table they come from: a paper's by number, a document's by caption."""
    first, tables = published[0], list(dict.fromkeys(p.table for p in published))
    plural = "s" if len(tables) > 1 else ""
    if first.document:
        captions = "; ".join(f"“{t}”" for t in tables)
        return f"{first.document}, table{plural} {captions} (its paper: arXiv:{first.arxiv})"
    return f"{first.title} (arXiv:{first.arxiv}), Table{plural} {', '.join(tables)}"


@functools.lru_cache(maxsize=None)
def load(source: str) -> dict:
    if source not in SOURCES:
        raise ParameterError(f"published: no source {source!r} (known: {', '.join(SOURCES)})")
    return yaml.safe_load((FOLDER / f"{source}.yaml").read_text())


def recipe_of(method: str | None, chain: str | None) -> str | None:
    """mergecal's recipe label for a published row: the reference's name, the merge, or the merge then its chain."""
    if method in REFERENCE_METHODS:
        return method
    if method is None or chain is None:
        return None
    return chain.replace("{merge}", method)


def rows(source: str, backbone: str, task_set: str, columns: dict[str, str] | None = None) -> list[PublishedRow]:
    """Every row of ``source``'s table for ``backbone`` on ``task_set`` (none when it has no such table).
    ``columns``: {the paper's task: the track's task} where they are named apart (GSM8K, lm-eval's ``gsm8k``)."""
    data = load(source)
    out = []
    for table in data["tables"]:
        if table["backbone"] != backbone or table["task_set"] != task_set:
            continue
        tasks = tuple((columns or {}).get(t, t) for t in table.get("tasks", data["tasks"]))
        for row in table["rows"]:
            out.append(PublishedRow(source, data["paper"]["title"], str(data["paper"]["arxiv"]), str(table["table"]),
                                    backbone, task_set, row["row"], recipe_of(row["method"], row["chain"]),
                                    tasks, tuple(row["per_task"]), row["average"], int(table.get("decimals", 1)),
                                    data.get("document")))
    return out


def for_tracks(params) -> dict[str, list[list[PublishedRow]]]:
    """{track name (its leaderboard backbone): for each paper its preset names, that paper's rows for the pool},
    for every ``local_clip`` and ``local_llm`` track built from a preset that names any."""
    from ..presets import published_of

    out = {}
    for track in [*params.local_clip, *params.local_llm]:
        found = [rows(r["source"], r["backbone"], r["task_set"], r.get("columns"))
                 for r in published_of(track.preset)] if track.preset else []
        if any(found):
            out[track.name] = [f for f in found if f]
    return out
