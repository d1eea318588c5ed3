"""How a registry finds its members: by reading its package's sources (``ast``; nothing is imported), so that a new
merge method, calibration or track is one file (or one package) and no list names it.

* a merge method or a calibration: a module of the registry's package that applies its decorator
  (``@register`` in ``mergecal.methods``, ``@register_calibration("name", ...)`` in ``mergecal.calibrations``);
* a track: a source package ``tracks/<family>/<source>/`` whose ``__init__.py`` sets ``TRACK = "<name>"``.

The same readers give the import graph its run-time edges (``mergecal.pipeline.imports``), so a cell's code
digest and each DVC stage's deps follow the registries without a list to keep in step.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path


def _decorator_name(node: ast.expr) -> tuple[str, str | None]:
    """(the decorator's name, its first positional argument if a string) of ``@name`` or ``@name("x", ...)``."""
    call = node if isinstance(node, ast.Call) else None
    func = call.func if call else node
    name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
    first = call.args[0] if call and call.args else None
    return name, first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


@lru_cache(maxsize=256)
def _applied(source: bytes, decorator: str) -> tuple[str | None, ...] | None:
    """The first argument of every ``@decorator`` a module's source applies (None for a bare one), or None when
    it applies none."""
    found = [arg for node in ast.walk(ast.parse(source))
             if isinstance(node, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
             for name, arg in map(_decorator_name, node.decorator_list) if name == decorator]
    return tuple(found) if found else None


def registering_modules(package_dir: Path, decorator: str) -> dict[str, tuple[str | None, ...]]:
    """Module name within the package -> what each ``@decorator`` in it names (see ``_applied``), for every
    module directly in ``package_dir`` that applies it, in module-name order."""
    out = {}
    for path in sorted(Path(package_dir).glob("*.py")):
        names = _applied(path.read_bytes(), decorator)
        if names is not None and path.stem != "__init__":
            out[path.stem] = names
    return out


def _constant(source: bytes, name: str) -> str | None:
    """The string a module's source assigns to ``name`` at module level, or None."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets) \
                and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            return node.value.value
    return None


def declaring_packages(package_dir: Path, constant: str) -> dict[str, str]:
    """Value of ``constant`` -> the dotted path (relative to ``package_dir``) of each package two levels down
    (``<family>/<source>/__init__.py``) that sets it, in path order; a value declared twice is refused."""
    out: dict[str, str] = {}
    for init in sorted(Path(package_dir).glob("*/*/__init__.py")):
        value = _constant(init.read_bytes(), constant)
        if value is None:
            continue
        where = ".".join(init.parent.relative_to(package_dir).parts)
        if value in out:
            raise ValueError(f"{init}: {constant} = {value!r} is declared by {out[value]} too")
        out[value] = where
    return out
