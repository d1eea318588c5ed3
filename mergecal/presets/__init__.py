"""Presets: published model pools as data, expanded into a lab track's settings.

A ``local_clip`` (or ``local_llm``) track may say ``preset: <name>``: the preset's ``track:`` values (the pretrained
model, the fine-tuned checkpoints and the datasets, as hub ids read from the local Hugging Face cache,
``mergecal.hub_cache``) are its defaults, and the track's own keys win (a mapping such as ``finetuned`` key by
key). ``preset_tasks: [MNIST, EuroSAT]`` keeps those tasks only (a smaller run of the same pool). A preset is a
YAML file: one shipped in this folder, named without ``.yaml`` (``PRESETS``), or a lab's own, named by its path
(``*.yaml``; relative to the directory the command runs in, the repository root for the stages). Its top level:
``family`` (the params section it belongs to), ``description``, ``source`` (where its ids come from), ``track``,
and optionally ``published`` (a list of ``{source, backbone, task_set}``: the papers' tables of
``mergecal.published`` it reproduces, shown beside the leaderboard), ``pool`` (the checkpoints it names, as those
tables name theirs: only a table of the same pool gets an inside/outside verdict) and ``roots``
(``{name: what it is}``): a pool
that is not on the hub (task_vectors' checkpoints) names its files under folders only the lab knows, as
``{name}/...`` in its track values, and the track gives each folder as ``preset_roots: {name: path}``.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from ..config_types import ConfigValueError

FOLDER = Path(__file__).resolve().parent
PRESETS = tuple(sorted(p.stem for p in FOLDER.glob("*.yaml")))
# the keys of a track whose values are {task: ...} mappings: ``preset_tasks`` selects in them, overrides merge
TASK_KEYS = {"local_clip": ("finetuned", "datasets", "class_names", "templates"), "local_llm": ("experts", "tasks")}


def preset_path(name: str) -> Path:
    if name.endswith((".yaml", ".yml")):
        path = Path(name).expanduser()
        if not path.is_file():
            raise ConfigValueError("preset", f"{name}: no such preset file")
        return path
    if name not in PRESETS:
        raise ConfigValueError("preset", f"{name!r}: not a preset (shipped: {', '.join(PRESETS)}; or a path to a "
                                         "preset's .yaml file)")
    return FOLDER / f"{name}.yaml"


def load_preset(name: str, family: str) -> dict[str, Any]:
    """The preset's whole YAML (``track``, ``roots``, ...); one ConfigValueError (key ``preset``) for an unknown,
    unreadable or misplaced preset."""
    path = preset_path(name)
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as err:
        raise ConfigValueError("preset", f"{path}: not a readable YAML file ({str(err).splitlines()[0]})") from None
    if not isinstance(data, dict) or not isinstance(data.get("track"), dict):
        raise ConfigValueError("preset", f"{path}: expected a mapping with a 'track' mapping")
    if data.get("family") != family:
        raise ConfigValueError("preset", f"{name!r} is a preset for {data.get('family')!r} tracks, not {family!r}")
    if not isinstance(data.get("roots", {}), dict):
        raise ConfigValueError("preset", f"{path}: expected 'roots' to map each folder's name to what it holds")
    return data


def fill_roots(value: Any, roots: dict[str, str]) -> Any:
    """``value`` with every ``{name}`` of a root in ``roots`` replaced by its path, in strings at any depth
    (other braces, such as a template's ``{}``, are left as they are)."""
    if isinstance(value, str):
        return re.sub(r"\{([A-Za-z_][A-Za-z0-9_]*)\}", lambda m: roots.get(m.group(1), m.group(0)), value)
    if isinstance(value, dict):
        return {k: fill_roots(v, roots) for k, v in value.items()}
    if isinstance(value, list):
        return [fill_roots(v, roots) for v in value]
    return value


def _roots(name: str, declared: dict[str, str], given: Any) -> dict[str, str]:
    """The track's ``preset_roots``, checked against the folders the preset declares."""
    if given is None:
        given = {}
    if not isinstance(given, dict) or not all(isinstance(v, str) and v for v in given.values()):
        raise ConfigValueError("preset_roots", f"expected {{name: folder}}, got {given!r}")
    unknown = [r for r in given if r not in declared]
    if unknown:
        known = ", ".join(declared) or "none"
        raise ConfigValueError(f"preset_roots.{unknown[0]}", f"not a folder of preset {name!r} (it names: {known})")
    missing = [r for r in declared if r not in given]
    if missing:
        raise ConfigValueError(f"preset_roots.{missing[0]}", f"required by preset {name!r}: {declared[missing[0]]}")
    return {r: str(Path(v).expanduser()) for r, v in given.items()}


def published_of(name: str) -> list[dict]:
    """The published tables a preset reproduces (``published: [{source, backbone, task_set}, ...]``)."""
    data = yaml.safe_load(preset_path(name).read_text())
    return list(data.get("published") or []) if isinstance(data, dict) else []


def summary(name: str) -> dict[str, Any]:
    """What a shipped (or a lab's) preset holds, for ``mergecal presets``: its family, pool, task set and tasks,
    the published sources it is compared with, and its description."""
    data = yaml.safe_load(preset_path(name).read_text())
    track = data.get("track") or {}
    tasks = track.get(TASK_KEYS.get(data.get("family"), ("finetuned",))[0]) or {}
    return {"name": name, "family": data.get("family"), "pool": data.get("pool"), "task_set": track.get("task_set"),
            "tasks": list(tasks), "compared_with": [f"{p['source']} ({p['backbone']}, {p['task_set']})"
                                                    for p in data.get("published") or []],
            "description": data.get("description", "")}


def pool_of(name: str) -> str | None:
    """The pool of checkpoints a preset names (``pool:``, as the published tables name theirs); None without one."""
    data = yaml.safe_load(preset_path(name).read_text())
    pool = data.get("pool") if isinstance(data, dict) else None
    return str(pool) if pool else None


def expand(values: Any, family: str) -> Any:
    """A track's settings with its ``preset`` (and ``preset_tasks``, ``preset_roots``) expanded; anything else as
    it is."""
    if not isinstance(values, dict) or "preset" not in values:
        for key in ("preset_tasks", "preset_roots"):
            if isinstance(values, dict) and key in values:
                raise ConfigValueError(key, "only with a preset")
        return values
    own = dict(values)
    name = own.pop("preset")
    if not isinstance(name, str):
        raise ConfigValueError("preset", f"expected a preset's name or path, got {name!r}")
    preset = load_preset(name, family)
    roots = _roots(name, preset.get("roots") or {}, own.pop("preset_roots", None))
    merged = fill_roots(dict(preset["track"]), roots)
    for key, value in own.items():
        if key in TASK_KEYS[family] and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        elif key in ("model", "evaluation") and isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        elif key != "preset_tasks":
            merged[key] = value
    merged["preset"] = name  # kept on the track (not in its cell ids: the expanded values are)
    tasks = own.get("preset_tasks")
    if tasks is not None:
        first = TASK_KEYS[family][0]
        if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
            raise ConfigValueError("preset_tasks", f"expected a list of the preset's tasks, got {tasks!r}")
        unknown = [t for t in tasks if t not in merged.get(first, {})]
        if unknown:
            raise ConfigValueError("preset_tasks", f"{unknown[0]!r} is not a task of preset {name!r} "
                                                   f"({', '.join(merged.get(first, {}))})")
        for key in TASK_KEYS[family]:
            if isinstance(merged.get(key), dict):
                merged[key] = {t: v for t, v in merged[key].items() if t in tasks}
    return merged
