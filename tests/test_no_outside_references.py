"""Nothing the repository ships cites a file it does not ship: no relative path into a folder beside the checkout,
no absolute path of the machine it was written on, no note that only lived there. Papers are cited by title
and arXiv id, what their authors' code settles by docs/references.md."""

import re
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

#: a path outside the repository, or the name of a note that never was part of it (written so that this
#: file does not match itself)
OUTSIDE = re.compile(r"\.\./shared|/wor[k]/|reference-detail[s]|offline-materials\.md")
#: generated outputs (datasets, models, results, tracking store) are not written by hand
SKIPPED = ("data/", "models/", "results/", "mlruns/")


def tracked_text_files(root: Path) -> list[Path]:
    names = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout
    files = [root / name for name in names.decode().split("\0") if name and not name.startswith(SKIPPED)]
    return [path for path in files if path.is_file() and b"\0" not in path.read_bytes()[:8192]]


def outside_references(path: Path, root: Path) -> list[str]:
    lines = path.read_text(errors="replace").splitlines()
    return [f"{path.relative_to(root)}:{number}: {line.strip()}"
            for number, line in enumerate(lines, 1) if OUTSIDE.search(line)]


def test_no_tracked_file_cites_a_path_outside_the_repository():
    found = [hit for path in tracked_text_files(REPO) for hit in outside_references(path, REPO)]
    assert not found, "cite papers by title and arXiv id, the authors' code by docs/references.md:\n" + "\n".join(found)


def test_a_citation_outside_is_named_by_file_and_line(tmp_path):
    note = tmp_path / "note.py"
    outside, machine = "../sha" + "red/papers/x.txt", "/wor" + "k/main"  # split: this file must not match itself
    note.write_text(f'"""After the paper (docs/references.md)."""\n# see {outside}\nPATH = "{machine}"\n')
    assert outside_references(note, tmp_path) == [f"note.py:2: # see {outside}", f'note.py:3: PATH = "{machine}"']
