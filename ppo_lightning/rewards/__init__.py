"""Rewards behind one protocol: ``Reward.score(RewardBatch) -> Scored`` (``base.py``).

Every kind of reward implements ``score``: it reads one ``RewardBatch`` (the whole token sequences,
the texts decoded from them on first use, the prompts as written, the records' columns; in an
episode its messages and environment) and returns one ``Scored`` (the raw score of each row,
which rows it applies to, each term's raw score). ``build_reward(cfg.reward)`` picks the reward
from ``reward.kind``: ``function`` (any importable callable, see ``function.py``; built-in rules in
``rules.py``, math answers in ``verifiable.py``) or ``model`` (a sequence classification reward
model, see ``model.py``); with ``reward.terms``, the weighted sum of several such rewards
(``weighted.py``). ``environment`` has no reward of its own (None): the episode's environment
scores it (``environment.py``, added by the factory). A plain callable ``(prompts, responses) ->
scores`` becomes a ``Reward`` once (``as_reward``); ``dispatch.py`` builds a rollout's batch and
calls ``score``.
"""

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.config.schema import get_key
from ppo_lightning.rewards.base import (
    Reward,
    RewardBatch,
    RewardError,
    Scored,
    as_reward,
    check_scores,
    fit_normalization,
)
from ppo_lightning.rewards.function import FunctionReward, import_callable
from ppo_lightning.rewards.model import RewardModel
from ppo_lightning.rewards.weighted import WeightedReward
from ppo_lightning.config.choices import REWARD_KINDS as KINDS


__all__ = [
    "KINDS",
    "Reward",
    "RewardBatch",
    "Scored",
    "as_reward",
    "RewardError",
    "check_scores",
    "fit_normalization",
    "FunctionReward",
    "import_callable",
    "RewardModel",
    "WeightedReward",
    "build_reward",
    "needs_model",
    "pop_reward_logs",
]


def pop_reward_logs(reward_fn) -> dict[str, float]:
    """What the reward functions passed to ``log_metric`` since the last call, as
    ``rewards/<term>/<name>`` (a lone function's term is its name), means over the calls."""
    if isinstance(reward_fn, WeightedReward):
        logged = reward_fn.pop_logged()
    elif hasattr(reward_fn, "pop_logged"):
        logged = {f"{reward_fn.short_name}/{k}": v for k, v in reward_fn.pop_logged().items()}
    else:
        logged = {}
    return {f"rewards/{k}": v for k, v in logged.items()}


def build_reward(cfg):
    """The scorer a ``reward`` config describes (see ``config.RewardConfig``): its ``terms``,
    weighted, when it has any; else the one scorer ``kind`` says."""
    terms = get_key(cfg, "terms")
    if terms:
        return WeightedReward(
            {
                name: (_build_one(term, f"reward.terms.{name}"), float(get_key(term, "weight", 1.0)))
                for name, term in terms.items()
            }
        )
    return _build_one(cfg, "reward")


def function_scorers(cfg) -> list:
    """The reward functions of a ``reward`` config (its one function, or its function terms), built
    without loading any reward model: for checking the data's columns before any model loads."""
    terms = get_key(cfg, "terms")
    if terms:
        return [
            _build_one(t, f"reward.terms.{n}") for n, t in terms.items() if get_key(t, "kind", "function") == "function"
        ]
    return [_build_one(cfg, "reward")] if get_key(cfg, "kind", "function") == "function" else []


def build_eval_metrics(metrics) -> dict:
    """``eval.metrics``' functions by name (each a ``FunctionReward``, so called as a reward is)."""
    return {name: FunctionReward(fn, {}, key=f"eval.metrics.{name}") for name, fn in (metrics or {}).items()}


def needs_model(cfg) -> bool:
    """Whether the reward (or one of its terms) is a reward model: built after the policy loads."""
    terms = (get_key(cfg, "terms") or {}).values()
    return get_key(cfg, "kind", "function") == "model" or any(get_key(t, "kind", "function") == "model" for t in terms)


def _build_one(cfg, key: str):
    kind = get_key(cfg, "kind", "function")
    if kind == "environment":
        if key != "reward":
            raise ConfigError(
                f"{key}.kind=environment: the environment's get_reward() is added as a term of its own (named "
                "after its class) whenever it has one; remove this term"
            )
        return None
    if kind == "function":
        if not get_key(cfg, "fn"):
            raise ConfigError(f"{key}.fn is empty: set {key}.fn=my_pkg.my_module.my_fn")
        return FunctionReward(get_key(cfg, "fn"), dict(get_key(cfg, "kwargs") or {}), key=f"{key}.fn")
    if kind == "model":
        if not get_key(cfg, "name_or_path"):
            raise ConfigError(
                f"{key}.name_or_path is empty: set it to a reward-model directory "
                f"or hub id ({key}.kind=model {key}.name_or_path=/path/to/rm)"
            )
        return RewardModel(
            get_key(cfg, "name_or_path"),
            batch_size=get_key(cfg, "batch_size", 32),
            max_length=get_key(cfg, "max_length", 512),
            dtype=get_key(cfg, "dtype", "float32"),
            label_index=get_key(cfg, "label_index", 0),
            trust_remote_code=get_key(cfg, "trust_remote_code", False),
        )
    raise ConfigError(f"{key}.kind={kind!r}: choose one of {', '.join(KINDS)}")
