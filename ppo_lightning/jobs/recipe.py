"""The contract between the jobs and a recipe (``ppo_lightning/recipes/<name>/``), its lookup and
its cached build.

A recipe is an offline demo that builds everything it needs once and reports what PPO changed:
``recipe=<name>`` (set by its experiment, ``conf/experiment/<name>.yaml``) makes
``jobs.run.train`` build it (``prepare``) before the run and call its ``evaluate`` after it. The
recipe's module (``config.recipe_module``) is found by name at run time, like a Hydra
``_target_``: nothing below the recipes imports one.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from ppo_lightning.config import recipe_folder, recipe_module, recipe_root
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.models.tiny import atomic_build

DONE = "DONE"  # the file that marks a finished build
OLD_PACKAGE = "ppo_lightning.tasks"  # what ppo_lightning.recipes was called: named in the error


@runtime_checkable
class Recipe(Protocol):
    """What a recipe's module defines (a module implements a protocol with its functions)."""

    def build(self, cfg, out: Path) -> None:
        """Write the models and prompts its experiment points at (``${recipe_dir:<name>}/...``)
        into ``out``, a fresh directory that becomes the cache once this returns (``prepare``)."""
        ...

    def evaluate(self, cfg, module: Any, out_dir: Path | None) -> str:
        """After PPO, on rank 0: the before/after table of the run's own first and last
        evaluations (``recipes.common.eval_report``), also written to ``out_dir/eval.json``."""
        ...


def load_recipe(name: str) -> Recipe:
    """The module of recipe ``name`` (``recipe``), checked against ``Recipe``. A recipe that still
    imports ``ppo_lightning.tasks`` fails in one line naming ``ppo_lightning.recipes``."""
    folder = recipe_folder(name)  # an unknown name fails here, with the choices
    try:
        module = importlib.import_module(recipe_module(name))
    except ModuleNotFoundError as e:
        if e.name is None or not (e.name == OLD_PACKAGE or e.name.startswith(OLD_PACKAGE + ".")):
            raise
        raise ConfigError(
            f"recipe={name}: {folder / 'recipe.py'} imports {e.name}; {OLD_PACKAGE} is now ppo_lightning.recipes"
        ) from None
    if not isinstance(module, Recipe):
        missing = [f for f in ("build", "evaluate") if not callable(getattr(module, f, None))]
        raise ConfigError(f"recipe={name}: {folder / 'recipe.py'} lacks {', '.join(missing)} (jobs.recipe.Recipe)")
    return module


def built_root(cfg) -> Path:
    """Where the job's recipe builds (``${recipe_dir:<recipe>}``, this seed's)."""
    return recipe_root(cfg.paths.cache_dir, cfg.recipe, cfg.seed)


def prepare(recipe: Recipe, cfg) -> Path:
    """Build the job's recipe once: ``recipe.build`` into a temporary sibling of
    ``built_root(cfg)``, renamed into place when it holds ``DONE`` (``tiny.atomic_build``). A later
    run finds it and returns at once; a killed build leaves no half-made cache, and the next run
    starts it again."""

    def build_and_mark(tmp: Path) -> None:
        recipe.build(cfg, tmp)
        (tmp / DONE).write_text("ok\n")

    return atomic_build(built_root(cfg), build_and_mark, done=DONE, replace_unfinished=True)
