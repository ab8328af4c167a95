"""Typed schemas for every config group: each key's default, type, range check and doc, together.

Each field is declared once: its type annotation, its default and its check (``param``), and the
docstring under it (litgpt style). ``docs/config.md`` is generated from these by
``python docs/gen_config.py`` (a test fails when it is stale), and ``validate`` checks every
field's range and choices from the same declaration. Choice lists come from ``choices.py``, which
imports nothing: loading this module imports no torch, Lightning or transformers.

``conf/train.yaml`` starts its defaults list with ``train_schema`` (registered below), so Hydra
merges every YAML and command-line override into these dataclasses while composing: an unknown key
(``ppo.clpi=0.1``) or a wrong type (``ppo.clip=abc``) fails at composition, naming the key, before
anything is loaded. ``validate(cfg)`` then checks ranges and cross-group constraints.
"""

from __future__ import annotations

from pathlib import Path

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

from ppo_lightning.config import choices
from ppo_lightning.config.compat import check_moved_keys, is_placeholder, MOVED_KEYS, MOVED_MODULES, REMOVED_KEYS
from ppo_lightning.config.data import DataConfig
from ppo_lightning.config.env import EnvConfig, ToolsConfig
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.config.eval import EvalConfig
from ppo_lightning.config.recipes import recipe_folder, recipe_module, recipe_root
from ppo_lightning.config.model import LoRAConfig, ModelConfig, RefConfig, TinyModelConfig
from ppo_lightning.config.optimizer import OptimizerConfig
from ppo_lightning.config.ppo import PPOConfig
from ppo_lightning.config.reward import RewardConfig, RewardTermConfig
from ppo_lightning.config.root import PathsConfig, TrainConfig
from ppo_lightning.config.ignored import ignored_keys, IGNORED_UNLESS
from ppo_lightning.config.rules import validate
from ppo_lightning.config.rollout import RolloutConfig
from ppo_lightning.config.sampling import SamplingConfig
from ppo_lightning.config.schema import check_fields, describe_check, param
from ppo_lightning.config.task import RewardModelConfig, RewardModelTask, SFTConfig, SFTTask, StageConfig
from ppo_lightning.config.trainer import TrainerConfig


__all__ = [
    "ASSETS",
    "ConfigError",
    "DataConfig",
    "EnvConfig",
    "EvalConfig",
    "IGNORED_UNLESS",
    "LoRAConfig",
    "MOVED_KEYS",
    "MOVED_MODULES",
    "ModelConfig",
    "OptimizerConfig",
    "PPOConfig",
    "PathsConfig",
    "REMOVED_KEYS",
    "RefConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RewardModelTask",
    "RewardTermConfig",
    "RolloutConfig",
    "SFTConfig",
    "SFTTask",
    "SamplingConfig",
    "StageConfig",
    "TinyModelConfig",
    "ToolsConfig",
    "TrainConfig",
    "TrainerConfig",
    "check_fields",
    "check_moved_keys",
    "choices",
    "describe_check",
    "ignored_keys",
    "is_placeholder",
    "param",
    "recipe_folder",
    "recipe_module",
    "recipe_root",
    "register_configs",
    "validate",
]

ASSETS = Path(__file__).parents[1] / "data"  # the package's own data files (toy_prompts.txt)


# ============================================================================= registration
def register_configs() -> None:
    cs = ConfigStore.instance()
    schema = OmegaConf.structured(TrainConfig)
    # reward.terms and eval.metrics take new names without a "+": reward.terms.correct.fn=my.fn
    OmegaConf.set_struct(schema.reward.terms, False)
    OmegaConf.set_struct(schema.eval.metrics, False)
    cs.store(name="train_schema", node=schema)
    # the task=sft / task=reward_model nodes: conf/task/<name>.yaml puts them at `task`
    cs.store(group="task", name="sft_schema", node=SFTTask)
    cs.store(group="task", name="reward_model_schema", node=RewardModelTask)
    if not OmegaConf.has_resolver("ppo_asset"):
        # ${ppo_asset:toy_prompts.txt} -> a data file shipped inside the package
        OmegaConf.register_new_resolver("ppo_asset", lambda name: str(ASSETS / name))
    if not OmegaConf.has_resolver("recipe_dir"):
        # ${recipe_dir:reviews} -> where recipe=reviews builds its models and prompts (this seed's)
        OmegaConf.register_new_resolver("recipe_dir", _recipe_dir)


def _recipe_dir(name: str, *, _root_) -> str:
    return str(recipe_root(_root_.paths.cache_dir, name, _root_.seed))


register_configs()
