"""Several rewards, weighted: ``reward.terms``.

Each term is a scorer of its own (a function or a reward model, configured as ``reward`` is) with
a ``weight``; the reward is the weighted sum of the terms' raw scores. Reward normalisation, when
on, then applies to that sum: the KL coefficient is weighed against the score PPO learns from,
and normalising each term first would replace the weights the user chose by the terms' spreads.
Each term's raw scores are kept for its metrics (``rewards/<name>/mean``, ``/std``).
"""

from __future__ import annotations

import torch
from torch import nn

from ppo_lightning.rewards.base import Reward, RewardBatch, Scored, as_reward


class WeightedReward(nn.Module, Reward):
    """``sum_k weight_k * term_k``, term by term in the order given; each term a ``Reward`` (a
    plain callable is wrapped once, here: ``as_reward``).

    An ``nn.Module`` whose reward-model terms are submodules (``models``), so that Lightning moves
    them to the policy's device as it moves a single reward model; frozen weights are not
    checkpointed (``PPOModule.checkpointed``). Every term reads text (a reward model term through
    its own tokenizer)."""

    def __init__(self, terms: dict[str, tuple[object, float]]):
        super().__init__()
        self.terms = {name: (as_reward(fn), w) for name, (fn, w) in terms.items()}  # a plain dict: modules below
        self.models = nn.ModuleDict({name: fn for name, (fn, _) in self.terms.items() if isinstance(fn, nn.Module)})
        self.name = " + ".join(f"{w:g} * {name}" for name, (_, w) in self.terms.items())
        self.required_columns = tuple(dict.fromkeys(c for fn, _ in self.terms.values() for c in fn.required_columns))

    def use_policy_tokens(self, policy_tokenizer, mode: str = "auto") -> bool:
        return False

    def pop_logged(self) -> dict[str, float]:
        """Each term's ``log_metric`` scalars since the last call, as ``<term>/<name>``."""
        return {
            f"{name}/{k}": v
            for name, (fn, _) in self.terms.items()
            for k, v in (fn.pop_logged() if hasattr(fn, "pop_logged") else {}).items()
        }

    def score(self, batch: RewardBatch) -> Scored:
        """``Scored(weighted sum [B], applies [B], {name: the term's raw scores [B]})``. A term
        that returns None for a response is left out of that response's sum, and its raw score
        there is NaN (out of the term's statistics); ``applies`` is False where every term did."""
        total = torch.zeros(len(batch))
        applies = torch.zeros(len(batch), dtype=torch.bool)
        raw = {}
        for name, (fn, w) in self.terms.items():
            values, a, _ = fn.score(batch)
            values, a = values.cpu(), a.cpu()
            total += w * torch.where(a, values, torch.zeros_like(values))
            applies |= a
            raw[name] = torch.where(a, values, torch.full_like(values, float("nan")))
        return Scored(total, applies, raw)

    def forward(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        return self.score_texts(prompts, responses)
