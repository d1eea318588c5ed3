"""The project's layers and the import arrows that run up them, from the sources (``mergecal.pipeline.imports``:
nothing is imported). The arrows are the imports written in the code, at module level or in a function (not a
registry's imports by name, nor a package's ``__init__`` run before its modules). A module sits on the layer of its
longest matching prefix in ``LAYERS``; an arrow runs up when a module imports one on a higher layer; a circle is a
set of modules that import each other.

    python -m scripts.layers          # modules per layer, every arrow that runs up, every circle; exit 1 if any
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import ast

from mergecal.pipeline.imports import PROJECT_PACKAGES, _resolve, imported_names, module_files

#: bottom to top: what a layer's modules may import is on its own layer or below
LAYERS = (
    ("foundation", ("mergecal.errors", "mergecal.config_types", "mergecal.offline", "mergecal.regimes",
                    "mergecal.magnitude", "mergecal.linalg", "mergecal.plugins", "mergecal.device", "mergecal.ui",
                    "mergecal.hub_cache", "mergecal.outputs", "mergecal.checkpoint", "mergecal.intervals",
                    "mergecal.confidence", "mergecal.published", "mergecal.presets", "mergecal.task_vectors",
                    "mergecal.experiments")),
    ("models", ("mergecal.backbones", "mergecal.data", "mergecal.train", "mergecal.evaluation",
                "mergecal.architecture_specs", "mergecal.feature_hooks", "mergecal.keys")),
    ("library", ("mergecal.methods", "mergecal.calibrations", "mergecal.recipe", "mergecal.merge",
                 "mergecal.merge_causal_lm", "mergecal.run_recipe", "mergecal.perf", "mergecal.analysis",
                 "mergecal.adapters", "mergecal.adamerging", "mergecal.cost")),
    ("pipeline", ("mergecal.pipeline",)),
    ("reports", ("mergecal.reports",)),
    ("entry points", ("mergecal.cli", "stages", "flows")),
)
PACKAGE_ROOT = "mergecal"  # ``mergecal/__init__.py``: the exports, loaded by name (PEP 562), any layer


def layer_of(module: str) -> int | None:
    best = None
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and (best is None or len(prefix) > best[1]):
                best = (index, len(prefix))
    return None if best is None else best[0]


def circles(graph) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    sys.setrecursionlimit(10000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def written_imports(root: Path) -> dict[str, set[str]]:
    """Module -> the project's modules its code imports (see the module docstring)."""
    files = module_files(root, PROJECT_PACKAGES)
    graph = {}
    for module, path in files.items():
        names = imported_names(ast.parse(path.read_bytes()), module, path.name == "__init__.py")
        graph[module] = {t for t in (_resolve(n, files) for n in names) if t is not None and t != module}
    return graph


def measure(root: Path) -> dict:
    graph = written_imports(root)
    modules = sorted(m for m in graph if m != PACKAGE_ROOT)
    unplaced = [m for m in modules if layer_of(m) is None]
    up = sorted((m, t) for m in modules for t in graph[m] if t != PACKAGE_ROOT and layer_of(m) is not None
                and layer_of(t) is not None and layer_of(t) > layer_of(m))
    per_layer = {name: sum(layer_of(m) == i for m in modules) for i, (name, _) in enumerate(LAYERS)}
    return {"modules": len(modules), "arrows": sum(len(graph[m]) for m in modules), "per_layer": per_layer,
            "unplaced": unplaced, "up": up, "circles": circles(graph)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.layers", description=__doc__.split("\n\n")[0])
    parser.add_argument("--root", type=Path, default=Path("."), help="the checkout (default: .)")
    found = measure(parser.parse_args(argv).root)
    print(f"{found['modules']} modules, {found['arrows']} arrows; per layer (bottom up): "
          + ", ".join(f"{name} {n}" for name, n in found["per_layer"].items()))
    for module in found["unplaced"]:
        print(f"not on a layer: {module}")
    for module, target in found["up"]:
        print(f"runs up: {module} -> {target}")
    for circle in found["circles"]:
        print(f"circle: {' -> '.join(circle)}")
    print(f"{len(found['up'])} arrow(s) run up, {len(found['circles'])} circle(s)")
    return 1 if found["up"] or found["circles"] or found["unplaced"] else 0


if __name__ == "__main__":
    sys.exit(main())
