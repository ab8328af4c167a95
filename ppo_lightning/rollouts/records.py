"""What goes into a rollout worker and what comes out: ``Prompts`` (a batch of records, tokenised)
and ``Episodes`` (the same records played and scored). Both are frozen: a worker's output is
complete when it is made, so it can be handed to the update as it is, or across a process.

Layout of a batch of episodes (``P`` prompt positions, ``R`` response positions, ``T = P + R``)::

    query_responses  [B, T]   <pad><pad> prompt tokens | response tokens <eos> <pad> <pad>
    attention_mask   [B, T]      0    0    1 ... 1     |   1  ...  1      1     0     0
    response_mask    [B, R]                            |   1  ...  1      1     0     0

Everything after the first EOS is masked out of every loss and statistic ([N+] detail). In a
multi-turn episode the environment's tokens are attended to (``attention_mask`` 1) but are not
the policy's (``response_mask`` 0).
"""

from __future__ import annotations

import dataclasses

from torch import Tensor


@dataclasses.dataclass(frozen=True)
class Prompts:
    """A batch of left-padded prompts: ``input_ids`` and ``attention_mask`` ``[B, P]``, and each
    row's prompt as written (``texts``) with its record's ``columns``, None when the data has none
    (what a reward function and an environment read)."""

    input_ids: Tensor
    attention_mask: Tensor
    texts: list | None = None
    columns: list[dict] | None = None

    @classmethod
    def of(cls, batch: dict, device=None) -> "Prompts":
        """The prompts of a DataLoader batch (its tensors moved to ``device``, when given)."""
        ids, am = batch["input_ids"], batch["attention_mask"]
        if device is not None:
            ids, am = ids.to(device), am.to(device)
        return cls(ids, am, batch.get("prompts"), batch.get("columns"))

    def repeated(self, n: int) -> "Prompts":
        """Each row ``n`` times in a row: a group of ``n`` samples of one prompt on consecutive rows."""
        if n == 1:
            return self
        return Prompts(
            self.input_ids.repeat_interleave(n, dim=0),
            self.attention_mask.repeat_interleave(n, dim=0),
            None if self.texts is None else [row for row in self.texts for _ in range(n)],
            None if self.columns is None else [row for row in self.columns for _ in range(n)],
        )


class PromptResponseRows:
    """What a batch of rows of ``query_responses [B, T]`` says of itself: each row a prompt
    left-padded to ``context_length`` columns, then what followed it (a response, or an episode's
    turns). Shared by the worker's ``Episodes`` and the update's ``algo.rollout.Rollout``."""

    query_responses: Tensor
    context_length: int

    @property
    def batch_size(self) -> int:
        return self.query_responses.shape[0]

    @property
    def responses(self) -> Tensor:
        """``[B, R]``: everything after the prompts."""
        return self.query_responses[:, self.context_length :]


@dataclasses.dataclass(frozen=True)
class Episodes(PromptResponseRows):
    """A batch of records played and scored by a ``worker.RolloutWorker``: everything the update
    needs from the rollout side, and nothing it derives (logprobs of the trainer's models,
    values, advantages: ``algo.rollout.Rollout``).

    Each row is one episode: its prompt and everything after it in ``query_responses``, the
    policy's own tokens in ``response_mask``. A single-turn episode is one response."""

    query_responses: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] long: every real token, the environment's included
    response_mask: Tensor  # [B, R] float: 1 on the policy's own tokens, up to and including each stop
    context_length: int  # P
    raw_scores: Tensor  # [B] the reward's own output (0 where none applies; an environment error's score)
    scored: Tensor  # [B] bool: some reward applies (False: every term returned None; masked out)
    term_scores: dict[str, Tensor]  # reward.terms: each term's raw score [B], NaN where it returned None
    contains_eos: Tensor  # [B] bool: the last policy turn ended on a stop (EOS, a stop token or string)
    turn_rewards: Tensor | None  # [B, R] each turn's EnvStep.reward on its last token; None: single-turn
    engine_logprobs: Tensor | None  # [B, R] an engine backend's logprobs of the policy's tokens, 0 elsewhere
    played: object  # the envs.EpisodeBatch as played (metrics, dumps); None: single-turn
    records: tuple[list, list] | None  # each row's prompt as written and its columns (dumps); None: none
    reward_logs: dict[str, float]  # rewards/<term>/<name>: what the reward functions passed to log_metric
    token_versions: Tensor  # [B, R] long: the policy version (iteration) that sampled each policy token; -1 elsewhere
    play_time_s: float  # wall time of sampling, stepping the environments and scoring

    @property
    def returns(self) -> Tensor:
        """``[B]`` each episode's raw return: the reward's score plus the environment's turn rewards."""
        return self.raw_scores if self.turn_rewards is None else self.raw_scores + self.turn_rewards.sum(1)
