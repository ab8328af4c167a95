"""What a batch of played episodes holds: each record (``Record``), each episode as it was
played (``Transcript``) and the batch as the rollout's tensors (``EpisodeBatch``), which knows how
it is scored, shown, measured and dumped.
"""

from __future__ import annotations

import dataclasses
from collections import Counter, defaultdict
from typing import Any

import torch
from torch import Tensor

from ppo_lightning.envs.base import Message
from ppo_lightning.envs.template import conversation_text, jsonable
from ppo_lightning.envs.tools import COUNTERS
from ppo_lightning.rewards.base import Scored
from ppo_lightning.rewards.dispatch import score_episodes


@dataclasses.dataclass
class Record:
    """What ``Environment.reset`` reads: the prompt as written (a string or chat messages) and
    the record's metadata columns (``data.records.PromptRecord``'s fields)."""

    prompt: str | list[Message]
    columns: dict[str, Any]

    @property
    def is_chat(self) -> bool:
        return isinstance(self.prompt, list)


@dataclasses.dataclass
class Transcript:
    """One episode as it is played, written turn by turn: the prompt's ids, then the response ids
    (the policy's turns as sampled and the environment's answers), with ``loss_mask`` 1 on the
    policy's tokens. Complete once its ``EpisodeBatch`` is made."""

    record: Record
    env: Any
    prompt_messages: list[Message]
    prompt_ids: list[int]
    tools: list[dict] | None = None
    messages: list[Message] = dataclasses.field(default_factory=list)  # the prompt's, then every turn's
    response_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[int] = dataclasses.field(default_factory=list)
    turn_ends: list[int] = dataclasses.field(default_factory=list)  # each policy turn's last token, in the response
    turn_rewards: list[float | None] = dataclasses.field(default_factory=list)  # EnvStep.reward of each turn
    stopped: bool = False  # the last policy turn ended on a stop (EOS, a stop token or string)
    truncated: bool = False  # ended by a budget while the environment expected more
    env_error: str | None = None  # what the environment's step raised (on_error=count)
    done: bool = False
    info: dict[str, list[float]] = dataclasses.field(default_factory=lambda: defaultdict(list))
    counts: Counter = dataclasses.field(default_factory=Counter)
    engine_logprobs: list[float] = dataclasses.field(
        default_factory=list
    )  # an engine's, per response id (0 off policy)

    @property
    def turns(self) -> int:
        return len(self.turn_ends)

    @property
    def completion(self) -> list[Message]:
        """The conversation after the prompt: assistant turns and the environment's messages."""
        return self.messages[len(self.prompt_messages) :]

    def dump(self, reward: float | None = None, score: float | None = None) -> dict:
        """The episode as one JSON line of ``ppo.rollout_dump`` (``dump_row``)."""
        error = {"env_error": self.env_error} if self.env_error else {}
        ids = (self.prompt_ids, self.response_ids, self.loss_mask)
        return dump_row(
            self.record.columns, *ids, self.messages, self.turns, reward, score, truncated=self.truncated, **error
        )


def dump_row(columns, prompt_ids, response_ids, loss_mask, messages, turns, reward, score, **extra) -> dict:
    """One line of ``ppo.rollout_dump``, the layout single-turn and multi-turn episodes share: the
    record's columns, the token ids, the policy's tokens, the conversation, the turns, what else
    the episode says (``extra``), its raw return and its training score (left out where None)."""
    row = {
        "columns": jsonable(columns or {}),
        "prompt_ids": prompt_ids,
        "response_ids": response_ids,
        "loss_mask": loss_mask,
        "messages": messages,
        "turns": turns,
        **extra,
    }
    return row | {k: v for k, v in (("reward", reward), ("score", score)) if v is not None}


@dataclasses.dataclass(frozen=True)
class EpisodeBatch:
    """A batch of episodes as the rollout's tensors: ``query_responses [B, P + R]`` (prompts
    left-padded to ``P``, responses right-padded to ``R``), ``attention_mask`` 1 on every real
    token (the environment's too), ``loss_mask [B, R]`` 1 on the policy's tokens only,
    ``turn_rewards [B, R]`` each turn's ``EnvStep.reward`` on its last token, ``stopped [B]``."""

    episodes: list[Transcript]
    query_responses: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    turn_rewards: Tensor
    stopped: Tensor
    context_length: int
    env_time_s: float
    engine_logprobs: Tensor | None = None  # [B, R]: an engine backend's logprobs of the policy's tokens
    scores: tuple | None = None  # the reward's (total [B], applies [B], {term: [B]}), scored while live

    def scored_by(self, reward_fn, tokenizer, error_reward: float = 0.0) -> Scored:
        """The reward's ``Scored`` of the episodes (``rewards.dispatch.score_episodes``): the whole
        conversation; an episode whose environment raised scores ``error_reward``."""
        return score_episodes(reward_fn, tokenizer, self, error_reward)

    def conversations(self, tokenizer, n: int | None = None, response_mask: Tensor | None = None):
        """The first ``n`` episodes' prompt and completion as text, each message under its role
        (every message shown, whatever ``response_mask`` says)."""
        episodes = self.episodes[:n]
        return [conversation_text(e.prompt_messages) for e in episodes], [
            conversation_text(e.completion) for e in episodes
        ]

    def eval_measures(self) -> dict[str, Tensor]:
        """Each episode's ``env/turns_mean`` and ``env/tool_calls_mean`` ``[B]`` float64 (evaluation)."""
        return {
            "env/turns_mean": torch.tensor([e.turns for e in self.episodes], dtype=torch.float64),
            "env/tool_calls_mean": torch.tensor([e.counts["tool_calls"] for e in self.episodes], dtype=torch.float64),
        }

    def dump_rows(self, tokenizer, response_mask: Tensor, raw: list[float], scores: list[float]) -> list[dict]:
        """``ppo.rollout_dump``'s rows: each episode as played, its raw return and training score."""
        return [e.dump(raw[i], scores[i]) for i, e in enumerate(self.episodes)]

    def metrics(self, turn_rewards: Tensor | None = None) -> dict[str, Tensor]:
        """This rank's ``env/*`` statistics, the same names on every rank: means over its
        episodes, the counts of ``COUNTED_METRICS`` (the caller sums those over ranks), and
        with ``turn_rewards`` (the rollout's, scaled as the scores) ``env/turn_reward_mean``."""
        eps, device = self.episodes, self.loss_mask.device
        n = max(len(eps), 1)
        tokens = float(sum(len(e.response_ids) for e in eps))
        env_tokens = tokens - float(self.loss_mask.sum())
        out = {
            "env/turns_mean": sum(e.turns for e in eps) / n,
            "env/tool_calls_mean": sum(e.counts["tool_calls"] for e in eps) / n,
            "env/env_token_frac": env_tokens / max(tokens, 1.0),
            "env/truncated_frac": sum(e.truncated for e in eps) / n,
            "env/time_s": self.env_time_s,
        }
        for key in EVENTS:
            out[f"env/{key}"] = float(sum(e.counts[key] for e in eps))
        metrics = {k: torch.tensor(float(v), device=device) for k, v in out.items()}
        if turn_rewards is not None:
            metrics["env/turn_reward_mean"] = turn_rewards.sum(1).mean()
        return metrics

    def info_sums(self) -> dict[str, tuple[float, float]]:
        """``env/<key>: (sum, count)`` of every ``EnvStep.info`` scalar of these episodes (all of
        their steps), for the mean over every rank's steps."""
        sums: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        for e in self.episodes:
            for k, values in e.info.items():
                sums[f"env/{k}"][0] += sum(values)
                sums[f"env/{k}"][1] += len(values)
        return {k: (v[0], v[1]) for k, v in sums.items()}


EVENTS = (*COUNTERS[1:], "env_errors", "truncated_observations", "template_fallbacks", "budget_cut_turns")
"""What an episode counts (``Transcript.counts``) and an iteration reports as ``env/<event>``: tool
faults, environments that raised, observations cut to ``env.max_observation_tokens``, answers
tokenised after the probe because the template re-rendered the conversation, policy turns cut
short by ``env.max_total_tokens`` (before their own ``sampling.max_new_tokens``)."""
COUNTED_METRICS = tuple(f"env/{k}" for k in EVENTS)
"""The ``env/*`` metrics that count events in an iteration: summed over ranks, not averaged."""


def episode_batch(episodes: list[Transcript], pad: int, device, env_time: float) -> EpisodeBatch:
    """``episodes`` as the rollout's tensors (``EpisodeBatch``): prompts left-padded with ``pad``,
    responses right-padded, each turn reward on its turn's last token, an engine's logprobs
    where every episode has them."""
    B = len(episodes)
    P = max(len(e.prompt_ids) for e in episodes)
    R = max(1, max(len(e.response_ids) for e in episodes))
    qr = torch.full((B, P + R), pad, dtype=torch.long)
    am = torch.zeros(B, P + R, dtype=torch.long)
    loss = torch.zeros(B, R)
    turn_rewards = torch.zeros(B, R)
    for i, e in enumerate(episodes):
        p, r = len(e.prompt_ids), len(e.response_ids)
        qr[i, P - p : P] = torch.tensor(e.prompt_ids)
        am[i, P - p : P + r] = 1
        if r:
            qr[i, P : P + r] = torch.tensor(e.response_ids)
            loss[i, :r] = torch.tensor(e.loss_mask, dtype=torch.float32)
        for end, reward in zip(e.turn_ends, e.turn_rewards):
            if reward is not None and end >= 0:
                turn_rewards[i, end] += reward
    stopped = torch.tensor([e.stopped for e in episodes], dtype=torch.bool)
    engine = None
    if episodes and all(e.engine_logprobs for e in episodes):
        engine = torch.zeros(B, R)
        for i, e in enumerate(episodes):
            engine[i, : len(e.engine_logprobs)] = torch.tensor(e.engine_logprobs[: len(e.response_ids)])
        engine = engine.to(device)
    return EpisodeBatch(
        episodes,
        qr.to(device),
        am.to(device),
        loss.to(device),
        turn_rewards.to(device),
        stopped.to(device),
        P,
        env_time,
        engine,
    )


def cat_scores(parts: list[tuple]) -> tuple:
    """The waves' ``(total, applies, terms)`` joined in row order."""
    if len(parts) == 1:
        return parts[0]
    total = torch.cat([p[0] for p in parts])
    applies = torch.cat([p[1] for p in parts])
    terms = {k: torch.cat([p[2][k] for p in parts]) for k in parts[0][2]}
    return total, applies, terms
