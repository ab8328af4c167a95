"""A reward from any importable Python callable ``(prompts, responses) -> list[float]``.

Chosen on the command line: ``reward=function reward.fn=my_pkg.my_module.my_fn``; extra keyword
arguments come from ``reward.kwargs``. The import happens when the run is built, so a typo fails
before any model is loaded.
"""

from __future__ import annotations

import functools
import importlib
from typing import Any, Callable

from ppo_lightning.errors import ConfigError
from ppo_lightning.rewards.base import RewardError, check_scores


def import_callable(path: str, key: str = "reward.fn") -> Callable:
    """Import ``pkg.module.attr`` (or ``pkg.module:attr``) and check that it is callable."""
    module_name, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep or not module_name:
        raise ConfigError(f"{key}={path!r}: expected a dotted path such as my_pkg.my_module.my_fn")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(
            f"{key}={path!r}: cannot import module {module_name!r} ({e}). Check the "
            "spelling and that the module is on PYTHONPATH or installed."
        ) from None
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ConfigError(f"{key}={path!r}: module {module_name!r} has no attribute {attr!r}") from None
    if not callable(fn):
        raise ConfigError(f"{key}={path!r} is a {type(fn).__name__}, not a callable")
    return fn


class FunctionReward:
    """Wraps a callable; validates every batch of scores it returns (length, numbers).

    NaN or inf scores pass through by default: the PPO step skips that iteration, counts it and
    names the prompt, and stops the run if it keeps happening (``ppo.max_nonfinite_iterations``).
    """

    def __init__(self, fn: str, kwargs: dict[str, Any] | None = None, allow_nonfinite: bool = True):
        self.name = fn
        self.fn = functools.partial(import_callable(fn), **(kwargs or {}))
        self.allow_nonfinite = allow_nonfinite

    def __call__(self, prompts: list[str], responses: list[str]):
        try:
            scores = self.fn(prompts, responses)
        except Exception as e:
            raise RewardError(
                f"reward {self.name} raised {type(e).__name__}: {e} ({self._culprit(prompts, responses)})"
            ) from e
        return check_scores(scores, prompts, self.name, self.allow_nonfinite)

    def _culprit(self, prompts: list[str], responses: list[str]) -> str:
        """Find the first row that fails on its own, so the message can name the prompt."""
        for i, (p, r) in enumerate(zip(prompts, responses)):
            try:
                self.fn([p], [r])
            except Exception:
                return f"on prompt {i} {p[:60]!r} with response {r[:60]!r}"
        return f"on a batch of {len(prompts)} that fails only as a whole"
