"""Tool calls parsed from an assistant message, in the model family's format (``env.parser``).

A parser turns the text of one policy turn into the calls it asks for, plus a note for each call
it could not read (a malformed call is answered with an error message, never a crash). One
format ships so far. Another is a class with ``parse(text) -> ParsedTurn`` and a
``stop_strings`` tuple: give its dotted path as ``env.parser=my_pkg.MyParser``, or add an entry
to ``PARSERS`` to ship it by name:

- ``hermes`` (Hermes, Qwen2.5, Qwen3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one or more per message, the JSON possibly spread over lines.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Protocol


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]


@dataclasses.dataclass
class ParsedTurn:
    """The calls one assistant message makes, in order, and one error text per call that could
    not be parsed (bad JSON, no name, arguments that are not an object, an unclosed tag)."""

    calls: list[ToolCall]
    malformed: list[str]

    @property
    def empty(self) -> bool:
        """Nothing for a tool environment to act on: the episode ends with this turn."""
        return not self.calls and not self.malformed


class ToolCallParser(Protocol):
    stop_strings: tuple[str, ...]
    """Strings that end a policy turn that calls tools (sampled as ``sampling.stop_strings``)."""

    def parse(self, text: str) -> ParsedTurn: ...


class HermesParser:
    """``<tool_call>{"name": "f", "arguments": {"x": 1}}</tool_call>`` (Hermes 2 Pro's format,
    which Qwen2.5's and Qwen3's chat templates use). ``arguments`` may also be a JSON string
    holding the object, as some models write it."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    stop_strings = (CLOSE,)
    _BLOCK = re.compile(re.escape(OPEN) + r"(.*?)(" + re.escape(CLOSE) + r"|$)", re.DOTALL)

    def parse(self, text: str) -> ParsedTurn:
        calls, malformed = [], []
        for m in self._BLOCK.finditer(text):
            body, closed = m.group(1).strip(), bool(m.group(2))
            if not closed:
                malformed.append(f"the tool call is not closed with {self.CLOSE}")
                continue
            try:
                obj = json.loads(body)
            except json.JSONDecodeError as e:
                malformed.append(f"the tool call is not valid JSON ({e.msg} at character {e.pos})")
                continue
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                malformed.append('a tool call is a JSON object {"name": <tool>, "arguments": {...}}')
                continue
            args = obj.get("arguments", {})
            if isinstance(args, str):
                try:
                    args = json.loads(args)
                except json.JSONDecodeError:
                    pass
            if not isinstance(args, dict):
                malformed.append(f"the arguments of {obj['name']!r} are not a JSON object")
                continue
            calls.append(ToolCall(obj["name"], args))
        return ParsedTurn(calls, malformed)


PARSERS: dict[str, type] = {"hermes": HermesParser}
"""``env.parser`` names: the tool-call formats that ship."""


def resolve_parser(name: str, key: str = "env.parser") -> ToolCallParser:
    """The parser ``name`` stands for: a name in ``PARSERS``, or the dotted path of a class with
    ``parse`` and ``stop_strings``, built with no arguments; a ``ConfigError`` naming ``key``."""
    from ppo_lightning.config.errors import ConfigError

    if name in PARSERS:
        return PARSERS[name]()
    if not isinstance(name, str) or "." not in name:
        raise ConfigError(
            f"{key}={name!r}: choose one of {', '.join(PARSERS)}, or give the dotted path of a class with "
            "parse(text) -> ParsedTurn and stop_strings"
        )
    from ppo_lightning.rewards.function import import_callable

    cls = import_callable(name, key)
    parser = cls() if isinstance(cls, type) else None
    if parser is None or not callable(getattr(parser, "parse", None)) or not hasattr(parser, "stop_strings"):
        raise ConfigError(f"{key}={name!r} is not a parser class: it needs parse(text) -> ParsedTurn and stop_strings")
    return parser
