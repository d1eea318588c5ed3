"""Published rows: the numbers papers print for the published model pools, transcribed once as data.

One YAML file per paper in this folder (``SOURCES``): the paper's title and arXiv id, the checkpoints' origin as the
paper states it, the protocol, and ``tables`` of rows — each with the paper's row name, mergecal's recipe for it
(``method`` and ``chain``; null where mergecal has none), the per-task accuracies and the average as printed (in
percent), and the printed gain of a calibrated row over its base (``gains``: one a column, where a table prints them
so). A table may name tasks of its own (``tasks``: the LLM tables' AlpacaEval and GSM8K columns); its average may be
null (not printed). tests/test_published.py checks each table's arithmetic. A preset names the table its pool
reproduces (``published:`` in ``mergecal/presets/*.yaml``), and the leaderboard of a track built from it shows the
published number beside the run's (``mergecal.reports.published``).
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

    @property
    def cite(self) -> str:
        return f"{self.title} (arXiv:{self.arxiv}), Table {self.table}"


def cite(published: list[PublishedRow]) -> str:
    """One paper's rows, cited with every table they come from."""
    tables = list(dict.fromkeys(p.table for p in published))
    return (f"{published[0].title} (arXiv:{published[0].arxiv}), Table{'s' if len(tables) > 1 else ''} "
            f"{', '.join(tables)}")


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
                                    tasks, tuple(row["per_task"]), row["average"]))
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
