# The set-up and the everyday commands, on a fresh machine as on yours:
#
#   make run  [ARGS="ppo.clip=0.1"]          the default job (python train.py ARGS)
#   make test [ARGS="-m 'not slow'"]         ruff (lint and format check), then pytest ARGS (the whole suite)
#   make lint [ARGS=--fix]                   ruff alone (check ARGS ., format --check .)
#   make format                              ruff format . (what the format check asks for)
#   make install                             only the set-up below (CI runs it after removing .venv)
#
# Each creates the venv .venv if it is missing, then installs into it: torch first (the pinned
# version is a CPU build; an unpinned torch would pull a multi-GB CUDA build through the other
# requirements), then this project with its dev, optuna, lora, data and math extras. The install runs again
# only when pyproject.toml changes (a stamp file in the venv). VENV=<dir> uses another venv.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ppo_lightning-installed
TORCH ?= torch==2.13.0
EXTRAS ?= dev,optuna,lora,data,math
ARGS ?=

# Offline: nothing in the default job or the tests needs the hub.
ENV := HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false

.PHONY: run test lint format install

run: $(STAMP)
	$(ENV) $(PY) train.py $(ARGS)

test: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(ENV) $(PY) -m pytest -q $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check $(ARGS) .
	$(PY) -m ruff format --check .

format: $(STAMP)
	$(PY) -m ruff format .

install: $(STAMP)

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q $(TORCH)
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@
