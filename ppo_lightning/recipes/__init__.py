"""Recipes: self-contained jobs that build everything they need offline, then report.

A recipe (``recipe=<name>`` in the config; ``python train.py`` runs ``reviews``) generates its
data, trains its own tokenizer-sized SFT policy and reward model once (cached under
``paths.cache_dir``), and after PPO prints a before/after table on held-out prompts.
"""

from __future__ import annotations

from ppo_lightning.errors import ConfigError

RECIPES = ("reviews", "arithmetic")


def get_recipe(name: str):
    if name == "reviews":
        from ppo_lightning.recipes import reviews

        return reviews
    if name == "arithmetic":
        from ppo_lightning.recipes import arithmetic

        return arithmetic
    raise ConfigError(f"recipe={name!r}: choose one of {list(RECIPES)} or null")
