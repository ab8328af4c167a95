"""What the multi-turn tests share: a BPE tokenizer with merges (the byte tokenizer cannot show a
split that differs), a backend that emits scripted token ids, tools and environments that behave
(or misbehave) on purpose, and an environment written to TRL's ``environment_factory`` contract."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from ppo_lightning.envs import Environment, EnvStep
from ppo_lightning.generation import Generated, GenerationBackend

CALL = '<tool_call>{{"name": "{name}", "arguments": {args}}}</tool_call>'


def tool_call(name: str, args: str) -> str:
    return CALL.format(name=name, args=args)


# ----------------------------------------------------------------------------- a BPE tokenizer
def bpe_corpus() -> list[str]:
    """Text with tool calls, chat markers and arithmetic, so that the merges span turn
    boundaries (``>\\n<|``) and split stop strings in more than one way."""
    lines = []
    for i in range(300):
        a, b = 17 * i % 997, 31 * i % 89
        lines += [
            f"<|user|>What is {a} * {b}?\n<|assistant|>Let me compute. "
            + tool_call("calculator", f'{{"expression": "{a} * {b}"}}')
            + f"\n<|tool|>{a * b}\n<|assistant|>The answer is <answer>{a * b}</answer>.\n",
            f"so the sum is {a + b}.</answer> and then </answer>\n\n",
        ]
    return lines


def build_bpe_tokenizer(vocab_size: int = 600):
    """A byte-level BPE tokenizer trained on ``bpe_corpus`` with merges across every character
    (no pre-tokenising regex), EOS and pad, and the tiny chat template (tools and tool messages)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from ppo_lightning.models.tiny import EOS_TOKEN, PAD_TOKEN, TINY_CHAT_TEMPLATE

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(bpe_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
        model_max_length=1_000_000,
        chat_template=TINY_CHAT_TEMPLATE,
    )


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
"""ChatML (Qwen's layout, without tools): every message ends ``<|im_end|>\n``, so the assistant
suffix starts with the end-of-turn token."""


def build_chatml_tokenizer(vocab_size: int = 600):
    """A byte-level BPE tokenizer (``bpe_corpus``, merges across every character) whose EOS is
    ChatML's end-of-turn token ``<|im_end|>`` (Qwen's instruct layout), with ``<|im_start|>``, a
    pad token and ``CHATML_TEMPLATE``: the assistant suffix ``<|im_end|>\n`` starts with EOS."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|im_end|>", "<|im_start|>", "<|pad|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(bpe_corpus(), trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>"],
        padding_side="left",
        model_max_length=1_000_000,
        chat_template=CHATML_TEMPLATE,
    )


def save_bpe_lm(path: Path, seed: int = 0) -> Path:
    """A tiny random GPT-2 over the BPE tokenizer, saved with it (``from_pretrained`` loads both)."""
    from ppo_lightning.models.tiny import gpt2_config, save_random_model

    tok = build_bpe_tokenizer()
    config = gpt2_config(n_layer=2, n_head=2, n_embd=64, n_positions=512)
    config.vocab_size = len(tok)
    config.bos_token_id = config.eos_token_id = tok.eos_token_id
    config.pad_token_id = tok.pad_token_id
    return save_random_model(path, config, tok, seed=seed)


# ----------------------------------------------------------------------------- a scripted backend
class ScriptedBackend(GenerationBackend):
    """A generation backend that emits fixed token ids: ``script[prompt ids]`` is the list of
    turns an episode with that prompt says, one per ``generate`` call in which it takes part
    (each turn's ids as given: a model may split its text in any way). Turns longer than
    ``max_new_tokens`` are cut, as a sampler cuts them. ``calls`` records each call's contexts."""

    def __init__(self, script: dict[tuple[int, ...], list[list[int]]], pad_token_id: int):
        self.script, self.pad = script, pad_token_id
        self.turn: dict[tuple[int, ...], int] = {}
        self.calls: list[list[list[int]]] = []

    def _prompt(self, context: list[int]) -> tuple[int, ...]:
        matches = [p for p in self.script if tuple(context[: len(p)]) == p]
        assert matches, f"no script for a context starting {context[:12]}"
        return max(matches, key=len)

    def generate(self, prompt_ids, attention_mask, params, generator=None):
        rows = [r[m.bool()].tolist() for r, m in zip(prompt_ids.cpu(), attention_mask.cpu())]
        self.calls.append(rows)
        seen: dict[tuple[int, ...], int] = {}
        out = []
        limits = params.row_max_new_tokens or [params.max_new_tokens] * len(rows)
        for row, limit in zip(rows, limits):
            p = self._prompt(row)
            k = self.turn.get(p, 0)
            seen[p] = k
            out.append(self.script[p][min(k, len(self.script[p]) - 1)][:limit])
        for p, k in seen.items():
            self.turn[p] = k + 1
        R = max(len(t) for t in out)
        responses = torch.full((len(out), R), self.pad, dtype=torch.long)
        mask = torch.zeros(len(out), R)
        for i, t in enumerate(out):
            responses[i, : len(t)] = torch.tensor(t)
            mask[i, : len(t)] = 1.0
        return Generated(responses.to(prompt_ids.device), mask.to(prompt_ids.device))


class StoppingScriptedBackend(ScriptedBackend):
    """``ScriptedBackend`` that stops as a sampler does: each scripted turn is cut after its
    first stop (EOS, ``params.stop_token_ids``, ``params.stop_strings`` matched on the decoded
    text), so a script may ramble on past a stop that the sampler is told about. Only the stops
    in the ``params`` of the call end a turn: what never reaches the sampler never stops it."""

    def __init__(self, script, tokenizer):
        super().__init__(script, tokenizer.pad_token_id)
        self.tok = tokenizer

    def generate(self, prompt_ids, attention_mask, params, generator=None):
        from ppo_lightning.generation import StopChecker

        out, mask, _ = super().generate(prompt_ids, attention_mask, params, generator)
        stops = StopChecker(self.tok.eos_token_id, params.stop_token_ids, params.stop_strings, self.tok)
        first = stops.first_stops(out.masked_fill(mask == 0, self.pad))
        cut = torch.arange(out.shape[1])[None, :] <= first[:, None]
        mask = mask * cut
        return Generated(out.masked_fill(mask == 0, self.pad), mask)


class EngineScriptedBackend(ScriptedBackend):
    """``ScriptedBackend`` that reports an engine's own logprobs (``Generated.logprobs [B, R]``, as
    the vLLM backends do): every sampled token gets a value of its own (-0.01, -0.02, ... in the
    order sampled), the padding after a row -99, and ``given[prompt]`` keeps each episode's
    values in order, so a test can tell which token a logprob landed on."""

    def __init__(self, script, pad_token_id: int):
        super().__init__(script, pad_token_id)
        self.given: dict[tuple[int, ...], list[float]] = {}
        self._n = 0

    def generate(self, prompt_ids, attention_mask, params, generator=None):
        out, mask, _ = super().generate(prompt_ids, attention_mask, params, generator)
        lp = torch.full(out.shape, -99.0)
        for i, row in enumerate(self.calls[-1]):
            n = int(mask[i].sum())
            values = [-0.01 * (self._n + k + 1) for k in range(n)]
            self._n += n
            lp[i, :n] = torch.tensor(values)
            self.given.setdefault(self._prompt(row), []).extend(values)
        return Generated(out, mask, lp.to(out.device))


# ----------------------------------------------------------------------------- tools
def lookup(key: str) -> str:
    """Look up a word in a tiny dictionary.

    Args:
        key: The word.

    Returns:
        Its meaning.
    """
    return {"cat": "a small animal"}.get(key, "unknown")


def broken(x: int) -> int:
    """A tool that always fails.

    Args:
        x: Anything.
    """
    raise RuntimeError(f"broken tool got {x}")


def slow(seconds: float) -> str:
    """A tool that takes its time.

    Args:
        seconds: How long to sleep.
    """
    time.sleep(seconds)
    return "finally"


def no_hints(x):
    """A function without type hints.

    Args:
        x: Anything.
    """
    return x


NOT_A_FUNCTION = 3


class EveryTurnCalls:
    """A tool-call parser for runs whose policy is a random tiny model (``env.parser`` by dotted
    path): it reads a call into every turn, chosen by the sum of the turn's character codes, so
    that such a run exercises every branch of a tool environment: 0 mod 4 asks nothing (the
    episode ends), 1 calls ``calculator`` on arithmetic, 2 is malformed, 3 calls it on a
    division by zero (the tool raises)."""

    stop_strings = ("</tool_call>",)

    def parse(self, text: str):
        from ppo_lightning.envs.parsers import ParsedTurn, ToolCall

        kind = sum(map(ord, text)) % 4
        if kind == 0:
            return ParsedTurn([], [])
        if kind == 2:
            return ParsedTurn([], ["the tool call is not valid JSON (read by EveryTurnCalls)"])
        expression = f"{len(text)} * 7" if kind == 1 else "1 / 0"
        return ParsedTurn([ToolCall("calculator", {"expression": expression})], [])


# ----------------------------------------------------------------------------- environments
class IncrementEnv:
    """An environment written to TRL's GRPOTrainer ``environment_factory`` contract (its docs):
    ``reset(**kwargs)`` gets the record's columns and returns None or text appended to the last
    user message; public methods are tools; ``get_reward()`` scores the finished episode."""

    def reset(self, target=0, **kwargs) -> str | None:
        self.counter, self.target = 0, int(target)
        return f" Reach {self.target}."

    def get_reward(self) -> float:
        return float(self.counter == self.target)

    def increment(self, step: int) -> int:
        """Increment the internal counter.

        Args:
            step: Value to add to the counter.

        Returns:
            The updated counter value.
        """
        self.counter += step
        return self.counter


class AsyncIncrementEnv(IncrementEnv):
    """``IncrementEnv`` whose ``get_reward`` is a coroutine (TRL allows an async one: a judge
    called over the network)."""

    async def get_reward(self) -> float:
        import asyncio

        await asyncio.sleep(0)
        return float(self.counter == self.target)


class Echo(Environment):
    """Answers every turn with a user message until ``turns`` turns, rewarding each with its
    length in messages (``EnvStep.reward``), with an info scalar."""

    def __init__(self, turns: int = 3, reply: str = "go on"):
        self.turns, self.reply = turns, reply

    def reset(self, record):
        self.n = 0
        return None

    def step(self, messages):
        self.n += 1
        done = self.n >= self.turns
        return EnvStep(
            [] if done else [{"role": "user", "content": self.reply}], reward=0.5, done=done, info={"n": self.n}
        )


class CountedTurns(Environment):
    """Answers with a user message until the record's ``turns`` column (default 3) turns; turn
    ``j`` earns ``EnvStep.reward = j``, so a reward that lands on another turn shows."""

    def reset(self, record):
        self.turns, self.n = int(record.columns.get("turns", 3)), 0
        return None

    def step(self, messages):
        self.n += 1
        done = self.n >= self.turns
        return EnvStep([] if done else [{"role": "user", "content": "go on"}], reward=float(self.n), done=done)


class Raises(Environment):
    """``step`` raises on the first turn."""

    def step(self, messages):
        raise ValueError("the game server is down")


class DownOnSecondTurn(Environment):
    """Answers the first turn (turn reward 0.5); on the second, ``step`` raises where the
    record's ``down`` column is true, and ends the episode otherwise."""

    def reset(self, record):
        self.down, self.n = bool(record.columns.get("down")), 0
        return None

    def step(self, messages):
        self.n += 1
        if self.n == 1:
            return EnvStep([{"role": "user", "content": "again"}], reward=0.5)
        if self.down:
            raise ConnectionError("the game server is down")
        return EnvStep(done=True)


class WrongTypes(Environment):
    """``step`` returns a reward that is not a number."""

    def step(self, messages):
        return EnvStep([{"role": "user", "content": "x"}], reward="high")


# ----------------------------------------------------------------------------- rewards
LOWER = set("abcdefghijklmnopqrstuvwxyz ")


def assistant_lowercase(completions, log_metric, **kwargs):
    """TRL's signature: the mean, over an episode's assistant messages, of the fraction of their
    characters that are lowercase letters or spaces (the multi-turn analogue of char_fraction);
    logs the number of assistant messages it saw."""
    scores, turns = [], []
    for messages in completions:
        said = [m["content"] for m in messages if m["role"] == "assistant"]
        turns.append(len(said))
        scores.append(sum(sum(c in LOWER for c in s) / max(len(s), 1) for s in said) / max(len(said), 1))
    log_metric("assistant_turns", sum(turns) / len(turns))
    return scores


def counts_tool_calls(completions, **kwargs):
    """How many tool results an episode received (its tool calls): a reward that counts them."""
    return [float(sum(m["role"] == "tool" for m in messages)) for messages in completions]


class ReachTargetBackend(GenerationBackend):
    """A generation backend that plays a rule instead of sampling (for runs whose episodes must
    call tools): a context whose last line is the user's asks for ``increment`` by the target the
    prompt names (``Reach N.``); a context after a tool's result answers ``done`` and EOS. Built as
    any backend is, from ``(lm, tokenizer)``; records every call's contexts in ``calls`` (a class
    list, since the run builds the backend: a test clears it before its run, or it would read
    the contexts of every run before it)."""

    calls: list = []

    def __init__(self, lm, tokenizer, **kwargs):
        self.tok = tokenizer

    def generate(self, prompt_ids, attention_mask, params, generator=None):
        import re

        out = []
        for row, m in zip(prompt_ids.cpu(), attention_mask.cpu()):
            text = self.tok.decode(row[m.bool()].tolist())
            ReachTargetBackend.calls.append(text)
            if "<|tool|>" in text.rsplit("<|user|>", 1)[-1]:
                ids = self.tok.encode("done", add_special_tokens=False) + [self.tok.eos_token_id]
            else:
                target = re.findall(r"Reach (\d+)\.", text)[-1]
                ids = self.tok.encode(tool_call("increment", f'{{"step": {target}}}'), add_special_tokens=False)
            out.append(ids[: (params.row_max_new_tokens or [params.max_new_tokens] * 10**4)[len(out)]])
        R = max(len(t) for t in out)
        responses = torch.full((len(out), R), self.tok.pad_token_id, dtype=torch.long)
        mask = torch.zeros(len(out), R)
        for i, t in enumerate(out):
            responses[i, : len(t)] = torch.tensor(t)
            mask[i, : len(t)] = 1.0
        return Generated(responses.to(prompt_ids.device), mask.to(prompt_ids.device))
