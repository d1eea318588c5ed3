"""The project's import graph (mergecal.pipeline.imports) and dvc.yaml's code deps drawn from it
(scripts/stage_deps.py): each stage depends on exactly the modules its command imports."""

import ast
import re
from pathlib import Path

import pytest

from mergecal.pipeline import imports, track_registry
from scripts import layers, stage_deps

REPO = Path(__file__).resolve().parents[1]


def test_dvc_yaml_code_deps_equal_each_stages_import_closure():
    """Fails when an import was added or removed without `python -m scripts.stage_deps --write`: the message names
    the stage and the modules missing from (or extra in) its deps."""
    stages = stage_deps.load_stages((REPO / "dvc.yaml").read_text())
    expected = stage_deps.expected_code_deps(stages, REPO)
    assert {"benchmark", "text_finetune", "llm_finetune", "report"} <= expected.keys()  # foreach stages included
    found = stage_deps.drift(stages, expected)
    assert not found, "\n".join(stage_deps.describe(found) + ["run: python -m scripts.stage_deps --write"])


def test_dvc_lock_holds_an_entry_for_each_stage_and_no_other():
    """DVC does not prune a lock entry when a stage (or a foreach item) leaves dvc.yaml; 30 such entries had
    accumulated by 2026-12-02. The stages as DVC itself expands them (``Repo.index``) are the lock's, one to one."""
    import yaml
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        stages = {stage.addressing for stage in repo.index.stages}
    # each pipeline file has its lock beside it: papers/dvc.yaml's stages are named papers/dvc.yaml:<stage>
    locked = set(yaml.safe_load((REPO / "dvc.lock").read_text())["stages"]) | {
        f"papers/dvc.yaml:{name}" for name in yaml.safe_load((REPO / "papers" / "dvc.lock").read_text())["stages"]}
    assert "finetune@0" in stages and "text_finetune@0-bbc_topics" in stages  # foreach and matrix items
    assert not locked - stages, f"dvc.lock entries of stages dvc.yaml no longer has: {sorted(locked - stages)}"
    assert not stages - locked, f"stages dvc.lock has no entry for (run them once): {sorted(stages - locked)}"


def test_no_stage_of_the_papers_profile_is_upstream_of_the_default_run():
    """`make run` (`dvc repro`) must never run papers/dvc.yaml's stages: a profile output inside a path a default
    stage depends on (`models/<backbone>/seeds`, which the benchmark reads whole) would make its stage upstream."""
    import networkx as nx
    from dvc.repo import Repo

    with Repo(str(REPO)) as repo:
        graph = repo.index.graph
        default = [s for s in graph if not s.addressing.startswith("papers/")]
        upstream = {u.addressing for s in default for u in nx.descendants(graph, s)}
    profile = sorted(a for a in upstream if a.startswith("papers/"))
    assert "finetune@0" in upstream and not profile, f"the default run would run {profile}"


def test_every_run_time_import_of_the_project_is_in_lazy_imports():
    """A module that imports by a computed name hides its deps from `ast`: LAZY_IMPORTS must say where the names
    are, and each of its rules must still find modules."""
    files = imports.module_files(REPO, imports.PROJECT_PACKAGES)
    callers = {module for module, path in files.items() for node in ast.walk(ast.parse(path.read_bytes()))
               if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
               in ("import_module", "__import__")}
    assert callers == set(imports.LAZY_IMPORTS)
    for module, rule in imports.LAZY_IMPORTS.items():
        found = imports.lazy_targets(REPO, module, files[module].read_bytes()) if rule[0] != "exports" else {
            f"{rule[2]}.{m}" for m in ast.literal_eval(next(
                node.value for node in ast.parse(files[module].read_bytes()).body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == rule[1] for t in node.targets))).values()}
        assert found and found <= files.keys(), (module, found)


def test_benchmark_stage_reruns_when_any_built_in_track_is_switched_on_or_off():
    """`<track>.enabled` decides which cells the benchmark stage runs: each built-in track's switch is among
    its params deps (vision's was missing, so turning the vision track off left DVC's benchmark up to date)."""
    from mergecal.pipeline.config import Params

    sections = [name for name, field in Params.model_fields.items()
                if "enabled" in getattr(field.annotation, "model_fields", {})]
    assert sections == track_registry.BUILT
    params = stage_deps.load_stages((REPO / "dvc.yaml").read_text())["benchmark"]["params"]
    missing = [f"{name}.enabled" for name in sections if f"{name}.enabled" not in params and name not in params]
    assert not missing, f"dvc.yaml: benchmark's params lack {missing}"


def write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


PROJECT = {
    "mergecal/__init__.py": '"""The package."""\n',
    "mergecal/core.py": "import os\n\n\ndef run():\n    from . import helper  # inside a function: still a dep\n",
    "mergecal/helper.py": "from .sub.leaf import X\n",
    "mergecal/sub/__init__.py": "from .leaf import X\n",
    "mergecal/sub/leaf.py": "X = 1\n",
    "mergecal/typed.py": "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from . import unused\n",
    "mergecal/unused.py": "",
    "stages/__init__.py": "",  # empty: no stage's dep (DVC would warn that it is empty)
    "stages/one.py": "from mergecal import core\n",
    "stages/two.py": "import mergecal.typed\n",
}

DVC_YAML = """\
# the pipeline (this comment stays)
stages:
  one:  # first stage
    cmd: python -m stages.one
    deps:
      - stages/one.py
      - data/raw  # its data
      - mergecal/unused.py
    params:
      - seed
    outs:
      - out/one
  two:
    foreach: [a, b]
    do:
      cmd: python -m stages.two --task ${item}
      deps:
        - data/${item}
      outs:
        - out/${item}.json:
            cache: false
  other:  # runs no project module: left alone
    cmd: echo hi
    deps:
      - mergecal/unused.py
"""

REWRITTEN = """\
# the pipeline (this comment stays)
stages:
  one:  # first stage
    cmd: python -m stages.one
    deps:
      - mergecal/__init__.py
      - mergecal/core.py
      - mergecal/helper.py
      - mergecal/sub/__init__.py
      - mergecal/sub/leaf.py
      - stages/one.py
      - data/raw  # its data
    params:
      - seed
    outs:
      - out/one
  two:
    foreach: [a, b]
    do:
      cmd: python -m stages.two --task ${item}
      deps:
        - mergecal/__init__.py
        - mergecal/typed.py
        - stages/two.py
        - data/${item}
      outs:
        - out/${item}.json:
            cache: false
  other:  # runs no project module: left alone
    cmd: echo hi
    deps:
      - mergecal/unused.py
"""


def test_check_names_the_stage_and_the_drifted_modules_and_write_fixes_only_the_deps(tmp_path, capsys):
    write(tmp_path, {**PROJECT, "dvc.yaml": DVC_YAML})
    assert stage_deps.main(["--check", "--root", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        "dvc.yaml: stage 'one': missing mergecal/__init__.py, mergecal/core.py, mergecal/helper.py, "
        "mergecal/sub/__init__.py, mergecal/sub/leaf.py; extra mergecal/unused.py",
        "dvc.yaml: stage 'two': missing mergecal/__init__.py, mergecal/typed.py, stages/two.py"]
    assert stage_deps.main(["--write", "--root", str(tmp_path)]) == 0
    assert (tmp_path / "dvc.yaml").read_text() == REWRITTEN
    assert stage_deps.main(["--check", "--root", str(tmp_path)]) == 0
    assert stage_deps.main(["--write", "--root", str(tmp_path)]) == 0  # nothing left to do
    assert capsys.readouterr().out.endswith("code deps of 0 stage(s) rewritten\n")
    assert (tmp_path / "dvc.yaml").read_text() == REWRITTEN


def test_import_closure_enters_a_plugin_only_when_named_or_used_by_a_plugin():
    graph = {"cells": frozenset({"registry", "core"}), "core": frozenset(),
             "registry": frozenset({"ties", "dare", "ta"}), "ties": frozenset({"core"}),
             "dare": frozenset({"ties"}), "ta": frozenset({"linalg"}), "linalg": frozenset()}
    plugins = [frozenset({"ties", "dare", "ta"})]
    assert imports.import_closure(graph, {"cells"}, plugins) == {"cells", "registry", "core"}
    assert imports.import_closure(graph, {"cells", "ta"}, plugins) == {"cells", "registry", "core", "ta", "linalg"}
    assert imports.import_closure(graph, {"cells", "dare"}, plugins) == {"cells", "registry", "core", "dare", "ties"}
    assert imports.import_closure(graph, {"cells"}) == graph.keys()  # no plug-ins: the whole closure


def test_a_stage_does_not_depend_on_what_a_registry_or_the_params_validation_imports():
    """A registry imports every member (so that names resolve) and config.py imports method and calibration
    parameter classes (to validate params.yaml): neither computes a stage's output, so neither is a dep of the
    stage, while a member the stage's code imports directly is, and the benchmark stage depends on every member."""
    graph = {"stages.fit": frozenset({"mergecal.pipeline.config", "mergecal.pipeline.vision"}),
             "mergecal.pipeline.config": frozenset({"mergecal.methods", "mergecal.calibrations.distac",
                                                    "mergecal.recipe", "mergecal.train"}),
             "mergecal.pipeline.vision": frozenset({"mergecal.calibrations.distac"}),
             "mergecal.methods": frozenset({"mergecal.methods.base", "mergecal.methods.ties"}),
             "mergecal.methods.base": frozenset(), "mergecal.methods.ties": frozenset({"mergecal.linalg"}),
             "mergecal.calibrations.distac": frozenset({"mergecal.calibrations.registry"}),
             "mergecal.calibrations.registry": frozenset({"mergecal.calibrations.svc",
                                                          "mergecal.calibrations.distac"}),
             "mergecal.calibrations.svc": frozenset(), "mergecal.recipe": frozenset({"mergecal.calibrations.svc"}),
             "mergecal.linalg": frozenset(), "mergecal.train": frozenset()}
    assert imports.stage_closure(graph, "stages.fit") == {
        "stages.fit", "mergecal.pipeline.config", "mergecal.pipeline.vision", "mergecal.train",
        "mergecal.calibrations.distac", "mergecal.calibrations.registry"}
    assert {"mergecal.methods.ties", "mergecal.linalg", "mergecal.calibrations.svc"} <= \
        imports.stage_closure(graph, "stages.fit", runs_every_member=True)


def test_editing_a_merge_method_reruns_the_benchmark_stage_only():
    """The measured aim of the cost-of-change issue: a lab that edits methods/ties.py waits for the benchmark stage
    (whose cell ids then recompute the TIES and DARE cells only), the testbed's and the stability stage's TA merges
    follow methods/task_arithmetic.py, and no training stage reruns for either."""
    stages = stage_deps.load_stages((REPO / "dvc.yaml").read_text())
    expected = stage_deps.expected_code_deps(stages, REPO)
    assert [s for s, deps in expected.items() if "mergecal/methods/ties.py" in deps] == ["benchmark"]
    assert sorted(s for s, deps in expected.items() if "mergecal/methods/task_arithmetic.py" in deps) == \
        ["benchmark", "stability", "testbed"]
    for training in ("pretrain", "finetune", "llm_pretrain", "llm_finetune", "text_finetune"):
        assert not [d for d in expected[training] if d.startswith(("mergecal/methods/", "mergecal/calibrations/svc",
                                                                    "mergecal/calibrations/wsc"))
                    and not d.endswith(("__init__.py", "base.py"))], training


def test_a_report_edit_reruns_the_report_stage_only_and_a_cell_edit_no_stage_that_trains():
    """#43: the leaderboard's, the plots' and the report writer's code are deps of the report stage alone (the
    stability stage reads only the intervals and its own section); the cells' code and the CLIP family's shared
    session are deps of the benchmark stage, not of a stage that trains, conditions or probes a model (#41)."""
    stages = stage_deps.load_stages((REPO / "dvc.yaml").read_text())
    expected = stage_deps.expected_code_deps(stages, REPO)
    for module in ("leaderboard", "plots", "write", "history", "seeds"):
        assert [s for s, deps in expected.items() if f"mergecal/reports/{module}.py" in deps] == ["report"], module
    assert "mergecal/intervals.py" in expected["stability"]
    # the published tables and the presets' `published:` and `pool:` are data the report reads, and the matrix too
    # (a preset's track runs the protocols its own pool's rows need: #56): a transcription fix reruns those three
    # stages (the benchmark's cells are found in the cell cache), and no stage that trains (the presets' tracks
    # reach the cells through the params, hashed by local_inputs)
    for data in ("mergecal/published/svc.yaml", "mergecal/published/magic.yaml",
                 "mergecal/published/fusionbench.yaml", "mergecal/presets/fusionbench-clip-vit-b32-ta8.yaml",
                 "mergecal/presets/wizardmath-llama-2-chat-7b.yaml"):
        assert sorted(s for s, deps in expected.items() if data in deps) == ["benchmark", "report", "stability"], data
    for module in ("mergecal/pipeline/cells.py", "mergecal/pipeline/tracks/clip/session.py"):
        users = {s for s, deps in expected.items() if module in deps}
        assert "benchmark" in users and not users & {"pretrain", "finetune", "distac", "probe", "local_distac",
                                                     "local_sensitivity", "llm_finetune", "text_finetune"}, module


# ----------------------------------------------------------------------------------------------- bad input

def one_line_error(capsys) -> str:
    captured = capsys.readouterr()
    assert captured.err.count("stage_deps: error: ") == 1 and captured.err.count("\n") == 1, captured.err
    return captured.err.strip()


@pytest.mark.parametrize("files, message", [
    ({}, r"dvc.yaml: cannot read \(No such file or directory\)"),
    ({"dvc.yaml": "stages: [unclosed\n"}, r"dvc.yaml: expected a YAML mapping with `stages:` \(.*\)"),
    ({"dvc.yaml": DVC_YAML.replace("stages.one", "stages.gone")},
     r"dvc.yaml: stage 'one': its cmd runs 'stages.gone', not a module of the project's sources"),
    ({"dvc.yaml": DVC_YAML, "mergecal/helper.py": "def broken(:\n"}, r"mergecal/helper.py:1: not valid Python"),
    ({"dvc.yaml": DVC_YAML.replace("    deps:\n      - stages/one.py\n      - data/raw  # its data\n"
                                   "      - mergecal/unused.py\n", "    deps: [stages/one.py, data/raw]\n")},
     r"dvc.yaml: its layout is not the one this tool rewrites .*; nothing written"),
])
def test_bad_input_is_one_line_and_leaves_dvc_yaml_as_it_was(tmp_path, capsys, files, message):
    write(tmp_path, {**PROJECT, **files})
    assert stage_deps.main(["--write", "--root", str(tmp_path)]) == 2
    assert re.search(message, one_line_error(capsys))
    if "dvc.yaml" in files:
        assert (tmp_path / "dvc.yaml").read_text() == files["dvc.yaml"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # no temporary file left


def _static_graph() -> dict[str, set[str]]:
    """Module -> the mergecal modules its import statements name (at module level, inside a function or for
    annotations only); the registries' look-ups by name and a module's parent packages left out."""
    files = imports.module_files(REPO, ("mergecal",))

    def module_of(name):
        while name and name not in files:
            name = name.rpartition(".")[0]
        return name

    graph = {}
    for module, path in files.items():
        names = imports.imported_names(ast.parse(path.read_bytes()), module, path.name == "__init__.py",
                                       annotations=True)
        graph[module] = {t for t in map(module_of, names) if t and t != module and not module.startswith(t + ".")}
    return graph


def test_the_library_has_no_import_cycle():
    """#33: no two modules import each other, directly or not, at module level or inside a function (merge.py and
    recipe.py, config.py and vision.py, local_clip.py and local_llm.py did); #41: nor for annotations only (cells,
    config and the tracks' registry did)."""
    assert layers.circles(_static_graph()) == []


#: mergecal modules a pipeline module may import inside a function: they import open_clip (seconds), needed only
#: where a CLIP is used; and the params validation, which builds library objects only to check a section
LAZY_FOR_START_UP = ("mergecal.backbones.open_clip_vit", "mergecal.evaluation.zeroshot")


def test_pipeline_modules_import_the_library_at_module_level():
    """#33: an import of a mergecal module inside a function hid a cycle; only the start-up ones above remain."""
    inside = []
    for module, path in imports.module_files(REPO, ("mergecal",)).items():
        if not module.startswith("mergecal.pipeline.") or module == "mergecal.pipeline.config" \
                or imports.is_track_section(module):  # the params validation (a track's section is part of it)
            continue
        tree = ast.parse(path.read_bytes())
        for function in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]:
            for node in ast.walk(function):
                if isinstance(node, ast.ImportFrom) and node.level:
                    names = imports.imported_names(ast.Module(body=[node], type_ignores=[]), module,
                                                   path.name == "__init__.py")
                    target = min(names, key=len)
                    if target not in LAZY_FOR_START_UP:
                        inside.append(f"{module}.{function.name}: {ast.unparse(node)}")
    assert inside == []


def test_the_tracks_params_of_dvc_yaml_are_written_from_the_track_registry():
    """#57: the params lists that name tracks (local_inputs, local_tracks, benchmark, stability) follow the
    registry: a list missing a track is found by --check and restored by --write, every other line as it was."""
    text = (REPO / "dvc.yaml").read_text()
    tracks = frozenset(track_registry.MODULES)
    expected = stage_deps.expected_track_params(REPO)
    # in the registry's order (a built track named after the lab's sources, seq2seq, comes after them)
    assert expected["benchmark"] == [n if n in track_registry.LAB_FILES else f"{n}.enabled"
                                     for n in track_registry.MODULES]
    assert expected["stability"] == list(track_registry.DIAGNOSTICS)
    assert not stage_deps.params_drift(stage_deps.load_stages(text), expected, tracks)
    start = text.index("\n  benchmark:\n")
    cut = text.index("      - local_clip\n", start)
    broken = text[:cut] + text[cut + len("      - local_clip\n"):]
    stages = stage_deps.load_stages(broken)
    assert stage_deps.params_drift(stages, expected, tracks) == {"benchmark": (["local_clip"], [])}
    code = stage_deps.expected_code_deps(stages, REPO)
    assert stage_deps.rewrite_deps(broken, code, expected, tracks) == text


def test_write_keeps_params_that_name_a_track_in_part_and_the_comments_of_lists_that_did_not_drift():
    """#57 review: only `<track>` and `<track>.enabled` are the registry's to write; `llm.evaluation` in the benchmark's
    params is the stage's own (kept, never called extra), and a params list that did not drift keeps its comments."""
    text = (REPO / "dvc.yaml").read_text()
    tracks = frozenset(track_registry.MODULES)
    start = text.index("\n  benchmark:\n")
    at = text.index("      - local_clip\n", start)
    edited = text[:at] + "      - local_clip  # a lab's CLIP tracks\n      - llm.evaluation\n" + \
        text[at + len("      - local_clip\n"):]
    stages = stage_deps.load_stages(edited)
    expected = stage_deps.expected_track_params(REPO)
    assert not stage_deps.params_drift(stages, expected, tracks)
    cut = edited.index("      - local_llm\n", edited.index("\n  local_inputs:"))
    broken = edited[:cut] + edited[cut + len("      - local_llm\n"):]
    found = stage_deps.params_drift(stage_deps.load_stages(broken), expected, tracks)
    assert found == {"local_inputs": (["local_llm"], [])}
    code = stage_deps.expected_code_deps(stages, REPO)
    fixed = stage_deps.rewrite_deps(broken, code, {s: expected[s] for s in found}, tracks)
    assert fixed == edited  # the benchmark's comment and its llm.evaluation as they were


def test_a_stage_that_runs_lab_files_depends_on_every_files_source_it_reaches_through_the_registry():
    """#57: `lab_files` reaches each family's `files` source by name (the registry's LAB_FILES); a stage whose closure
    holds it depends on their stages modules, and a stage that does not, on none of them."""
    expected = stage_deps.expected_code_deps(stage_deps.load_stages((REPO / "dvc.yaml").read_text()), REPO)
    sources = [f"mergecal/pipeline/tracks/{m.replace('.', '/')}.py" for m in track_registry.LAB_FILES.values()]
    for stage in ("local_inputs", "local_tracks"):
        assert set(sources) <= set(expected[stage]), stage
    assert not set(sources) & set(expected["text_finetune"])
