"""Multi-step word problems as chat records, each with its own gold answer (the GSM8K shape).

A problem is a short story of two or three operations on one quantity, its numbers written in
words or digits, and a question::

    Ann has seven apples . She buys 4 more apples . Then she gives 3 apples to Ben .
    How many apples does Ann have now ?

A prompt record is what a user's GSM8K file looks like after the usual preprocessing: chat
messages (a system prompt asking for ``<answer>`` tags, then the problem), plus the gold
``answer`` and a ``data_source`` (``two_step`` / ``three_step``) as metadata columns. A worked
answer writes one equation per operation, then the answer in tags::

    7 + 4 = 11 . 11 - 3 = 8 . <answer> 8 </answer>

Text conventions: every token is a whitespace-separated word (punctuation included), numbers are
whole tokens (``"0"`` .. ``"99"``), so :data:`VOCAB` is closed and the tokenizer word-level.
The rewards are ``ppo_lightning.rewards.verifiable``'s, which read the ``answer`` column.

The supervised corpus (:func:`sft_corpus`) carries the two flaws RL is asked to fix: a share of the
worked three-step answers stop after two steps (``skip_last_step``: a wrong answer, written
confidently), and a share of all answers state the result without tags (``untagged``).
"""

from __future__ import annotations

import random

SYSTEM_PROMPT = "Solve the problem step by step . Write the final answer as <answer> N </answer> ."
"""The system message of every prompt: the format the format reward checks."""

NAMES = {"Ann": "she", "Ben": "he", "Cara": "she", "Dan": "he", "Eva": "she", "Finn": "he"}
ITEMS = ("apples", "books", "coins", "cards", "pens", "shells")
NUMBER_WORDS = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
    "seventeen eighteen nineteen twenty"
).split()
MAX_VALUE = 60
"""Every intermediate result stays in 0..MAX_VALUE, so every number is one token."""

_OBJECT = {"she": "her", "he": "him"}
_STEPS = {
    "+": ("{P} buys {n} more {item} .", "{P} finds {n} more {item} .", "{other} gives {O} {n} more {item} ."),
    "-": ("{P} gives {n} {item} to {other} .", "{P} loses {n} {item} .", "{P} sells {n} {item} ."),
    "*": ("{P} doubles {poss} {item} .", "{P} triples {poss} {item} ."),
}
_POSSESSIVE = {"she": "her", "he": "his"}
_CONNECTIVES = ("Then", "Next", "Later")
_TAGS = ("<answer>", "</answer>")

CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A word-level chat template: ``<|role|> content`` per message, then ``<|assistant|>``."""


def _as_rng(rng: random.Random | int) -> random.Random:
    return rng if isinstance(rng, random.Random) else random.Random(rng)


def _number(rng: random.Random, n: int) -> str:
    """``n`` in words (when it has one) or digits, half and half."""
    return NUMBER_WORDS[n] if n < len(NUMBER_WORDS) and rng.random() < 0.5 else str(n)


def _operation(rng: random.Random, value: int, allow_multiply: bool) -> tuple[str, int]:
    """An operation on ``value`` whose result stays in 0..MAX_VALUE: ``(op, operand)``."""
    choices = ["+", "-"] + (["*"] if allow_multiply and value * 2 <= MAX_VALUE else [])
    while True:
        op = rng.choice(choices)
        if op == "*":
            return op, 3 if value * 3 <= MAX_VALUE and rng.random() < 0.5 else 2
        n = rng.randint(1, 9)
        if (op == "+" and value + n <= MAX_VALUE) or (op == "-" and n <= value):
            return op, n


def problem(rng: random.Random | int, n_steps: int) -> dict:
    """One problem of ``n_steps`` operations: ``{"question", "steps": [(a, op, b, result)], "answer"}``."""
    if n_steps not in (2, 3):
        raise ValueError(f"n_steps={n_steps}: a problem has 2 or 3 operations")
    rng = _as_rng(rng)
    name = rng.choice(list(NAMES))
    other = rng.choice([n for n in NAMES if n != name])
    pronoun, item = NAMES[name], rng.choice(ITEMS)
    value = rng.randint(2, 15)
    sentences = [f"{name} has {_number(rng, value)} {item} ."]
    steps = []
    for i in range(n_steps):
        op, n = _operation(rng, value, allow_multiply=i > 0)
        result = {"+": value + n, "-": value - n, "*": value * n}[op]
        template = rng.choice([t for t in _STEPS[op] if op != "*" or ("doubles" in t) == (n == 2)])
        subject = pronoun.capitalize() if i == 0 else pronoun
        sentence = template.format(
            P=subject, O=_OBJECT[pronoun], poss=_POSSESSIVE[pronoun], n=_number(rng, n), item=item, other=other
        )
        if i > 0:
            sentence = f"{rng.choice(_CONNECTIVES)} {sentence}"
        sentences.append(sentence)
        steps.append((value, op, n, result))
        value = result
    sentences.append(f"How many {item} does {name} have now ?")
    return {"question": " ".join(sentences), "steps": steps, "answer": value}


def worked_answer(
    steps: list[tuple[int, str, int, int]], *, skip_last_step: bool = False, untagged: bool = False
) -> str:
    """One equation per step, then the answer in tags: ``7 + 4 = 11 . 11 - 3 = 8 . <answer> 8 </answer>``.

    ``skip_last_step`` stops one step early (so the stated answer is wrong); ``untagged`` states the
    answer as ``the answer is 8 .`` instead of in tags (so the format reward is 0)."""
    steps = steps[:-1] if skip_last_step else steps
    text = " ".join(f"{a} {op} {b} = {r} ." for a, op, b, r in steps)
    result = steps[-1][3]
    return f"{text} the answer is {result} ." if untagged else f"{text} {_TAGS[0]} {result} {_TAGS[1]}"


def messages(question: str) -> list[dict[str, str]]:
    """The chat prompt of a problem: the system prompt, then the question as the user's message."""
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


def prompt_records(rng: random.Random | int, n: int, three_step_share: float = 0.5) -> list[dict]:
    """``n`` prompt records ``{"prompt": messages, "answer": "8", "data_source": "two_step"}``, a
    ``three_step_share`` of them with three operations (``data_source`` says which)."""
    rng = _as_rng(rng)
    out = []
    for _ in range(n):
        k = 3 if rng.random() < three_step_share else 2
        p = problem(rng, k)
        out.append({"prompt": messages(p["question"]), "answer": str(p["answer"]), "data_source": f"{_STEP_NAMES[k]}"})
    return out


_STEP_NAMES = {2: "two_step", 3: "three_step"}


def sft_corpus(
    rng: random.Random | int,
    n: int,
    *,
    skip_last_step: float = 0.7,
    untagged: float = 0.2,
    three_step_share: float = 0.5,
    exclude: set[str] = frozenset(),
) -> list[dict]:
    """``n`` ``{"prompt": messages, "response": worked answer}`` records for the SFT warm start.

    A ``skip_last_step`` share of the three-step answers stop after two steps, and an ``untagged``
    share of all answers leave out the tags (see :func:`worked_answer`): the flawed warm start that
    RL with the correctness and format rewards then improves. Problems whose question is in
    ``exclude`` (the RL and eval prompts) are skipped."""
    for name, share in (("skip_last_step", skip_last_step), ("untagged", untagged)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name}={share} must lie in [0, 1]")
    rng = _as_rng(rng)
    out = []
    while len(out) < n:
        k = 3 if rng.random() < three_step_share else 2
        p = problem(rng, k)
        if p["question"] in exclude:
            continue
        response = worked_answer(
            p["steps"], skip_last_step=k == 3 and rng.random() < skip_last_step, untagged=rng.random() < untagged
        )
        out.append({"prompt": messages(p["question"]), "response": response})
    return out


def vocabulary() -> list[str]:
    """Every word a prompt, a chat turn or a worked answer can hold (for :func:`build_tokenizer`)."""
    words = set(SYSTEM_PROMPT.split()) | set(NAMES) | set(NUMBER_WORDS) | set(ITEMS) | set(_CONNECTIVES)
    words |= {p.capitalize() for p in NAMES.values()} | set(NAMES.values()) | set(_OBJECT.values())
    words |= set(_POSSESSIVE.values()) | {w for ts in _STEPS.values() for t in ts for w in t.split() if "{" not in w}
    words |= set("has How many does have now ? + - * = . the answer is".split()) | set(_TAGS)
    words |= {f"<|{role}|>" for role in ("system", "user", "assistant")}
    words |= {str(i) for i in range(MAX_VALUE + 1)}
    return sorted(words)


def build_tokenizer():
    """A word-level tokenizer over :func:`vocabulary` with :data:`CHAT_TEMPLATE` as its chat template."""
    from ppo_lightning.recipes.tokenizers import build_word_tokenizer

    tokenizer = build_word_tokenizer(vocabulary())
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer
