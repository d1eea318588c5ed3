# The two commands of the README:
#   make run    set up the environment (.venv) and run the main job
#   make test   run the test suite (sets up the environment first if needed)
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

# Offline and quiet (../shared/notes/stack.md): only 127.0.0.1 connections remain.
export DO_NOT_TRACK := true
export PREFECT_SERVER_ANALYTICS_ENABLED := false
export MLFLOW_DISABLE_TELEMETRY := true
export DVC_NO_ANALYTICS := 1
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS := 120

.PHONY: setup run test bench clean

setup: $(STAMP)

# torch and torchvision are pinned exactly in pyproject.toml: pip takes them from the machine's local
# wheel store; an unpinned torch would pull a multi-GB CUDA build from the network.
$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found (Python 3.11 is required)"; exit 1; }
	@# WordNet 3.0 glosses for the text suite come from Debian's wordnet-base package.
	test -f /usr/share/wordnet/data.noun || { apt-get update -q && apt-get install -y -q wordnet-base; } \
		|| { echo "error: could not install Debian's wordnet-base (needed by the text suite): run 'apt-get install wordnet-base' as root"; exit 1; }
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[pipeline,dev]'
	$(BIN)/python -m pip check
	touch $(STAMP)

# The main job: the whole default benchmark through DVC (data -> pretraining -> fine-tunes -> task vectors ->
# DisTaC -> probing -> Prefect benchmark flow tracked in MLflow -> leaderboards). Stages call `python`, so the
# venv comes first on PATH.
run: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/dvc repro
	@echo "leaderboard: $(CURDIR)/reports/leaderboard.html (also reports/leaderboard.md, reports/history.md)"

# Speed and memory of the merge methods and calibrations on ViT-B/32-shaped task vectors.
bench: $(STAMP)
	$(BIN)/mergecal bench --calibrations --streaming --models --output reports/bench/merging.md

test: $(STAMP)
	PATH="$(abspath $(BIN)):$$PATH" $(BIN)/python -m pytest

clean:
	rm -rf $(VENV) .pytest_cache
