"""Arithmetic a tiny model cannot do in its head, and a calculator it can learn to call.

A problem is three-digit arithmetic: a product (``347*26``), a sum of three terms
(``512+374+909``) or both (``347*26+518``), asked as a chat message with its gold ``answer``
and its kind as ``data_source``. The policy sees the calculator in its prompt (the chat template
renders the tool's name and argument, ``<|tools|>calculator(expression)``) and may call it in the
Hermes format; the tool's result comes back as a ``tool`` message, and the policy then answers::

    <|tools|>calculator(expression)
    <|user|>What is 347*26+518?
    <|assistant|><tool_call>{"name":"calculator","arguments":{"expression":"347*26+518"}}</tool_call>
    <|tool|>9540
    <|assistant|>The answer is 9540.<|endoftext|>

The tokenizer is a byte-level BPE trained on such transcripts, every digit a token of its own (a
number is copied digit by digit), the chat markers and the tool-call tags added tokens; decoding
is exact, so a tool call's JSON parses. The SFT corpus (:func:`sft_records`) teaches both ways of answering, mostly the
wrong one: for 30% of its problems the first turn calls the tool, for 70% it states an answer at
once (the true one, which a 2-layer model cannot compute); every problem also teaches the turn
after a call, which repeats the tool's result. Greedy decoding therefore starts by answering in its head and is
almost never right; RL with a correctness reward has to find that calling the tool pays.
"""

from __future__ import annotations

import random
import re

KINDS = ("product", "sum", "mixed")
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|tools|>")

CHAT_TEMPLATE = (
    "{% if tools %}<|tools|>{% for t in tools %}{{ t['function']['name'] }}"
    "({{ t['function']['parameters']['properties'] | join(',') }}){% endfor %}{{ '\\n' }}{% endif %}"
    "{% for m in messages %}{% if m['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('unknown role: ' + m['role']) }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
"""A compact template: each tool as ``name(arguments)``, then one ``<|role|>content`` line per
message; prefix-preserving, so episodes append the tool's answer as the template's delta."""


def _as_rng(rng: random.Random | int) -> random.Random:
    return rng if isinstance(rng, random.Random) else random.Random(rng)


def problem(rng: random.Random, kind: str) -> tuple[str, int]:
    """``(expression, value)`` of one problem of ``kind``."""
    if kind == "product":
        a, b = rng.randint(100, 999), rng.randint(10, 99)
        return f"{a}*{b}", a * b
    if kind == "sum":
        a, b, c = (rng.randint(100, 999) for _ in range(3))
        return f"{a}+{b}+{c}", a + b + c
    a, b, c = rng.randint(100, 999), rng.randint(10, 99), rng.randint(100, 999)
    return f"{a}*{b}+{c}", a * b + c


def question(expression: str) -> str:
    return f"What is {expression}?"


def prompt_records(rng: random.Random | int, n: int, exclude: set[str] = frozenset()) -> list[dict]:
    """``n`` chat prompt records ``{"prompt": [user message], "answer", "data_source"}``, the kinds
    in turn, none of whose expressions is in ``exclude``."""
    rng, out, seen = _as_rng(rng), [], set(exclude)
    while len(out) < n:
        kind = KINDS[len(out) % len(KINDS)]
        expr, value = problem(rng, kind)
        if expr in seen:
            continue
        seen.add(expr)
        out.append({"prompt": [{"role": "user", "content": question(expr)}], "answer": str(value), "data_source": kind})
    return out


def tool_call_text(expression: str) -> str:
    """The Hermes-format call of the calculator on ``expression`` (compact JSON)."""
    return TOOL_OPEN + '{"name":"calculator","arguments":{"expression":"' + expression + '"}}' + TOOL_CLOSE


def answer_text(value: int | str) -> str:
    return f"The answer is {value}."


def sft_records(rng: random.Random | int, n: int, tokenizer, tools: list[dict], tool_share: float = 0.3, exclude=()):
    """SFT examples for ``n`` problems, as ``{"prompt": rendered text, "response": text}``, each
    one assistant turn (the loss is on the policy's own turns only): the first turn, a call
    (a ``tool_share`` of the problems) or an answer at once (the rest), and, for every problem,
    the answer after a call, repeating the tool's result (half the time the result shown is
    another number of the same length, so the answer can only be the copy)."""
    rng, out = _as_rng(rng), []

    def render(messages):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)

    for r in prompt_records(rng, n, exclude=set(exclude)):
        user = r["prompt"]
        expr = user[0]["content"][len("What is ") : -1]
        call = tool_call_text(expr)
        first = call if rng.random() < tool_share else answer_text(r["answer"])
        out.append({"prompt": render(user), "response": first})
        # every problem also teaches the turn after a call: the answer repeats the tool's result;
        # half the time the result shown is another number of that length, so that SFT teaches the
        # copy rather than a guess from the question (the first turn's mix is what RL must change)
        digits = len(r["answer"])
        shown = r["answer"] if rng.random() < 0.5 else str(rng.randint(10 ** (digits - 1), 10**digits - 1))
        conversation = [
            *user,
            {"role": "assistant", "content": call},
            {"role": "tool", "name": "calculator", "content": shown},
        ]
        out.append({"prompt": render(conversation), "response": answer_text(shown)})
    return out


_NUMBER = re.compile(r"-?\d+")


def final_answer(completions, answer, **kwargs) -> list[float]:
    """TRL's signature: 1.0 when the last number of the episode's last assistant message is the
    record's ``answer``, else 0.0 (an episode that ends on a tool call has not answered)."""
    scores = []
    for messages, gold in zip(completions, answer):
        said = [m["content"] for m in messages if m["role"] == "assistant"]
        numbers = _NUMBER.findall(said[-1]) if said and TOOL_OPEN not in said[-1] else []
        scores.append(float(bool(numbers) and int(numbers[-1]) == int(gold)))
    return scores


def tool_calls(completions, **kwargs) -> list[float]:
    """How many tool results an episode received: its tool calls (an eval metric)."""
    return [float(sum(m["role"] == "tool" for m in messages)) for messages in completions]


def build_tokenizer(corpus: list[str]):
    """A byte-level BPE tokenizer trained on ``corpus`` (the recipe's transcripts): every digit a
    token of its own (so numbers are copied digit by digit), the tool-call boilerplate merged into
    a few tokens as a real model's vocabulary merges it, the chat markers and tool-call tags as
    added tokens, EOS and pad; ``CHAT_TEMPLATE`` as its chat template. Decoding is exact, so a
    tool call's JSON parses."""
    from ppo_lightning.recipes.tokenizers import build_bpe_tokenizer

    return build_bpe_tokenizer(
        corpus, vocab_size=VOCAB_SIZE, added=(*ROLE_TOKENS, TOOL_OPEN, TOOL_CLOSE), chat_template=CHAT_TEMPLATE
    )


VOCAB_SIZE = 400


def tokenizer_corpus(rng: random.Random | int, n: int = 2000) -> list[str]:
    """Transcripts of both kinds, as text, to train the tokenizer on."""
    rng, out = _as_rng(rng), []
    for r in prompt_records(rng, n):
        expr, value = r["prompt"][0]["content"][len("What is ") : -1], r["answer"]
        out.append(f"{question(expr)}\n{tool_call_text(expr)}\n{value}\n{answer_text(value)}\ncalculator(expression)\n")
    return out
