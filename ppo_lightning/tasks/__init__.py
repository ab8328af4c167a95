"""Recipes: self-contained jobs that build everything they need offline, then report.

A recipe (``recipe=<name>``, set by the job that needs it: ``conf/experiment/preset/*.yaml``)
generates its data, trains its own tokenizer-sized SFT policy and reward model once (cached under
``paths.cache_dir``), and after PPO prints a before/after table on held-out prompts: the run's own
first and last evaluation (``eval.*``, set by the preset; ``recipes.common.eval_report``). Each
recipe module offers ``root(cfg)``, ``prepare(cfg)`` and ``evaluate(cfg, module, out_dir)``.
"""

from __future__ import annotations


from ppo_lightning.config import recipe_root


def get_recipe(name: str):
    """The recipe module ``name`` (imported on demand: recipes pull in the stages and examples)."""
    recipe_root(".", name)  # an unknown name fails here, with the choices
    import importlib

    return importlib.import_module(f"ppo_lightning.tasks.{name}.task")
