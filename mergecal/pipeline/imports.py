"""The project's own import graph, read from its sources with ``ast`` (nothing is imported).

Two users: a benchmark cell's id hashes the sources of the modules its computation imports
(``mergecal.pipeline.code_digest``), and each DVC stage depends on the modules its script imports
(``scripts/stage_deps.py`` keeps dvc.yaml's code deps equal to them). An edge is any import the module can run:
at module level or inside a function; ``if TYPE_CHECKING:`` imports never run and are left out. Importing a
module runs its packages' ``__init__.py`` first, so every module also depends on its parent packages.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterable, Mapping
from functools import lru_cache
from pathlib import Path

from ..errors import MergecalError
from ..plugins import registering_modules
from .track_registry import registered

#: the project's top-level packages (the roots under a checkout)
PROJECT_PACKAGES = ("mergecal", "flows", "stages")

#: modules that import others by a name computed at run time (``importlib.import_module``), and where those
#: names are found: ("exports", <module-level dict of name -> module>, <their package>: PEP 562 exports), ("calls",
#: <function whose first argument is a module name>, <its package>), ("registering", <decorator>, <package>: the
#: package's modules that apply it, ``plugins.registering_modules``) or ("tracks", "TRACK", <package>: every
#: module the track registry names, ``track_registry.registered``). A test checks that every ``import_module``
#: call of the project is in this table.
LAZY_IMPORTS = {
    "mergecal": ("exports", "_EXPORTS", "mergecal"),
    "mergecal.methods": ("registering", "register", "mergecal.methods"),
    "mergecal.calibrations.registry": ("registering", "register_calibration", "mergecal.calibrations"),
    "mergecal.pipeline.track_registry": ("tracks", "TRACK", "mergecal.pipeline.tracks"),
    "mergecal.pipeline.tracks.clip.built.params": ("calls", "_library_default", "mergecal"),
}

Graph = Mapping[str, frozenset[str]]


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Module name -> source file of every module of ``packages`` under ``root`` (a package: its __init__.py)."""
    files = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return files


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(tree: ast.Module, module: str, is_package: bool, *, annotations: bool = False) -> set[str]:
    """Absolute names of what the module imports, anywhere in it (``from a import b`` gives ``a`` and ``a.b``: b
    may be a module; the caller resolves names to modules); ``if TYPE_CHECKING:`` imports only with
    ``annotations``."""
    package = module.split(".") if is_package else module.split(".")[:-1]
    never_run = set() if annotations else {
        id(node) for test in ast.walk(tree) if isinstance(test, ast.If) and _is_type_checking(test.test)
        for statement in test.body for node in ast.walk(statement)}
    names: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in never_run:
            continue
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            base = ".".join(base + (node.module.split(".") if node.module else []))
            names.add(base)
            names.update(f"{base}.{alias.name}" for alias in node.names if alias.name != "*")
    return names


def lazy_names(tree: ast.Module, rule: tuple[str, str, str]) -> set[str]:
    """The module names a "calls" rule reads from a module's source."""
    kind, name, package = rule
    values = [node.args[0].value for node in ast.walk(tree)
              if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == name
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)]
    return {f"{package}.{value}" for value in values}


def scanned_names(root: Path, rule: tuple[str, str, str]) -> set[str]:
    """The module names a "registering" or "tracks" rule finds in the sources under ``root``."""
    kind, name, package = rule
    folder = Path(root, *package.split("."))
    if kind == "registering":
        return {f"{package}.{module}" for module in registering_modules(folder, name)}
    return {f"{package}.{module}" for modules in registered(folder).values() for module in modules.values()}


def lazy_targets(root: Path, module: str, source: bytes) -> set[str]:
    """The module names ``module``'s ``LAZY_IMPORTS`` rule gives (none for "exports": see ``_exported``)."""
    rule = LAZY_IMPORTS.get(module)
    if rule is None or rule[0] == "exports":  # exports load when a name is used
        return set()
    if rule[0] == "calls":
        return lazy_names(ast.parse(source), rule)
    return scanned_names(root, rule)


@lru_cache(maxsize=1024)
def _source_imports(source: bytes, module: str, is_package: bool) -> frozenset[str]:
    """``imported_names`` of a module's source (parsed once a process for the same bytes)."""
    return frozenset(imported_names(ast.parse(source), module, is_package))


def _exported(root: Path, modules: Mapping[str, Path]) -> dict[str, str]:
    """``package.name`` -> the module that defines it, for the names a package exports lazily (PEP 562): importing
    the package loads none of them, ``from package import name`` loads that one module."""
    out = {}
    for package, rule in LAZY_IMPORTS.items():
        if rule[0] == "exports" and package in modules:
            tree = ast.parse(modules[package].read_bytes())
            for node in tree.body:
                targets = node.targets if isinstance(node, ast.Assign) else []
                if any(isinstance(t, ast.Name) and t.id == rule[1] for t in targets):
                    for name, module in ast.literal_eval(node.value).items():
                        out[f"{package}.{name}"] = f"{rule[2]}.{module}"
    return out


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The module a dotted name lives in: itself if it is a module, else its longest prefix that is one."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def import_graph(root: Path, packages: Iterable[str] = PROJECT_PACKAGES) -> dict[str, frozenset[str]]:
    """Module -> the project's modules it imports (statically, lazily per ``LAZY_IMPORTS``, and its parent
    packages), over the modules of ``packages`` under ``root``. Imports of anything else are left out."""
    modules = module_files(root, packages)
    exported = _exported(root, modules)
    graph = {}
    for module, path in modules.items():
        try:
            source = path.read_bytes()
            names = _source_imports(source, module, path.name == "__init__.py") | lazy_targets(root, module, source)
        except SyntaxError as err:
            raise MergecalError(f"{path}:{err.lineno}: not valid Python ({err.msg})") from None
        targets = {_resolve(exported.get(name, name), modules) for name in names} | set(_parents(module))
        graph[module] = frozenset(t for t in targets if t in modules and t != module)
    return graph


def import_closure(graph: Graph, roots: Iterable[str], plugins: Iterable[frozenset[str]] = (),
                   leave_out: Callable[[str], bool] = lambda module: False,
                   skip_edge: Callable[[str, str], bool] = lambda module, target: False) -> set[str]:
    """The modules ``roots`` import, directly or not, themselves included.

    ``plugins``: families of modules that a registry imports all of (the merge methods, the calibrations, the
    tracks). A family's module comes in only as a root or when a module of the same family imports it: the
    registry that imports every method does not bring every method into a TIES cell, while a method built on
    another (DARE on TIES' core) brings that one in. ``leave_out``: modules not followed at all. ``skip_edge``:
    imports (module, target) not followed."""
    roots = set(roots)
    unknown = sorted(roots - graph.keys())
    if unknown:
        raise MergecalError(f"module {unknown[0]!r}: no such module in the project's sources")
    family = {module: i for i, members in enumerate(plugins) for module in members}
    seen: set[str] = set()
    pending = list(roots)
    while pending:
        module = pending.pop()
        if module in seen or leave_out(module):
            continue
        seen.add(module)
        for target in graph[module]:
            if target in family and target not in roots and family.get(module) != family[target]:
                continue
            if skip_edge(module, target):
                continue
            pending.append(target)
    return seen


#: registry -> the package of its members: a registry imports every member so that its name resolves
REGISTRIES = {module: rule[2] for module, rule in LAZY_IMPORTS.items() if rule[0] in ("registering", "tracks")}
#: the params.yaml validation (and each track's section, ``tracks/<family>/<source>/params.py``), and the packages it
#: imports only to check settings (a merge's or calibration's parameters, a chain's recipe), never to compute
PARAMS_VALIDATION = ("mergecal.pipeline.config", ("mergecal.methods", "mergecal.calibrations", "mergecal.recipe",
                                                   "mergecal.pipeline.chains"))
TRACK_PACKAGES = REGISTRIES["mergecal.pipeline.track_registry"]


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def is_track_section(module: str) -> bool:
    """A track's params.yaml section or a family's shared settings (``tracks/**/params.py``): part of the params
    validation."""
    return _within(module, TRACK_PACKAGES) and module.endswith(".params")


def registry_members(graph: Graph) -> set[str]:
    """The merge methods, calibrations and tracks: what the registries import, less their own infrastructure
    (``base``, the registry itself), the tracks' stability diagnostics (``diagnostics_members``) and the stages of
    a lab's files (``lab_files_members``)."""
    return {target for registry, package in REGISTRIES.items() if registry in graph for target in graph[registry]
            if _within(target, package) and target != package and target != registry
            and target.rpartition(".")[2] != "base"} - diagnostics_members(graph) - lab_files_members(graph)


def _track_members(graph: Graph, name: str) -> set[str]:
    registry = next(r for r, package in REGISTRIES.items() if package == TRACK_PACKAGES)
    return {target for target in graph.get(registry, ()) if _within(target, TRACK_PACKAGES)
            and target.rpartition(".")[2] == name}


def diagnostics_members(graph: Graph) -> set[str]:
    """The tracks' stability diagnostics (``tracks/<family>/<source>/diagnostics.py``, the registry's
    ``DIAGNOSTICS``)."""
    return _track_members(graph, "diagnostics")


def lab_files_members(graph: Graph) -> set[str]:
    """What the stages of a lab's files run (``tracks/<family>/files/stages.py``, the registry's ``LAB_FILES``)."""
    return _track_members(graph, "stages")


def stage_closure(graph: Graph, module: str, *, runs_every_member: bool = False,
                  runs_diagnostics: bool = False, runs_lab_files: bool = False) -> set[str]:
    """The modules a DVC stage whose command runs ``module`` depends on: its import closure, less two kinds of
    import that compute nothing the stage writes: a registry importing its members (so that names resolve) and
    the params validation (``config`` and the tracks' sections) importing a method's or calibration's parameter
    classes. A member comes in when a
    module the stage runs imports it directly (the DisTaC stage and ``calibrations/distac.py``), or, with
    ``runs_every_member`` (the benchmark stage, which dispatches every cell through the registries), always; the
    tracks' diagnostics with ``runs_diagnostics`` (the stability stage, which reaches them through the registry),
    the sources of a lab's files with ``runs_lab_files`` (the stages ``local_inputs`` and ``local_tracks``)."""
    validator, validated = PARAMS_VALIDATION

    def skip(source: str, target: str) -> bool:
        if source in REGISTRIES and _within(target, REGISTRIES[source]) and target != source:
            # the tracks' sections are the params schema every stage reads (``config`` composes them)
            return target.rpartition(".")[2] != "base" and not is_track_section(target)
        return (source == validator or is_track_section(source)) and any(_within(target, p) for p in validated)

    roots = {module} | (registry_members(graph) if runs_every_member else set()) \
        | (diagnostics_members(graph) if runs_diagnostics else set()) \
        | (lab_files_members(graph) if runs_lab_files else set())
    return import_closure(graph, roots, skip_edge=skip)


def source_paths(modules: Iterable[str], root: Path, packages: Iterable[str] = PROJECT_PACKAGES) -> list[str]:
    """Sorted paths (relative to ``root``, with /) of the sources of ``modules``."""
    files = module_files(root, packages)
    return sorted(files[m].relative_to(root).as_posix() for m in modules)
