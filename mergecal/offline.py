"""The environment that keeps the stack offline and quiet (docs/references.md), its OpenMP threads
passive and its CPU kernels pinned, defined once. The stage scripts and the tests apply all of it; the model
loaders apply the hub part before importing transformers or lm-eval. The Makefile exports the same variables
for dvc and the servers it starts (a test keeps them equal)."""

from __future__ import annotations

import os
from collections.abc import Mapping, MutableMapping

# nothing is fetched from a model or dataset hub at run time
HUB_OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
# no telemetry, and a temporary Prefect server given time to start on a busy 2-core machine
QUIET = {"DO_NOT_TRACK": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
         "DVC_NO_ANALYTICS": "1", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
# OpenMP threads (torch's MKL and ATen, GNU OpenMP) sleep when idle instead of spinning: beside other work on the
# cores (a training run, parallel cells, the test suite) spinning threads slowed a 3072 x 768 SVD 20-60x (#17;
# evidence/scripts/perf_wait_policy.py measures it). numpy/scipy's OpenBLAS (the Gram route of TSV-M, Iso-C,
# Iso-CTS and SVC) runs one thread: its pthreads pool, which the wait policy does not govern, made those merges
# 1.2-1.6x slower with 2 threads than with 1 on the idle 2-core machine and 1.2-2.1x slower beside one busy
# process (3.9x with more load) (evidence/scripts/perf_blas_threads.py, docs/performance.md); one thread also
# gives the same bits on any core count.
# torch's thread count is params.yaml's `threads`, which its stages and cells pin (mergecal.pipeline.threads): its
# bits depend on it, and torch's own default (all cores) differs between machines.
# These are read when the libraries load: apply them before torch or numpy is imported (``import mergecal``
# imports neither).
THREADING = {"OMP_WAIT_POLICY": "PASSIVE", "OPENBLAS_NUM_THREADS": "1"}
# The same CPU kernels on every x86-64 machine with AVX2: MKL (matmuls), oneDNN (convolutions), ATen's own
# vectorized kernels and numpy/scipy's OpenBLAS (the Gram route of the SVD-based merges) each pick a code path by
# the CPU's instruction set, and each choice changes the bits of a training run or a merge (measured: 5 AdamW steps
# of a conv + transformer layer give four different results with each library's path changed alone). The chaotic
# tiny pretraining then turns those bits into other models. AVX2 is the widest set the 2-core AMD EPYC machines
# all have. Checked across machines on 2026-11-25 (docs/performance.md): a cold run on an AVX-512 EPYC reproduced
# every stage output of the last cold run on an AVX2 EPYC byte for byte; only OpenBLAS, then unpinned (it chose
# its SkylakeX kernels), moved 10 of 202 leaderboard rows, the ill-posed SVC-after-Iso ones; with its Haswell
# (AVX2) kernels 200 rows were equal, the other 2 moved by its thread count (now 1, THREADING). The pinned kernels
# were not slower there (the benchmark flow 429 s against 442 s). Where the environment already sets
# OPENBLAS_CORETYPE (some machines do, for OpenBLAS's correctness on their CPU), its value is kept.
KERNELS = {"MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
           "OPENBLAS_CORETYPE": "Haswell"}
OFFLINE_ENV = {**HUB_OFFLINE, **QUIET, **THREADING, **KERNELS}


def apply(variables: Mapping[str, str] = OFFLINE_ENV, environ: MutableMapping[str, str] = os.environ) -> None:
    """Set each variable unless the environment already sets it (a user's explicit choice wins)."""
    for name, value in variables.items():
        environ.setdefault(name, value)
