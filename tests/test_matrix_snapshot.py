"""#41: the benchmark matrix stays what it was when the track packages were rearranged: every cell's fields, its
input roles and paths, and every skip reason (tests/matrix_snapshot.py, written at the commit before the change)."""

import difflib

from matrix_snapshot import SNAPSHOT, dumps, snapshot


def test_the_matrix_equals_its_snapshot(tmp_path):
    now, before = dumps(snapshot(tmp_path)), SNAPSHOT.read_text()
    if now != before:
        diff = list(difflib.unified_diff(before.splitlines(), now.splitlines(), "snapshot", "now", lineterm="", n=0))
        raise AssertionError(f"{len(diff)} diff lines (python tests/matrix_snapshot.py --write if meant):\n"
                             + "\n".join(diff[:20]))
