"""A reward from any importable Python callable, with either of two signatures.

Chosen on the command line: ``reward=function reward.fn=my_pkg.my_module.my_fn``; extra keyword
arguments come from ``reward.kwargs``. The import happens when the run is built, so a typo fails
before any model is loaded. The signature is chosen by the function's parameters:

- with a parameter named ``completions``, TRL's: ``fn(prompts=, completions=, completion_ids=,
  **columns)``, all by keyword. ``prompts`` are as the user wrote them (strings, or lists of chat
  messages); ``completions`` the response texts (for chat prompts, each as a one-message list
  ``[{"role": "assistant", "content": text}]``, as TRL gives them); ``completion_ids`` the
  response token ids.
- otherwise ``fn(prompts, responses, **kwargs)``: the decoded prompt and response texts
  (``prompt + response`` is the decoded whole sequence).

Either way, a parameter that ``reward.kwargs`` does not set and that is not one of the call's own
is a column of the prompt records (``answer``, ``data_source``, ...), one value per response: a
parameter without a default must exist in every record (checked before any model loads), one
with a default is passed where the records have it. A TRL-style function that takes ``**kwargs``
gets every column, as TRL's do.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any, Callable

import torch

from ppo_lightning.errors import ConfigError
from ppo_lightning.rewards.base import RewardError, RewardInputs, check_scores

TRL_ARGS = ("prompts", "completions", "completion_ids")  # the TRL-style call's own parameters


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

    def __init__(
        self, fn: str, kwargs: dict[str, Any] | None = None, allow_nonfinite: bool = True, key: str = "reward.fn"
    ):
        self.name = fn
        raw, kwargs = import_callable(fn, key), dict(kwargs or {})
        self.fn = functools.partial(raw, **kwargs)
        self.allow_nonfinite = allow_nonfinite
        params = inspect.signature(raw).parameters
        self.trl_style = "completions" in params
        named = [p for p in params.values() if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        own = set(TRL_ARGS) if self.trl_style else {p.name for p in named[:2]}  # (prompts, responses)
        columns = [p for p in named if p.name not in own and p.name not in kwargs]
        self.required_columns = tuple(p.name for p in columns if p.default is p.empty)
        self.optional_columns = tuple(p.name for p in columns if p.default is not p.empty)
        self.every_column = self.trl_style and any(p.kind is p.VAR_KEYWORD for p in params.values())

    def __call__(self, prompts: list[str], responses: list[str]):
        """Scores of decoded texts alone (no records; NaN where None): the columns a function
        needs are missing."""
        return self.score(RewardInputs(prompts, responses))

    def score(self, inputs: RewardInputs):
        """One checked score per response (``check_scores``); NaN where the function returned None."""
        values, applies = self.score_applies(inputs)
        return torch.where(applies, values, torch.full_like(values, float("nan")))

    def score_applies(self, inputs: RewardInputs) -> tuple[torch.Tensor, torch.Tensor]:
        """``(scores [B], applies [B] bool)``, the call chosen by the signature: ``None`` from the
        function means "does not apply to this response" (its score there is 0 and ``applies``
        False)."""
        columns = self._columns(inputs)
        try:
            if self.trl_style:
                chat = inputs.prompts is not None and any(isinstance(p, list) for p in inputs.prompts)
                completions = (
                    [[{"role": "assistant", "content": r}] for r in inputs.responses] if chat else inputs.responses
                )
                scores = self.fn(
                    prompts=inputs.prompts if inputs.prompts is not None else inputs.prompt_texts,
                    completions=completions,
                    completion_ids=inputs.completion_ids,
                    **columns,
                )
            else:
                scores = self.fn(inputs.prompt_texts, inputs.responses, **columns)
        except Exception as e:
            raise RewardError(
                f"reward {self.name} raised {type(e).__name__}: {e} "
                f"({self._culprit(inputs.prompt_texts, inputs.responses, columns)})"
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
        values = check_scores(scores, inputs.prompt_texts, self.name, self.allow_nonfinite)
        return values, applies if applies is not None else torch.ones(len(values), dtype=torch.bool)

    def _columns(self, inputs: RewardInputs) -> dict[str, list]:
        """The columns this function takes, one list each (a value per response)."""
        rows = inputs.columns or [{} for _ in inputs.responses]
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
        return {c: [row.get(c) for row in rows] for c in names}

    def _culprit(self, prompts: list[str], responses: list[str], columns: dict[str, list]) -> str:
        """Find the first row that fails on its own, so the message can name the prompt."""
        for i, (p, r) in enumerate(zip(prompts, responses)):
            row = {c: v[i : i + 1] for c, v in columns.items()}
            try:
                if self.trl_style:
                    self.fn(prompts=[p], completions=[r], completion_ids=None, **row)
                else:
                    self.fn([p], [r], **row)
            except Exception:
                return f"on prompt {i} {p[:60]!r} with response {r[:60]!r}"
        return f"on a batch of {len(prompts)} that fails only as a whole"


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
