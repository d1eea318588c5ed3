"""A fingerprint of every transcribed table (mergecal/published/*.yaml), stored in
tests/data/published_fingerprints.json with the source each was checked against: any change of a printed number, a
row name, a column's place or a table's precision changes its digest, so a typo or a swap cannot land unseen (#56).
The protocol a row runs (``method``, ``chain``, ``params``) and the pool are not transcriptions and stay out.

    python tests/published_fingerprints.py --write    # only after checking the changed table against its source
"""

from __future__ import annotations

import argparse
import hashlib
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
STORED = HERE / "data" / "published_fingerprints.json"
PRINTED = ("row", "per_task", "average", "gain", "gains")  # what a row's transcription is
CHECKED_AGAINST = {
    "svc": "the paper's text, arXiv:2602.05536 (Tables 1, 2 and 5-10)",
    "magic": "the paper's text, arXiv:2512.19320 (Tables I-III and VI)",
    "fusionbench": ("FusionBench's docs/modelpool/clip_vit.md at tanganke/fusion_bench "
                    "26ffec5ba05b9b85d22726d1794852bce3b6b63e"),
}


def _digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, ensure_ascii=False).encode()).hexdigest()[:16]


def fingerprints(data: dict) -> dict[str, str]:
    """{table's name: digest} of one source's data: each table's rows (what was printed of them), its columns in
    order and its precision; each other ``table_*`` block (the SVC paper's Table 1) as a whole."""
    out = {}
    for table in data["tables"]:
        name = f"{table['table']} · {table['backbone']} · {table['task_set']}"
        printed = {"tasks": table.get("tasks", data["tasks"]), "decimals": table.get("decimals", 1),
                   "rows": [{k: row[k] for k in PRINTED if k in row} for row in table["rows"]]}
        assert name not in out, f"two tables named {name}"
        out[name] = _digest(printed)
    out.update({key: _digest(value) for key, value in data.items() if key.startswith("table_")})
    return out


def current() -> dict:
    from mergecal.published import SOURCES, load

    return {source: {"checked_against": CHECKED_AGAINST[source], "tables": fingerprints(load(source))}
            for source in SOURCES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help=f"write {STORED.name}")
    args = parser.parse_args()
    text = json.dumps(current(), indent=1, ensure_ascii=False) + "\n"
    if args.write:
        STORED.write_text(text)
    else:
        print(text, end="")


if __name__ == "__main__":
    import sys

    sys.path.insert(0, str(HERE.parent))
    main()
