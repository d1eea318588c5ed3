"""scripts/kernel_bits.py (#30, across machines): a variant's digests are a function of the kernel settings, so the
same settings give the same digests in two processes, and a setting known to change the bits here changes them."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
spec = importlib.util.spec_from_file_location("kernel_bits", ROOT / "scripts" / "kernel_bits.py")
kernel_bits = importlib.util.module_from_spec(spec)
spec.loader.exec_module(kernel_bits)


@pytest.mark.slow  # three fresh processes, each importing open_clip and pretraining 3 steps (about 1 min)
def test_the_same_settings_give_the_same_digests_and_another_thread_count_other_weights():
    first = kernel_bits.run_variant({}, 2, "mergecal-vit-micro", timing=False)
    again = kernel_bits.run_variant({}, 2, "mergecal-vit-micro", timing=False)
    assert (first["sgemm"], first["losses"], first["weights"]) == (again["sgemm"], again["losses"], again["weights"])
    assert len(first["losses"]) == 3
    # ATen's generic kernels instead of its AVX2 ones: other bits on any x86 CPU with AVX2 (as measured on the EPYC)
    other = kernel_bits.run_variant({"ATEN_CPU_CAPABILITY": "default"}, 2, "mergecal-vit-micro", timing=False)
    assert other["weights"] != first["weights"]


def test_every_variant_names_known_kernel_variables():
    for changes, threads in kernel_bits.VARIANTS.values():
        assert set(changes) <= set(kernel_bits.PINNED) and threads >= 1
