"""The environment protocol: what a multi-turn episode talks to.

An environment turns one data record into an episode of several policy turns. Write one in a few
lines::

    from ppo_lightning.envs import Environment, EnvStep

    class Guess(Environment):
        def reset(self, record):
            self.target = int(record.columns["target"])  # the record's metadata columns
            return None  # keep the record's prompt as it is

        def step(self, messages):
            guess = messages[-1]["content"].strip()
            if guess == str(self.target):
                return EnvStep(reward=1.0, done=True)
            hint = "higher" if guess.isdigit() and int(guess) < self.target else "lower"
            return EnvStep([{"role": "user", "content": hint}])

``python train.py env=function env._target_=my_pkg.Guess`` then runs it; every other key of the
``env`` group that is not the episode loop's own (``EnvConfig``) is a constructor argument
(``+env.some_arg=3``). One instance serves one episode at a time, so an environment may keep
state; with ``env.reuse_instances`` an instance is ``reset`` again for a later episode instead of
being built anew.

The episode loop (``envs/episodes.py``) calls ``reset`` once, then ``step`` after every policy
turn, with the conversation so far ending with that turn's assistant message. It ends the episode
on ``done``, on the budgets (``env.max_turns``, ``env.max_total_tokens``), or when ``step`` returns
no messages (nothing for the policy to answer). Once the episode is scored, ``close()`` (when the
environment has one) frees what it holds: a session, a connection, a sandbox. Every instance the
run builds is closed, whatever ends its episode (a budget, an error, SIGTERM); with
``env.reuse_instances`` each is closed once, when the run ends.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

Message = dict[str, Any]  # {"role": ..., "content": ...} (and, for a tool message, "name")

OBSERVATION_ROLES = ("tool", "user")
"""The roles an environment's messages may have: a tool's result, or what a user (or game) says."""


class EnvError(RuntimeError):
    """An environment broke the protocol (wrong types): a bug in its code, named with its class."""


@dataclasses.dataclass
class EnvStep:
    """What ``Environment.step`` returns after a policy turn.

    ``messages``: appended to the conversation, each ``{"role": "tool" | "user", "content": str}``
    (a tool message may carry ``"name"``); the policy answers them in its next turn. ``reward``: a
    reward for the turn just taken (it sits on that turn's last token), or None. ``done``: the
    episode is over. ``info``: scalars to log, averaged over episodes into ``env/<key>``.
    """

    messages: list[Message] = dataclasses.field(default_factory=list)
    reward: float | None = None
    done: bool = False
    info: dict[str, float] = dataclasses.field(default_factory=dict)


class Environment:
    """Base class of a multi-turn environment (subclassing it is optional: any class with these
    two methods will do). ``tools``: JSON schemas the chat template renders in the prompt (the
    ``tools=`` argument), empty for an environment that is not a tool environment."""

    tools: list[dict] = []

    def reset(self, record) -> list[Message] | None:
        """Start an episode from one record (``data.records.PromptRecord``: its ``prompt`` as written and
        its metadata ``columns``). Return messages to use as the prompt (for example the record's
        with a system prompt added), or None to keep the record's prompt."""
        return None

    def step(self, messages: list[Message]) -> EnvStep:
        """Answer the policy's latest turn (``messages[-1]``, role ``assistant``)."""
        raise NotImplementedError

    def close(self) -> None:
        """Free what the episode holds (a session, a connection, a sandbox); called once the
        episode is scored, or with ``env.reuse_instances`` once the run ends."""


def check_protocol(env: object) -> None:
    """Before any model loads: ``env`` has the methods the episode loop calls, ``reset`` and
    ``step``; an ``EnvError`` naming its class and what is missing (a class without ``step`` would
    otherwise train with every episode counted as an environment error)."""
    name = type(env).__name__
    missing = [m for m in ("reset", "step") if not callable(getattr(type(env), m, None))]
    if missing:
        raise EnvError(
            f"{name} has no {' and no '.join(f'{m}()' for m in missing)}: an environment needs reset(record) -> "
            "messages or None, and step(messages) -> EnvStep (ppo_lightning/envs/base.py)"
        )


def close_env(env: object) -> str | None:
    """``env.close()`` where it has one; what it raised, as text, or None. A failing ``close`` is
    reported by the caller, never raised: it must not stop the others from closing."""
    close = getattr(env, "close", None)
    if not callable(close):
        return None
    try:
        close()
    except Exception as e:  # noqa: BLE001 - a teardown error is reported, not raised
        return f"{type(env).__name__}.close raised {type(e).__name__}: {e}"
    return None


def check_step(step: Any, env: object) -> EnvStep:
    """``step`` as an ``EnvStep``, or an ``EnvError`` naming the environment's class and the field
    that has the wrong type."""
    name = type(env).__name__
    if not isinstance(step, EnvStep):
        raise EnvError(f"{name}.step returned {type(step).__name__}, not an EnvStep(messages, reward, done, info)")
    if not isinstance(step.messages, (list, tuple)):
        raise EnvError(f"{name}.step: EnvStep.messages is a {type(step.messages).__name__}, not a list of messages")
    for i, m in enumerate(step.messages):
        check_message(m, f"{name}.step: EnvStep.messages[{i}]", roles=OBSERVATION_ROLES)
    if step.reward is not None and (isinstance(step.reward, bool) or not isinstance(step.reward, numbers.Real)):
        raise EnvError(f"{name}.step: EnvStep.reward is {step.reward!r}, not a float or None")
    if not isinstance(step.done, bool):
        raise EnvError(f"{name}.step: EnvStep.done is {step.done!r}, not a bool")
    if not isinstance(step.info, dict):
        raise EnvError(f"{name}.step: EnvStep.info is a {type(step.info).__name__}, not a dict of scalars")
    for k, v in step.info.items():
        if not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, numbers.Real):
            raise EnvError(f"{name}.step: EnvStep.info[{k!r}] is {v!r}, not a float (info holds scalars to log)")
    return step


def check_reset(messages: Any, env: object) -> list[Message] | None:
    """``reset``'s return value checked: None, or a non-empty list of messages."""
    if messages is None:
        return None
    name = type(env).__name__
    if not isinstance(messages, (list, tuple)) or not messages:
        raise EnvError(f"{name}.reset returned {messages!r}: return None or a non-empty list of messages")
    for i, m in enumerate(messages):
        check_message(m, f"{name}.reset: message {i}")
    return list(messages)


def check_message(m: Any, where: str, roles: tuple[str, ...] | None = None) -> None:
    if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
        raise EnvError(f"{where} is {m!r}: a message is a dict with string 'role' and 'content'")
    if roles is not None and m["role"] not in roles:
        raise EnvError(f"{where} has role {m['role']!r}; an environment speaks as one of {', '.join(roles)}")
