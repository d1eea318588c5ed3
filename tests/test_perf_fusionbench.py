"""scripts/perf_fusionbench.py (#17) on tiny shapes: the FusionBench-less path, the ratio and FLOP-floor arithmetic
against a hand computation, the alternation order, the wheel loader's stand-ins, and the float64 SVC oracle."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from crosscheck import reference_merging as ref

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("perf_fusionbench", ROOT / "scripts" / "perf_fusionbench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_the_wheel_the_fusionbench_columns_are_skipped_with_one_line(bench, tmp_path, capsys):
    out = tmp_path / "bench.md"
    assert bench.main(["--blocks", "1", "--width", "16", "--tasks", "2", "--threads", "1", "--repeats", "1",
                       "--output", str(out)]) == 0
    printed = capsys.readouterr().out
    assert sum("FusionBench columns skipped" in line for line in printed.splitlines()) == 1
    rows = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert [r["method"] for r in rows] == bench.METHODS
    for r in rows:
        assert "theirs_seconds" not in r and r["ours_seconds"] > 0 and r["ours_floor_multiple"] > 0
        assert r["ours_max_rel_diff"] < 1e-5  # our default routes against the float64 reference
    table = out.read_text().splitlines()
    assert table[4].startswith("| tsv_m |") and "| - | - | - |" in table[4]


def test_ratio_and_floor_multiple_match_a_hand_computation(bench):
    # tsv_m's floor on (4, 2) and (2, 4) with K = 2: K M r^2 = 2 * 4 * 2^2 = 32 flops each, 64 in all;
    # at 3.2e-8 GFLOP/s float64 that is 2.0 s
    per_key = [{"ours": 1.0, "theirs": 3.0, "ours_diff": 1e-8, "theirs_diff": 4e-6},
               {"ours": 2.0, "theirs": 3.0, "ours_diff": 3e-8, "theirs_diff": 2e-6}]
    row = bench.summarize("tsv_m", per_key, [(4, 2), (2, 4)], 2, {"float32": 1.0, "float64": 3.2e-8})
    assert row["floor_gflop"] == pytest.approx(64e-9)
    assert row["floor_seconds"] == pytest.approx(2.0)
    assert row["ours_seconds"] == 3.0 and row["theirs_seconds"] == 6.0
    assert row["ratio"] == pytest.approx(2.0)  # theirs / ours
    assert row["median_key_ratio"] == pytest.approx(2.25)  # median of 3.0 and 1.5
    assert row["ours_floor_multiple"] == pytest.approx(1.5) and row["theirs_floor_multiple"] == pytest.approx(3.0)
    assert row["ours_max_rel_diff"] == 3e-8 and row["theirs_max_rel_diff"] == 4e-6


def test_calls_alternate_and_the_median_is_kept(bench, monkeypatch):
    calls = []
    clock = iter([0.0, 1.0, 1.0, 2.0, 2.0, 5.0, 5.0, 6.0, 6.0, 7.0, 7.0, 9.0])

    def impl(name):
        return lambda taus: calls.append(name) or name

    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(clock))
    times, out = bench.time_alternated({"a": impl("a"), "b": impl("b")}, [], repeats=3, start=1)
    assert calls == ["b", "a", "a", "b", "b", "a"]  # start=1: b first, then the order flips every repetition
    assert times == {"b": 1.0, "a": 2.0}  # b: 1, 1, 1 s; a: 1, 3, 2 s
    assert out == {"a": "a", "b": "b"}


def _fake_wheel(root: Path) -> None:
    """FusionBench's layout with stand-in functions that import what the real files import."""
    method = root / "fusion_bench" / "method"
    # each stand-in refuses any accelerator but the CPU, naming it: the device the loader hands over shows
    header = ("from fusion_bench.utils.type import StateDictType\nfrom fusion_bench.utils import timeit_context\n"
              "def _on(accelerator):\n    if accelerator != 'cpu':\n        raise ValueError(f'on {accelerator}')\n")
    files = {"task_singular_vector/utils/TSVM_utils.py":
             "def compute_and_sum_svd_mem_reduction(tvs, accelerator):\n    _on(accelerator)\n"
             "    return {'w': sum(t['w'] for t in tvs)}\n",
             "isotropic_merging/iso_utils.py":
             "def iso_c(tvs, accelerator):\n    _on(accelerator)\n    print('Merging w...')\n"
             "    return {'w': 2 * tvs[0]['w']}\n"
             "def iso_cts(tvs, f, accelerator):\n    _on(accelerator)\n    return {'w': f * tvs[0]['w']}\n",
             "singular_value_calibration/utils.py":
             "def subspace_consistency_spectral_calibration_accelerated(base_weight, task_weights, merged_weight,"
             " alpha, accelerator):\n    _on(accelerator)\n    return merged_weight * alpha\n"}
    for rel, body in files.items():
        (method / rel).parent.mkdir(parents=True, exist_ok=True)
        (method / rel).write_text(header + body)


def test_the_loader_wraps_fusionbench_per_key_and_leaves_no_stub_behind(bench, tmp_path, capsys):
    _fake_wheel(tmp_path)
    fb = bench.load_fusion_bench(tmp_path)
    assert "fusion_bench" not in sys.modules and "fusion_bench.utils.type" not in sys.modules
    taus = [torch.ones(2, 3), 2 * torch.ones(2, 3)]
    assert torch.equal(fb["tsv_m"](taus), 3 * torch.ones(2, 3))
    assert torch.equal(fb["iso_c"](taus), 2 * torch.ones(2, 3))
    assert torch.equal(fb["iso_cts"](taus), 0.8 * torch.ones(2, 3))
    assert torch.equal(fb["svc"](taus), 1.5 * torch.ones(2, 3))  # merged = the sum, alpha = 1/K
    assert "Merging" not in capsys.readouterr().out  # FusionBench's per-key prints are swallowed


def test_the_loader_hands_every_method_the_device(bench, tmp_path):
    _fake_wheel(tmp_path)
    fb = bench.load_fusion_bench(tmp_path, accelerator="cuda:1")
    for method in bench.METHODS:
        with pytest.raises(ValueError, match="on cuda:1"):
            fb[method]([torch.ones(2, 3), torch.ones(2, 3)])


def test_a_gpu_sync_ends_every_timed_call(bench, monkeypatch):
    # the clock advances 1 s per call and 2 s per synchronize: each time must hold its own sync
    now = [0.0]
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])

    def impl(taus):
        now[0] += 1.0

    def sync():
        now[0] += 2.0
        syncs.append(now[0])

    syncs = []
    times, _ = bench.time_alternated({"a": impl, "b": impl}, [], repeats=2, sync=sync)
    assert times == {"a": 3.0, "b": 3.0} and len(syncs) == 4


def test_the_oracle_can_be_limited_to_the_first_keys(bench, tmp_path):
    out = tmp_path / "bench.md"
    assert bench.main(["--blocks", "1", "--width", "16", "--tasks", "2", "--threads", "1", "--repeats", "1",
                       "--methods", "iso_c", "--reference-keys", "1", "--output", str(out)]) == 0
    data = json.loads(out.with_suffix(".json").read_text())
    (row,) = data["rows"]
    assert row["keys"] == 4 and row["reference_keys"] == 1 and row["ours_max_rel_diff"] < 1e-5
    diffs = [k["ours_diff"] for k in data["per_key"]["iso_c"]]
    assert diffs[0] is not None and diffs[1:] == [None, None, None]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_cuda_without_a_gpu_is_refused_in_one_line(bench):
    with pytest.raises(SystemExit, match="--device cuda: expected cpu, or cuda"):
        bench.main(["--device", "cuda", "--blocks", "1", "--width", "16"])
    with pytest.raises(SystemExit, match="--reference-keys 0: expected at least 1"):
        bench.main(["--reference-keys", "0", "--blocks", "1", "--width", "16"])


def test_the_loader_names_a_missing_file(bench, tmp_path):
    (tmp_path / "fusion_bench" / "method").mkdir(parents=True)
    with pytest.raises(SystemExit, match="TSVM_utils.py missing"):
        bench.load_fusion_bench(tmp_path)
    with pytest.raises(SystemExit, match="expected a fusion_bench wheel"):
        bench.load_fusion_bench(tmp_path / "nowhere")


def test_the_svc_oracle_undoes_identical_tasks_and_matches_our_svc():
    # K identical tasks: s_r = K on every direction, gamma_r = 1/K, so the calibrated sum is the task itself
    rng = np.random.default_rng(0)
    a = rng.standard_normal((7, 5))
    np.testing.assert_allclose(ref.svc_matrix([a, a, a]), a, rtol=1e-12, atol=1e-12)
    from mergecal.perf.merging import svc_after_ta

    taus = [rng.standard_normal((9, 6)) for _ in range(4)]
    ours = svc_after_ta([torch.from_numpy(t).float() for t in taus]).double().numpy()
    expected = ref.svc_matrix([t.astype(np.float32).astype(np.float64) for t in taus])
    assert np.linalg.norm(ours - expected) / np.linalg.norm(expected) < 1e-5
