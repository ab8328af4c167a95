"""The one reward interface: ``reward_fn(prompts, responses) -> one float score per response``.

Prompts and responses are decoded strings, so any scorer (a Python rule, a reward model with its
own tokenizer, a remote judge) plugs in without sharing the policy's tokenizer. ``check_scores``
turns whatever a scorer returned into a float tensor, or raises ``RewardError`` naming the scorer
and the first bad row. ``fit_normalization`` is reward normalisation, the same for every scorer:
the update turns a scorer's raw output into ``gain * raw + bias`` (``algo.rollout.normalized``).
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from typing import Any, Callable

import torch

log = logging.getLogger(__name__)


@dataclasses.dataclass
class RewardInputs:
    """What a scorer may read about a batch of responses, row by row.

    ``prompt_texts`` and ``responses`` are decoded text such that ``prompt + response`` is the
    decoded whole sequence (what a reward model with its own tokenizer reads). ``prompts`` are the
    prompts as the user wrote them (strings, or lists of chat messages), and ``columns`` each
    row's metadata (the other fields of its record), both repeated for each of a prompt's samples;
    None when the caller has none (the text alone). ``completion_ids``: the response token ids
    (in an episode, every turn's, the environment's included)."""

    prompt_texts: list[str]
    responses: list[str]
    completion_ids: list[list[int]] | None = None
    prompts: list | None = None
    columns: list[dict[str, Any]] | None = None
    completions: list[list[dict]] | None = None  # multi-turn: each episode's messages after its prompt
    environments: list | None = None  # multi-turn: each episode's environment (TRL's ``environments``)

    def completion_messages(self) -> list:
        """TRL's ``completions``: an episode's messages after its prompt; for chat prompts each
        response as one assistant message; else the response texts."""
        if self.completions is not None:
            return self.completions
        if self.prompts is not None and any(isinstance(p, list) for p in self.prompts):
            return [[{"role": "assistant", "content": r}] for r in self.responses]
        return self.responses


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
