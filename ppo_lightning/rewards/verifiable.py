"""Verifiable rewards for math answers, each scored against its prompt's own gold answer.

All take TRL's signature (``reward.fn=ppo_lightning.rewards.verifiable.<name>``), so they read the
``answer`` column of the prompt records and accept completions as text or as assistant messages:

- ``math_answer``: 1.0 when the response's answer equals the gold one, else 0.0. The answer is
  the last ``<answer>…</answer>`` block, else what follows ``####``, else the last ``\\boxed{…}``,
  else the last number in the response. Numbers compare within ``tolerance`` (1e-4 absolute, as
  the tutorial does); with the ``math-verify`` extra installed, answers that are not plain
  numbers (fractions, expressions) are compared symbolically by it, else as normalised text.
- ``answer_format``: 1.0 when the response holds exactly one ``<answer>…</answer>`` block.
- ``math_answer_and_format``: the tutorial's GSM8K reward, ``min(1.0 * correct + 0.2 * format,
  1.2)``.
- ``overlong_penalty``: DAPO's soft length penalty, 0 up to ``max_length - buffer`` tokens, then
  falling linearly to -1 at ``max_length`` (``reward.kwargs.max_length=${sampling.max_new_tokens}``).
"""

from __future__ import annotations

import math
import re

ANSWER_BLOCK = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
HASHES = re.compile(r"####\s*([^\n]*)")
NUMBER = re.compile(r"[-+]?(?:(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
"""A number as answers write it: thousands separators only in groups of three (``1,234,567``;
``1,2,3`` is three numbers), a decimal part, an exponent."""
TOLERANCE = 1e-4


def completion_text(completion) -> str:
    """A completion as text: a string as it is; assistant messages (TRL's conversational form) as
    their contents joined."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content", "") for m in completion)


def _last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}``, braces balanced."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 0, start + len("\\boxed")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1 : j]
    return None


def extract_answer(text: str) -> str | None:
    """The response's final answer as text (see the module docstring for the order), or None."""
    blocks = ANSWER_BLOCK.findall(text)
    if blocks:
        return blocks[-1].strip()
    hashes = HASHES.findall(text)
    if hashes:
        return hashes[-1].strip()
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


EXPRESSION = re.compile(r"[\\{}^/*=()]|\d\s*[-+]\s*\d")
"""What makes an answer an expression (``\\frac{1}{2}``, ``\\sqrt{4}``, ``2^3``, ``1/2``, ``3+4``),
not a number that ``parse_number`` reads."""


def parse_number(text: str) -> float | None:
    """The number a short answer states (``1,234``, ``$5.50``, ``-3``, ``12%``, ``7.``, ``12
    apples``), or None when it holds no number, several, or is an expression (``EXPRESSION``: its
    one number is not its value)."""
    if EXPRESSION.search(text):
        return None
    found = NUMBER.findall(text.replace("$", ""))
    if len(found) != 1:
        return None
    try:
        value = float(found[0].replace(",", "").rstrip("."))
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def answers_match(predicted: str | None, gold, tolerance: float = TOLERANCE) -> bool:
    """Whether a predicted answer equals the gold one: numerically within ``tolerance`` when both
    are numbers; else equal as text (whitespace and case aside); else, with ``math_verify``
    installed, symbolically equal (``\\frac{6}{4}`` and ``3/2``, ``\\sqrt{4}`` and ``2``)."""
    if predicted is None or gold is None:
        return False
    gold = str(gold)
    p, g = parse_number(predicted), parse_number(gold)
    if p is not None and g is not None:
        return abs(p - g) <= tolerance
    if " ".join(predicted.split()).lower() == " ".join(gold.split()).lower():
        return True
    try:
        import math_verify
    except ImportError:
        return False
    return bool(math_verify.verify(_math_verify_parse(math_verify, gold), _math_verify_parse(math_verify, predicted)))


def _math_verify_parse(math_verify, text: str):
    """``math_verify.parse`` of an answer, as LaTeX math (``$…$``) when it has no delimiters: it
    extracts bare LaTeX such as ``\\sqrt{4}`` only between them."""
    return math_verify.parse(text if "$" in text else f"${text}$") or math_verify.parse(text)


def math_answer(prompts, completions, answer, tolerance: float = TOLERANCE, **kwargs) -> list[float]:
    """1.0 where the completion's answer equals its prompt's ``answer`` column, else 0.0."""
    return [float(answers_match(extract_answer(completion_text(c)), a, tolerance)) for c, a in zip(completions, answer)]


def answer_format(prompts, completions, **kwargs) -> list[float]:
    """1.0 where the completion holds exactly one ``<answer>…</answer>`` block, else 0.0."""
    return [float(len(ANSWER_BLOCK.findall(completion_text(c))) == 1) for c in completions]


def math_answer_and_format(prompts, completions, answer, tolerance: float = TOLERANCE, **kwargs) -> list[float]:
    """The tutorial's GSM8K reward: +1.0 for a correct answer, +0.2 for exactly one answer block,
    clipped at 1.2."""
    correct = math_answer(prompts, completions, answer, tolerance)
    formatted = answer_format(prompts, completions)
    return [min(1.0 * c + 0.2 * f, 1.2) for c, f in zip(correct, formatted)]


def overlong_penalty(prompts, completions, completion_ids, max_length: int, buffer: int = 4, **kwargs) -> list[float]:
    """DAPO's soft overlong punishment on response length ``L`` in tokens: 0 while
    ``L <= max_length - buffer``, then ``(max_length - buffer - L) / buffer`` down to -1 at
    ``max_length`` (a response cut there is penalised fully)."""
    if not 0 < buffer <= max_length:
        raise ValueError(f"overlong_penalty: buffer={buffer} must be in (0, max_length={max_length}]")
    start = max_length - buffer
    return [max(-1.0, min(0.0, (start - len(ids)) / buffer)) for ids in completion_ids]
