"""#57: every module on its layer (``scripts/layers.py``): no import runs up a layer, no circle, no module outside
the layers."""

from pathlib import Path

from scripts import layers

REPO = Path(__file__).resolve().parents[1]


def test_no_import_runs_up_a_layer_and_no_module_is_off_the_layers():
    found = layers.measure(REPO)
    assert not found["unplaced"], f"modules on no layer of scripts/layers.py: {found['unplaced']}"
    assert not found["up"], "imports that run up a layer: " + ", ".join(f"{a} -> {b}" for a, b in found["up"])
    assert not found["circles"], f"import circles: {found['circles']}"


def test_an_import_from_the_library_into_the_pipeline_runs_up(tmp_path):
    for path, text in {"mergecal/__init__.py": "", "mergecal/merge.py": "from .pipeline import cells\n",
                       "mergecal/pipeline/__init__.py": "", "mergecal/pipeline/cells.py": "from .. import merge\n",
                       "mergecal/nowhere.py": ""}.items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(text)
    found = layers.measure(tmp_path)
    assert found["up"] == [("mergecal.merge", "mergecal.pipeline"), ("mergecal.merge", "mergecal.pipeline.cells")]
    assert found["circles"] == [["mergecal.merge", "mergecal.pipeline.cells"]]
    assert found["unplaced"] == ["mergecal.nowhere"]
