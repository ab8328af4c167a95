"""Scoring a batch of responses: the one place that decides how each kind of scorer is called.

A reward model that shares the policy's vocabulary reads token ids (``RewardModel.token_input``);
a scorer with ``score_applies`` (a reward function, weighted terms, an environment's
``get_reward``) gets ``base.RewardInputs``; any other callable gets ``(prompts, responses)`` as
decoded text. Every path returns a ``Scored``: the raw score of each row, which rows some reward
applies to, and each term's raw score.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import torch
from torch import Tensor

from ppo_lightning.rewards.base import RewardInputs


class Scored(NamedTuple):
    """What scoring a batch gives: ``total [B]`` the raw score (0 where no reward applies),
    ``applies [B]`` bool (False where every term returned None: "does not apply to this
    response"), ``terms`` each ``reward.terms`` term's raw score ``[B]`` (NaN where that term
    returned None; empty without terms)."""

    total: Tensor
    applies: Tensor
    terms: dict[str, Tensor]


def decode_prompts_and_responses(
    tokenizer, input_ids: Tensor, responses: Tensor, response_mask: Tensor
) -> tuple[list[str], list[str]]:
    """Prompt and response texts such that ``prompt + response`` is the decoded whole sequence.

    A response decoded on its own can lose the space (or other joiner) that the tokenizer only
    emits between tokens: word-level and SentencePiece tokenizers do. So the whole sequence is
    decoded and the response is what follows the decoded prompt; the reward then judges exactly
    the text a user would read.
    """
    pad = tokenizer.pad_token_id
    responses = responses.masked_fill(response_mask == 0, pad)
    prompts = tokenizer.batch_decode(input_ids, skip_special_tokens=True)
    full = tokenizer.batch_decode(torch.cat([input_ids, responses], dim=1), skip_special_tokens=True)
    alone = None
    texts = []
    for i, (p, f) in enumerate(zip(prompts, full)):
        if f.startswith(p):
            texts.append(f[len(p) :])
        else:  # a tokenizer whose joint decoding rewrites the prompt: fall back to the response alone
            alone = alone or tokenizer.batch_decode(responses, skip_special_tokens=True)
            texts.append(alone[i])
    return prompts, texts


def score_responses(
    reward_fn: Callable,
    tokenizer,
    input_ids: Tensor,
    attention_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    prompts: list | None = None,
    columns: list[dict] | None = None,
) -> Tensor:
    """The scorer's raw score of each row, float32, on the rollout's device; NaN where no reward
    applies (``score_terms``)."""
    total, applies, _ = score_terms(
        reward_fn, tokenizer, input_ids, attention_mask, responses, response_mask, prompts, columns
    )
    return torch.where(applies, total, torch.full_like(total, float("nan")))


def score_terms(
    reward_fn: Callable,
    tokenizer,
    input_ids: Tensor,
    attention_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    prompts: list | None = None,
    columns: list[dict] | None = None,
) -> Scored:
    """The ``Scored`` of single-turn responses, on the rollout's device.

    ``applies`` is False where the reward (every term, with ``reward.terms``) returned None: "does
    not apply to this response"; the score there is 0. The terms' raw scores are NaN where that
    term returned None, and the dict is empty without ``reward.terms``.

    A reward model that shares the policy's vocabulary (``RewardModel.token_input``) reads the
    token ids directly. A scorer with ``score_applies`` (a reward function, weighted terms) gets
    ``RewardInputs``: the decoded texts, and each row's prompt as the user wrote it and its
    record's ``columns`` when the batch has them; any other scorer gets ``(prompts, responses)``
    as decoded text.
    """
    device = input_ids.device
    if getattr(reward_fn, "token_input", False):
        ids = torch.cat([input_ids, responses], dim=1)
        mask = torch.cat([attention_mask, response_mask.to(attention_mask.dtype)], dim=1)
        scores = reward_fn.score_tokens(ids, mask).float().to(device)
        return Scored(scores, torch.ones_like(scores, dtype=torch.bool), {})
    prompt_texts, texts = decode_prompts_and_responses(tokenizer, input_ids, responses, response_mask)
    if not hasattr(reward_fn, "score_applies"):
        scores = torch.as_tensor(reward_fn(prompt_texts, texts), dtype=torch.float32).to(device)
        return Scored(scores, torch.ones_like(scores, dtype=torch.bool), {})
    completion_ids = None
    if getattr(reward_fn, "trl_style", False):
        completion_ids = [row[m > 0].tolist() for row, m in zip(responses.cpu(), response_mask.cpu())]
    inputs = RewardInputs(prompt_texts, texts, completion_ids, prompts, columns)
    out = reward_fn.score_applies(inputs)
    total, applies, terms = out if len(out) == 3 else (*out, {})
    total = torch.where(applies, total, torch.zeros_like(total))
    return Scored(total.to(device), applies.to(device), {k: v.to(device) for k, v in terms.items()})


def score_episodes(reward_fn: Callable, tokenizer, played, error_reward: float = 0.0) -> Scored:
    """``score_terms`` for multi-turn episodes (``played``, an ``envs.EpisodeBatch``): the reward sees the whole conversation (a reward
    function: ``prompts`` the episode's prompt messages, ``completions`` its messages after them,
    ``completion_ids`` every response token, ``environments``; a reward model: the rendered
    sequence). An episode whose environment raised scores ``error_reward``, its terms NaN."""
    eps, P, device = played.episodes, played.context_length, played.loss_mask.device
    prompt_ids, responses = played.query_responses[:, :P], played.query_responses[:, P:]
    response_attention = played.attention_mask[:, P:]
    if getattr(reward_fn, "token_input", False):
        total = reward_fn.score_tokens(played.query_responses, played.attention_mask).float().to(device)
        applies, terms = torch.ones_like(total, dtype=torch.bool), {}
    else:
        prompt_texts, texts = decode_prompts_and_responses(tokenizer, prompt_ids, responses, response_attention)
        if not hasattr(reward_fn, "score_applies"):
            total = torch.as_tensor(reward_fn(prompt_texts, texts), dtype=torch.float32).to(device)
            applies, terms = torch.ones_like(total, dtype=torch.bool), {}
        else:
            inputs = RewardInputs(
                prompt_texts,
                texts,
                [e.response_ids for e in eps],
                [e.prompt_messages for e in eps],
                [e.record.columns for e in eps],
                completions=[e.completion for e in eps],
                environments=[getattr(e.env, "environment", None) or e.env for e in eps],
            )
            out = reward_fn.score_applies(inputs)
            total, applies, terms = out if len(out) == 3 else (*out, {})
            total = torch.where(applies, total, torch.zeros_like(total)).to(device)
            applies, terms = applies.to(device), {k: v.to(device) for k, v in terms.items()}
    failed = torch.tensor([e.env_error is not None for e in eps], dtype=torch.bool, device=device)
    if failed.any():  # the environment broke: its score, not the reward's
        total = torch.where(failed, torch.full_like(total, error_reward), total)
        applies = applies | failed
        terms = {k: torch.where(failed, torch.full_like(v, float("nan")), v) for k, v in terms.items()}
    return Scored(total, applies, terms)
