"""Shared fixtures: tiny offline models and Hydra configs composed exactly as train.py composes them."""

from __future__ import annotations

import csv
import os
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")  # tests of the W&B logger turn it back on
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import ppo_lightning.algo.advantages  # noqa: E402,F401  the estimators register (config.choices.ESTIMATORS)

if os.environ.get("PYTEST_XDIST_WORKER"):  # pytest -n N: one core per worker, as the subprocesses have
    import torch

    torch.set_num_threads(1)

ROOT = Path(__file__).resolve().parents[1]
CONF = ROOT / "conf"


LONGEST_FIRST = (
    "test_reliability_distributed.py",
    "test_recipes.py",
    "test_reliability.py",
    "test_estimators.py",
    "test_precision.py",
    "test_multiturn_train.py",
    "test_fsdp.py",
    "test_train.py",
    "test_bad_input.py",
    "test_config.py",
    "test_padding.py",
    "test_shared_prompt.py",
    "test_memory_switches.py",
    "test_notebook.py",
    "test_math_chat.py",
    "test_lora.py",
    "test_sweeps.py",
    "test_benchmarks.py",
    "test_env_safety.py",
    "test_vllm_distributed.py",  # make test-vllm: beside test_vllm.py, which must come last
)
"""The test files that take longest, longest first: every file of more than about 15 CPU seconds
(each test's CPU time, this process's and its children's, summed by file: a loaded machine
stretches wall time unevenly). ``make test`` runs the suite on two workers, a file to a worker
(``--dist loadfile --no-loadscope-reorder``), in collection order: starting with the longest
files leaves only short ones to fill in at the end, so no worker runs a long file alone while the
other is idle (longest-processing-time first)."""


def pytest_addoption(parser):
    parser.addoption(
        "--demos",
        action="store_true",
        help="also run the documented demos end to end (tests marked demo: make test-demos)",
    )


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: the rest keep their order
    if not config.getoption("--demos"):
        skip = pytest.mark.skip(reason="a documented demo end to end, minutes of CPU: make test-demos (pytest --demos)")
        for item in items:
            if "demo" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(autouse=True)
def _restore_global_state():
    """Each test leaves the process as it found it: the environment (``PL_GLOBAL_SEED`` from
    ``seed_everything``, ``RANK``/``LOCAL_RANK`` from a vLLM engine, anything a test sets), the
    root logger's handlers and level (an in-process Hydra app adds its own), and the flaky test
    reward's call counter. So a test passes alone, in any order, and on any pytest worker."""
    import logging

    from tests import helpers

    environ = dict(os.environ)
    root = logging.getLogger()
    handlers, level = set(root.handlers), root.level
    yield
    os.environ.clear()
    os.environ.update(environ)
    for h in root.handlers[:]:  # pytest's own capture handlers come and go by themselves
        if h not in handlers and not type(h).__module__.startswith("_pytest"):
            root.removeHandler(h)
            h.close()
    root.setLevel(level)
    helpers._CALLS["n"] = 0


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    """Where ``model=tiny`` builds its model once per test session."""
    return tmp_path_factory.mktemp("ppo_cache")


@pytest.fixture(scope="session")
def tiny_lm_dir(cache_dir) -> Path:
    from ppo_lightning.models.tiny import save_tiny_causal_lm

    return save_tiny_causal_lm(cache_dir / "tiny-lm")


@pytest.fixture(scope="session")
def tiny_rm_dir(cache_dir) -> Path:
    from ppo_lightning.models.tiny import save_tiny_reward_model

    return save_tiny_reward_model(cache_dir / "tiny-rm")


def compose_cfg(overrides: list[str], output_dir: Path, cache_dir: Path, experiment: str | None = "tiny_char"):
    """``train.yaml`` composed with the real Hydra compose API (schemas and all).

    Unless the overrides pick an experiment, ``experiment=tiny_char``: the tiny offline model
    and toy prompts (the default reviews recipe builds models first; its own tests do that).
    ``experiment=None`` composes exactly what ``python train.py <overrides>`` would.
    """
    if experiment and not any(o.startswith("experiment=") for o in overrides):
        overrides = [f"experiment={experiment}", *overrides]
    import ppo_lightning.config  # noqa: F401  registers the schema
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(
            "train", overrides=[f"paths.output_dir={output_dir}", f"paths.cache_dir={cache_dir}", *overrides]
        )


def read_metrics(path: Path) -> list[dict[str, float]]:
    """Rows of a CSVLogger ``metrics.csv`` as floats (empty cells dropped)."""
    with open(path) as f:
        return [{k: float(v) for k, v in row.items() if v != ""} for row in csv.DictReader(f)]
