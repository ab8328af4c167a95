"""Small-integer arithmetic: RL from a verifiable reward.

A prompt is an equation without its answer (``"12+7="``, operands 0-20), the response is the
answer (``"19"``, or ``"-4"`` for ``"3-7="``) followed by EOS. The reward is exact: 1.0 for the right
integer, 0.0 otherwise. The supervised corpus is deliberately noisy (mostly right, some answers
off by one or two), so a warm-started policy is only partly correct and PPO has room to improve it.

Text conventions: no spaces anywhere; ``prompt + response`` is the equation (``"12+7=19"``). The
tokenizer is character-level (:data:`VOCAB`, every digit is a token) and decodes without spaces,
so prompt and response decoded separately still concatenate to the equation.
"""

from __future__ import annotations

import random
import re

VOCAB: list[str] = list("0123456789+-*=")
"""Every character of the language, one token each (for :func:`build_tokenizer`)."""

_PROMPT = re.compile(r"\s*(\d+)\s*([+\-*])\s*(\d+)\s*=\s*")
_INT = re.compile(r"-?\d+")
_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_ERRORS, _ERROR_WEIGHTS = (-2, -1, 1, 2), (1, 3, 3, 1)  # mostly off by one


def _as_rng(rng: random.Random | int) -> random.Random:
    return rng if isinstance(rng, random.Random) else random.Random(rng)


def answer(prompt: str) -> int:
    """The exact answer to ``"a<op>b="``; ValueError for anything else (a bug in the data)."""
    m = _PROMPT.fullmatch(prompt)
    if m is None:
        raise ValueError(f"{prompt!r} is not an arithmetic prompt like '12+7='")
    return _OPS[m[2]](int(m[1]), int(m[3]))


def parse_response(response: str) -> int | None:
    """The first integer in the response (an optional ``-`` and digits), None if there is none."""
    m = _INT.search(response.strip())
    return int(m[0]) if m else None


def prompts(rng: random.Random | int, n: int, ops: str = "+-", max_operand: int = 20) -> list[str]:
    """``n`` prompts ``"a<op>b="`` with operands uniform in 0..max_operand and ``op`` from ``ops``.

    ``ops`` may include ``"*"`` (answers up to 400, harder for a tiny model); ``"-"`` gives
    negative answers, which the tokenizer spells with the ``"-"`` token.
    """
    if not ops or set(ops) - set(_OPS):
        raise ValueError(f"ops={ops!r}: choose from '+-*'")
    rng = _as_rng(rng)
    return [f"{rng.randint(0, max_operand)}{rng.choice(ops)}{rng.randint(0, max_operand)}=" for _ in range(n)]


def sft_corpus(
    rng: random.Random | int, n: int, accuracy: float = 0.6, ops: str = "+-", max_operand: int = 20
) -> list[dict[str, str]]:
    """``n`` ``{"prompt", "response"}`` pairs; a fraction ``accuracy`` of the answers is right.

    Each wrong answer is off by -2, -1, +1 or +2 (off-by-one three times as often): plausible
    mistakes, so a policy fitted to this corpus answers about ``accuracy`` of prompts correctly
    and is close enough for PPO's samples to find the right answer. Append the EOS token to the
    response when training so the policy learns to stop.
    """
    if not 0.0 <= accuracy <= 1.0:
        raise ValueError(f"accuracy={accuracy} must lie in [0, 1]")
    rng = _as_rng(rng)
    out = []
    for prompt in prompts(rng, n, ops, max_operand):
        value = answer(prompt)
        if rng.random() >= accuracy:
            value += rng.choices(_ERRORS, _ERROR_WEIGHTS)[0]
        out.append({"prompt": prompt, "response": str(value)})
    return out


def reward_fn(prompts: list[str], responses: list[str]) -> list[float]:
    """1.0 where the response's first integer is the exact answer, else 0.0.

    For ``reward=function reward.fn=ppo_lightning.recipes.arithmetic.data.reward_fn``. Anything after the
    first integer is ignored (the EOS token ends generation anyway; a missing EOS is penalised by
    ``ppo.missing_eos_penalty``, not here).
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    return [float(parse_response(r) == answer(p)) for p, r in zip(prompts, responses)]


def build_tokenizer():
    """A character-level tokenizer over :data:`VOCAB` (see :mod:`ppo_lightning.recipes.tokenizers`)."""
    from ppo_lightning.recipes.tokenizers import build_word_tokenizer

    return build_word_tokenizer(VOCAB, char_level=True)
