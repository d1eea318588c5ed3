"""The two stages every source of a lab's files shares, over every family's such source (``causal_lm.files``: the
``local_llm`` tracks; ``clip.files``: the ``local_clip`` tracks), so that one file, ``models/local/inputs.json``,
is the dependency through which DVC reruns ``local_tracks`` exactly when a byte of a lab's file changed:

* ``record_inputs`` (stage ``local_inputs``, always run; cheap): each source's ``input_records``, the size and
  sha256 of each file its loaders read, hashes cached by path, size and mtime (``.mergecal/hashes``);
* ``all_references`` (stage ``local_tracks``): each configured track's ``references`` (its source's), and an index
  of the tracks, so that the output directory exists when none is configured; ``report_lines`` what the stage
  prints (each task's figures in its source's ``task_line``).

A new source of a lab's files is a family's ``files`` source (``track_registry.LAB_FILES``): no list names it."""

from __future__ import annotations

import json
from pathlib import Path

from ...checkpoint import atomic_write_text
from ...hub_cache import check_cached, hub_ids_in
from ..config import Params
from ..hashing import HASH_CACHE
from ..own_models import inputs_path, tracks_dir
from ..track_registry import lab_file_sources


def record_inputs(params: Params, root: str | Path = ".") -> dict:
    """``inputs.json``: each source's records of its tracks' files (written atomically), once every hub id the
    tracks name is in the local cache (else one error naming them all: ``hub_cache.check_cached``)."""
    sources = lab_file_sources()  # every family's source of a lab's files, in matrix order
    check_cached([found for source in sources for track in source.configured(params)
                  for found in hub_ids_in(track.model_dump(mode="json"))])
    out = {}
    for source in sources:
        out.update(source.input_records(params, root, Path(root) / HASH_CACHE))
    atomic_write_text(inputs_path(root), json.dumps(out, indent=2, sort_keys=True))
    return out


def all_references(params: Params, root: str | Path = ".", *, device: str = "cpu") -> dict[str, dict]:
    """Every configured track's references, source by source, then ``tracks/index.json``."""
    out = {track.name: source.references(track, root, seed=params.seed, device=device)
           for source in lab_file_sources() for track in source.configured(params)}
    atomic_write_text(tracks_dir(root) / "index.json", json.dumps(sorted(out), indent=2))
    return out


def report_lines(params: Params, references: dict[str, dict]) -> list[str]:
    """What the stage ``local_tracks`` prints: a track's or a task's recorded error, else the task's figures."""
    source_of = {track.name: source for source in lab_file_sources() for track in source.configured(params)}
    lines = []
    for name, report in references.items():
        if "error" in report:
            lines.append(f"{name}: ERROR {report['error']}")
            continue
        lines += [f"{name}/{task}: ERROR {info['error']}" if "error" in info else
                  f"{name}/{task}: {source_of[name].task_line(report, task, info)}"
                  for task, info in report["tasks"].items()]
    return lines
