"""Write ``mergecal/data/real_vision_metadata_tall.py`` from FusionBench 0.2.33's class names and templates.

The twelve tasks the TALL-mask paper (Wang et al., "Localizing Task Information for Improved Model Merging and
Compression", arXiv:2405.07813) adds to the standard eight, as FusionBench's 14- and 20-task CLIP pools evaluate
them. Copied programmatically, never retyped: each of FusionBench's ``fusion_bench/tasks/clip_classification/<m>.py``
is executed on its own (they are plain lists of names and of ``lambda c: f"..."`` templates), every template is
turned into a ``str.format`` string by calling it with ``"{}"``, and checked to give FusionBench's text for a probe
class name. Where PyPI is reachable:

    pip download fusion-bench==0.2.33 --no-deps -d /tmp/fb && unzip -q /tmp/fb/fusion_bench-0.2.33-*.whl -d /tmp/fb/src
    python scripts/copy_fusionbench_metadata.py /tmp/fb/src
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

# mergecal's name -> (FusionBench's module, the variable holding its class names), in FusionBench's TALL20 order
TALL_EXTRA = {
    "Flowers102": ("flower102", "classnames"),
    "PCAM": ("pcam", "classnames"),
    "FER2013": ("fer2013", "classnames"),
    "OxfordIIITPet": ("oxford_iiit_pet", "classnames"),
    "STL10": ("stl10", "classnames"),
    "CIFAR100": ("cifar100", "fine_label"),  # FusionBench's CLIPTemplateFactory: {"classnames": "fine_label"}
    "CIFAR10": ("cifar10", "classnames"),
    "Food101": ("food101", "classnames"),
    "FashionMNIST": ("fashion_mnist", "classnames"),
    "EMNIST": ("emnist_letters", "classnames"),
    "KMNIST": ("kmnist", "classnames"),
    "RenderedSST2": ("rendered_sst2", "classnames"),
}
PROBE = "probe class"
OUT = Path(__file__).resolve().parents[1] / "mergecal" / "data" / "real_vision_metadata_tall.py"


def read_module(path: Path) -> dict:
    namespace: dict = {}
    exec(compile(path.read_text(), str(path), "exec"), namespace)  # FusionBench's own data files, read once here
    return namespace


def format_string(template, where: str) -> str:
    text = template("{}")
    if text.count("{") != 1 or text.count("}") != 1 or text.format(PROBE) != template(PROBE):
        raise SystemExit(f"error: {where}: template {text!r} is not a plain one-placeholder format string")
    return text


def tuple_literal(name: str, values: list[str] | tuple[str, ...]) -> str:
    """``name = (...)`` with the items' reprs packed into lines of at most 116 characters (never split)."""
    lines, line = [], "   "
    for item in (repr(v) + "," for v in values):
        if len(line) + 1 + len(item) > 116:
            lines.append(line)
            line = "   "
        line += " " + item
    return f"{name} = (\n" + "\n".join([*lines, line]) + "\n)\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="the folder holding FusionBench's fusion_bench/ package")
    parser.add_argument("--out", type=Path, default=OUT)
    args = parser.parse_args(argv)
    folder = args.source / "fusion_bench" / "tasks" / "clip_classification"
    if not folder.is_dir():
        print(f"error: {folder}: not found (unpack FusionBench 0.2.33's wheel there)", file=sys.stderr)
        return 2
    parts = ['"""The TALL-mask tasks\' class names and templates: generated, do not edit.\n\n'
             "Class names (in the datasets' label order) and zero-shot templates of the twelve tasks the TALL-mask\n"
             "paper (arXiv:2405.07813) adds to the standard eight, as FusionBench 0.2.33 (PyPI wheel fusion_bench)\n"
             "evaluates them: fusion_bench/tasks/clip_classification/<module>.py, copied by\n"
             "scripts/copy_fusionbench_metadata.py (templates as str.format strings with one {}).\n"
             '"""\n\nfrom __future__ import annotations\n\n'
             + tuple_literal("TALL_TASKS: tuple[str, ...]", tuple(TALL_EXTRA))]
    names = {}
    for task, (module, variable) in TALL_EXTRA.items():
        data = read_module(folder / f"{module}.py")
        classnames = [str(c) for c in data[variable]]
        templates = [format_string(t, f"{module}.py") for t in data["templates"]]
        names[task] = (classnames, templates)
        prefix = f"_{task.upper()}"
        parts.append(f"\n# {module}.py ({variable}: {len(classnames)} classes; {len(templates)} templates)\n")
        parts.append(tuple_literal(f"{prefix}_CLASSNAMES", classnames))
        parts.append(tuple_literal(f"{prefix}_TEMPLATES", templates))
    parts.append("\nCLASSNAMES: dict[str, tuple[str, ...]] = {\n"
                 + "".join(f"    {t!r}: _{t.upper()}_CLASSNAMES,\n" for t in TALL_EXTRA) + "}\n")
    parts.append("TEMPLATES: dict[str, tuple[str, ...]] = {\n"
                 + "".join(f"    {t!r}: _{t.upper()}_TEMPLATES,\n" for t in TALL_EXTRA) + "}\n")
    args.out.write_text("".join(parts))
    for task, (classnames, templates) in names.items():
        print(f"{task}: {len(classnames)} classes, {len(templates)} templates")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
