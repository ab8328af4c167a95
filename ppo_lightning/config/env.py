"""``env``: multi-turn episodes (``EnvConfig``, every choice but ``none``) and ``env=tools`` (``ToolsConfig``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from ppo_lightning.config import choices
from ppo_lightning.config.schema import param


@dataclass
class EnvConfig:
    """Multi-turn episodes (the ``env`` group, ``ppo_lightning/envs``): the policy writes, an
    environment answers (a tool's result, a user's or a game's reply), the policy writes again,
    and the whole conversation is scored. ``env=none`` (the default): no environment, an episode
    is one prompt and one response. ``env=tools``: tool calling (``ToolEnvironment``, keys below).
    ``env=function env._target_=my_pkg.MyEnv``: any class with ``reset(record)`` and
    ``step(messages) -> EnvStep`` (``envs/base.py``), one instance per episode unless
    ``reuse_instances``. These keys are the episode loop's (``envs/episodes.py``); every other
    key of the group is an argument of ``env._target_``'s constructor (``+env.some_arg=3``). Only the policy's own sampled tokens
    train: the environment's are in the sequence, with no loss, KL, entropy or value target, and
    GAE steps over policy tokens only."""

    _target_: Optional[str] = None
    """The environment class (null: single-turn); must import, checked before any model loads."""
    max_turns: int = param(4, ge=1)
    """Policy turns per episode at most (each one generation call for all unfinished episodes)."""
    max_total_tokens: Optional[int] = param(None, ge=1)
    """Response positions per episode at most, policy and environment tokens together; each
    policy turn is also bounded by ``sampling.max_new_tokens``. An environment answer that would
    not leave the policy a token to answer ends the episode as truncated, its tokens dropped; a
    policy turn cut by it is counted (``env/budget_cut_turns``). Null: what fits, the model's
    context (its config's ``max_position_embeddings`` or equivalent) less
    ``data.max_prompt_length``, read before the weights load."""
    max_observation_tokens: Optional[int] = param(256, ge=1)
    """Tokens of one environment message at most: a longer one is cut (counted,
    ``env/truncated_observations``). Null: no limit."""
    on_error: str = param("count", choices=choices.ENV_ERROR_MODES)
    """An environment whose ``step`` raises: ``count`` ends that episode with ``error_reward``
    and counts it (``env/env_errors``), so one bad episode cannot end a long run; ``raise``
    stops the run (for debugging an environment). A tool that fails is never an error of the
    environment: its message tells the policy what went wrong."""
    error_reward: float = 0.0
    """The score of an episode whose environment raised (``on_error=count``), instead of the
    reward's."""
    reuse_instances: bool = False
    """Build each environment instance once and ``reset`` it for every later episode (TRL's
    "construct once, reset often"), instead of one new instance per episode; ``env=tools`` sets
    it true, as TRL runs its ``environment_factory`` classes. Either way each instance's
    ``close()`` runs: after its episode, or, reused, when the run ends (SIGTERM included)."""
    max_concurrent: Optional[int] = param(None, ge=1)
    """Environment instances live at once at most (a server's session capacity): a batch with
    more episodes plays in waves of this many, each wave scored and its instances closed (or
    pooled) before the next starts. Null: the whole batch at once (one sampling call per turn
    for all of it)."""


@dataclass
class ToolsConfig:
    """``env=tools`` (``ppo_lightning.envs.ToolEnvironment``): tools the policy calls, their JSON
    schemas (from type hints and docstrings) in the prompt through the chat template's ``tools=``
    argument, calls parsed in the model family's format. A malformed call, a tool that raises
    and one that runs past ``tool_timeout_s`` are answered with an ``error: ...`` message and
    counted (``env/malformed_calls``, ``env/tool_errors``, ``env/tool_timeouts``); none stops
    the run. A turn with no tool call ends the episode."""

    tools: List[str] = field(default_factory=list)
    """Dotted paths of functions, each with type hints and a Google-style docstring
    (``ppo_lightning.envs.calculator.calculator`` is a safe arithmetic tool)."""
    environment: Any = None
    """What TRL's GRPOTrainer ``environment_factory`` takes, unchanged: the dotted path of a class or
    of any zero-argument callable returning an instance (built once and reset for every later
    episode, as TRL does: ``env.reuse_instances``), whose
    ``reset(**columns)`` returns None or text appended to the last user message, whose public
    methods are the tools, with an optional ``get_reward()`` scoring the finished episode as one
    more reward term named after the class and an optional ``close()``; or a mapping
    ``{name: path}`` of several, each record choosing one by its ``environment`` column (TRL's
    multi-environment mode)."""
    environment_kwargs: Optional[Dict[str, Any]] = None
    """Keyword arguments of ``environment``'s constructor; with a mapping of environments, a
    mapping ``{name: {argument: value}}``."""
    parser: str = "hermes"
    """The tool-call format: ``hermes``, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (Hermes, Qwen2.5, Qwen3); or the dotted path of a parser class of your own, with
    ``parse(text) -> ParsedTurn`` and ``stop_strings`` (``envs/parsers.py``)."""
    tool_timeout_s: Optional[float] = param(10.0, gt=0)
    """Seconds a tool call may run; a slower one is answered with an error (its thread finishes
    on its own). Null: no limit."""
    stop_at_tool_call: bool = True
    """End a policy turn at the end of its first tool call (the parser's stop strings, added to
    ``sampling.stop_strings``), so the policy never writes a tool's result itself; false lets it
    make several calls in one turn, ending the turn at EOS."""
