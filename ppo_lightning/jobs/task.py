"""The contract between the jobs and a task (``ppo_lightning/tasks/<name>/``), its lookup and its
cached build.

A task is an offline demo that builds everything it needs once and reports what PPO changed:
``recipe=<name>`` (set by its experiment, ``conf/experiment/<name>.yaml``) makes
``jobs.run.train`` build it (``prepare``) before the run and call its ``evaluate`` after it. The
task's module (``config.task_module``) is found by name at run time, like a Hydra ``_target_``:
nothing below the tasks imports one.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ppo_lightning.config import recipe_root, task_dir, task_module
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.models.tiny import atomic_build

DONE = "DONE"  # the file that marks a finished build


@runtime_checkable
class Task(Protocol):
    """What a task's module defines (a module implements a protocol with its functions)."""

    def build(self, cfg, out: Path) -> None:
        """Write the models and prompts its experiment points at (``${recipe_dir:<name>}/...``)
        into ``out``, a fresh directory that becomes the cache once this returns (``prepare``)."""
        ...

    def evaluate(self, cfg, module: Any, out_dir: Path | None) -> str:
        """After PPO, on rank 0: the before/after table of the run's own first and last
        evaluations (``tasks.common.eval_report``), also written to ``out_dir/eval.json``."""
        ...


def load_task(name: str) -> Task:
    """The module of task ``name`` (``recipe``), checked against ``Task``."""
    folder = task_dir(name)  # an unknown name fails here, with the choices
    module = importlib.import_module(task_module(name))
    if not isinstance(module, Task):
        missing = [f for f in ("build", "evaluate") if not callable(getattr(module, f, None))]
        raise ConfigError(f"recipe={name}: {folder / 'task.py'} lacks {', '.join(missing)} (jobs.task.Task)")
    return module


def built_root(cfg) -> Path:
    """Where the job's task builds (``${recipe_dir:<recipe>}``, this seed's)."""
    return recipe_root(cfg.paths.cache_dir, cfg.recipe, cfg.seed)


def prepare(task: Task, cfg) -> Path:
    """Build the job's task once: ``task.build`` into a temporary sibling of ``built_root(cfg)``,
    renamed into place when it holds ``DONE`` (``tiny.atomic_build``). A later run finds it and
    returns at once; a killed build leaves no half-made cache, and the next run starts it again."""

    def build_and_mark(tmp: Path) -> None:
        task.build(cfg, tmp)
        (tmp / DONE).write_text("ok\n")

    return atomic_build(built_root(cfg), build_and_mark, done=DONE, replace_unfinished=True)
