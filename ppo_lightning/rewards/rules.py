"""Built-in rule rewards for tests, examples and quick experiments.

Each is a plain ``(prompts, responses, **kwargs) -> list[float]`` function, usable as
``reward=function reward.fn=ppo_lightning.rewards.rules.<name> +reward.kwargs.<arg>=...``.
"""

from __future__ import annotations

import re


def char_fraction(prompts: list[str], responses: list[str], chars: str = "abcdefghijklmnopqrstuvwxyz ") -> list[float]:
    """Fraction of the response's characters that are in ``chars`` (0 for an empty response).

    Dense and easy to learn from a random policy: the toy task of the offline tests.
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


def exact_answer(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 if the first integer in the response equals the answer the prompt's arithmetic gives.

    The prompt must contain one ``a op b`` expression (``op`` in + - *), e.g. ``"12+7="``.
    A verifiable reward: no model, no reward hacking through style.
    """
    scores = []
    for p, r in zip(prompts, responses):
        m = re.search(r"(-?\d+)\s*([+\-*])\s*(-?\d+)", p)
        got = re.search(r"-?\d+", r)
        if not m or not got:
            scores.append(0.0)
            continue
        a, op, b = int(m.group(1)), m.group(2), int(m.group(3))
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        scores.append(float(int(got.group(0)) == answer))
    return scores
