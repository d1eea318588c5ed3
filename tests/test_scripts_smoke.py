"""#41: every script under scripts/ is run by something (the Makefile, a stage, a test); this runs the one that
needs a GPU for its figures on the CPU, so that a library change that breaks it is seen here, not on a lent GPU.
The one-off measurements of evidence/scripts/ are not run (their figures are dated): each must still compile and
import what it names, and answer ``--help`` where it has a command line (evidence/README.md)."""

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # about 40 s: every method three times on a ViT-B/32 block
def test_check_cuda_merges_runs_every_method_cpu_against_cpu(capsys):
    """scripts/check_cuda_merges.py on one device: the two merges are the same computation, so every method's row
    and a difference of 0."""
    from mergecal.methods import MERGE_METHODS

    assert load("check_cuda_merges").main(["--blocks", "1", "--tasks", "2", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    rows = dict(re.findall(r"^\| (\w+) \| [\d.]+ \| [\d.]+ \| (\S+) \|$", out, flags=re.M))
    assert sorted(rows) == sorted(n for n, cls in MERGE_METHODS.items() if not cls.needs_data)
    assert all(float(diff) == 0.0 for diff in rows.values()), rows
    assert "largest difference (all but dare): 0.0e+00" in out


def test_every_script_is_run_by_something():
    """A script nothing runs breaks unseen: each is named by the Makefile, dvc.yaml, the library or a test."""
    runners = [ROOT / "Makefile", ROOT / "dvc.yaml", *ROOT.joinpath("tests").glob("*.py")]
    text = "\n".join(path.read_text() for path in runners)
    unrun = [p.name for p in sorted((ROOT / "scripts").glob("*.py")) if p.stem != "__init__"
             and not re.search(rf"scripts[/.\"', ]+{p.stem}\b", text)]
    assert unrun == []


@pytest.mark.slow  # about 5 min: the smoke profile's dvc repro, then two merges of smoke-size Llama checkpoints
def test_the_gpu_session_script_runs_every_step_on_the_cpu(tmp_path):
    """scripts/gpu_session.py, what a lent GPU runs (#43), on the CPU at smoke size: the smoke `dvc repro` logs every
    cell with the device asked for, and both recipes merge the Llama-shaped checkpoints with their figures."""
    import json

    out = tmp_path / "out"
    assert load("gpu_session").main(["--device", "cpu", "--size", "smoke", "--budget", "1500", "--out", str(out),
                                     "--work", str(tmp_path)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    smoke, merges = summary["steps"]["smoke_repro"], summary["steps"]["merges"]
    assert smoke["ok"] and smoke["rc"] == 0 and smoke["devices"] == ["cpu"] and smoke["cells"] > 50
    assert [r["recipe"] for r in merges["rows"]] == ["task_arithmetic>svc", "tsv_m"]
    assert all(r["seconds"] >= 0 and r["peak_mib"] >= 0 for r in merges["rows"])
    assert "task_arithmetic>svc" in (out / "summary.md").read_text()


def test_bench_intervals_runs_and_agrees_with_scipy(capsys, monkeypatch):
    """scripts/bench_intervals.py: both intervals on the same rows, their ends equal up to summation order."""
    monkeypatch.setattr("sys.argv", ["bench_intervals", "--rows", "3", "--tasks", "2", "--examples", "40"])
    load("bench_intervals").main()
    out = capsys.readouterr().out
    assert float(re.search(r"largest difference of ends (\S+)", out).group(1)) < 1e-12, out


def test_perf_mergekit_compares_outputs_and_matches_settings(tmp_path):
    """scripts/perf_mergekit.py's parts that need no MergeKit (CI has none; `make perf-mergekit` runs the whole):
    its tensor comparison on mergecal outputs and the MergeKit configurations it writes."""
    import subprocess
    import sys

    from mergecal.perf.llm_checkpoints import write_family

    script = load("perf_mergekit")
    base, experts = write_family(tmp_path / "family", "smoke", 2)
    outs = {}
    for name, scaling in (("a", "0.3"), ("b", "0.6")):
        outs[name] = tmp_path / name
        subprocess.run([sys.executable, "-m", "mergecal.cli", "merge", "--pretrained", str(base), "--finetuned",
                        *map(str, experts), "--method", "task_arithmetic", "--set", f"scaling={scaling}",
                        "--dtype", "bfloat16", "--out", str(outs[name]), "--weights-only"], check=True)
    same = script.compare(outs["a"], outs["a"], base, "task_arithmetic")
    assert same["max_rel_diff"] == 0 and same["equal_share"] == 1 and same["delta_l1_ratio"] == 1
    half = script.compare(outs["a"], outs["b"], base, "task_arithmetic")  # twice lambda: twice the delta
    assert half["delta_l1_ratio"] == pytest.approx(0.5, rel=0.02) and half["equal_share"] < 0.5
    config = script.mergekit_config("ties", base, experts)
    assert config["merge_method"] == "ties" and config["base_model"] == str(base)
    assert [m["parameters"] for m in config["models"]] == [{"weight": 1.0, "density": 0.2}] * 2


def test_perf_mergekit_names_the_ties_convention_of_every_differing_element(tmp_path):
    """ties_conventions: nothing differs between an output and itself; an element changed where no task ties its
    threshold and no vote is zero is counted as unexplained, not hidden under a convention."""
    from mergecal import merge_checkpoints
    from mergecal.checkpoint import load_state_dict, save_checkpoint
    from mergecal.perf.llm_checkpoints import write_family

    script = load("perf_mergekit")
    base, experts = write_family(tmp_path / "family", "smoke", 3)
    ours = merge_checkpoints(base, experts, "ties", tmp_path / "ours", top_k=script.TIES_TOP_K,
                             trim_scope="per_tensor", scaling=1.0)
    assert script.ties_conventions(ours, ours, base, experts, script.TIES_TOP_K)["differing"] == 0
    changed = load_state_dict(ours)
    key = "model.layers.0.mlp.up_proj.weight"
    moved = (changed[key].float() - load_state_dict(base)[key].float()).abs()
    changed[key] = changed[key].clone()
    changed[key].view(-1)[int(moved.argmax())] += 1.0  # the largest kept entry: above every threshold, vote not 0
    save_checkpoint(changed, tmp_path / "theirs")
    counts = script.ties_conventions(ours, tmp_path / "theirs", base, experts, script.TIES_TOP_K)
    assert counts == {"differing": 1, "tied_threshold": 0, "zero_vote": 0, "unexplained": 1}


def test_the_fusionbench_comparison_tokenizes_as_open_clip_and_needs_fusionbench_on_its_path(tmp_path, capsys,
                                                                                             monkeypatch):
    """scripts/compare_fusionbench_eval.py without FusionBench (never a dependency): the Hugging Face tokenizer it
    writes from open_clip's BPE gives open_clip's token ids (what makes the two evaluators' heads comparable), and
    its run is refused in one line naming what to put on PYTHONPATH."""
    import sys

    from open_clip.tokenizer import SimpleTokenizer

    script = load("compare_fusionbench_eval")
    script.write_tokenizer_files(tmp_path)
    tokenizer = script.build_processor(tmp_path).tokenizer
    simple = SimpleTokenizer()
    texts = ["a photo of a stanford cars' 2012 Tesla Model S.", "a centered satellite photo of annual crop land.",
             'a photo of the number: "7".', "a photo of a bumpy texture."]
    assert tokenizer(texts)["input_ids"] == [[49406, *simple.encode(t), 49407] for t in texts]
    monkeypatch.setitem(sys.modules, "fusion_bench", None)  # an import of it fails, as where it is not installed
    assert script.main(["--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == ("error: fusion_bench is not importable: put FusionBench 0.2.33's source on "
                                       "PYTHONPATH (see the docstring)\n")
    assert not (tmp_path / "out").exists()


def test_the_clip_evaluation_benchmark_prints_a_cost_per_image_and_per_model(capsys):
    """scripts/bench_clip_eval.py on the micro ViT: a positive time per image, split into resize and model, and
    the eight test sets' hours per model as that time times their 87,433 images."""
    import mergecal.backbones.open_clip_vit  # noqa: F401  (registers the micro architecture with open_clip)

    assert load("bench_clip_eval").main(["--arch", "mergecal-vit-micro", "--batch", "2", "--batches", "1",
                                         "--image-size", "40"]) == 0
    row = dict(re.findall(r"(\w+) ([^|]+?)(?: \||$)", capsys.readouterr().out.strip()))
    ms = float(row["ms_per_image"])
    assert ms > 0 and abs(ms - float(row["ms_per_image_resize"]) - float(row["ms_per_image_model"])) < 2e-3
    assert int(row["eight_test_sets_images"]) == 87433 and row["images"] == "2"
    assert abs(float(row["eight_test_sets_hours_per_model"]) - ms * 87433 / 3.6e6) < 0.01


def test_perf_svd_llama_covers_every_key_and_adds_the_model_up_from_its_classes(tmp_path, capsys):
    """scripts/perf_svd_llama.py at smoke size, with a streamed end-to-end merge: every 2-D key of the Llama layout is
    in one class; each method's whole-model seconds are its covered keys times the per-key seconds (SVC leaves the
    embedding and LM head alone, as its authors' key rule); the FLOP floors are mergecal.perf.merging's."""
    import json

    from mergecal.perf.llm_checkpoints import shapes
    from mergecal.perf.merging import flop_floor

    script = load("perf_svd_llama")
    out = tmp_path / "svd.md"
    assert script.main(["--size", "smoke", "--end-to-end", "task_arithmetic>svc", "--work", str(tmp_path),
                        "--output", str(out)]) == 0
    result = json.loads(out.with_suffix(".json").read_text())
    matrices = [s for s in shapes("smoke").values() if len(s) == 2]
    rows = result["rows"]
    assert sum(r["keys"] for r in rows if r["method"] == "svc") == len(matrices)
    embedding = [r for r in rows if r["class"] == "embedding / lm_head"]
    assert {r["method"]: r["covered"][r["method"]] for r in embedding} == {"svc": 0, "tsv_m": 2, "iso_cts": 2}
    for total in result["totals"]:
        mine = [r for r in rows if r["method"] == total["method"]]
        assert total["seconds"] == pytest.approx(sum(r["covered"][total["method"]] * r["seconds"] for r in mine))
        assert total["keys"] == sum(r["covered"][total["method"]] for r in mine)
    for r in rows:
        assert r["floor_flop"] == flop_floor(r["method"], tuple(r["shape"]), 2)
        assert r["exact_floor_seconds"] > r["floor_seconds"] > 0 and r["seconds"] > 0
        assert sum(r["parts"].values()) == pytest.approx(r["seconds"], rel=1e-6)
    (e2e,) = result["end_to_end"]
    assert e2e["recipe"] == "task_arithmetic>svc" and e2e["layers"] == 1 and e2e["seconds"] > 0
    assert "| svc | 14 |" in out.read_text()  # 2 layers x 7 matrices: the embedding and LM head left out
    assert not any(tmp_path.glob("mergecal-svd-*"))  # the family and the merge removed


def test_perf_svd_llama_compares_the_eigensolver_rules_and_below_its_size_they_are_one(tmp_path):
    """--compare-drivers: the default rule and dsyevr-only, alternated; at smoke size every Gram matrix is below
    ``EVD_FOR_MANY_PAIRS_FROM``, so both are the same computation, bit for bit, and the rule is put back after."""
    import json

    from mergecal import linalg

    out = tmp_path / "drivers.md"
    assert load("perf_svd_llama").main(["--size", "smoke", "--compare-drivers", "--methods", "tsv_m", "iso_cts",
                                        "--output", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert len(rows) == 2 * 5 and all(r["rel_diff"] == 0.0 for r in rows), rows
    assert linalg.EVD_FOR_MANY_PAIRS_FROM == 1024
    # SVC's merged responses likewise: below MERGED_RESPONSE_FROM (every smoke key) both rules are one computation
    from mergecal.calibrations import svc

    assert load("perf_svd_llama").main(["--size", "smoke", "--compare-svc-responses", "--methods", "svc",
                                        "--output", str(out)]) == 0
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert len(rows) == 5 and all(r["rel_diff"] == 0.0 and r["before"] == "product" for r in rows), rows
    assert svc.MERGED_RESPONSE_FROM == 1024 and "against the product" in out.read_text()
    script = load("perf_svd_llama")
    table = script.eigh_sizes_table([40, 64])
    assert [line.split(" | ")[0] for line in table.splitlines()[2:]] == ["| 40", "| 64"]
    assert all(len(line.split("|")) == 2 + 7 for line in table.splitlines()[2:])  # n, dsyevd, five shares


def test_copy_fusionbench_metadata_writes_the_committed_module_from_fusionbench_shaped_files(tmp_path, capsys):
    """scripts/copy_fusionbench_metadata.py on data files in FusionBench's own shape (plain lists and
    ``lambda c: f"..."`` templates, CIFAR-100's names under ``fine_label``), written here from the committed module:
    it writes that module back byte for byte, and refuses a template that is not a one-placeholder string."""
    from mergecal.data import real_vision_metadata_tall as tall

    script = load("copy_fusionbench_metadata")
    folder = tmp_path / "fusion_bench" / "tasks" / "clip_classification"
    folder.mkdir(parents=True)

    def write(module: str, variable: str, names, templates) -> None:
        lambdas = ",\n".join(f"    lambda c: f{t.replace('{}', '{c}')!r}" for t in templates)
        (folder / f"{module}.py").write_text(f"{variable} = {list(names)!r}\n\ntemplates = [\n{lambdas},\n]\n")

    for task, (module, variable) in script.TALL_EXTRA.items():
        write(module, variable, tall.CLASSNAMES[task], tall.TEMPLATES[task])
    out = tmp_path / "tall.py"
    assert script.main([str(tmp_path), "--out", str(out)]) == 0
    assert out.read_text() == (ROOT / "mergecal" / "data" / "real_vision_metadata_tall.py").read_text()
    assert "CIFAR100: 100 classes, 18 templates" in capsys.readouterr().out
    (folder / "pcam.py").write_text("classnames = ['a', 'b']\ntemplates = [lambda c: f'{c} or {c}']\n")
    with pytest.raises(SystemExit, match=r"pcam\.py: template '\{\} or \{\}' is not a plain one-placeholder"):
        script.main([str(tmp_path), "--out", str(out)])
    assert script.main([str(tmp_path / "missing"), "--out", str(out)]) == 2


EVIDENCE = ROOT / "evidence" / "scripts"


def evidence_imports(path: Path) -> list[tuple[str, str | None]]:
    """(module, imported name or None) of every absolute import in a script, at its top or inside a function."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.module, alias.name) for alias in node.names]
    return found


def missing_imports(path: Path) -> list[str]:
    """What a script imports that is not there: a project module or name (read with ast from the source tree, as
    the script's own ``sys.path`` would find it: evidence/ first, then the root), or a package not installed."""
    import importlib.util

    from test_doc_paths import resolve_dotted

    missing = []
    for module, name in evidence_imports(path):
        dotted = f"{module}.{name}" if name and name != "*" else module
        if module.split(".")[0] in ("mergecal", "scripts", "stages", "flows"):
            problems = [resolve_dotted(dotted, root) for root in (ROOT / "evidence", ROOT)]
            if all(problems):
                missing.append(f"{dotted}: {problems[-1]}")
        elif importlib.util.find_spec(module.split(".")[0]) is None:
            missing.append(f"{module}: not installed")
    return missing


def test_every_evidence_script_compiles_and_what_it_imports_exists(tmp_path):
    """A module moved or renamed breaks a kept measurement script even where its import sits in a function."""
    import py_compile

    scripts = sorted(EVIDENCE.glob("*.py"))
    assert len(scripts) >= 5
    for path in scripts:
        py_compile.compile(str(path), cfile=str(tmp_path / f"{path.stem}.pyc"), doraise=True)
    broken = {path.name: missing_imports(path) for path in scripts}
    assert not {name: what for name, what in broken.items() if what}, "delete it and name its last commit in " \
        "evidence/README.md (or mend it):\n" + "\n".join(f"{n}: {w}" for n, w in broken.items() if w)


def test_evidence_scripts_with_a_command_line_answer_help(tmp_path):
    """``--help`` of each evidence script that parses arguments, all at once in fresh processes: it runs the
    script's top-level imports (torch, lm-eval, the library) without doing its measurement."""
    import os
    import subprocess
    import sys

    scripts = [p for p in sorted(EVIDENCE.glob("*.py")) if "ArgumentParser(" in p.read_text()]
    assert len(scripts) >= 5
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}  # nothing written beside the scripts
    runs = {p.name: subprocess.Popen([sys.executable, str(p), "--help"], cwd=tmp_path, env=env, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT) for p in scripts}
    failed = {}
    for name, run in runs.items():
        out, _ = run.communicate(timeout=120)
        if run.returncode != 0 or "usage:" not in out:
            failed[name] = out[-2000:]
    assert not failed, "\n\n".join(f"{name}:\n{out}" for name, out in failed.items())


def test_a_script_importing_a_missing_module_or_name_is_named(tmp_path):
    """The import check on a script whose imports are gone: a module, a name in a module (inside a function)
    and an uninstalled package are each named; what exists is not."""
    script = tmp_path / "x.py"
    script.write_text("import os\nfrom mergecal.merge import merge_models\nfrom mergecal.no_such import f\n\n"
                      "def g():\n    from mergecal.merge import no_such_name\n    import no_such_package_xyz\n")
    assert missing_imports(script) == [
        "mergecal.no_such.f: no module mergecal.no_such, nor a name no_such in mergecal/__init__.py",
        "mergecal.merge.no_such_name: no_such_name is not defined in mergecal/merge.py",
        "no_such_package_xyz: not installed",
    ]
