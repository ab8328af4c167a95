"""Several rewards, weighted: ``reward.terms``.

Each term is a scorer of its own (a function or a reward model, configured as ``reward`` is) with
a ``weight``; the reward is the weighted sum of the terms' raw scores. Reward normalisation, when
on, then applies to that sum: the KL coefficient is weighed against the score PPO learns from,
and normalising each term first would replace the weights the user chose by the terms' spreads.
Each term's raw scores are kept for its metrics (``rewards/<name>/mean``, ``/std``).
"""

from __future__ import annotations

import torch

from ppo_lightning.rewards.base import RewardInputs


class WeightedReward:
    """``sum_k weight_k * term_k``, term by term in the order given."""

    token_input = False  # every term reads text (a reward model term through its own tokenizer)

    def __init__(self, terms: dict[str, tuple[object, float]]):
        self.terms = terms
        self.name = " + ".join(f"{w:g} * {name}" for name, (_, w) in terms.items())
        self.trl_style = any(getattr(fn, "trl_style", False) for fn, _ in terms.values())
        self.required_columns = tuple(
            dict.fromkeys(c for fn, _ in terms.values() for c in getattr(fn, "required_columns", ()))
        )

    def use_policy_tokens(self, policy_tokenizer, mode: str = "auto") -> bool:
        return False

    def score_terms(self, inputs: RewardInputs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """``(weighted sum [B], {name: the term's raw scores [B]})``."""
        raw = {}
        for name, (fn, _) in self.terms.items():
            out = fn.score(inputs) if hasattr(fn, "score") else fn(inputs.prompt_texts, inputs.responses)
            raw[name] = torch.as_tensor(out, dtype=torch.float32).flatten().cpu()
        total = sum(w * raw[name] for name, (_, w) in self.terms.items())
        return total, raw

    def score(self, inputs: RewardInputs) -> torch.Tensor:
        return self.score_terms(inputs)[0]

    def __call__(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        return self.score(RewardInputs(prompts, responses))
