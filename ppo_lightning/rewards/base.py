"""The one reward interface: ``reward_fn(prompts, responses) -> one float score per response``.

Prompts and responses are decoded strings, so any scorer (a Python rule, a reward model with its
own tokenizer, a remote judge) plugs in without sharing the policy's tokenizer. ``check_scores``
turns whatever a scorer returned into a float tensor, or raises ``RewardError`` naming the scorer
and the first bad row.
"""

from __future__ import annotations

import numbers
from typing import Protocol, Sequence

import torch


class RewardFunction(Protocol):
    def __call__(self, prompts: list[str], responses: list[str]) -> Sequence[float] | torch.Tensor: ...


class RewardError(RuntimeError):
    """A reward scorer returned something unusable (wrong length, not numbers, NaN/inf)."""


def check_scores(scores, prompts: list[str], source: str, allow_nonfinite: bool = False) -> torch.Tensor:
    """Validate a scorer's output for ``prompts`` and return it as a float32 tensor ``[B]``."""
    n = len(prompts)
    if isinstance(scores, torch.Tensor):
        values = scores.detach().float().flatten().cpu()
        if values.numel() != n:
            raise RewardError(f"reward {source} returned {values.numel()} scores for {n} responses; "
                              "return exactly one float per response")
    else:
        try:
            items = list(scores)
        except TypeError:
            raise RewardError(f"reward {source} returned {type(scores).__name__}, not a list of "
                              f"floats; return one float per response") from None
        if len(items) != n:
            raise RewardError(f"reward {source} returned {len(items)} scores for {n} responses; "
                              "return exactly one float per response")
        for i, x in enumerate(items):
            # numbers.Real covers Python and numpy scalars (numpy registers its types there)
            if isinstance(x, bool) or not isinstance(x, numbers.Real) and not (
                    isinstance(x, torch.Tensor) and x.numel() == 1):
                raise RewardError(f"reward {source} returned {x!r} (a {type(x).__name__}) for prompt "
                                  f"{i} {prompts[i][:60]!r}; return a float per response")
        values = torch.tensor([float(x) for x in items], dtype=torch.float32)
    if not allow_nonfinite:
        bad = (~torch.isfinite(values)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            raise RewardError(f"reward {source} returned {values[i].item()} for prompt {i} "
                              f"{prompts[i][:60]!r}; scores must be finite")
    return values
