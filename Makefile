# The two commands of the README:
#   make run    set up the environment (.venv) and run the main job
#   make test   run the test suite (sets up the environment first if needed)
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Offline and quiet (mergecal/offline.py holds the same variables): only 127.0.0.1 connections remain.
export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120
# OpenMP threads sleep when idle rather than spin beside other work (mergecal/offline.py; #17)
export OMP_WAIT_POLICY := PASSIVE
# numpy/scipy's OpenBLAS: one thread (faster for the Gram route, idle or shared; mergecal/offline.py)
export OPENBLAS_NUM_THREADS := 1
# the same CPU kernels (MKL, oneDNN, ATen) on every AVX2 machine, so a run trains the same models (mergecal/offline.py)
export MKL_CBWR := AVX2
export ONEDNN_MAX_CPU_ISA := AVX2
export ATEN_CPU_CAPABILITY := avx2
# numpy/scipy's OpenBLAS: its AVX2 (Haswell) kernels, unless the environment already chooses (?=: some machines set
# OPENBLAS_CORETYPE for OpenBLAS's correctness on their CPU)
export OPENBLAS_CORETYPE ?= Haswell

.PHONY: setup run paper perf-svc test lint fast perf bench perf-mergekit perf-svd-llama clean

setup: $(STAMP)

# torch and torchvision are pinned exactly in pyproject.toml and come from the machine's local wheel store
# (pip's configured extra indexes); an unpinned torch would pull a multi-GB build from the network.
# uv installs exactly what pip would (same `pip freeze`) in about a third of the time (84 s against 229 s,
# measured on a cold cache). uv reads no pip configuration, so pip's extra indexes, find-links and its
# best-match-across-indexes rule are handed over.
UV_VERSION := 0.13.9
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python 3.11 is required)"; exit 1; }
	@# WordNet 3.0 glosses for the text suite come from Debian's wordnet-base package.
	test -f /usr/share/wordnet/data.noun || { apt-get update -q && apt-get install -y -q wordnet-base; } \
		|| { echo "error: could not install Debian's wordnet-base (needed by the text suite): run 'apt-get install wordnet-base' as root"; exit 1; }
	@# PostgreSQL's server for the lab tests (tests/lab_servers.py starts one on 127.0.0.1 and stops it).
	ls /usr/lib/postgresql/*/bin/initdb >/dev/null 2>&1 || { apt-get update -q && apt-get install -y -q postgresql; } \
		|| { echo "error: could not install Debian's postgresql (needed by the lab tests): run 'apt-get install postgresql' as root"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet uv==$(UV_VERSION)
	extra="$${PIP_EXTRA_INDEX_URL:-$$($(BIN)/python -m pip config get global.extra-index-url 2>/dev/null)}"; \
	links="$${PIP_FIND_LINKS:-$$($(BIN)/python -m pip config get global.find-links 2>/dev/null)}"; \
	export UV_INDEX_STRATEGY=unsafe-best-match; \
	if [ -n "$$extra" ]; then export UV_EXTRA_INDEX_URL="$$extra"; fi; \
	if [ -n "$$links" ]; then export UV_FIND_LINKS="$${links// /,}"; fi; \
	$(BIN)/uv pip install --quiet --python $(BIN)/python --compile-bytecode -e '.[pipeline,lab,dev]'
	$(BIN)/python -m pip check
	touch $(STAMP)

# The main job: the whole default benchmark through DVC (data -> pretraining -> fine-tunes -> task vectors ->
# DisTaC -> probing -> Prefect benchmark flow tracked in MLflow -> leaderboards). Stages call `python`, so the
# venv comes first on PATH.
run: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro
	@echo "leaderboard: $(CURDIR)/reports/leaderboard.html (also reports/leaderboard.md, reports/history.md)"

# The papers' experiments, opt-in (docs/papers.md): their stages (papers/dvc.yaml) after the default run's, whose
# cells they reuse; one report per paper under reports/papers/. A plain `make run` / `dvc repro` never runs them.
paper: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro papers/dvc.yaml
	@echo "papers: $(CURDIR)/reports/papers/{svc,magic,distac}.html (and .md)"

# SVC's own time and peak memory at ViT-B/32 and ViT-L/14 shapes, K = 8, one thread (the SVC paper's Table 4;
# reports/papers/svc.md reads the two files, which make paper never rewrites: a measurement is not reproducible)
SVC_ONLY := --calibrations --no-merges --no-solvers --only "svc (alpha=1/K)" --threads 1
perf-svc: $(STAMP)
	$(BIN)/mergecal perf $(SVC_ONLY) --shapes vit-b-32 --output reports/perf/svc-vit-b-32.md
	$(BIN)/mergecal perf $(SVC_ONLY) --shapes vit-l-14 --output reports/perf/svc-vit-l-14.md

# Speed and memory of the merge methods and calibrations on ViT-B/32-shaped task vectors.
perf: $(STAMP)
	$(BIN)/mergecal perf --calibrations --streaming --models --output reports/perf/merging.md

# TSV-M, Iso-C, Iso-CTS and SVC after TA: ours against FusionBench 0.2.33 and the float64 reference (#17), on ViT-B/32
# and 2 ViT-L/14 blocks. FusionBench is not a dependency: FUSION_BENCH=its wheel (pip download --no-deps
# fusion-bench==0.2.33) or the unpacked folder; without it those columns are skipped. One thread for both libraries
# (the algorithms compared; docs/performance.md); the float64 reference dominates: over an hour on 2 cores.
FB_ARG = $(if $(FUSION_BENCH),--fusion-bench $(FUSION_BENCH))
bench: $(STAMP)
	$(BIN)/python scripts/perf_fusionbench.py $(FB_ARG) --shapes vit-b-32 --threads 1 \
		--output reports/perf/fusionbench-vit-b-32.md
	$(BIN)/python scripts/perf_fusionbench.py $(FB_ARG) --shapes vit-l-14 --blocks 2 --methods tsv_m svc --threads 1 \
		--output reports/perf/fusionbench-vit-l-14.md

# `mergecal merge` against MergeKit 0.1.5 (#43) on Llama-shaped checkpoints: MERGEKIT_SIZE=smoke (default), 1.6b or
# 7b (about 55 GB of disk). MergeKit is not a dependency: it is installed from PyPI into a venv of its own.
MERGEKIT_SIZE ?= smoke
MERGEKIT_VENV := .mergekit-venv
perf-mergekit: $(STAMP)
	test -x $(MERGEKIT_VENV)/bin/mergekit-yaml || ($(BIN)/uv venv --quiet --python $(PYTHON) $(MERGEKIT_VENV) && \
		VIRTUAL_ENV=$(abspath $(MERGEKIT_VENV)) $(BIN)/uv pip install --quiet mergekit==0.1.5)
	$(BIN)/python scripts/perf_mergekit.py --mergekit $(MERGEKIT_VENV)/bin/mergekit-yaml --size $(MERGEKIT_SIZE) \
		--work .mergecal/perf-mergekit --output reports/perf/mergekit-$(MERGEKIT_SIZE).json

# SVC, TSV-M and Iso-CTS per key class of a Llama-shaped model against their floors, and a streamed SVC merge (#43):
# SVD_SIZE=smoke (default, seconds), 1.6b or 7b (about 35 min on one thread and 4 GB of disk).
SVD_SIZE ?= smoke
perf-svd-llama: $(STAMP)
	mkdir -p .mergecal
	$(BIN)/python scripts/perf_svd_llama.py --size $(SVD_SIZE) --tasks 2 --threads 1 \
		--end-to-end "task_arithmetic>svc" --work .mergecal --output reports/perf/svd-llama-$(SVD_SIZE).md

lint: $(STAMP)
	$(BIN)/ruff check .

# the unit tier alone: no Prefect, MLflow, DVC or pipeline builds (about 2 minutes)
fast: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -m "not slow and not integration"

# lint, the default suite (unit and integration tiers), then the end-to-end runs a plain `pytest` leaves out
test: lint
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest -m slow

clean:
	rm -rf $(VENV) .pytest_cache
