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

from ppo_lightning.envs import EpisodeRunner
from ppo_lightning.generation import GenerationBackend, SamplingParams, stopped_rows
from ppo_lightning.rewards import Reward, Scored, as_reward, pop_reward_logs
from ppo_lightning.rewards.dispatch import score_episodes, score_sequences
from ppo_lightning.rollouts.records import Episodes, Prompts


@dataclasses.dataclass(frozen=True)
class RolloutWorker:
    """Plays records through ``backend`` as ``params`` say and scores them with ``reward_fn`` (a
    ``rewards.Reward``; a plain ``(prompts, responses)`` callable is wrapped once, here), the texts
    ``tokenizer`` decodes. With ``episodes`` (an ``envs.EpisodeRunner``, ``env``) each
    record is a multi-turn episode of its environment; without, one response. An evaluation or
    the normalisation's fit plays with other params or another backend: ``replace``."""

    backend: GenerationBackend
    params: SamplingParams
    reward_fn: Reward
    tokenizer: object
    episodes: EpisodeRunner | None = None

    def __post_init__(self):
        object.__setattr__(self, "reward_fn", as_reward(self.reward_fn))

    def replace(self, **changes) -> "RolloutWorker":
        """This worker with other fields (``params``: greedy evaluation; ``backend``: the
        reference's)."""
        return dataclasses.replace(self, **changes)

    @property
    def error_reward(self) -> float:
        """The score of an episode whose environment raised (``env.error_reward``)."""
        return 0.0 if self.episodes is None else self.episodes.cfg.error_reward

    @property
    def max_policy_tokens(self) -> int:
        """The most policy tokens one episode can hold: ``sampling.max_new_tokens``, or with an
        environment every turn's (``EpisodeRunner.max_policy_tokens``)."""
        n = self.params.max_new_tokens
        return n if self.episodes is None else self.episodes.max_policy_tokens(n)

    @torch.no_grad()
    def play(self, prompts: Prompts, generator: torch.Generator | None = None, policy_version: int = 0) -> Episodes:
        """One episode per row of ``prompts``, sampled from ``generator``'s stream and scored; the
        reward functions' ``log_metric`` calls of this batch go with it (``Episodes.reward_logs``)."""
        t0 = time.perf_counter()
        if self.episodes is None:
            ids, am = prompts.input_ids, prompts.attention_mask
            out = self.backend.generate(ids, am, self.params, generator)
            query_responses = torch.cat([ids, out.responses], dim=1)  # [B, T]
            attention_mask = torch.cat([am, out.response_mask.to(am.dtype)], dim=1)
            scored = score_sequences(
                self.reward_fn,
                self.tokenizer,
                query_responses,
                attention_mask,
                ids.shape[1],
                prompts.texts,
                prompts.columns,
            )
            contains_eos = stopped_rows(out.responses, out.response_mask, self.params, self.tokenizer)
            response_mask, P, turn_rewards, engine, played = out.response_mask, ids.shape[1], None, out.logprobs, None
        else:
            played = self.episodes.run(
                prompts.texts,
                prompts.columns,
                self.backend,
                self.params,
                generator,
                prompts.input_ids.device,
                score=self._score_live,
            )
            query_responses, attention_mask, response_mask = (
                played.query_responses,
                played.attention_mask,
                played.loss_mask,
            )
            scored, contains_eos, P = Scored(*played.scores), played.stopped, played.context_length
            turn_rewards, engine = played.turn_rewards, played.engine_logprobs
        return Episodes(
            query_responses=query_responses,
            attention_mask=attention_mask,
            response_mask=response_mask,
            context_length=P,
            raw_scores=scored.total,
            scored=scored.applies,
            term_scores=scored.terms,
            contains_eos=contains_eos,
            turn_rewards=turn_rewards,
            engine_logprobs=engine,
            played=played,
            records=(prompts.texts, prompts.columns) if prompts.texts is not None else None,
            reward_logs=pop_reward_logs(self.reward_fn),
            policy_version=policy_version,
            play_time_s=time.perf_counter() - t0,
        )

    def _score_live(self, played) -> Scored:
        """The reward of a wave of episodes while their environments are live (a TRL reward may
        read an environment's state)."""
        return score_episodes(self.reward_fn, self.tokenizer, played, self.error_reward)

    def score(self, episodes: Episodes, reward: Reward) -> Scored:
        """Another reward's ``Scored`` of episodes already played (``eval.metrics``): as the
        worker's own reward would see them, the environments no longer live."""
        if episodes.played is not None:
            return score_episodes(reward, self.tokenizer, episodes.played, self.error_reward)
        texts, columns = episodes.records or (None, None)
        return score_sequences(
            reward,
            self.tokenizer,
            episodes.query_responses,
            episodes.attention_mask,
            episodes.context_length,
            texts,
            columns,
        )

    def sync_weights(self) -> float | None:
        """The backend takes the policy's new weights (``GenerationBackend.sync_weights``)."""
        return self.backend.sync_weights()

    def close(self) -> None:
        """The run is over: the backend frees its engine, and the environments kept for reuse
        (``env.reuse_instances``) are closed."""
        self.backend.close()
        if self.episodes is not None:
            self.episodes.close()
