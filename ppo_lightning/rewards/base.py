"""The reward protocol: ``Reward.score(RewardBatch) -> Scored``, for every kind of reward.

A reward function (``function.py``, TRL's signature or ``(prompts, responses)``), a reward model
(``model.py``: the text through its own tokenizer, or the policy's token ids), weighted terms
(``weighted.py``), an environment's ``get_reward`` and the turns' rewards alone
(``environment.py``) each implement one method, ``score``: it reads what it needs from one
``RewardBatch`` and returns one ``Scored``. A plain callable ``(prompts, responses) -> scores`` (a
rule of ``rules.py``, a test's function) becomes a ``Reward`` once, where the run's reward is
built or the rollout worker takes it (``as_reward``); ``dispatch.py`` builds the batch of a
rollout's responses or episodes and calls ``score``.

A ``RewardBatch`` holds the whole token sequences and decodes them only when a reward reads the
text (``prompt_texts``, ``responses``; ``prompt + response`` is the decoded whole sequence), and
builds ``completion_ids`` only when a function asks for them: a reward model that reads the
policy's token ids never decodes. ``check_scores`` turns whatever a scorer returned into a float
tensor, or raises ``RewardError`` naming the scorer and the first bad row. ``fit_normalization``
is reward normalisation, the same for every reward: the update turns a raw score into
``gain * raw + bias`` (``algo.rollout.normalized``).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import numbers
from typing import Any, Callable, NamedTuple

import torch
from torch import Tensor

log = logging.getLogger(__name__)


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


@dataclasses.dataclass(frozen=True, eq=False)
class RewardBatch:
    """What a reward may read about a batch of responses, row by row.

    ``input_ids`` / ``attention_mask`` ``[B, P + R]``: the whole sequences, prompts left-padded
    to ``context_length`` (P), then the responses (in an episode every turn's tokens, the
    environment's included); a reward model that shares the policy's vocabulary reads them as they
    are. ``prompt_texts`` and ``responses`` are decoded from them on first use, such that
    ``prompt + response`` is the decoded whole sequence (what a reward with its own tokenizer
    reads); a batch of text alone (``of_texts``) has no sequences, its ``texts`` given.
    ``prompts``: the prompts as the user wrote them (strings, or lists of chat messages);
    ``columns``: each row's metadata (the other fields of its record), both repeated for each of a
    prompt's samples, None when the caller has none. Episodes also have ``completions`` (each
    episode's messages after its prompt), ``environments`` (each episode's environment, TRL's
    ``environments``) and ``given_completion_ids`` (every turn's tokens); ``completion_ids`` reads
    the response ids from the sequences where none are given, on first use."""

    input_ids: Tensor | None = None  # [B, P + R]
    attention_mask: Tensor | None = None  # [B, P + R]
    context_length: int = 0  # P
    tokenizer: Any = None  # decodes input_ids
    prompts: list | None = None
    columns: list[dict[str, Any]] | None = None
    completions: list[list[dict]] | None = None  # multi-turn: each episode's messages after its prompt
    environments: list | None = None  # multi-turn: each episode's environment
    texts: tuple[list[str], list[str]] | None = None  # (prompt_texts, responses) given: no sequences
    given_completion_ids: list[list[int]] | None = None

    @classmethod
    def of_texts(
        cls, prompt_texts: list[str], responses: list[str], completion_ids: list[list[int]] | None = None, **fields
    ) -> "RewardBatch":
        """A batch of decoded texts alone (and what else the caller has: ``prompts``, ``columns``, ...)."""
        return cls(texts=(list(prompt_texts), list(responses)), given_completion_ids=completion_ids, **fields)

    def __len__(self) -> int:
        return len(self.texts[0]) if self.texts is not None else self.input_ids.shape[0]

    @functools.cached_property
    def decoded(self) -> tuple[list[str], list[str]]:
        """``(prompt_texts, responses)``: the given texts, or the sequences decoded once
        (``decode_prompts_and_responses``)."""
        if self.texts is not None:
            return self.texts
        P = self.context_length
        return decode_prompts_and_responses(
            self.tokenizer, self.input_ids[:, :P], self.input_ids[:, P:], self.attention_mask[:, P:]
        )

    @property
    def prompt_texts(self) -> list[str]:
        return self.decoded[0]

    @property
    def responses(self) -> list[str]:
        return self.decoded[1]

    @functools.cached_property
    def completion_ids(self) -> list[list[int]] | None:
        """Each row's response token ids, pads left out: the given ones, else read from the
        sequences once (None for a batch of text alone)."""
        if self.given_completion_ids is not None or self.input_ids is None:
            return self.given_completion_ids
        P = self.context_length
        responses, mask = self.input_ids[:, P:].cpu(), self.attention_mask[:, P:].cpu()
        return [row[m > 0].tolist() for row, m in zip(responses, mask)]

    def completion_messages(self) -> list:
        """TRL's ``completions``: an episode's messages after its prompt; for chat prompts each
        response as one assistant message; else the response texts."""
        if self.completions is not None:
            return self.completions
        if self.prompts is not None and any(isinstance(p, list) for p in self.prompts):
            return [[{"role": "assistant", "content": r}] for r in self.responses]
        return self.responses


class Scored(NamedTuple):
    """What a reward says of a batch: ``total [B]`` the raw score (0 where no reward applies),
    ``applies [B]`` bool (False where every term returned None: "does not apply to this
    response"), ``terms`` each ``reward.terms`` term's raw score ``[B]`` (NaN where that term
    returned None; empty without terms)."""

    total: Tensor
    applies: Tensor
    terms: dict[str, Tensor]


class Reward:
    """The protocol of every reward: ``score(batch: RewardBatch) -> Scored``.

    ``required_columns``: the record columns the reward needs in every record (checked before any
    model loads). Calling a reward on decoded texts alone, ``reward(prompts, responses)``, gives
    its scores ``[B]`` with NaN where it does not apply."""

    required_columns: tuple[str, ...] = ()

    def score(self, batch: RewardBatch) -> Scored:
        raise NotImplementedError(f"{type(self).__name__} does not implement score(batch)")

    def score_texts(self, prompts: list[str], responses: list[str]) -> Tensor:
        """The scores of decoded texts alone (no records), NaN where the reward does not apply."""
        total, applies, _ = self.score(RewardBatch.of_texts(prompts, responses))
        return torch.where(applies, total, torch.full_like(total, float("nan")))

    def __call__(self, prompts: list[str], responses: list[str]) -> Tensor:
        return self.score_texts(prompts, responses)


class CallableReward(Reward):
    """A plain callable ``fn(prompts, responses) -> one float per response`` as a ``Reward``:
    called with the decoded texts; it applies to every row."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def score(self, batch: RewardBatch) -> Scored:
        scores = torch.as_tensor(self.fn(batch.prompt_texts, batch.responses), dtype=torch.float32).flatten()
        return Scored(scores, torch.ones_like(scores, dtype=torch.bool), {})


def as_reward(reward) -> Reward:
    """``reward`` itself when it is a ``Reward``; a plain callable wrapped as one (``CallableReward``)."""
    return reward if isinstance(reward, Reward) else CallableReward(reward)


class RewardError(RuntimeError):
    """A reward scorer returned something unusable (wrong length, not numbers, NaN/inf)."""


def check_scores(scores, prompts: list[str], source: str, allow_nonfinite: bool = False) -> torch.Tensor:
    """Validate a scorer's output for ``prompts`` and return it as a float32 tensor ``[B]``."""
    n = len(prompts)
    if isinstance(scores, torch.Tensor):
        values = scores.detach().float().flatten().cpu()
        if values.numel() != n:
            raise RewardError(
                f"reward {source} returned {values.numel()} scores for {n} responses; "
                "return exactly one float per response"
            )
    else:
        try:
            items = list(scores)
        except TypeError:
            raise RewardError(
                f"reward {source} returned {type(scores).__name__}, not a list of floats; return one float per response"
            ) from None
        if len(items) != n:
            raise RewardError(
                f"reward {source} returned {len(items)} scores for {n} responses; return exactly one float per response"
            )
        for i, x in enumerate(items):
            # numbers.Real covers Python and numpy scalars (numpy registers its types there)
            if (
                isinstance(x, bool)
                or not isinstance(x, numbers.Real)
                and not (isinstance(x, torch.Tensor) and x.numel() == 1)
            ):
                raise RewardError(
                    f"reward {source} returned {x!r} (a {type(x).__name__}) for prompt "
                    f"{i} {prompts[i][:60]!r}; return a float per response"
                )
        values = torch.tensor([float(x) for x in items], dtype=torch.float32)
    if not allow_nonfinite:
        bad = (~torch.isfinite(values)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise RewardError(
                f"reward {source} returned {values[i].item()} for prompt {i} {prompts[i][:60]!r}; scores must be finite"
            )
    return values


def fit_normalization(
    raw: torch.Tensor, reduce: Callable[[torch.Tensor], torch.Tensor] | None = None, source: str = "reward"
) -> tuple[float, float]:
    """``(gain, bias)`` that map these raw scores to mean 0 and std 1: ``gain * raw + bias``.

    ``raw`` holds the scores of responses sampled from the reference policy ([N+] reward
    normalisation), so after the fit a score of +1 means one reference standard deviation better
    than the reference's average, whatever the reward's own scale: the KL coefficient then weighs
    the penalty against the same thing for every reward. ``reduce`` sums a tensor over ranks under
    DDP, so every rank gets the same gain and bias. Non-finite scores are left out (with a
    warning). Scores without variance (every sample scored the same, as a sparse reward can on
    the reference policy) are only centred, with a warning: ``gain = 1``, ``bias = -mean``.
    """
    raw = raw.detach().double().cpu().flatten()
    finite = raw[torch.isfinite(raw)]
    stats = torch.stack(
        [
            finite.sum(),
            (finite**2).sum(),
            torch.tensor(float(len(finite)), dtype=torch.float64),
            torch.tensor(float(len(raw)), dtype=torch.float64),
        ]
    )
    if reduce is not None:
        stats = reduce(stats).cpu()
    total, sq, n, n_all = stats.tolist()
    if n == 0:
        raise RewardError(
            f"reward.normalize: every one of the {int(n_all)} reference samples scored a "
            f"non-finite value with {source}; fix the reward or set reward.normalize=false"
        )
    if n < n_all:
        log.warning(
            "reward.normalize: %d of %d reference scores were not finite and are left out of the fit",
            int(n_all - n),
            int(n_all),
        )
    mean = total / n
    var = max(sq / n - mean**2, 0.0)
    if var <= 1e-12 * max(1.0, mean**2):
        log.warning(
            "reward.normalize: all %d reference samples scored %.4g with %s (no variance to scale "
            "by); scores are only centred (gain 1, bias %.4g)",
            int(n),
            mean,
            source,
            -mean,
        )
        return 1.0, -mean
    std = var**0.5
    return 1.0 / std, -mean / std
