"""Built-in rule rewards for tests, examples and quick experiments.

Each is a plain ``(prompts, responses, **kwargs) -> list[float]`` function, usable as
``reward=function reward.fn=ppo_lightning.rewards.rules.<name> +reward.kwargs.<arg>=...``.
"""

from __future__ import annotations


def char_fraction(prompts: list[str], responses: list[str], chars: str = "abcdefghijklmnopqrstuvwxyz ") -> list[float]:
    """Fraction of the response's characters that are in ``chars`` (0 for an empty response).

    Dense and easy to learn from a random policy: the toy prompts of the offline tests.
    """
    allowed = set(chars)
    return [sum(c in allowed for c in r) / len(r) if r else 0.0 for r in responses]


def keyword(prompts: list[str], responses: list[str], word: str = "good") -> list[float]:
    """1.0 if ``word`` occurs in the response (case-insensitive), else 0.0."""
    w = word.lower()
    return [float(w in r.lower()) for r in responses]


def target_length(prompts: list[str], responses: list[str], target: int = 32) -> list[float]:
    """``-|len(response) - target| / target``: 0 at the target length, negative either side."""
    return [-abs(len(r) - target) / target for r in responses]
