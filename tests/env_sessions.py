"""Environments that hold something an episode must give back, and environments that break the
protocol, for the environment-safety tests (``test_env_safety.py``).

``Sessions`` opens a "session" when built and closes it in ``close()``, writing each event to a
ledger file (so a run in another process, stopped by SIGTERM, can be counted afterwards) and
keeping the count of open ones in the class (for in-process runs): an OpenEnv client against a
server of bounded capacity, or a sandbox per episode, behaves like this.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

from ppo_lightning.envs import Environment, EnvStep

_IDS = itertools.count()


class Sessions(Environment):
    """Two turns per episode (a user reply, then done, each with turn reward ``reward``); a
    session open from construction to ``close()``. ``ledger``: a file each open and close is
    appended to, ``<pid> open|close <id>``. ``fail_every``: ``step`` raises on that many-th
    episode's first turn (a server error mid-episode); ``capacity``: construction raises past
    that many open sessions (an OpenEnv server at capacity)."""

    open_now = 0
    peak = 0
    built = 0
    resets = 0

    def __init__(self, ledger: str | None = None, fail_every: int = 0, capacity: int = 0, reward: float = 0.5):
        if capacity and Sessions.open_now >= capacity:
            raise RuntimeError(f"Server at capacity: {Sessions.open_now}/{capacity} sessions active")
        self.id, self.ledger, self.fail_every, self.reward = next(_IDS), ledger, fail_every, reward
        self.closed = False
        Sessions.open_now += 1
        Sessions.built += 1
        Sessions.peak = max(Sessions.peak, Sessions.open_now)
        self._write("open")

    def _write(self, event: str) -> None:
        if self.ledger:
            with open(self.ledger, "a") as f:
                f.write(f"{os.getpid()} {event} {self.id}\n")

    @classmethod
    def reset_counts(cls) -> None:
        cls.open_now = cls.peak = cls.built = cls.resets = 0

    def reset(self, record):
        assert not self.closed, "reset after close"
        Sessions.resets += 1
        self.n = 0
        self.episode = Sessions.resets
        return None

    def step(self, messages):
        assert not self.closed, "step after close"
        self.n += 1
        if self.fail_every and self.n == 1 and self.episode % self.fail_every == 0:
            raise ConnectionError("the session dropped")
        if self.n >= 2:
            return EnvStep(reward=self.reward, done=True)
        return EnvStep([{"role": "user", "content": "again"}], reward=self.reward)

    def close(self):
        assert not self.closed, "closed twice"
        self.closed = True
        Sessions.open_now -= 1
        self._write("close")


def open_sessions(ledger: Path) -> int:
    """Sessions the ledger says were opened and never closed."""
    opened, closed = set(), set()
    for line in ledger.read_text().splitlines() if ledger.exists() else []:
        pid, event, i = line.split()
        (opened if event == "open" else closed).add((pid, i))
    return len(opened - closed)


class NoStep:
    """Has ``reset`` but no ``step``."""

    def reset(self, record):
        return None


class NoReset:
    """Has ``step`` but no ``reset``."""

    def step(self, messages):
        return EnvStep(done=True)


class StepReturnsDict(Environment):
    """``step`` returns a dict instead of an ``EnvStep`` (a gym-style habit)."""

    def step(self, messages):
        return {"reward": 1.0, "done": True}


class NeedsLevel(Environment):
    """``reset`` reads a column the records do not have."""

    def reset(self, record):
        self.level = record.columns["level"]
        return None

    def step(self, messages):
        return EnvStep(done=True)


class LazyProperty:
    """A TRL-style environment whose property needs ``reset()`` first: tool discovery must read
    the class, not evaluate the instance's properties."""

    def reset(self, **kwargs):
        self.board = [0, 0, 0]
        return None

    @property
    def score(self) -> int:
        return sum(self.board)  # AttributeError before reset

    def move(self, cell: int) -> str:
        """Mark a cell.

        Args:
            cell: The cell to mark.
        """
        self.board[cell] = 1
        return "ok"


class Counter:
    """A TRL-style environment with constructor arguments and a ``close``: counts its open
    instances in the class."""

    open_now = 0

    def __init__(self, start: int = 0):
        self.start = start
        Counter.open_now += 1

    def reset(self, **kwargs):
        self.value = self.start
        return f" Start at {self.start}."

    def add(self, x: int) -> int:
        """Add to the counter.

        Args:
            x: What to add.
        """
        self.value += x
        return self.value

    def get_reward(self) -> float:
        return float(self.value)

    def close(self):
        Counter.open_now -= 1


class Doubler(Counter):
    """A second TRL-style environment for the multi-environment mode."""

    def double(self) -> int:
        """Double the counter."""
        self.value *= 2
        return self.value


def make_counter() -> Counter:
    """A zero-argument factory (TRL's ``environment_factory`` takes any callable)."""
    return Counter(start=7)


def no_score(prompts, completions, **kwargs):
    """A TRL-signature reward that applies to no response (None for every one)."""
    return [None] * len(completions)


def _callback_base():
    import lightning as L

    return L.Callback


class OpenSessions(_callback_base()):
    """A callback: the sessions open at the end of every iteration, in ``OpenSessions.seen``."""

    seen: list[int] = []

    def on_train_batch_end(self, trainer, pl_module, *args) -> None:
        OpenSessions.seen.append(Sessions.open_now)


class EchoServer:
    """A server of bounded capacity, as an OpenEnv space is: each client holds a session until the
    process ends (the client of TRL's echo example is never closed)."""

    capacity = 8
    sessions = 0

    @classmethod
    def connect(cls) -> None:
        if cls.sessions >= cls.capacity:
            raise RuntimeError(f"Server at capacity: {cls.sessions}/{cls.capacity} sessions active")
        cls.sessions += 1


class EchoClientEnv:
    """TRL's OpenEnv echo example, its shape kept: a client made in ``__init__``, ``reset()`` with
    no arguments, the tool named ``step``, ``get_reward()``, and no ``close()``."""

    def __init__(self):
        EchoServer.connect()

    def reset(self) -> None:
        self._reward = 0.0

    def step(self, message: str) -> str:
        """Echo the message back from the environment.

        Args:
            message: The message to echo

        Returns:
            The echoed message.
        """
        self._reward = float(len(message))
        return message

    def get_reward(self) -> float:
        return self._reward
