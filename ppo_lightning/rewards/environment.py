"""An environment that scores its own episodes: TRL's ``get_reward()``, as one more reward term.

An environment written for TRL's GRPOTrainer ``environment_factory`` may define ``get_reward()``:
no argument, a float from its own state once the episode is over (did the game end in a win?),
possibly ``async`` (a judge it calls over the network). TRL adds it as a reward source with weight
1, named after the class; so does ``env=tools env.environment=...`` (``with_environment_reward``):
the run's reward becomes ``reward.terms`` plus a term of that name, and ``rewards/<Class>/mean``
is logged like any term's. As in TRL, it may be the only reward: ``reward=environment``. With a
``reset``/``step`` environment, ``reward=environment`` takes the turns' ``EnvStep`` rewards alone
(``StepRewardsOnly``).
"""

from __future__ import annotations

import asyncio
import inspect

import torch

from ppo_lightning.rewards.base import Reward, RewardBatch, Scored, check_scores


class EnvironmentReward(Reward):
    """``get_reward()`` of each episode's environment (``RewardBatch.environments``); None
    where an episode has no environment of that class (it does not apply there)."""

    def __init__(self, cls: type):
        self.cls, self.name = cls, cls.__name__

    def score(self, batch: RewardBatch) -> Scored:
        envs = batch.environments or [None] * len(batch)
        items = [e.get_reward() if type(e) is self.cls else None for e in envs]  # exact type, as TRL
        pending = [i for i, x in enumerate(items) if inspect.isawaitable(x)]
        if pending:  # an async get_reward: the batch's calls awaited together

            async def gather():
                return await asyncio.gather(*(items[i] for i in pending))

            for i, x in zip(pending, asyncio.run(gather())):
                items[i] = x
        applies = torch.tensor([x is not None for x in items], dtype=torch.bool)
        values = check_scores([0.0 if x is None else x for x in items], batch.prompt_texts, f"{self.name}.get_reward")
        return Scored(values, applies, {})


class StepRewardsOnly(Reward):
    """``reward=environment`` with a ``reset``/``step`` environment and no ``get_reward``: the
    episode's return is the sum of its turns' ``EnvStep.reward`` alone, so the final score is 0
    on every episode (it applies everywhere: an episode the environment gave no reward scored 0,
    as TRL scores it)."""

    name = "environment"

    def score(self, batch: RewardBatch) -> Scored:
        n = len(batch)
        return Scored(torch.zeros(n), torch.ones(n, dtype=torch.bool), {})


def with_environment_reward(reward_fn, owners: list[type]):
    """``reward_fn`` plus each class's ``get_reward`` as a term named after it (weight 1): the
    run's terms with more, or the one reward as a term under its own name beside them, or the
    only terms (``reward_fn`` None: ``reward=environment``). No owners and no ``reward_fn``: the
    turns' ``EnvStep`` rewards are the whole return (``StepRewardsOnly``)."""
    from ppo_lightning.rewards.weighted import WeightedReward

    if not owners:
        return StepRewardsOnly() if reward_fn is None else reward_fn
    if reward_fn is None:
        terms = {}
    elif isinstance(reward_fn, WeightedReward):
        terms = dict(reward_fn.terms)
    else:
        terms = {getattr(reward_fn, "short_name", None) or "reward": (reward_fn, 1.0)}
    for cls in owners:
        terms[cls.__name__] = (EnvironmentReward(cls), 1.0)
    return WeightedReward(terms)
