"""dvc.yaml's code deps from the import graph: each stage depends on exactly the project's modules (mergecal/,
flows/, stages/) that its command's module imports, directly or not (``mergecal.pipeline.imports``), and the data
files those packages read (``PACKAGE_DATA``), so that an edit reruns the stages that import the edited module and
no other.

    python -m scripts.stage_deps --check   # exit 1 and one line per stage whose code deps or tracks' params drifted
    python -m scripts.stage_deps --write   # rewrite those lists in place (comments and layout kept)

A stage's command module is the project module its ``cmd`` runs (``python -m stages.<name>``); a stage whose
command runs none is left alone. Only two kinds of list change: the code deps (paths under mergecal/, flows/,
stages/, files or folders) are replaced by the closure's files (less empty ones), sorted, where the first of them
stood; and in the stages of ``TRACK_PARAMS``, whose params lists drifted, the entries that name a track whole
(``<track>`` or ``<track>.enabled``) by the registry's, where the first of them stood. Every other line (data/ and
models/ deps, other params such as ``vision.tasks``) keeps its place, comment and order.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import yaml

from mergecal.errors import MergecalError
from mergecal.pipeline.imports import PROJECT_PACKAGES, TRACK_PACKAGES, import_graph, source_paths, stage_closure
from mergecal.pipeline.track_registry import registered

#: the stage that runs the benchmark matrix: every merge method, calibration and track, through the registries
#: (paper_significance runs the matrix's cells too, on subsets of the tasks)
RUNS_EVERY_MEMBER = {"stages.benchmark", "stages.paper_cells", "stages.paper_significance"}
#: the stage that measures every track's stability through the registry's DIAGNOSTICS
RUNS_DIAGNOSTICS = {"stages.stability"}
#: the module through which a stage runs the sources of a lab's files (the registry's LAB_FILES): a stage that
#: imports it depends on them too
LAB_FILES_MODULE = "mergecal.pipeline.tracks.lab_files"
#: data files a module reads at run time, deps of every stage that imports it: the published tables and the presets'
#: ``published:`` and ``pool:``, which the report's published section reads and which give a preset's track the
#: fixed-scaling protocols its own pool's rows run (``cells.published_protocols``: the matrix of the benchmark and
#: stability stages). The presets' tracks are no stage's file deps: their values reach the cells through the tracks'
#: params, hashed by local_inputs into its output.
PACKAGE_DATA = {"mergecal.published": ("mergecal/published/*.yaml", "mergecal/presets/*.yaml"),
                "mergecal.experiments": ("mergecal/experiments/*.yaml",)}
#: the pipeline files whose stages this writes: the default run's and the papers' experiments' (``make paper``), whose
#: stages run in the root (``wdir: ..``), so every path is the root's
PIPELINES = ("dvc.yaml", "papers/dvc.yaml")
#: stages whose params name tracks, and which of the registry's tracks: their entries are written from the track
#: registry (``registered``), so a new track is no edit of dvc.yaml: the lab's tracks (each a list of configured
#: tracks), every track's switch (``<track>.enabled``, or a lab's list), the tracks with stability diagnostics
TRACK_PARAMS = {"local_inputs": "lab_files", "local_tracks": "lab_files", "benchmark": "switches",
                "stability": "diagnostics"}
COMMAND_MODULE = re.compile(r"\bpython3?\s+-m\s+((?:" + "|".join(PROJECT_PACKAGES) + r")(?:\.\w+)*)")


def is_code_dep(path: str) -> bool:
    return path.split("/", 1)[0] in PROJECT_PACKAGES


def stage_bodies(stages: dict) -> dict[str, dict]:
    """Stage name -> the mapping that holds its cmd and deps (a ``foreach`` stage's ``do``)."""
    return {name: stage.get("do", stage) if isinstance(stage, dict) else {} for name, stage in stages.items()}


def expected_code_deps(stages: dict, root: Path) -> dict[str, list[str]]:
    """Stage name -> the sorted source files of its command module's import closure (stages that run one)."""
    graph = import_graph(root)
    out = {}
    for name, body in stage_bodies(stages).items():
        match = COMMAND_MODULE.search(str(body.get("cmd", "")))
        if match is None:
            continue
        if match.group(1) not in graph:
            raise MergecalError(f"dvc.yaml: stage {name!r}: its cmd runs {match.group(1)!r}, not a module of the "
                                "project's sources")
        options = {"runs_every_member": match.group(1) in RUNS_EVERY_MEMBER,
                   "runs_diagnostics": match.group(1) in RUNS_DIAGNOSTICS}
        closure = stage_closure(graph, match.group(1), **options)
        if LAB_FILES_MODULE in closure:
            closure = stage_closure(graph, match.group(1), **options, runs_lab_files=True)
        data = [p.relative_to(root).as_posix() for module, patterns in PACKAGE_DATA.items() if module in closure
                for pattern in patterns for p in root.glob(pattern)]
        # an empty module (a bare package marker) cannot change a stage's result, and DVC warns "'<path>' is empty"
        # for each empty dep of each stage; should it gain content, --check names it at once
        sources = [path for path in source_paths(closure, root) if (root / path).stat().st_size > 0]
        out[name] = sorted(sources + data)
    return out


def load_stages(text: str) -> dict:
    try:
        stages = yaml.safe_load(text)["stages"]
    except (yaml.YAMLError, TypeError, KeyError) as err:
        raise MergecalError(f"dvc.yaml: expected a YAML mapping with `stages:` ({type(err).__name__})") from None
    if not isinstance(stages, dict):
        raise MergecalError("dvc.yaml: `stages:` should be a mapping of stage names")
    return stages


def expected_track_params(root: Path) -> dict[str, list[str]]:
    """Stage name -> the params entries it has for tracks (``TRACK_PARAMS``), in matrix order."""
    tracks = registered(Path(root, *TRACK_PACKAGES.split(".")))
    switches = [name if name in tracks["lab_files"] else f"{name}.enabled" for name in tracks["modules"]]
    return {stage: switches if kind == "switches" else list(tracks[kind]) for stage, kind in TRACK_PARAMS.items()}


def _track_entry(value: str, tracks: set[str]) -> bool:
    """Whether a params entry names a track whole (``<track>``, ``<track>.enabled``): the entries this tool writes."""
    return value in tracks or (value.endswith(".enabled") and value.removesuffix(".enabled") in tracks)


def drift(stages: dict, expected: dict[str, list[str]]) -> dict[str, tuple[list[str], list[str]]]:
    """Stage name -> (missing, extra) code deps, for each stage whose code deps differ from ``expected``."""
    bodies = stage_bodies(stages)
    out = {}
    for name, paths in expected.items():
        listed = {d for d in bodies[name].get("deps") or [] if isinstance(d, str) and is_code_dep(d)}
        missing, extra = sorted(set(paths) - listed), sorted(listed - set(paths))
        if missing or extra:
            out[name] = (missing, extra)
    return out


def params_drift(stages: dict, expected: dict[str, list[str]], tracks: set[str]) -> dict[str, tuple[list, list]]:
    """Stage name -> (missing, extra) params entries for tracks, for each stage whose entries differ (in content or
    order) from ``expected``."""
    bodies = stage_bodies(stages)
    out = {}
    for name, entries in expected.items():
        if name not in bodies:  # a checkout without that stage
            continue
        listed = [p for p in bodies[name].get("params") or [] if isinstance(p, str) and _track_entry(p, tracks)]
        if listed != entries:
            missing, extra = [e for e in entries if e not in listed], [e for e in listed if e not in entries]
            out[name] = (missing or ([] if extra else ["(their order)"]), extra)
    return out


def describe(found: dict[str, tuple[list[str], list[str]]], what: str = "") -> list[str]:
    return [f"dvc.yaml: stage {name!r}: " + "; ".join(
        f"{which}{what} {', '.join(paths)}" for which, paths in (("missing", missing), ("extra", extra)) if paths)
        for name, (missing, extra) in found.items()]


def _item_value(line: str) -> str:
    """The scalar of a ``- value  # comment`` line."""
    value = line.strip()[2:].split(" #", 1)[0].strip()
    return value[1:-1] if len(value) > 1 and value[0] == value[-1] and value[0] in "'\"" else value


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _in_deps_list(line: str, deps_indent: int) -> bool:
    """Whether a line after ``deps:`` still belongs to its list: blank, a comment, deeper, or a ``- item`` at the
    same indent (YAML's compact form)."""
    content = line.strip()
    return not content or content.startswith("#") or _indent(line) > deps_indent or \
        (content.startswith("- ") and _indent(line) == deps_indent)


def rewrite_deps(text: str, expected: dict[str, list[str]], params: dict[str, list[str]] | None = None,
                 tracks: frozenset[str] = frozenset()) -> str:
    """``text`` with each named stage's code deps replaced by ``expected[stage]`` and its params entries for
    ``tracks`` by ``params[stage]``; every other line as it was.
    Relies on dvc.yaml's block layout (``stages:`` at the left margin, a stage's name alone on its line, ``deps:``
    followed by ``- path`` lines) and checks the result: the same YAML but for those lists, else a
    MergecalError and nothing written."""
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    in_stages, stage_indent, stage = False, None, None
    i = 0
    while i < len(lines):
        line, content = lines[i], lines[i].split("#", 1)[0].strip()
        i += 1
        out.append(line)
        if not content:
            continue
        if _indent(line) == 0:
            in_stages, stage_indent, stage = content == "stages:", None, None
        elif in_stages and stage_indent in (None, _indent(line)):
            stage_indent, stage = _indent(line), content.split(":", 1)[0]
        elif stage in expected and content == "deps:":
            block = []
            while i < len(lines) and _in_deps_list(lines[i], _indent(line)):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():  # blank lines after the list belong to what follows
                block.pop()
                i -= 1
            out += _new_block(block, expected[stage], stage)
        elif stage in (params or {}) and content == "params:":
            block = []
            while i < len(lines) and _in_deps_list(lines[i], _indent(line)):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
                i -= 1
            out += _new_block(block, params[stage], stage, lambda value: _track_entry(value, tracks))
    new = "".join(out)
    if _normalized(load_stages(text), expected, params, tracks) != _normalized(load_stages(new), tracks=tracks):
        raise MergecalError("dvc.yaml: its layout is not the one this tool rewrites (`stages:` at the left margin, "
                            "a stage's name alone on its line, `deps:` then `- path` lines); nothing written")
    return new


def _new_block(block: list[str], code: list[str], stage: str, replaced=is_code_dep) -> list[str]:
    """A list's lines with its ``replaced`` items (code deps) replaced by ``code``, where the first of them
    stood."""
    items = [line for line in block if line.lstrip().startswith("- ")]
    if not items:
        raise MergecalError(f"dvc.yaml: stage {stage!r}: expected its deps as `- path` lines")
    prefix = items[0][: _indent(items[0])]
    replacement = [f"{prefix}- {path}\n" for path in code]
    new, placed = [], False
    for line in block:
        if line.lstrip().startswith("- ") and replaced(_item_value(line)):
            new += [] if placed else replacement
            placed = True
        else:
            new.append(line)
    if not placed:  # no code dep yet: the closure goes first
        first = new.index(items[0])
        new[first:first] = replacement
    return new


def _normalized(stages: dict, replaced: dict[str, list[str]] | None = None,
                params: dict[str, list[str]] | None = None, tracks: frozenset[str] = frozenset()) -> dict:
    """``stages`` with each deps list as (its code deps sorted, or ``replaced[stage]``) + the others in order, and
    each ``TRACK_PARAMS`` stage's params as its entries for ``tracks`` (or ``params[stage]``) + the others."""
    for name, body in stage_bodies(stages).items():
        deps = body.get("deps") or []
        code = sorted(d for d in deps if isinstance(d, str) and is_code_dep(d))
        others = [d for d in deps if not (isinstance(d, str) and is_code_dep(d))]
        body["deps"] = sorted((replaced or {}).get(name, code)) + others
        if name in TRACK_PARAMS:
            listed = body.get("params") or []
            mine = [p for p in listed if isinstance(p, str) and _track_entry(p, tracks)]
            body["params"] = (params or {}).get(name, mine) + [p for p in listed if p not in mine]
    return stages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.stage_deps", description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true",
                      help="exit 1 naming each stage whose code deps or tracks' params drifted")
    mode.add_argument("--write", action="store_true",
                      help="rewrite dvc.yaml's code deps from the import graph, its tracks' params from the registry")
    parser.add_argument("--root", type=Path, default=Path("."), help="the checkout (default: .)")
    args = parser.parse_args(argv)
    drifted = False
    for name in PIPELINES:
        if name != "dvc.yaml" and not (args.root / name).is_file():  # a checkout without the papers' profile
            continue
        status = _pipeline(args.root, args.root / name, args.check)
        if status == 2:
            return 2
        drifted |= status == 1
    return 1 if drifted else 0


def _pipeline(root: Path, path: Path, check: bool) -> int:
    """``--check`` (1: drifted) or ``--write`` one pipeline file; 2 on an error."""
    try:
        try:
            text = path.read_text()
        except OSError as err:
            raise MergecalError(f"{path}: cannot read ({err.strerror or err})") from None
        stages = load_stages(text)
        expected = expected_code_deps(stages, root)
        found = drift(stages, expected)
        params = expected_track_params(root)
        tracks = frozenset(registered(Path(root, *TRACK_PACKAGES.split(".")))["modules"])
        found_params = params_drift(stages, params, tracks)
        if check:
            for line in describe(found) + describe(found_params, " params"):
                print(line if path.name == "dvc.yaml" and path.parent == root else
                      line.replace("dvc.yaml:", f"{path.relative_to(root)}:", 1))
            return 1 if found or found_params else 0
        if found or found_params:
            from mergecal.checkpoint import atomic_write_text

            # only the params lists that drifted are rewritten (a list left alone keeps its comments)
            atomic_write_text(path, rewrite_deps(text, expected, {s: params[s] for s in found_params}, tracks))
        print(f"{path}: code deps of {len(found)} stage(s) rewritten" + (f": {', '.join(found)}" if found else "")
              + (f"; tracks' params of {len(found_params)}: {', '.join(found_params)}" if found_params else ""))
        return 0
    except MergecalError as err:
        print(f"stage_deps: error: {err}", file=sys.stderr)
        return 2

if __name__ == "__main__":
    sys.exit(main())
