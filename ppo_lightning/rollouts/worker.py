"""``RolloutWorker``: the one object that turns records into scored episodes.

Training, evaluation and the reward normalisation's fit all sample through a worker; nothing
else pairs a generation backend with a reward. One call, ``play``, does the whole rollout side::

    prompts (records, tokenised)
      -> the backend samples (with an environment: turn by turn, the environment answering)
      -> the reward scores each episode (with an environment: while its instance is live)
      -> Episodes (frozen: tokens, masks, the engine's logprobs, raw scores, the policy's version)

What a run derives from the episodes with its own models (the reference's and the old policy's
logprobs, values, advantages) is the update's: ``algo.rollout.finish_rollout``.
"""

from __future__ import annotations

import dataclasses
import time
import torch

from ppo_lightning.envs import EpisodeRunner, SingleTurn
from ppo_lightning.generation import GenerationBackend, SamplingParams
from ppo_lightning.rewards import Reward, Scored, as_reward, pop_reward_logs
from ppo_lightning.rollouts.records import Episodes, Prompts


@dataclasses.dataclass(frozen=True)
class RolloutWorker:
    """Plays records through ``backend`` as ``params`` say and scores them with ``reward_fn`` (a
    ``rewards.Reward``; a plain ``(prompts, responses)`` callable is wrapped once, here), the
    texts ``tokenizer`` decodes. ``runner`` plays each record as an episode of the run's
    environment (``envs.EpisodeRunner``, ``env``), or of the null environment, one response
    (``envs.SingleTurn``, the default). An evaluation or the normalisation's fit plays with other
    params or another backend: ``replace``."""

    backend: GenerationBackend
    params: SamplingParams
    reward_fn: Reward
    tokenizer: object
    runner: EpisodeRunner | SingleTurn | None = None  # None: SingleTurn(tokenizer)

    def __post_init__(self):
        object.__setattr__(self, "reward_fn", as_reward(self.reward_fn))
        if self.runner is None:
            object.__setattr__(self, "runner", SingleTurn(self.tokenizer))

    def replace(self, **changes) -> "RolloutWorker":
        """This worker with other fields (``params``: greedy evaluation; ``backend``: the
        reference's)."""
        return dataclasses.replace(self, **changes)

    @property
    def max_policy_tokens(self) -> int:
        """The most policy tokens one episode can hold: one turn's ``sampling.max_new_tokens``, or
        with an environment every turn's (``EpisodeRunner.max_policy_tokens``)."""
        return self.runner.max_policy_tokens(self.params.max_new_tokens)

    @torch.no_grad()
    def play(self, prompts: Prompts, generator: torch.Generator | None = None, policy_version: int = 0) -> Episodes:
        """One episode per row of ``prompts``, sampled from ``generator``'s stream and scored; the
        reward functions' ``log_metric`` calls of this batch go with it (``Episodes.reward_logs``).
        Every policy token is tagged with the version of the weights the backend sampled, when
        the policy is at ``policy_version`` (``GenerationBackend.weights_version``;
        ``Episodes.token_versions``): the record an off-policy update reads its staleness from,
        token by token."""
        t0 = time.perf_counter()
        played = self.runner.play(prompts, self.backend, self.params, generator, score=self._score_live)
        scored = Scored(*played.scores)
        return Episodes(
            query_responses=played.query_responses,
            attention_mask=played.attention_mask,
            response_mask=played.loss_mask,
            context_length=played.context_length,
            raw_scores=scored.total,
            scored=scored.applies,
            term_scores=scored.terms,
            contains_eos=played.stopped,
            turn_rewards=played.turn_rewards,
            engine_logprobs=played.engine_logprobs,
            played=played,
            records=(prompts.texts, prompts.columns) if prompts.texts is not None else None,
            reward_logs=pop_reward_logs(self.reward_fn),
            token_versions=torch.where(played.loss_mask > 0, self.backend.weights_version(policy_version), -1),
            play_time_s=time.perf_counter() - t0,
        )

    def _score_live(self, played) -> Scored:
        """The reward of a batch as it is played (with an environment: each wave while its
        instances are live, since a TRL reward may read an environment's state)."""
        return played.scored_by(self.reward_fn, self.tokenizer, self.runner.error_reward)

    def score(self, episodes: Episodes, reward: Reward) -> Scored:
        """Another reward's ``Scored`` of episodes already played (``eval.metrics``): as the
        worker's own reward would see them, the environments no longer live."""
        return episodes.played.scored_by(reward, self.tokenizer, self.runner.error_reward)

    def sync_weights(self) -> float | None:
        """The backend takes the policy's new weights (``GenerationBackend.sync_weights``)."""
        return self.backend.sync_weights()

    def close(self) -> None:
        """The run is over: the backend frees its engine, and the environments kept for reuse
        (``env.reuse_instances``) are closed."""
        self.backend.close()
        self.runner.close()
