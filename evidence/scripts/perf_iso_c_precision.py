"""Why Iso-C stays under 2x FusionBench on one CPU thread (#17): what a float32 eigendecomposition would buy and cost.

Iso-C needs U V^T and the mean singular value of the task-vector sum. Our route (mergecal.linalg.flat_polar_gram)
takes them from a float64 eigendecomposition of the sum's Gram matrix; FusionBench takes a float32 SVD. On a
square 768 x 768 key the float64 eigh alone costs most of FusionBench's whole SVD, so 2x there needs the eigh in
float32. This script measures both sides on one thread: the relative error ||x - exact||_F / ||exact||_F of our
route and of the same route in float32 (Gram, ssyevd, inverse square root, product), against the float64 SVD's
U mean(S) V^T, on the synthetic sums of ``mergecal perf`` (K = 8) and on 768 x 768 matrices with geometric spectra
of condition 1e2-1e4; then the median time of dsyevd and ssyevd on a 768 x 768 Gram matrix, of torch's float32
SVD (FusionBench's route) and of our Iso-C matrix.

    python scripts/perf_iso_c_precision.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np
import scipy.linalg
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def exact(a: np.ndarray) -> np.ndarray:
    u, s, vt = np.linalg.svd(a, full_matrices=False)
    return (u * s.mean()) @ vt


def float32_route(a: np.ndarray) -> np.ndarray:
    """The Gram route with every step in float32 (what 2x on square keys would need)."""
    a32 = a.astype(np.float32)
    w, v = scipy.linalg.eigh(a32.T @ a32, driver="evd")
    w = np.clip(w, np.finfo(np.float32).tiny, None)  # round-off can make the smallest eigenvalues <= 0
    c = v * w ** -0.25
    return ((a32 @ (c @ c.T)) * np.sqrt(w).mean()).astype(np.float64)


def median_ms(fn, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> int:
    from threadpoolctl import threadpool_limits

    from mergecal.linalg import flat_polar_gram
    from mergecal.perf.merging import synthetic_task_vectors

    threadpool_limits(1)
    torch.set_num_threads(1)
    task_vectors = synthetic_task_vectors({"square": (768, 768), "tall": (3072, 768)}, 8)
    cases = {f"synthetic sum {k}": sum(tv[k] for tv in task_vectors).double().numpy() for k in ("square", "tall")}
    rng = np.random.default_rng(0)
    for kappa in (1e2, 1e3, 1e4):
        q1, _ = np.linalg.qr(rng.standard_normal((768, 768)))
        q2, _ = np.linalg.qr(rng.standard_normal((768, 768)))
        cases[f"768 x 768, sigma 1 .. 1/{kappa:.0e}"] = (q1 * np.geomspace(1.0, 1.0 / kappa, 768)) @ q2.T
    print("| input | condition | ours (float64 Gram route) | the same route in float32 |\n|---|---:|---:|---:|")
    for name, a in cases.items():
        s = np.linalg.svd(a, compute_uv=False)
        ref = exact(a)
        polar, mean = flat_polar_gram(torch.from_numpy(a))
        ours = (polar * mean).float().double().numpy()  # float32 output, as the merge stores it
        with np.errstate(all="ignore"):
            f32 = float32_route(a)
        err = [float(np.linalg.norm(x - ref) / np.linalg.norm(ref)) for x in (ours, f32)]
        print(f"| {name} | {s[0] / s[-1]:.1e} | {err[0]:.1e} | {err[1]:.1e} |", flush=True)
    a = cases["synthetic sum square"]
    gram64 = a.T @ a
    gram32 = gram64.astype(np.float32)
    a32 = torch.from_numpy(a).float()
    dsyevd = median_ms(lambda: scipy.linalg.eigh(gram64, driver="evd"))
    print(f"\none thread, 768 x 768, median of 5: dsyevd {dsyevd:.1f} ms, "
          f"ssyevd {median_ms(lambda: scipy.linalg.eigh(gram32, driver='evd')):.1f} ms; torch float32 SVD "
          f"(FusionBench) {median_ms(lambda: torch.linalg.svd(a32, full_matrices=False)):.1f} ms; our Iso-C matrix "
          f"{median_ms(lambda: flat_polar_gram(a32)):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
