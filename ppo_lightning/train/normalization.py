"""Reward normalisation of a run ([N+]): the scorer with its ``(gain, bias)``, and the fit of that
map on reference samples when the run starts.

Every raw score goes through ``gain * raw + bias`` (``rewards.normalized``). With
``reward.normalize`` the map is fitted once per run (a resumed run restores it from its
checkpoint) so that the reference's samples score mean 0, std 1 (``rewards.fit_normalization``);
otherwise it is ``reward.gain`` and ``reward.bias``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from ppo_lightning.algo.rollout import Sampler, reference_scores
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.rewards import fit_normalization, pop_reward_logs

log = logging.getLogger("ppo_lightning.train.module")  # the name its lines have always had in the run log

# the normalisation samples' own stream: the training stream does not move
FIT_SEED_OFFSET = 7919


@dataclasses.dataclass(frozen=True)
class NormalizedReward:
    """The run's reward with its normalisation, as one object. ``fn``: ``(prompts, responses) ->
    raw scores``; ``norm``: the ``(gain, bias)`` every raw score goes through, or None to fit it
    on ``fit_samples`` reference samples when the run starts (``fit``); ``value_head_from_reward``:
    the value head was copied from the reward model's raw head, so the fit maps it too."""

    fn: Callable
    norm: tuple[float, float] | None = (1.0, 0.0)
    fit_samples: int = 256
    value_head_from_reward: bool = False


@torch.no_grad()
def fit(module) -> tuple[float, float]:
    """Fix a ``PPOModule``'s normalisation from the raw scores of reference samples on this rank's
    share of ``fit_samples`` of the run's prompts ([N+]; ``rewards.fit_normalization``), sampled in
    the rollouts' numerics with a generator of their own (the training stream does not move). A
    value head copied from the reward model's raw head is mapped onto the new scale too. Returns
    the ``(gain, bias)``, also set on the module's algorithm."""
    spec: NormalizedReward = module.reward_normalization
    world, rt = module.trainer.world_size, module.runtime
    need = spec.fit_samples // max(1, world)
    if need < 1:  # config.validate refuses it when the process count is known before launch
        raise ConfigError(
            f"reward.normalize_samples={spec.fit_samples} is split over {world} ranks "
            f"and leaves none for some; set it to at least {2 * world}"
        )
    with rt.rollout_context(module.ref_lm):
        generator = rt.new_generator(module.seed + FIT_SEED_OFFSET, stride=1)
        raw = reference_scores(
            Sampler(module.ref_sampler, module.sampling, generator, module.algo.episodes),
            module.reward_fn,
            module.tokenizer,
            module.trainer.datamodule.normalization_batches(need),
            module.device,
        )
    gain, bias = fit_normalization(
        raw, rt.reduce_sum if world > 1 else None, source=getattr(module.reward_fn, "name", "the reward")
    )
    pop_reward_logs(module.reward_fn)  # log_metric calls of the fit are no iteration's
    module.algo.reward_norm = (gain, bias)
    if spec.value_head_from_reward:
        module.policy.v_head.weight.mul_(gain)
        module.policy.v_head.bias.mul_(gain).add_(bias)
    log.info("reward normalisation from %d reference samples: gain %.4g, bias %.4g", len(raw), gain, bias)
    return gain, bias
