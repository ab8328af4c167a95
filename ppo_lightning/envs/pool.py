"""Environment instances over their lifetime: built, reused, closed, counted.

An environment may hold what must be given back: a server session (an OpenEnv space of bounded
capacity), a connection, a sandbox. ``EnvPool`` is the one place that builds instances and the one
that closes them: ``acquire`` hands out an idle instance (``env.reuse_instances``) or builds one,
``release`` closes it (or keeps it for the next episode), ``close`` closes every idle one when the
run ends. ``live`` counts the instances built and not yet closed, so a test can hold the pool to
"nothing left open".
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from ppo_lightning.envs.base import close_env

log = logging.getLogger(__name__)


class EnvPool:
    """Instances of ``make_env``: with ``reuse`` each released one is kept and handed out again
    (TRL's "construct once, reset often"), else it is closed on release."""

    def __init__(self, make_env: Callable[[], Any], reuse: bool = False):
        self.make_env, self.reuse = make_env, reuse
        self.idle: list[Any] = []
        self.live = 0  # built and not yet closed, idle ones included
        self.close_errors = 0  # close() calls that raised (the first is logged)

    def acquire(self) -> Any:
        if self.idle:
            return self.idle.pop()
        env = self.make_env()
        self.live += 1
        return env

    def release(self, env: Any) -> None:
        if self.reuse:
            self.idle.append(env)
        else:
            self._close(env)

    def close(self) -> None:
        """Close every idle instance: the run is over."""
        while self.idle:
            self._close(self.idle.pop())

    def _close(self, env: Any) -> None:
        self.live -= 1
        error = close_env(env)
        if error is not None:
            if not self.close_errors:
                log.warning("%s (the run goes on; later close() errors are not shown)", error)
            self.close_errors += 1
