"""Scoring a rollout: the ``RewardBatch`` of single-turn responses or of episodes, then the
reward's ``score`` (``base.Reward``), its ``Scored`` on the rollout's device.

Every reward reads the same batch: the whole token sequences (a reward model that shares the
policy's vocabulary reads them as they are), the texts decoded from them on first use, and each
row's prompt as the user wrote it and its record's ``columns`` when the caller has them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppo_lightning.rewards.base import Reward, RewardBatch, Scored


def _scored(reward: Reward, batch: RewardBatch, device) -> Scored:
    """``reward.score(batch)`` with the score 0 where no reward applies, on ``device``."""
    total, applies, terms = reward.score(batch)
    total = torch.where(applies, total, torch.zeros_like(total))
    return Scored(total.to(device), applies.to(device), {k: v.to(device) for k, v in terms.items()})


def score_sequences(
    reward: Reward,
    tokenizer,
    query_responses: Tensor,
    attention_mask: Tensor,
    context_length: int,
    prompts: list | None = None,
    columns: list[dict] | None = None,
) -> Scored:
    """The ``Scored`` of single-turn responses, on the rollout's device: ``query_responses`` and
    ``attention_mask`` ``[B, P + R]``, the prompts left-padded to ``context_length`` (P) then the
    responses; ``prompts`` as the user wrote them and ``columns``, each row's, when the batch has
    them.

    ``applies`` is False where the reward (every term, with ``reward.terms``) returned None: "does
    not apply to this response"; the score there is 0. The terms' raw scores are NaN where that
    term returned None, and the dict is empty without ``reward.terms``.
    """
    batch = RewardBatch(query_responses, attention_mask, context_length, tokenizer, prompts, columns)
    return _scored(reward, batch, query_responses.device)


def score_responses(
    reward: Reward,
    tokenizer,
    input_ids: Tensor,
    attention_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    prompts: list | None = None,
    columns: list[dict] | None = None,
) -> Tensor:
    """The reward's raw score of each row of prompts ``input_ids`` and their ``responses``
    (``score_sequences``), float32, on the rollout's device; NaN where no reward applies."""
    ids = torch.cat([input_ids, responses], dim=1)
    mask = torch.cat([attention_mask, response_mask.to(attention_mask.dtype)], dim=1)
    total, applies, _ = score_sequences(reward, tokenizer, ids, mask, input_ids.shape[1], prompts, columns)
    return torch.where(applies, total, torch.full_like(total, float("nan")))


def score_episodes(reward: Reward, tokenizer, played, error_reward: float = 0.0) -> Scored:
    """``score_sequences`` for multi-turn episodes (``played``, an ``envs.EpisodeBatch``): the
    reward sees the whole conversation (a reward function: ``prompts`` the episode's prompt
    messages, ``completions`` its messages after them, ``completion_ids`` every response token,
    ``environments``; a reward model: the rendered sequence). An episode whose environment raised
    scores ``error_reward``, its terms NaN."""
    eps = played.episodes
    batch = RewardBatch(
        played.query_responses,
        played.attention_mask,
        played.context_length,
        tokenizer,
        prompts=[e.prompt_messages for e in eps],
        columns=[e.record.columns for e in eps],
        completions=[e.completion for e in eps],
        environments=[getattr(e.env, "environment", None) or e.env for e in eps],  # a tool env's inner one
        given_completion_ids=[e.response_ids for e in eps],
    )
    device = played.loss_mask.device
    total, applies, terms = _scored(reward, batch, device)
    failed = torch.tensor([e.env_error is not None for e in eps], dtype=torch.bool, device=device)
    if failed.any():  # the environment broke: its score, not the reward's
        total = torch.where(failed, torch.full_like(total, error_reward), total)
        applies = applies | failed
        terms = {k: torch.where(failed, torch.full_like(v, float("nan")), v) for k, v in terms.items()}
    return Scored(total, applies, terms)
