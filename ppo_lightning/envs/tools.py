"""Tools the policy calls: typed Python functions, or the public methods of a TRL-style environment.

``env=tools env.tools=[my_pkg.calc,my_pkg.lookup]`` gives the policy those functions;
``env.environment=my_pkg.MyEnv`` gives it an environment written for TRL's GRPOTrainer
``environment_factory``, unchanged: one instance per episode, ``reset(**columns)`` returning None or
text appended to the last user message, its public methods the tools, and an optional
``get_reward()`` that scores the finished episode as one more reward term named after the class
(``rewards.EnvironmentReward``). Both may be given together.

Each tool's JSON schema comes from its type hints and Google-style docstring, through transformers'
``get_json_schema`` (the one schema builder), and goes to the chat template's ``tools=`` argument.

A turn's calls are parsed in the model family's format (``env.parser``, ``parsers.py``) and run
in order. Whatever goes wrong becomes the tool's answer, an ``error: ...`` message the policy
reads, and is counted, never raised: a malformed call (bad JSON, an unknown tool, arguments the
function does not take: ``malformed_calls``), a tool that raises (``tool_errors``), a tool still
running after ``env.tool_timeout_s`` (``tool_timeouts``; its thread is left to finish on its own,
since Python cannot stop a thread). A turn with no call ends the episode.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from typing import Any, Callable

from ppo_lightning.envs.base import Environment, EnvStep, Message
from ppo_lightning.envs.parsers import ToolCall, resolve_parser
from ppo_lightning.config.errors import ConfigError

COUNTERS = ("tool_calls", "tool_errors", "tool_timeouts", "malformed_calls")
"""``EnvStep.info`` keys that count events: summed over an iteration's episodes (``env/<key>``),
not averaged; ``tool_calls`` is also reported per episode (``env/tool_calls_mean``)."""

RESERVED_METHODS = ("reset", "get_reward")  # a TRL environment's lifecycle methods, never tools


def reward_owner(env: object) -> type | None:
    """The class of the TRL-style environment inside ``env`` (a ``ToolEnvironment``'s
    ``environment``) when it scores its own episodes with ``get_reward``; else None."""
    inner = getattr(env, "environment", None)
    return type(inner) if inner is not None and callable(getattr(inner, "get_reward", None)) else None


@functools.lru_cache(maxsize=None)
def _schema_of_function(fn: Callable) -> dict:
    from transformers.utils import get_json_schema

    return get_json_schema(fn)


def tool_schema(fn: Callable, key: str = "env.tools") -> dict:
    """The JSON schema of a tool, from its type hints and docstring; a ``ConfigError`` naming
    ``key`` and what is missing when it cannot be built."""
    try:
        # bound methods are new objects on every access: cache their function, schema per class
        return _schema_of_function(fn.__func__ if inspect.ismethod(fn) else fn)
    except Exception as e:  # transformers' TypeHintParsingException, DocstringParsingException
        name = getattr(fn, "__qualname__", repr(fn))
        raise ConfigError(
            f"{key}: cannot describe tool {name} to the model ({e}); give every argument a type hint and "
            "write a Google-style docstring with an Args: section"
        ) from None


def environment_tools(env: object) -> dict[str, Callable]:
    """A TRL-style environment's tools: its public methods but ``reset`` and ``get_reward``."""
    return {
        name: member
        for name, member in inspect.getmembers(env, predicate=inspect.ismethod)
        if not name.startswith("_") and name not in RESERVED_METHODS
    }


def resolve_tools(paths, key: str = "env.tools") -> list[Callable]:
    """``env.tools``' dotted paths imported, each checked to be a function with a schema."""
    from ppo_lightning.rewards.function import import_callable

    tools = []
    for i, path in enumerate(paths or ()):
        fn = import_callable(path, f"{key}[{i}]") if isinstance(path, str) else path
        if not (inspect.isfunction(fn) or inspect.ismethod(fn) or inspect.isbuiltin(fn)):
            raise ConfigError(f"{key}[{i}]={path!r} is a {type(fn).__name__}, not a function")
        tool_schema(fn, f"{key}[{i}]")
        tools.append(fn)
    names = [fn.__name__ for fn in tools]
    if len(set(names)) != len(names):
        raise ConfigError(f"{key}: two tools share a name ({names}); the model calls tools by name")
    return tools


def resolve_environment(path, key: str = "env.environment"):
    """``env.environment``'s class imported and checked against TRL's contract (a ``reset``)."""
    if path is None:
        return None
    from ppo_lightning.rewards.function import import_callable

    cls = import_callable(path, key) if isinstance(path, str) else path
    if not inspect.isclass(cls) or not callable(getattr(cls, "reset", None)):
        raise ConfigError(f"{key}={path!r}: expected a class with a reset method (TRL's environment_factory contract)")
    return cls


class ToolEnvironment(Environment):
    """An episode's tools: ``tools`` (functions or their dotted paths) and the public methods of
    one instance of ``environment`` (a TRL-style class or its dotted path), parsed by ``parser``
    (``env.parser``), each call bounded by ``tool_timeout_s`` seconds (null: no bound); with
    ``stop_at_tool_call`` a policy turn ends at the end of its first call."""

    def __init__(
        self,
        tools=(),
        environment=None,
        parser: str = "hermes",
        tool_timeout_s: float | None = 10.0,
        stop_at_tool_call: bool = True,
    ):
        self.parser = resolve_parser(parser)
        self.timeout, self.stop_at_tool_call = tool_timeout_s, stop_at_tool_call
        cls = resolve_environment(environment)
        self.environment = cls() if cls is not None else None  # one instance per episode, as TRL
        functions = resolve_tools(tools)
        self.functions: dict[str, Callable] = {fn.__name__: fn for fn in functions}
        if self.environment is not None:
            for name, method in environment_tools(self.environment).items():
                tool_schema(method, f"env.environment={type(self.environment).__name__}")
                self.functions.setdefault(name, method)
        if not self.functions:
            raise ConfigError("env=tools has no tools: set env.tools=[my_pkg.my_fn] or env.environment=my_pkg.MyEnv")
        self.tools = [tool_schema(fn) for fn in self.functions.values()]

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """What ends a policy turn besides EOS: the end of a tool call (``env.stop_at_tool_call``)."""
        return self.parser.stop_strings if self.stop_at_tool_call else ()

    def reset(self, record) -> list[Message] | None:
        if self.environment is None:
            return None
        text = self.environment.reset(prompt=record.prompt, **record.columns)  # as TRL calls it
        if text is None:
            return None
        if not isinstance(text, str):
            raise TypeError(f"{type(self.environment).__name__}.reset returned {type(text).__name__}, not None or str")
        messages = list(record.prompt) if record.is_chat else [{"role": "user", "content": record.prompt}]
        last = max(i for i, m in enumerate(messages) if m["role"] == "user")
        messages[last] = {**messages[last], "content": messages[last]["content"] + text}
        return messages

    def step(self, messages: list[Message]) -> EnvStep:
        parsed = self.parser.parse(messages[-1]["content"])
        if parsed.empty:  # nothing to act on: the policy's answer ends the episode
            return EnvStep(done=True)
        counts = dict.fromkeys(COUNTERS, 0.0)
        out = []
        for note in parsed.malformed:
            counts["malformed_calls"] += 1
            out.append({"role": "tool", "name": "error", "content": f"error: {note}"})
        for call in parsed.calls:
            counts["tool_calls"] += 1
            content, outcome = self._call(call)
            if outcome:
                counts[outcome] += 1
            out.append({"role": "tool", "name": call.name, "content": content})
        return EnvStep(out, info=counts)

    def _call(self, call: ToolCall) -> tuple[str, str | None]:
        """``(the tool's answer, the counter it adds to or None)``."""
        fn = self.functions.get(call.name)
        if fn is None:
            return f"error: unknown tool {call.name!r}; the tools are {', '.join(self.functions)}", "malformed_calls"
        try:
            inspect.signature(fn).bind(**call.arguments)
        except TypeError as e:
            return f"error: {call.name} does not take these arguments ({e})", "malformed_calls"
        done, result, error = _run_with_timeout(fn, call.arguments, self.timeout)
        if not done:
            return f"error: {call.name} did not finish within {self.timeout} s", "tool_timeouts"
        if error is not None:
            return f"error: {call.name} raised {type(error).__name__}: {error}", "tool_errors"
        return _as_text(result), None


def _run_with_timeout(fn: Callable, kwargs: dict, timeout: float | None) -> tuple[bool, Any, BaseException | None]:
    """``(finished, result, exception)`` of ``fn(**kwargs)`` (awaited when it is a coroutine), run
    in a daemon thread and waited for at most ``timeout`` seconds."""
    box: dict[str, Any] = {}

    def target():
        try:
            result = fn(**kwargs)
            box["result"] = asyncio.run(result) if inspect.iscoroutine(result) else result
        except BaseException as e:  # the tool's failure is the model's observation
            box["error"] = e

    if timeout is None:
        target()
    else:
        thread = threading.Thread(target=target, daemon=True, name=f"tool-{getattr(fn, '__name__', 'call')}")
        thread.start()
        thread.join(timeout)
        if thread.is_alive():
            return False, None, None
    return True, box.get("result"), box.get("error")


def _as_text(result: Any) -> str:
    """A tool's result as the tool message's content (TRL: ``str(result)``)."""
    return result if isinstance(result, str) else str(result)
