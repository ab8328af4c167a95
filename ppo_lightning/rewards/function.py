"""A reward from any importable Python callable, called as TRL's GRPOTrainer calls it.

Chosen on the command line: ``reward=function reward.fn=my_pkg.my_module.my_fn``; extra keyword
arguments come from ``reward.kwargs``. The import happens when the run is built, so a typo fails
before any model is loaded. Two signatures:

- TRL's (any function but the one below): called by keyword, as TRL calls it, with what it
  asks for: ``prompts``
  (as the user wrote them: strings, or lists of chat messages), ``completions`` (the response
  texts; for chat prompts each a list of messages: ``[{"role": "assistant", "content": text}]``,
  and for a multi-turn episode every message after the prompt, assistant, tool and user turns),
  ``completion_ids`` (the response token ids), ``log_metric`` (``log_metric(name, value)`` logs a
  scalar under ``rewards/<term>/<name>``), ``environments`` (with ``env``: each episode's
  environment) and the record columns by name. A function that takes ``**kwargs`` gets all of
  them, so ``def f(completion_ids, **kwargs)`` and ``def f(completions, solution, **kwargs)`` both
  work unchanged.
- a function whose second parameter is named ``responses``, ``fn(prompts, responses, **kwargs)``:
  called with the decoded prompt and response texts (``prompt + response`` is the decoded whole
  sequence), then its columns by name.

A parameter that ``reward.kwargs`` does not set and that is not one of the call's own is a column
of the prompt records (``answer``, ``data_source``, ...), one value per response: one without a
default must exist in every record (checked before any model loads), one with a default is passed
where the records have it. A column with the name of a ``reward.kwargs`` key or of a call
argument never replaces it: the configured value and the call's own argument win, and the column
gets one warning.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections import defaultdict
from typing import Any, Callable

import torch

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.rewards.base import Reward, RewardBatch, RewardError, Scored, check_scores

TRL_ARGS = ("prompts", "completions", "completion_ids")  # the TRL-style call's own data arguments
CALL_ARGS = (*TRL_ARGS, "log_metric", "environments")  # everything the call itself passes, columns aside

log = logging.getLogger(__name__)


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


class FunctionReward(Reward):
    """Wraps a callable; validates every batch of scores it returns (length, numbers).

    NaN or inf scores pass through by default: the PPO step skips that iteration, counts it and
    names the prompt, and stops the run if it keeps happening (``ppo.max_nonfinite_iterations``).
    ``logged``: what the function passed to ``log_metric`` since the last ``pop_logged``.
    """

    def __init__(
        self, fn: str, kwargs: dict[str, Any] | None = None, allow_nonfinite: bool = True, key: str = "reward.fn"
    ):
        self.name = fn
        raw, kwargs = import_callable(fn, key), dict(kwargs or {})
        self.short_name = getattr(raw, "__name__", fn.rsplit(".", 1)[-1])
        self.kwargs = kwargs
        self.fn = functools.partial(raw, **kwargs)
        self.allow_nonfinite = allow_nonfinite
        params = inspect.signature(raw).parameters
        named = [p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        positional = [p for p in params.values() if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.trl_style = not (len(positional) >= 2 and positional[1].name == "responses")
        self.takes_all = any(p.kind is p.VAR_KEYWORD for p in params.values())
        own = set(CALL_ARGS) if self.trl_style else {p.name for p in named[:2]}  # (prompts, responses)
        self.call_args = tuple(a for a in CALL_ARGS if a in params or self.takes_all) if self.trl_style else ()
        columns = [p for p in named if p.name not in own and p.name not in kwargs]
        self.required_columns = tuple(p.name for p in columns if p.default is p.empty)
        self.optional_columns = tuple(p.name for p in columns if p.default is not p.empty)
        self.every_column = self.trl_style and self.takes_all
        self.reserved = own | set(kwargs)  # names a column may not take over
        self.logged: dict[str, list[float]] = defaultdict(list)
        self._warned: set[str] = set()

    def log_metric(self, name: str, value: float) -> None:
        """TRL's ``log_metric``: a scalar for ``rewards/<term>/<name>``, averaged over the iteration."""
        self.logged[str(name)].append(float(value))

    def pop_logged(self) -> dict[str, float]:
        """The mean of each ``log_metric`` name since the last call, and forget them."""
        out = {k: sum(v) / len(v) for k, v in self.logged.items() if v}
        self.logged.clear()
        return out

    def score(self, batch: RewardBatch) -> Scored:
        """One checked score per response (``check_scores``), the call chosen by the signature:
        ``None`` from the function means "does not apply to this response" (its score there is 0
        and ``applies`` False)."""
        args = self._arguments(batch)
        try:
            scores = self._call(args)
        except Exception as e:
            raise RewardError(
                f"reward {self.name} raised {type(e).__name__}: {e} ({self._culprit(batch, args)})"
            ) from e
        applies = None
        if not isinstance(scores, torch.Tensor):
            try:
                items = list(scores)
            except TypeError:
                items = None  # check_scores names the problem
            if items is not None:
                applies = torch.tensor([x is not None for x in items], dtype=torch.bool)
                scores = [0.0 if x is None else x for x in items]
        values = check_scores(scores, batch.prompt_texts, self.name, self.allow_nonfinite)
        return Scored(values, applies if applies is not None else torch.ones(len(values), dtype=torch.bool), {})

    def _call(self, args: dict[str, list]):
        if self.trl_style:
            return self.fn(**args)
        rest = {k: v for k, v in args.items() if k not in ("prompts", "responses")}
        return self.fn(args["prompts"], args["responses"], **rest)

    def _arguments(self, batch: RewardBatch) -> dict[str, list]:
        """Everything this call passes, one list (a value per response) each: the call's own
        arguments the function takes (each read from ``batch`` only when taken: the completion
        ids are built for a function that asks for them), then its columns."""
        if self.trl_style:
            own = {
                "prompts": lambda: batch.prompts if batch.prompts is not None else batch.prompt_texts,
                "completions": batch.completion_messages,
                "completion_ids": lambda: batch.completion_ids,
                "log_metric": lambda: self.log_metric,
                "environments": lambda: batch.environments,
            }
            args = {k: own[k]() for k in self.call_args if k != "environments" or batch.environments is not None}
        else:
            args = {"prompts": batch.prompt_texts, "responses": batch.responses}
        return {**args, **self._columns(batch)}

    def _columns(self, batch: RewardBatch) -> dict[str, list]:
        """The columns this function takes, one list each (a value per response); a column named
        like a ``reward.kwargs`` key or a call argument is left out, with one warning."""
        rows = batch.columns or [{} for _ in range(len(batch))]
        present = set(rows[0]) if rows else set()
        missing = [c for c in self.required_columns if c not in present]
        if missing:
            raise RewardError(
                f"reward {self.name} asks for column(s) {missing}, which the prompt records do not have "
                f"(their columns: {sorted(present)})"
            )
        names = (
            sorted(present)
            if self.every_column
            else [*self.required_columns, *(c for c in self.optional_columns if c in present)]
        )
        for c in [c for c in names if c in self.reserved and c not in self._warned]:
            self._warned.add(c)
            log.warning(
                "reward %s: the records' column %r has the name of %s; the %s wins and the column is not passed",
                self.name,
                c,
                "a reward.kwargs key" if c in self.kwargs else "one of the call's own arguments",
                "configured value" if c in self.kwargs else "call's argument",
            )
        return {c: [row.get(c) for row in rows] for c in names if c not in self.reserved}

    def _culprit(self, batch: RewardBatch, args: dict[str, list]) -> str:
        """Find the first row that fails on its own, called with that row's own arguments (its
        prompt, completion, ids and columns), so the message can name the prompt."""
        n = len(batch)
        for i in range(n):
            row = {k: (v if callable(v) else v[i : i + 1]) for k, v in args.items() if v is not None}
            try:
                self._call(row)
            except Exception:
                p, r = batch.prompt_texts[i], batch.responses[i]
                return f"on prompt {i} {p[:60]!r} with response {r[:60]!r}"
        return f"on a batch of {n} that fails only as a whole"


def check_reward_columns(reward_fn, records) -> None:
    """Before any model loads: every column a reward function needs is in every prompt record;
    else a ``ConfigError`` naming the first record without it and the columns that exist."""
    needed = getattr(reward_fn, "required_columns", ())
    for record in records if needed else ():
        missing = [c for c in needed if c not in record.columns]
        if missing:
            raise ConfigError(
                f"{record.where}: reward {reward_fn.name} asks for column(s) {missing}, which this record does "
                f"not have (its columns: {sorted(record.columns)}); add them to the data, or set them in "
                "reward.kwargs"
            )
