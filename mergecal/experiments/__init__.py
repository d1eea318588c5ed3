"""The papers' experiments and the catalogue of their tables and figures, as packaged data.

One YAML file per paper (``PAPERS``: ``svc.yaml``, ``magic.yaml``): the sweeps and ablations the experiments
profile (``make paper``) runs as cells of the benchmark, validated by ``mergecal.pipeline.experiments``; and
``catalogue.yaml``: every table and figure of the three papers, what each shows and whether mergecal regenerates
it (docs/papers.md renders it)."""

from __future__ import annotations

from pathlib import Path

import yaml

FOLDER = Path(__file__).resolve().parent
CATALOGUE = FOLDER / "catalogue.yaml"
PAPERS = tuple(sorted(p.stem for p in FOLDER.glob("*.yaml") if p != CATALOGUE))


def read(name: str) -> dict:
    """A packaged file's YAML document: a paper's experiments (``svc``) or the catalogue (``catalogue``)."""
    path = CATALOGUE if name == "catalogue" else FOLDER / f"{name}.yaml"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no such experiments file (papers: {', '.join(PAPERS)})")
    return yaml.safe_load(path.read_text())
