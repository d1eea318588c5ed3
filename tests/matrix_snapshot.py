"""The benchmark matrix as data, so that a refactor that must not move it can be checked (#41): every cell's
fields, the roles and paths of its inputs (relative to the checkout, or to the lab's folder), and each skipped
chain with its reason, for the default params.yaml and the smoke profile, each with a lab's CLIP and LLM track.
Cell ids are left out (they hash the code's sources, which a refactor edits); the cells they hash are not.

    python tests/matrix_snapshot.py --write    # after a change meant to move the matrix; say so in its note
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
SNAPSHOT = HERE / "data" / "matrix_snapshot.json"


def write_lab(folder: Path) -> dict:
    """The lab's tracks (``local_clip``, ``local_llm`` entries) written under ``folder``."""
    sys.path.insert(0, str(HERE))
    from local_models import write_clip_track, write_llm_family

    return {"local_clip": [write_clip_track(folder / "clip", "lab_clip")],
            "local_llm": [write_llm_family(folder / "llm", "lab_llm")]}


def matrix(params, root: Path, lab: Path) -> dict:
    from mergecal.pipeline.cells import cell_inputs, enumerate_cells
    from mergecal.pipeline.track_registry import skipped_cells

    def relative(path: str) -> str:
        path = Path(path)
        for base, name in ((lab, "<lab>"), (root, ".")):
            if path.is_relative_to(base):
                return f"{name}/{path.relative_to(base).as_posix()}"
        return path.as_posix()

    cells = [{**cell.to_dict(), "inputs": {role: relative(p) for role, p in cell_inputs(cell, params, root).items()}}
             for cell in enumerate_cells(params)]
    skipped = [{**cell.to_dict(), "reason": reason} for cell, reason in skipped_cells(params)]
    return json.loads(json.dumps({"cells": cells, "skipped": skipped}))  # tuples as lists, as in the file


def snapshot(folder: Path) -> dict:
    """{profile: matrix} of the default params.yaml and the smoke profile, each with the lab's tracks (written in
    ``folder``), against the checkout's committed models and data only (copied into ``folder``): what a run left in
    the checkout (an expert directory, say, whose files a cell's inputs then list) moves no cell (#55)."""
    from committed import committed_copy
    from mergecal.pipeline.config import parse_params
    from mergecal.pipeline.workspace import smoke_overrides

    lab, root = folder / "lab", committed_copy(folder / "checkout", "models", "data")
    tracks = write_lab(lab)
    default = yaml.safe_load((REPO / "params.yaml").read_text())
    return {"default": matrix(parse_params({**default, **tracks}), root, lab),
            "smoke": matrix(parse_params({**smoke_overrides(), **tracks}), root, lab)}


def dumps(data: dict) -> str:
    """The snapshot as text, one cell per line (a moved cell is one line of a diff)."""
    lines = ["{"]
    for i, (profile, parts) in enumerate(sorted(data.items())):
        lines.append(f"{json.dumps(profile)}: {{")
        for j, (part, rows) in enumerate(sorted(parts.items())):
            lines.append(f"{json.dumps(part)}: [")
            lines += [json.dumps(row, sort_keys=True) + ("," if k < len(rows) - 1 else "")
                      for k, row in enumerate(rows)]
            lines.append("]" + ("," if j < len(parts) - 1 else ""))
        lines.append("}" + ("," if i < len(data) - 1 else ""))
    return "\n".join(lines + ["}"]) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {SNAPSHOT.relative_to(REPO)}")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        data = snapshot(Path(folder))
    text = dumps(data)
    if args.write:
        SNAPSHOT.write_text(text)
        print(f"{SNAPSHOT.relative_to(REPO)}: {sum(len(m['cells']) for m in data.values())} cells")
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
