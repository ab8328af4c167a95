"""The null environment: every record is a one-turn episode, one response that nothing answers.

``SingleTurn`` plays a batch the way ``EpisodeRunner`` does, through the same interface, so a
rollout never asks whether it is multi-turn: it samples every row in one backend call on the
prompts as the data tokenised them, and its ``SingleTurnBatch`` answers what an ``EpisodeBatch``
answers (tensors, scores, texts, metrics, dump rows) for one turn. No environment instance, no
per-episode object: the single-turn path costs what sampling and scoring cost.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ppo_lightning.envs.batch import dump_row
from ppo_lightning.generation import stopped_rows
from ppo_lightning.rewards.base import Scored, decode_prompts_and_responses
from ppo_lightning.rewards.dispatch import score_sequences


@dataclasses.dataclass(frozen=True)
class SingleTurnBatch:
    """One response per prompt row: ``query_responses [B, P + R]`` (the prompts as left-padded by
    the data, the responses right-padded), ``attention_mask``, ``loss_mask [B, R]`` (the
    response up to and including its stop), ``stopped [B]``, the backend's ``engine_logprobs``
    when it has its own, and the rows' prompts as written with their ``columns``."""

    query_responses: Tensor
    attention_mask: Tensor
    loss_mask: Tensor
    stopped: Tensor
    context_length: int
    engine_logprobs: Tensor | None
    texts: list | None
    columns: list[dict] | None
    scores: Scored | None = None

    turn_rewards = None  # nothing answers a single turn: no turn rewards

    @property
    def responses(self) -> Tensor:
        return self.query_responses[:, self.context_length :]

    def scored_by(self, reward_fn, tokenizer, error_reward: float = 0.0) -> Scored:
        """The reward's ``Scored`` of the responses (``rewards.dispatch.score_sequences``): each
        row's prompt as written and its columns reach a reward function."""
        return score_sequences(
            reward_fn,
            tokenizer,
            self.query_responses,
            self.attention_mask,
            self.context_length,
            self.texts,
            self.columns,
        )

    def metrics(self, turn_rewards: Tensor | None = None) -> dict[str, Tensor]:
        """No ``env/*`` metrics: there is no environment."""
        return {}

    def info_sums(self) -> dict[str, tuple[float, float]]:
        return {}

    def eval_measures(self) -> dict[str, Tensor]:
        return {}

    def conversations(self, tokenizer, n: int | None = None, response_mask: Tensor | None = None):
        """The first ``n`` rows' prompt and response texts, ``prompt + response`` the decoded
        sequence; the response's tokens are those of ``response_mask`` (the rollout's, where a row
        out of the loss shows none), else every sampled one."""
        P, rows = self.context_length, slice(0, n)
        mask = self.loss_mask[rows] if response_mask is None else response_mask
        return decode_prompts_and_responses(tokenizer, self.query_responses[rows, :P], self.responses[rows], mask)

    def dump_rows(self, tokenizer, response_mask: Tensor, raw: list[float], scores: list[float]) -> list[dict]:
        """``ppo.rollout_dump``'s rows: one single-turn episode per row (its prompt as written, its
        response as one assistant message)."""
        B, P = self.query_responses.shape[0], self.context_length
        prompts, columns = (self.texts, self.columns) if self.texts is not None else ([None] * B, [{}] * B)
        attention, rows = self.attention_mask.tolist(), []
        for i, seq in enumerate(self.query_responses.tolist()):
            ids = [t for t, a in zip(seq, attention[i]) if a]
            n_prompt = sum(attention[i][:P])
            prompt_ids, response_ids = ids[:n_prompt], ids[n_prompt:]
            prompt = prompts[i] if prompts[i] is not None else tokenizer.decode(prompt_ids, skip_special_tokens=True)
            messages = list(prompt) if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
            text = tokenizer.decode(response_ids, skip_special_tokens=True)
            loss_mask = [int(x > 0) for x in response_mask[i, : len(response_ids)].tolist()]
            messages = [*messages, {"role": "assistant", "content": text}]
            rows.append(
                dump_row(
                    columns[i] if columns is not None else None,
                    prompt_ids,
                    response_ids,
                    loss_mask,
                    messages,
                    1,
                    raw[i],
                    scores[i],
                )
            )
        return rows


class SingleTurn:
    """Plays records as one-turn episodes (``env=none``): one backend call for the whole batch."""

    error_reward = 0.0  # nothing can raise: there is no environment
    chat = False  # prompts are rendered by the data as written (not as an environment's messages)

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def max_policy_tokens(self, max_new_tokens: int) -> int:
        """A response's own limit: one turn."""
        return max_new_tokens

    def probe_tools(self) -> None:
        return None

    def reward_owners(self) -> list[type]:
        return []

    @property
    def live(self) -> int:
        return 0

    def close(self) -> None:
        """Nothing to close."""

    @torch.no_grad()
    def play(self, prompts, backend, params, generator, score=None) -> SingleTurnBatch:
        """One response per row of ``prompts`` (``rollouts.Prompts``, tokenised by the data) through
        ``backend`` as ``params`` say; ``score`` (a batch's reward) gives the batch's ``scores``."""
        ids, am = prompts.input_ids, prompts.attention_mask
        out = backend.generate(ids, am, params, generator)
        batch = SingleTurnBatch(
            query_responses=torch.cat([ids, out.responses], dim=1),  # [B, T]
            attention_mask=torch.cat([am, out.response_mask.to(am.dtype)], dim=1),
            loss_mask=out.response_mask,
            stopped=stopped_rows(out.responses, out.response_mask, params, self.tokenizer),
            context_length=ids.shape[1],
            engine_logprobs=out.logprobs,
            texts=prompts.texts,
            columns=prompts.columns,
        )
        return batch if score is None else dataclasses.replace(batch, scores=score(batch))
