"""The contract between the jobs and a task (``ppo_lightning/tasks/<name>/``), and its lookup.

A task is an offline demo that builds everything it needs once and reports what PPO changed:
``recipe=<name>`` (set by its preset, ``conf/experiment/preset/``) makes ``jobs.run.train`` call
its ``prepare`` before the run and its ``evaluate`` after it. The task's module
(``ppo_lightning.tasks.<name>.task``) is found by name at run time, like a Hydra ``_target_``:
nothing below the tasks imports one.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ppo_lightning.config import recipe_root
from ppo_lightning.config.errors import ConfigError


@runtime_checkable
class Task(Protocol):
    """What a task's module defines (a module implements a protocol with its functions)."""

    def root(self, cfg) -> Path:
        """The directory its builds live in: ``recipe_root(cfg.paths.cache_dir, <name>)``. Paths
        under it are skipped by the input checks (the task builds them next)."""
        ...

    def prepare(self, cfg) -> Path:
        """Build the models and prompts its preset points at, once (atomically, cached under
        ``root(cfg)``); a later run finds them and returns at once. Returns ``root(cfg)``."""
        ...

    def evaluate(self, cfg, module: Any, out_dir: Path | None) -> str:
        """After PPO, on rank 0: the before/after table of the run's own first and last
        evaluations (``tasks.common.eval_report``), also written to ``out_dir/eval.json``."""
        ...


def load_task(name: str) -> Task:
    """The module of task ``name`` (``config.choices.RECIPES``), checked against ``Task``."""
    recipe_root(".", name)  # an unknown name fails here, with the choices
    module = importlib.import_module(f"ppo_lightning.tasks.{name}.task")
    if not isinstance(module, Task):
        missing = [f for f in ("root", "prepare", "evaluate") if not callable(getattr(module, f, None))]
        raise ConfigError(
            f"recipe={name}: ppo_lightning/tasks/{name}/task.py lacks {', '.join(missing)} (jobs.task.Task)"
        )
    return module
