"""Published rows: the numbers papers print for the published model pools, transcribed once as data.

One YAML file per source in this folder (``SOURCES``): the paper's title and arXiv id, the checkpoints' origin as
the source states it, the protocol, and ``tables`` of rows — each with the paper's row name, mergecal's recipe for
it (``method`` and ``chain``; null where mergecal has none), the per-task accuracies and the average as printed (in
percent), and the printed gain of a calibrated row over its base (``gains``: one a column, where a table prints them
so). A table may name tasks of its own (``tasks``: the LLM tables' AlpacaEval and GSM8K columns) and its printed
precision (``decimals``, 1 unless given: FusionBench's 20-task tables print 2); its average may be null (not
printed). A source that is not a paper's table names the document it comes from (``document``: FusionBench's
documentation page, at a commit) and its tables by caption. tests/test_published.py checks each table's arithmetic,
and a stored fingerprint of every table's numbers (tests/data/published_fingerprints.json) that none changes unseen.

A row carries its protocol: the chain says whether its merge's scaling was searched (``{merge}``) or fixed
(``{merge}(scaling=0.3)``), and ``params`` the merge's settings the source states (TIES's ``disjoint: sum`` in
FusionBench); it is compared only with the cell that runs exactly that (``mergecal.reports.published``). Each source
(or table) names the pool of checkpoints its numbers were computed on (``pool``). A preset names the tables its pool
reproduces (``published:`` in ``mergecal/presets/*.yaml``) and its own ``pool``; the leaderboard of a track built
from it shows the published numbers beside the run's, with an inside/outside verdict only for a table of the same
pool and, for a merge row, the same task set merged (``unlike`` says why not).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace
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
    pool: str = ""  # the checkpoints the numbers were computed on
    params: tuple[tuple[str, object], ...] = ()  # the merge's settings the source states: (name, value)
    unlike: str = ""  # why a track's run is not a reproduction of this row ("" when it is: same pool, same tasks)

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
                                    data.get("document"), str(table.get("pool", data["pool"])),
                                    tuple(sorted((row.get("params") or {}).items()))))
    return out


def unlike(row: PublishedRow, pool: str | None, task_set: str) -> str:
    """Why a run on ``pool`` (None: the preset names none) and ``task_set`` reproduces no ``row``: other checkpoints,
    or a merge of another task set (a reference row is per task: its task set does not matter); "" when it does."""
    if pool != row.pool:
        return f"other checkpoints ({row.pool}{'' if pool else '; the preset names no pool'})"
    if row.recipe not in REFERENCE_METHODS and row.task_set != task_set:
        return f"a merge of another task set ({row.task_set})"
    return ""


def of_track(track) -> list[list[PublishedRow]]:
    """For each paper a track's preset names (none without a preset), that paper's rows for the pool, each saying
    whether the track can reproduce it (``unlike``)."""
    from ..presets import pool_of, published_of

    if not getattr(track, "preset", None):
        return []
    return [[replace(row, unlike=unlike(row, pool_of(track.preset), track.task_set))
             for row in rows(r["source"], r["backbone"], r["task_set"], r.get("columns"))]
            for r in published_of(track.preset)]


def for_tracks(tracks) -> dict[str, list[list[PublishedRow]]]:
    """{track name (its leaderboard backbone): ``of_track``}, for every configured track of a lab's files (``tracks``:
    ``mergecal.pipeline.track_registry.lab_tracks``) built from a preset that names any published rows."""
    if hasattr(tracks, "model_fields"):  # a Params iterates as (field, value) pairs: never a silent empty answer
        raise TypeError("for_tracks: expected the configured tracks (track_registry.lab_tracks(params)), got "
                        f"{type(tracks).__name__}")
    out = {}
    for track in tracks:
        found = of_track(track)
        if any(found):
            out[track.name] = [f for f in found if f]
    return out
