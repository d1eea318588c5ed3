"""Every path, module and command the docs name exists: README.md and docs/**/*.md, checked against the checkout.

What is checked, per line of each Markdown file (code blocks, fenced as a shell or unnamed language or indented by
four spaces, are read for commands only; other fenced blocks, YAML or Python, not at all):

* links ``[text](target)``: a relative target must exist inside the checkout, resolved from the doc's folder (URLs and
  other schemes are skipped); an ``#anchor`` on a
  Markdown target (or alone, on the doc itself) must be one of that file's headings, slugged as GitHub does;
* repository paths in inline code: a word whose first part is a top-level entry of the checkout (``mergecal/``,
  ``scripts/``, ``tests/``, ``stages/``, ``docs/``, ``evidence/``, ``flows/``, ``params.yaml``, ``dvc.yaml``,
  ``Makefile`` ...), with ``::test_name`` or ``:LINE`` suffixes dropped and ``{a,b}`` lists expanded; it must exist
  in the working tree;
* paths under the folders the pipeline writes (``data/``, ``models/``, ``reports/``, ``results/``, ``mlruns/``,
  ``.mergecal/``): they exist only after a run, so the working tree is not asked; one must be committed
  (``git ls-files``), lie in or above an output that dvc.yaml declares (its ``${...}`` templates match any one
  folder name), or lie under a folder that .gitignore marks as generated (``reports/perf/``, ``results/``, ...);
* module names in inline code (``mergecal.pipeline.cells``, ``scripts.stage_deps``, ``stages.report``): the longest
  dotted prefix must be a module file or package of the source tree and what follows one name defined at the top
  of that module (a ``def``, ``class``, assignment or import; a name a module's ``__getattr__`` serves lazily counts
  when the module lists it as a string), then optionally one name defined in that class's body; read with ``ast``,
  nothing is imported;
* commands, in inline code and in fenced blocks: ``python [-flags] X.py`` (the script must exist), ``python -m X``
  (a project module: it must resolve as above), ``make TARGET...`` (every target a rule of the Makefile),
  ``mergecal SUBCOMMAND`` (a ``sub.add_parser("SUBCOMMAND")`` of mergecal/cli.py) and ``dvc repro STAGE...`` (a
  stage of dvc.yaml; ``stage@item`` for a ``foreach``/``matrix`` stage).

Skipped by rule: words with placeholders (``<...>``, ``{name}``, ``*``, ``...``, ``…``, ``$VAR``, ``%``), words
naming what lies outside the repository (absolute paths such as ``/tmp/x``, ``~``, ``../``, URLs, ``hf://`` and
other schemes), ``VAR=value`` words, words
whose first part is not a top-level entry of the checkout (``tracks/clip/built/params.py`` is relative to a package
the text names, not to the root; ``9c2e99a:evidence/scripts/x.py`` is a file at a past commit), third-party
modules (``python -m pytest``), code blocks' paths (they are read for commands only: a worked example's files are
the reader's to write), and the paths a worked example tells the reader to create, listed one by one in
``EXAMPLES``. ``mergecal.<name>`` is also accepted where ``<name>`` is an MLflow tag the code sets
(``tracking.tag("<name>")``: ``mergecal.user``, ``mergecal.worker``).

**docs/archive/ is checked for its links only.** Its files are dated logs kept as written: the paths, modules and
commands they name describe the code of their date, and some have moved or gone since; the links were adjusted
when the logs moved there and must keep resolving.

Every failure names the doc, the line and the missing thing; all are collected and reported together.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]

#: folders the pipeline (or `make perf`, the lab, the cell cache) writes at run time: checked against what is
#: committed and declared, not against the working tree
GENERATED = ("data", "models", "reports", "results", "mlruns", ".mergecal")
#: the project's own Python packages (``python -m X`` and dotted names are checked only for these)
PACKAGES = ("mergecal", "scripts", "stages", "flows", "tests")
#: what a worked example tells the reader to create (doc, path): named here one by one, so that a new one is a choice
EXAMPLES = {("docs/adding-a-track.md", "mergecal/pipeline/tracks/seq2seq/"),
            ("docs/adding-a-track.md", "mergecal/pipeline/tracks/clip/<source>/")}
PLACEHOLDER = re.compile(r"[<>{}*$%]|\.\.\.|…")
SCHEME = re.compile(r"^[a-z][a-z0-9+.-]*:(//)?", re.I)
CODE_SPAN = re.compile(r"(`+)(.+?)\1")
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
FENCE = re.compile(r"^\s*(```|~~~)")
DOTTED = re.compile(r"^(?:%s)(?:\.\w+)+$" % "|".join(PACKAGES))
#: a file name, not a dotted module name (``stages.py``, ``leaderboard.json``)
FILE_SUFFIX = re.compile(r"\.(py|md|ya?ml|json|toml|lock|txt|html|svg|csv|log|sh|safetensors|bin|pt|db)$")


@dataclass(frozen=True)
class Named:
    """One thing a doc names: its kind (link, path, module, command), the doc, the line and the text."""

    kind: str
    doc: str
    line: int
    text: str


# ---------------------------------------------------------------------------------------------------- the checkout

@cache
def top_entries(root: Path) -> frozenset[str]:
    return frozenset(p.name for p in root.iterdir() if p.name not in {".git", ".venv"}) | set(GENERATED)


@cache
def committed(root: Path) -> frozenset[str]:
    out = subprocess.run(["git", "ls-files", "-z"], cwd=root, capture_output=True, check=True).stdout.decode()
    return frozenset(name for name in out.split("\0") if name)


@cache
def committed_folders(root: Path) -> frozenset[str]:
    return frozenset(str(Path(name).parents[i]) for name in committed(root) for i in range(len(Path(name).parts) - 1))


PIPELINES = ("dvc.yaml", "papers/dvc.yaml")  # the default run's stages and the papers' profile's (wdir: the root)


@cache
def dvc_yaml(root: Path) -> dict:
    """Every stage of the project's pipeline files, by name."""
    stages = {}
    for name in PIPELINES:
        stages.update((yaml.safe_load((root / name).read_text()) or {}).get("stages") or {})
    return {"stages": stages}


@cache
def dvc_outputs(root: Path) -> tuple[tuple[re.Pattern, ...], ...]:
    """Each declared output as one pattern per path component: ``${...}`` matches any text within a component."""
    outs = []
    for stage in (dvc_yaml(root).get("stages") or {}).values():
        body = stage.get("do", stage)
        for out in body.get("outs") or []:
            name = next(iter(out)) if isinstance(out, dict) else out
            outs.append(tuple(re.compile("[^/]+".join(map(re.escape, re.split(r"\$\{[^}]*\}", part))))
                              for part in str(name).strip("/").split("/")))
    return tuple(outs)


@cache
def ignored_generated(root: Path) -> tuple[str, ...]:
    """What .gitignore marks as generated in the pipeline's folders (``reports/perf/``, ``reports/history.md``,
    ``results/``, ...), as paths from the root."""
    found = []
    for line in (root / ".gitignore").read_text().splitlines():
        line = line.strip().lstrip("/")
        if line and not line.startswith(("#", "!")) and line.split("/")[0] in GENERATED:
            found.append(line.rstrip("/"))
    return tuple(found)


def generated_path_is_known(path: str, root: Path) -> bool:
    path = path.rstrip("/")
    if path in GENERATED or path in committed(root) or path in committed_folders(root):
        return True
    if any(fnmatch.fnmatch(path, ignored) or path.startswith(ignored + "/") for ignored in ignored_generated(root)):
        return True
    parts = path.split("/")
    # the output itself, a file inside it, or a folder above it: their common components match
    return any(all(pattern.fullmatch(part) for pattern, part in zip(out, parts)) for out in dvc_outputs(root))


@cache
def make_targets(root: Path) -> frozenset[str]:
    text = (root / "Makefile").read_text()
    return frozenset(t for line in re.findall(r"^([^\s#=:][^=:]*):(?!=)", text, re.M) for t in line.split())


@cache
def dvc_stages(root: Path) -> frozenset[str]:
    return frozenset((dvc_yaml(root).get("stages") or {}))


@cache
def cli_subcommands(root: Path) -> frozenset[str]:
    tree = ast.parse((root / "mergecal" / "cli.py").read_text())
    return frozenset(node.args[0].value for node in ast.walk(tree)
                     if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                     and node.func.attr == "add_parser" and node.args and isinstance(node.args[0], ast.Constant))


# ------------------------------------------------------------------------------------------------ modules by ast

def module_file(parts: list[str], root: Path) -> Path | None:
    base = root.joinpath(*parts)
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if base.is_dir() and ((base / "__init__.py").is_file() or any(base.glob("*.py"))):
        return base / "__init__.py" if (base / "__init__.py").is_file() else base
    return None


@cache
def defined_names(path: Path) -> tuple[frozenset[str], dict[str, frozenset[str]]]:
    """Top-level names of a module, and each class's own names; a lazy ``__getattr__`` adds its string lists."""
    if path.is_dir():  # a namespace package: its modules are its names
        return frozenset(p.stem for p in path.glob("*.py")) | frozenset(p.name for p in path.iterdir()
                                                                          if p.is_dir()), {}
    tree = ast.parse(path.read_text())
    names, classes, lazy = set(), {}, False

    def targets(node) -> list[str]:
        if isinstance(node, ast.Name):
            return [node.id]
        if isinstance(node, (ast.Tuple, ast.List)):
            return [n for elt in node.elts for n in targets(elt)]
        return []

    def collect(body, into: set) -> None:
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                into.add(node.name)
            elif isinstance(node, ast.Assign):
                into.update(n for t in node.targets for n in targets(t))
            elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
                into.update(targets(node.target))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                into.update((a.asname or a.name).split(".")[0] for a in node.names)
            elif isinstance(node, (ast.If, ast.Try, ast.With)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    for sub in getattr(node, block, []):
                        collect(getattr(sub, "body", [sub]) if isinstance(sub, ast.ExceptHandler) else [sub], into)

    collect(tree.body, names)
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            own: set[str] = set()
            collect(node.body, own)
            classes[node.name] = frozenset(own)
        lazy |= isinstance(node, ast.FunctionDef) and node.name == "__getattr__"
    if lazy:  # PEP 562: the names it serves are listed as strings (__all__, an exports table)
        names.update(c.value for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                     for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)
                     and c.value.isidentifier())
    return frozenset(names), classes


def resolve_dotted(name: str, root: Path) -> str | None:
    """None when ``name`` is a module of the source tree, optionally followed by a name it defines (and one name
    of that class); else what is missing."""
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        path = module_file(parts[:cut], root)
        if path is None:
            continue
        rest = parts[cut:]
        if not rest:
            return None
        top, classes = defined_names(path)
        if rest[0] not in top:
            if path.name == "__init__.py" or path.is_dir():
                return f"no module {'.'.join(parts[:cut + 1])}, nor a name {rest[0]} in {path.relative_to(root)}"
            return f"{rest[0]} is not defined in {path.relative_to(root)}"
        if len(rest) >= 2 and rest[0] in classes and rest[1] not in classes[rest[0]]:
            return f"{rest[1]} is not defined in class {rest[0]} of {path.relative_to(root)}"
        return None
    return f"no module {parts[0]}"


@cache
def tracking_tags(root: Path) -> frozenset[str]:
    """The MLflow tags the code sets, ``mergecal.<name>`` through ``tracking.tag("<name>")``: their names."""
    names = set()
    for package in ("mergecal", "stages", "flows"):
        for path in (root / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                func = getattr(node, "func", None)
                if isinstance(node, ast.Call) and getattr(func, "id", getattr(func, "attr", None)) == "tag" \
                        and node.args and isinstance(node.args[0], ast.Constant):
                    names.add(str(node.args[0].value))
    return frozenset(names)


def dotted_problem(name: str, root: Path) -> str | None:
    """A module (and name) of the source tree, or one of the MLflow tags the runs carry (``mergecal.user``)."""
    problem = resolve_dotted(name, root)
    if problem and name.count(".") == 1 and name.startswith("mergecal.") and name[9:] in tracking_tags(root):
        return None
    return problem


# ------------------------------------------------------------------------------------------------ extraction

def split_braces(word: str) -> list[str]:
    """``reports/leaderboard.{md,json}`` -> both paths; a brace without a comma is a placeholder (kept)."""
    match = re.search(r"\{([^{}]*,[^{}]*)\}", word)
    if not match:
        return [word]
    return [w for alt in match.group(1).split(",")
            for w in split_braces(word[:match.start()] + alt + word[match.end():])]


def as_repo_path(word: str, root: Path) -> str | None:
    """The repository path a word of inline code names, or None when it names none (or only by placeholder)."""
    word = word.strip("'\"`()[],;").rstrip(".")
    word = word.split("::")[0]
    word = re.sub(r":\d+(-\d+)?$", "", word)  # file:LINE
    if word.startswith("./"):
        word = word[2:]
    if not word or PLACEHOLDER.search(word) or SCHEME.match(word) or word.startswith(("/", "~", "-", "../")):
        return None
    first = word.split("/")[0]
    if first not in top_entries(root) or "=" in word:
        return None
    if "/" not in word and not (root / first).is_file() and first not in GENERATED:
        return None  # a bare word equal to a folder's name ("tests", "models") is prose, not a path
    return word


def path_problem(path: str, root: Path) -> str | None:
    if path.split("/")[0] in GENERATED:
        return None if generated_path_is_known(path, root) else \
            "neither committed, nor declared by dvc.yaml, nor under a generated folder of .gitignore"
    return None if (root / path).exists() else "does not exist"


def heading_slugs(path: Path) -> frozenset[str]:
    slugs, seen, fenced = set(), {}, False
    for line in path.read_text().splitlines():
        if FENCE.match(line):
            fenced = not fenced
        match = None if fenced else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if match:
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", match.group(1))
            slug = re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            slugs.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(slugs)


def link_problem(doc: Path, target: str, root: Path) -> str | None:
    if SCHEME.match(target) or target.startswith("//"):
        return None  # a URL or another scheme
    file, _, anchor = target.partition("#")
    path = (doc.parent / file).resolve() if file else doc
    if root not in path.parents and path != root:
        return "points outside the repository"
    if not path.exists():
        return "does not exist"
    if anchor and path.suffix == ".md" and anchor not in heading_slugs(path):
        return f"has no heading #{anchor}"
    return None


#: a command where a shell line starts one: at the start, after ``;``, ``&&``, ``|``, ``(`` or ``$ ``, after
#: ``VAR=value`` words and wrappers (``timeout 60``, ``nice``, ``env``), its program given by name or path
COMMANDS = re.compile(
    r"(?:^|[;&|(]\s*|\$\s+)(?:[A-Za-z_]\w*=\S*\s+)*(?:(?:timeout\s+\S+|nice(?:\s+-n\s*\d+)?|env|time)\s+)*"
    r"(?:[^\s=]*/)?(?P<prog>python3?(?:\.\d+)?|make|mergecal|dvc)\s+(?P<args>[^;&|`]*)")
#: fenced blocks read for commands: shell ones (and those that name no language)
SHELL_FENCES = {"", "sh", "bash", "shell", "console", "text"}


def command_problems(prog: str, args: str, root: Path) -> list[tuple[str, str]]:
    """(the thing named, what is wrong) for one command line."""
    words = args.split()
    found = []
    if prog.startswith("python"):
        while words and words[0].startswith("-") and words[0] != "-m":
            words.pop(0)
        if len(words) >= 2 and words[0] == "-m":
            module = words[1]
            if module.split(".")[0] in PACKAGES and not PLACEHOLDER.search(module):
                problem = dotted_problem(module, root)
                found += [(f"python -m {module}", problem)] if problem else []
        elif words and words[0].endswith(".py"):
            script = as_repo_path(words[0], root)
            if script and not (root / script).is_file():
                found.append((f"python {words[0]}", "no such script"))
    elif prog == "make":
        for word in words:
            if word.startswith("-") or "=" in word or PLACEHOLDER.search(word):
                continue
            if not re.fullmatch(r"[\w.-]+", word):
                break
            if word not in make_targets(root):
                found.append((f"make {word}", "no such target in the Makefile"))
    elif prog == "mergecal":
        if words and re.fullmatch(r"[a-z][a-z-]*", words[0]) and words[0] not in cli_subcommands(root):
            found.append((f"mergecal {words[0]}", "no such subcommand in mergecal/cli.py"))
    elif prog == "dvc" and words[:1] == ["repro"]:
        for word in words[1:]:
            if word.startswith("-") or PLACEHOLDER.search(word):
                continue
            if not re.fullmatch(r"[\w.@:/-]+", word):
                break
            if word in PIPELINES:  # a pipeline file as the target: all its stages
                continue
            stage = word.split(":")[-1].split("@")[0]
            if stage not in dvc_stages(root):
                found.append((f"dvc repro {word}", "no such stage in dvc.yaml"))
    return found


def command_lines(code: str, rel: str, number: int, root: Path) -> list[tuple[Named, str | None]]:
    out = []
    for match in COMMANDS.finditer(code):
        problems = command_problems(match.group("prog"), match.group("args"), root)
        out.append((Named("command", rel, number, f"{match.group('prog')} {match.group('args')}".strip()),
                    "; ".join(f"{what}: {why}" for what, why in problems) or None))
    return out


def named_in(doc: Path, root: Path, links_only: bool = False, located: Path | None = None
             ) -> list[tuple[Named, str | None]]:
    """Every (thing named, problem) of one doc; the problem is None where the thing exists. ``located``: where in the
    checkout the doc is read as lying (its links resolve from there; default: where it is)."""
    located = located or doc
    rel = str(located.relative_to(root))
    previous_blank = True
    out: list[tuple[Named, str | None]] = []
    fenced = shell = indented = False
    for number, line in enumerate(doc.read_text().splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            shell = fenced and line.strip().lstrip("`~").strip().split(" ")[0].lower() in SHELL_FENCES
            continue
        if fenced and not shell:
            continue
        # an indented code block: 4 spaces after a blank line (or after its own lines); read as a shell block
        indented = not fenced and line.startswith("    ") and (indented or previous_blank)
        previous_blank = not line.strip()
        if indented:
            if not links_only:
                out += command_lines(line.strip(), rel, number, root)
            continue
        spans = [] if fenced else [m.group(2).strip() for m in CODE_SPAN.finditer(line)]
        if not fenced:
            for target in LINK.findall(CODE_SPAN.sub("", line)):
                out.append((Named("link", rel, number, target), link_problem(located, target, root)))
        if links_only:
            continue
        for code in spans if not fenced else [line.strip()]:
            out += command_lines(code, rel, number, root)
            if fenced:
                continue
            for word in code.split():
                word = word.strip("'\"()[],;:")
                word = word.rstrip(".")
                if DOTTED.match(word) and not FILE_SUFFIX.search(word):
                    out.append((Named("module", rel, number, word), dotted_problem(word, root)))
                    continue
                for alt in split_braces(word):
                    path = as_repo_path(alt, root)
                    if path and (rel, path) not in EXAMPLES:
                        out.append((Named("path", rel, number, path), path_problem(path, root)))
    return out


def docs(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").rglob("*.md"))]


def check(root: Path) -> tuple[int, list[str]]:
    """How many things the docs name, and a line per missing one."""
    checked, failures = 0, []
    for doc in docs(root):
        archived = (root / "docs" / "archive") in doc.parents
        for named, problem in named_in(doc, root, links_only=archived):
            checked += 1
            if problem:
                failures.append(f"{named.doc}:{named.line}: {named.kind} {named.text!r}: {problem}")
    return checked, failures


# ------------------------------------------------------------------------------------------------ tests

def test_every_path_module_and_command_the_docs_name_exists():
    checked, failures = check(ROOT)
    assert checked > 500, checked  # the extractor still finds what the docs name
    assert not failures, f"{len(failures)} of {checked} named things are missing:\n" + "\n".join(failures)


def test_a_broken_path_module_command_or_link_is_reported_by_doc_and_line(tmp_path):
    """The checker on a doc naming one missing thing of each kind (and as many that exist) reports each missing one
    with its file and line, and none of those that exist."""
    doc = tmp_path / "probe.md"
    doc.write_text("\n".join([
        "# Probe",
        "`mergecal/merge.py` and `mergecal/no_such_module.py`",
        "[pipeline](pipeline.md), [gone](no-such-doc.md) and [anchor](pipeline.md#no-such-heading)",
        "`mergecal.pipeline.cells` and `mergecal.calibrations.fsc.no_such_function`",
        "`python scripts/stage_deps.py` then `python scripts/no_such_script.py --help`",
        "`make test` and `make no-such-target`; `mergecal perf` and `mergecal no-such-command`",
        "",
        "    .venv/bin/python evidence/scripts/no_such_script.py   # an indented code block",
        "```",
        "dvc repro benchmark",
        "dvc repro no_such_stage",
        "```",
        "`models/<name>/x.json`, `/tmp/x.py`, `reports/leaderboard.{md,json}` and `reports/no_such_report.md`",
    ]) + "\n")
    located = ROOT / "docs" / "probe.md"  # read as a doc of docs/: its links resolve from there
    found = [(named, problem) for named, problem in named_in(doc, ROOT, located=located) if problem]
    failed = [f"{n.line}:{n.kind}:{n.text}" for n, _ in found]
    assert failed == [
        "2:path:mergecal/no_such_module.py",
        "3:link:no-such-doc.md",
        "3:link:pipeline.md#no-such-heading",
        "4:module:mergecal.calibrations.fsc.no_such_function",
        "5:command:python scripts/no_such_script.py --help",
        "5:path:scripts/no_such_script.py",
        "6:command:make no-such-target",
        "6:command:mergecal no-such-command",
        "8:command:python evidence/scripts/no_such_script.py   # an indented code block",
        "11:command:dvc repro no_such_stage",
        "13:path:reports/no_such_report.md",
    ], failed
    assert all(n.doc == "docs/probe.md" for n, _ in found)
