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

from ppo_lightning.rewards.base import RewardInputs


class WeightedReward(nn.Module):
    """``sum_k weight_k * term_k``, term by term in the order given.

    An ``nn.Module`` whose reward-model terms are submodules (``models``), so that Lightning moves
    them to the policy's device as it moves a single reward model; frozen weights are not
    checkpointed (``PPOModule.checkpointed``)."""

    token_input = False  # every term reads text (a reward model term through its own tokenizer)

    def __init__(self, terms: dict[str, tuple[object, float]]):
        super().__init__()
        self.terms = terms  # name -> (scorer, weight); a plain dict: the modules register below
        self.models = nn.ModuleDict({name: fn for name, (fn, _) in terms.items() if isinstance(fn, nn.Module)})
        self.name = " + ".join(f"{w:g} * {name}" for name, (_, w) in terms.items())
        self.trl_style = any(getattr(fn, "trl_style", False) for fn, _ in terms.values())
        self.required_columns = tuple(
            dict.fromkeys(c for fn, _ in terms.values() for c in getattr(fn, "required_columns", ()))
        )

    def use_policy_tokens(self, policy_tokenizer, mode: str = "auto") -> bool:
        return False

    def pop_logged(self) -> dict[str, float]:
        """Each term's ``log_metric`` scalars since the last call, as ``<term>/<name>``."""
        return {
            f"{name}/{k}": v
            for name, (fn, _) in self.terms.items()
            for k, v in (fn.pop_logged() if hasattr(fn, "pop_logged") else {}).items()
        }

    def score_applies(self, inputs: RewardInputs) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
        """``(weighted sum [B], applies [B], {name: the term's raw scores [B]})``. A term that
        returns None for a response is left out of that response's sum, and its raw score there
        is NaN (out of the term's statistics); ``applies`` is False where every term did."""
        total = torch.zeros(len(inputs.responses))
        applies = torch.zeros(len(inputs.responses), dtype=torch.bool)
        raw = {}
        for name, (fn, w) in self.terms.items():
            if hasattr(fn, "score_applies"):
                values, a = fn.score_applies(inputs)
            else:
                out = fn.score(inputs) if hasattr(fn, "score") else fn(inputs.prompt_texts, inputs.responses)
                values = torch.as_tensor(out, dtype=torch.float32).flatten().cpu()
                a = torch.ones(len(values), dtype=torch.bool)
            total += w * torch.where(a, values, torch.zeros_like(values))
            applies |= a
            raw[name] = torch.where(a, values, torch.full_like(values, float("nan")))
        return total, applies, raw

    def score_terms(self, inputs: RewardInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(weighted sum [B], {name: the term's raw scores [B]})``."""
        total, _, raw = self.score_applies(inputs)
        return total, raw

    def score(self, inputs: RewardInputs) -> torch.Tensor:
        total, applies, _ = self.score_applies(inputs)
        return torch.where(applies, total, torch.full_like(total, float("nan")))

    def forward(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        return self.score(RewardInputs(prompts, responses))
