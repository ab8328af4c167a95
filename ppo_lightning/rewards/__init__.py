"""Rewards behind one interface: ``reward_fn(prompts, responses) -> scores [B]``.

``build_reward(cfg.reward)`` picks the scorer from ``reward.kind``: ``function`` (any importable
callable, see ``function.py``; built-in rules in ``rules.py``) or ``model`` (a sequence
classification reward model, see ``model.py``).
"""

from ppo_lightning.errors import ConfigError
from ppo_lightning.rewards.base import Normalization, RewardError, check_scores, fit_normalization, normalized
from ppo_lightning.rewards.function import FunctionReward, import_callable
from ppo_lightning.rewards.model import RewardModel
from ppo_lightning.choices import REWARD_KINDS as KINDS


__all__ = [
    "KINDS",
    "Normalization",
    "RewardError",
    "check_scores",
    "fit_normalization",
    "normalized",
    "FunctionReward",
    "import_callable",
    "RewardModel",
    "build_reward",
]


def build_reward(cfg):
    """The scorer a ``reward`` config describes (see ``config.RewardConfig``)."""
    if cfg.kind == "function":
        if not cfg.fn:
            raise ConfigError("reward.fn is empty: set reward.fn=my_pkg.my_module.my_fn")
        return FunctionReward(cfg.fn, dict(cfg.kwargs or {}))
    if cfg.kind == "model":
        if not cfg.name_or_path:
            raise ConfigError(
                "reward.name_or_path is empty: set it to a reward-model directory "
                "or hub id (reward=model reward.name_or_path=/path/to/rm)"
            )
        return RewardModel(
            cfg.name_or_path,
            batch_size=cfg.batch_size,
            max_length=cfg.max_length,
            dtype=cfg.dtype,
            label_index=cfg.label_index,
            trust_remote_code=cfg.trust_remote_code,
        )
    raise ConfigError(f"reward.kind={cfg.kind!r}: choose one of {', '.join(KINDS)}")
