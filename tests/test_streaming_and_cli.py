"""Merging checkpoints on disk key by key, and the command line."""

import json
import subprocess
import sys

import pytest
import torch

from mergecal import merge_checkpoints, merge_models, save_checkpoint
from mergecal.checkpoint import SafetensorsSource, save_state_dict
from mergecal.cli import main
from mergecal.errors import IncompatibleModelsError


class CountingSource:
    """A TensorSource that records the order of its loads, to check the merge streams key by key."""

    def __init__(self, tensors, name, log):
        self._t, self.name, self._log = tensors, name, log

    def keys(self):
        return list(self._t)

    def shape(self, key):
        return tuple(self._t[key].shape)

    def dtype(self, key):
        return self._t[key].dtype

    def get(self, key):
        self._log.append((self.name, key))
        return self._t[key]


@pytest.fixture
def checkpoints(tmp_path, pretrained, finetuned):
    pre = save_checkpoint(pretrained, tmp_path / "pre", max_shard_bytes=700)  # sharded
    fts = [save_state_dict(ft, tmp_path / f"ft{i}.safetensors") for i, ft in enumerate(finetuned)]  # single files
    return pre, fts


@pytest.mark.parametrize("method,params", [("ties", {}), ("tsv_m", {}), ("dare", {"base": "ties"}), ("iso_cts", {})])
def test_merging_checkpoints_on_disk_equals_the_in_memory_merge(tmp_path, checkpoints, pretrained, finetuned, method,
                                                                params):
    pre, fts = checkpoints
    out = merge_checkpoints(pre, fts, method, tmp_path / "merged", max_shard_bytes=500, **params)
    on_disk = SafetensorsSource(out)
    in_memory = merge_models(pretrained, finetuned, method, **params)
    assert (out / "model.safetensors.index.json").exists()
    assert set(on_disk.keys()) == set(in_memory)
    for key, value in in_memory.items():
        assert torch.equal(on_disk.get(key), value), key
    assert (json.loads((out / "model.safetensors.index.json").read_text())["metadata"]["mergecal_method"]
            .startswith(method))


def test_a_per_key_merge_loads_each_key_once_in_order(pretrained, finetuned):
    log = []
    pre = CountingSource(pretrained, "pre", log)
    fts = [CountingSource(ft, f"ft{i}", log) for i, ft in enumerate(finetuned)]
    merge_models(pre, fts, "tsv_m")
    float_keys = [k for k, v in pretrained.items() if v.is_floating_point()]
    # each float key: pretrained + K fine-tuned loads for the task vectors, then pretrained again for theta_0
    loaded_keys = [key for _, key in log]
    expected = []
    for key in pretrained:
        expected += [key] * (1 + len(fts) + 1) if key in float_keys else [key]
    assert loaded_keys == expected


def test_cli_merge_writes_a_checkpoint(tmp_path, checkpoints, pretrained, finetuned, capsys):
    pre, fts = checkpoints
    out = tmp_path / "cli_out"
    rc = main(["merge", "--pretrained", str(pre), "--finetuned", *map(str, fts), "--method", "ties",
               "--set", "top_k=0.5", "--set", "scaling=0.8", "--out", str(out), "--dtype", "bfloat16"])
    assert rc == 0
    merged = SafetensorsSource(out)
    expected = merge_models(pretrained, finetuned, "ties", top_k=0.5, scaling=0.8, out_dtype=torch.bfloat16)
    assert all(torch.equal(merged.get(k), expected[k]) for k in expected)


def test_cli_bad_input_is_one_line_exit_2_and_nothing_written(tmp_path, checkpoints, pretrained, capsys):
    pre, fts = checkpoints
    bad = dict(pretrained, text_projection=torch.zeros(2, 2))
    bad_path = save_state_dict(bad, tmp_path / "bad.safetensors")
    out = tmp_path / "never"
    rc = main(["merge", "--pretrained", str(pre), "--finetuned", str(fts[0]), str(bad_path), "--method", "ties",
               "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2
    assert err.count("\n") == 0 and "'text_projection'" in err and "bad.safetensors" in err
    assert not out.exists() and not any(p.name.startswith(".never") for p in tmp_path.iterdir())
    rc = main(["merge", "--pretrained", str(pre), "--finetuned", str(fts[0]), "--method", "ties", "--set", "top_k=2",
               "--out", str(out)])
    assert rc == 2 and "top_k" in capsys.readouterr().err
    rc = main(["merge", "--pretrained", str(pre), "--finetuned", str(fts[0]), "--method", "nope", "--out", str(out)])
    assert rc == 2 and "choose one of" in capsys.readouterr().err


def test_merge_refuses_to_overwrite_an_input(tmp_path, checkpoints):
    pre, fts = checkpoints
    with pytest.raises(Exception, match="must not be one of the input checkpoints"):
        merge_checkpoints(pre, fts, "ties", pre)


def test_incompatible_checkpoints_name_the_file(tmp_path, pretrained, finetuned):
    pre = save_state_dict(pretrained, tmp_path / "pre.safetensors")
    ft = save_state_dict({k: v for k, v in finetuned[0].items() if k != "text_projection"}, tmp_path / "ft.safetensors")
    with pytest.raises(IncompatibleModelsError,
                       match=r"'text_projection' is in pretrained \(.*pre\.safetensors\) "
                             r"but missing from finetuned\[0\] \(.*ft\.safetensors\)"):
        merge_checkpoints(pre, [ft], "task_arithmetic", tmp_path / "out")


def test_console_script_lists_methods():
    result = subprocess.run([sys.executable, "-m", "mergecal.cli", "methods"],
                            capture_output=True, text=True, check=True)
    for name in ("weight_averaging", "task_arithmetic", "ties", "dare", "consensus", "tsv_m", "iso_c", "iso_cts"):
        assert name in result.stdout
    assert "top_k=0.2" in result.stdout and "common_space_fraction=0.8" in result.stdout


def test_flop_floor_of_svc_on_vit_b32_is_the_issues_teraflop():
    from mergecal.perf.merging import flop_floor, vit_b32_shapes

    shapes = [s for s in vit_b32_shapes(12).values() if len(s) == 2]
    assert sum(flop_floor("svc", s, 8) for s in shapes) == pytest.approx(1.04e12, rel=0.01)
    m, n = 3072, 768
    assert flop_floor("tsv_m", (m, n), 8) == flop_floor("tsv_m", (n, m), 8) == 8 * m * n * n
    assert flop_floor("iso_c", (m, n), 8) == m * n * n + 2 * m * n * n
    with pytest.raises(ValueError):
        flop_floor("ties", (m, n), 8)


def test_benchmark_quick_prints_a_row_per_method(tmp_path):
    out = tmp_path / "bench.md"
    result = subprocess.run([sys.executable, "-m", "mergecal.cli", "perf", "--quick", "--calibrations", "--streaming",
                             "--output", str(out)],
                            capture_output=True, text=True, check=True)
    table = out.read_text()
    rows = [line for line in table.splitlines()
            if line.startswith("| ") and not line.startswith(("| method", "| calibration"))]
    assert len(rows) == 10 + 4 + 5 + 4 + 3  # merges, gram vs svd (+SVC), calibrations, floors, streaming
    data = json.loads(out.with_suffix(".json").read_text())
    assert all(r["seconds"] > 0 for r in data["rows"])
    assert all(r["merged_norm"] > 0 for r in data["rows"] if "merged_norm" in r)
    assert "task_arithmetic" in result.stdout
    gram_rows = [r for r in data["rows"] if r["label"].endswith("(gram vs svd)")]
    assert len(gram_rows) == 4 and all(r["torch_seconds"] > 0 and r["torch_max_rel_diff"] < 1e-6 for r in gram_rows)
    if not torch.cuda.is_available():
        assert "cuda route skipped: torch.cuda.is_available() is False" in result.stdout
