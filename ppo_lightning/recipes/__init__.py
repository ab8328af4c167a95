"""Recipes: self-contained jobs that build everything they need offline, then report.

A recipe (``recipe=<name>``, set by the job that needs it: ``conf/experiment/preset/*.yaml``)
generates its data, trains its own tokenizer-sized SFT policy and reward model once (cached under
``paths.cache_dir``), and after PPO prints a before/after table on held-out prompts: the run's own
first and last evaluation (``eval.*``, set by the preset; ``recipes.common.eval_report``). Each
recipe module offers ``root(cfg)``, ``prepare(cfg)`` and ``evaluate(cfg, module, out_dir)``.
"""

from __future__ import annotations

from pathlib import Path

from ppo_lightning.errors import ConfigError

RECIPES = {
    "reviews": "reviews-v3",
    "arithmetic": "arithmetic-v2",
    "math_chat": "math_chat-v1",
    "calculator_tool": "calculator_tool-v1",
}
"""Recipe name -> its cache directory under ``paths.cache_dir``, the one place each is named
(configs reach it as ``${recipe_dir:<name>}``). Bump the version when a recipe's data or models
change, so no run reuses an old build."""


def recipe_root(cache_dir: str | Path, name: str) -> Path:
    """Where recipe ``name`` builds its models and prompts."""
    if name not in RECIPES:
        raise ConfigError(f"recipe={name!r}: choose one of {list(RECIPES)} or null")
    return Path(cache_dir) / RECIPES[name]


def get_recipe(name: str):
    """The recipe module ``name`` (imported on demand: recipes pull in the stages and examples)."""
    recipe_root(".", name)  # an unknown name fails here, with the choices
    import importlib

    return importlib.import_module(f"ppo_lightning.recipes.{name}")
