"""Reward normalisation of a run ([N+]): the scorer with its ``(gain, bias)``, and the fit of that
map on reference samples when the run starts.

Every raw score goes through ``gain * raw + bias`` (``algo.rollout.normalized``). With
``reward.normalize`` the map is fitted once per run (a resumed run restores it from its
checkpoint) so that the reference's samples score mean 0, std 1 (``rewards.fit_normalization``);
otherwise it is ``reward.gain`` and ``reward.bias``.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.rewards import fit_normalization
from ppo_lightning.rollouts import Prompts, RolloutWorker

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


def samples_per_rank(spec: NormalizedReward, world: int) -> int:
    """This rank's share of ``fit_samples`` (``reward.normalize_samples``) over ``world`` ranks."""
    need = spec.fit_samples // max(1, world)
    if need < 1:  # config.validate refuses it when the process count is known before launch
        raise ConfigError(
            f"reward.normalize_samples={spec.fit_samples} is split over {world} ranks "
            f"and leaves none for some; set it to at least {2 * world}"
        )
    return need


@torch.no_grad()
def fit(worker: RolloutWorker, batches, device, generator: torch.Generator, reduce=None) -> tuple[float, float]:
    """The ``(gain, bias)`` of the reward normalisation ([N+]; ``rewards.fit_normalization``),
    from the raw returns of the reference's episodes: ``worker`` plays ``batches`` (this rank's
    share of the run's prompts, moved to ``device``) through the reference's backend, with ``generator``, a stream of
    its own (the training stream does not move), as the rollouts play and score theirs (an
    episode's return is its score plus its turn rewards; NaN where no reward applies).
    ``reduce`` sums over ranks (None: one process)."""
    raw = []
    for batch in batches:
        ep = worker.play(Prompts.of(batch, device), generator)
        raw.append(torch.where(ep.scored, ep.returns, torch.full_like(ep.returns, float("nan"))))
    raw = torch.cat(raw)
    gain, bias = fit_normalization(raw, reduce, source=getattr(worker.reward_fn, "name", "the reward"))
    log.info("reward normalisation from %d reference samples: gain %.4g, bias %.4g", len(raw), gain, bias)
    return gain, bias


@torch.no_grad()
def fit_for_run(
    spec: NormalizedReward, worker: RolloutWorker, ref_lm, policy, datamodule, runtime, seed: int, world: int, device
) -> tuple[float, float]:
    """The run's ``(gain, bias)``, fitted once when it starts: ``fit`` on the reference's episodes
    (``worker`` with the reference's backend) over this rank's share of ``spec.fit_samples``
    prompts of ``datamodule`` (on ``device``), played in the rollouts' numerics (``runtime.rollout_context``) with
    a stream of their own (``seed + FIT_SEED_OFFSET``). A value head copied from the reward
    model's raw head (``spec.value_head_from_reward``) is mapped onto the new scale too."""
    batches = datamodule.normalization_batches(samples_per_rank(spec, world))
    with runtime.rollout_context(ref_lm):
        generator = runtime.new_generator(seed + FIT_SEED_OFFSET, stride=1)
        gain, bias = fit(worker, batches, device, generator, runtime.reduce_sum if world > 1 else None)
    if spec.value_head_from_reward:
        policy.v_head.weight.mul_(gain)
        policy.v_head.bias.mul_(gain).add_(bias)
    return gain, bias
