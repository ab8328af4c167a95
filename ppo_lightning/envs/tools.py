"""Tools the policy calls: typed Python functions, or the public methods of a TRL-style environment.

``env=tools env.tools=[my_pkg.calc,my_pkg.lookup]`` gives the policy those functions;
``env.environment=my_pkg.MyEnv`` gives it an environment written for TRL's GRPOTrainer
``environment_factory``, unchanged: built once and reset for every later episode, as TRL does
(``env.reuse_instances``), ``reset(**columns)`` returning None or
text appended to the last user message, its public methods the tools, and an optional
``get_reward()`` that scores the finished episode as one more reward term named after the class
(``rewards.environment.EnvironmentReward``). Both may be given together.

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

RESERVED_METHODS = ("reset", "get_reward", "close")  # a TRL environment's lifecycle methods, never tools

ENVIRONMENT_COLUMN = "environment"
"""The record column that selects an environment when ``env.environment`` names several (TRL's
multi-environment mode: a dict ``environment_factory`` and an ``environment`` column)."""


def reward_owners(env: object) -> list[type]:
    """The classes of the TRL-style environments inside ``env`` (a ``ToolEnvironment``'s, every
    one it may choose per record) that score their own episodes with ``get_reward``."""
    if not isinstance(env, ToolEnvironment):
        return []
    owners = []
    for name in env.factories:
        env._select(name)
        cls = type(env.environment)
        if callable(getattr(cls, "get_reward", None)) and cls not in owners:
            owners.append(cls)
    return owners


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
    """A TRL-style environment's tools: the public methods its class defines, but the lifecycle
    ones (``RESERVED_METHODS``), each bound to ``env``. Read on the class, so that no property of
    the instance is evaluated (one that needs ``reset()`` first would raise here)."""
    cls = type(env)
    return {
        name: getattr(env, name)
        for name, member in inspect.getmembers(cls, predicate=inspect.isfunction)
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


CONTRACT = (
    "TRL's environment_factory contract: a class or zero-argument callable whose instances have "
    "reset(**columns) -> None or str, public methods as tools, optionally get_reward() and close()"
)


def resolve_environment(path, kwargs=None, key: str = "env.environment") -> Callable[[], Any] | None:
    """``() -> a new instance`` of ``env.environment`` as TRL's ``environment_factory`` takes it: a
    class or any zero-argument callable (a dotted path, or the object), built with
    ``env.environment_kwargs`` as keyword arguments. The instance's ``reset`` is checked when it
    is built (``ToolEnvironment``)."""
    if path is None:
        return None
    from ppo_lightning.rewards.function import import_callable

    factory = import_callable(path, key) if isinstance(path, str) else path
    if not callable(factory):
        raise ConfigError(f"{key}={path!r} is a {type(factory).__name__}, not a class or callable ({CONTRACT})")
    if inspect.isclass(factory) and not callable(getattr(factory, "reset", None)):
        raise ConfigError(f"{key}={path!r}: class {factory.__name__} has no reset method ({CONTRACT})")
    kwargs = dict(kwargs or {})
    return functools.partial(factory, **kwargs) if kwargs else factory


def resolve_environments(spec, kwargs=None, key: str = "env.environment") -> dict[str | None, Callable[[], Any]]:
    """``env.environment`` as factories by name: ``{None: factory}`` for one environment, or, for a
    mapping ``{name: class or path}``, one factory per name, each with its own
    ``env.environment_kwargs.<name>``; a record picks one by its ``environment`` column."""
    if spec is None:
        return {}
    if isinstance(spec, dict):
        if not spec:
            raise ConfigError(
                f"{key}: an empty mapping; name one environment per value of the records' {ENVIRONMENT_COLUMN!r} column"
            )
        per_name = dict(kwargs or {})
        unknown = sorted(set(per_name) - set(spec))
        if unknown:
            raise ConfigError(
                f"env.environment_kwargs.{unknown[0]}: no environment of that name; env.environment has {sorted(spec)}"
            )
        return {str(n): resolve_environment(p, per_name.get(n), f"{key}.{n}") for n, p in spec.items()}
    return {None: resolve_environment(spec, kwargs, key)}


def build_environment(factory: Callable[[], Any], key: str) -> Any:
    """One instance from ``factory``, checked to have ``reset``; a ``ConfigError`` naming ``key``."""
    try:
        env = factory()
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"{key}: building it raised {type(e).__name__}: {e}") from None
    if not callable(getattr(env, "reset", None)):
        raise ConfigError(f"{key}: its instance ({type(env).__name__}) has no reset method ({CONTRACT})")
    return env


class ToolEnvironment(Environment):
    """An episode's tools: ``tools`` (functions or their dotted paths) and the public methods of
    one instance of ``environment`` (TRL's ``environment_factory``: a class, a zero-argument
    callable or a dotted path, built with ``environment_kwargs``; or a mapping of them, chosen per
    record by its ``environment`` column), parsed by ``parser`` (``env.parser``), each call bounded
    by ``tool_timeout_s`` seconds (null: no bound); with ``stop_at_tool_call`` a policy turn ends
    at the end of its first call. The inner instance is kept (per name) while this object lives:
    one instance per episode, or reset again with ``env.reuse_instances``."""

    def __init__(
        self,
        tools=(),
        environment=None,
        parser: str = "hermes",
        tool_timeout_s: float | None = 10.0,
        stop_at_tool_call: bool = True,
        environment_kwargs=None,
    ):
        self.parser = resolve_parser(parser)
        self.timeout, self.stop_at_tool_call = tool_timeout_s, stop_at_tool_call
        self.factories = resolve_environments(environment, environment_kwargs)
        self.functions_only: dict[str, Callable] = {fn.__name__: fn for fn in resolve_tools(tools)}
        self.instances: dict[str | None, Any] = {}
        self.environment = None  # the inner instance of the current episode (get_reward's)
        self.functions: dict[str, Callable] = dict(self.functions_only)
        self._tools: list[dict] | None = None
        if not self.factories and not self.functions_only:
            raise ConfigError("env=tools has no tools: set env.tools=[my_pkg.my_fn] or env.environment=my_pkg.MyEnv")
        if not self.per_record:  # one environment: built now, as TRL builds one per episode
            self._select(None)

    @property
    def per_record(self) -> bool:
        """Several environments, one chosen per record by its ``environment`` column."""
        return bool(self.factories) and None not in self.factories

    @property
    def tools(self) -> list[dict]:
        """The current environment's tool schemas, with the functions'; before any record has
        chosen one of several environments (a probe), the first one's."""
        if self._tools is None:
            self._select(next(iter(self.factories), None))
        return self._tools

    def _select(self, name: str | None) -> None:
        """Make environment ``name`` the current one (built once, kept per name), and its methods
        with the functions the tools."""
        self.functions = dict(self.functions_only)
        if self.factories:
            if name not in self.instances:
                key = "env.environment" if name is None else f"env.environment.{name}"
                self.instances[name] = build_environment(self.factories[name], key)
            self.environment = self.instances[name]
            cls = type(self.environment).__name__
            for member, method in environment_tools(self.environment).items():
                tool_schema(method, f"env.environment={cls}.{member}")
                self.functions.setdefault(member, method)
        self._tools = [tool_schema(fn) for fn in self.functions.values()]

    def close(self) -> None:
        """Close every inner instance that has a ``close`` (its session, connection or sandbox)."""
        from ppo_lightning.envs.base import close_env

        errors = [e for e in (close_env(env) for env in self.instances.values()) if e]
        self.instances, self.environment, self._tools = {}, None, None
        if errors:
            raise RuntimeError("; ".join(errors))

    @property
    def stop_strings(self) -> tuple[str, ...]:
        """What ends a policy turn besides EOS: the end of a tool call (``env.stop_at_tool_call``)."""
        return self.parser.stop_strings if self.stop_at_tool_call else ()

    def reset(self, record) -> list[Message] | None:
        if self.per_record:
            name = record.columns.get(ENVIRONMENT_COLUMN)
            if name not in self.factories:
                raise ConfigError(
                    f"a record's {ENVIRONMENT_COLUMN!r} column is {name!r}; env.environment names "
                    f"{sorted(self.factories)}: give every record one of them"
                )
            self._select(name)
        elif self.factories and not self.instances:  # closed, then reused
            self._select(None)
        if self.environment is None:
            return None
        columns = {k: v for k, v in record.columns.items() if not (self.per_record and k == ENVIRONMENT_COLUMN)}
        text = self.environment.reset(**_accepted(self.environment.reset, {"prompt": record.prompt, **columns}))
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


def _accepted(fn: Callable, kwargs: dict) -> dict:
    """The keyword arguments ``fn`` takes: all of them when it has ``**kwargs`` (TRL passes the
    record's every column, ``prompt`` included), else those it names (a ``reset(self)`` gets none).
    In multi-environment mode the ``environment`` column is a control field and never reaches it."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: as TRL calls it
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    return {k: v for k, v in kwargs.items() if k in names}


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
