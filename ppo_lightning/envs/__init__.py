"""Multi-turn episodes: environments and tools the policy talks to, trained on its own tokens only.

- ``base.py``: the protocol, ``Environment`` with ``reset(record)`` and ``step(messages) -> EnvStep``;
- ``tools.py``: ``ToolEnvironment`` (typed functions, or a TRL ``environment_factory`` class, as tools);
- ``parsers.py``: tool calls read in the model family's format (``env.parser``);
- ``calculator.py``: a safe arithmetic tool;
- ``template.py``: the prompt rendered once, each environment answer as the chat template's delta;
- ``episodes.py``: the loop that plays a batch of records as episodes (``EpisodeRunner``);
- ``single.py``: the null environment (``SingleTurn``): each record one response, in one call.

The ``env`` config group chooses one (``env=none``, the default, is the null environment).
``build_runner`` turns the group into a runner, ``SingleTurn`` or ``EpisodeRunner``: both
``play`` a batch of prompts into a batch that knows how it is scored, shown and measured, so no
code outside this package asks whether a run is multi-turn. ``check_env`` checks the group
before any model loads.
"""

from __future__ import annotations

from ppo_lightning.envs.base import Environment, EnvError, EnvStep
from ppo_lightning.envs.calculator import calculator
from ppo_lightning.envs.episodes import EpisodeBatch, EpisodeRunner, Record, Transcript
from ppo_lightning.envs.single import SingleTurn, SingleTurnBatch
from ppo_lightning.envs.template import ChatRenderer
from ppo_lightning.envs.tools import ToolEnvironment

__all__ = [
    "ChatRenderer",
    "EnvError",
    "EnvStep",
    "Environment",
    "EpisodeBatch",
    "EpisodeRunner",
    "Record",
    "SingleTurn",
    "SingleTurnBatch",
    "Transcript",
    "ToolEnvironment",
    "build_runner",
    "calculator",
    "check_env",
    "check_env_reward",
    "env_factory",
    "first_record",
]


def loop_keys() -> tuple[str, ...]:
    """The ``env`` group's keys that are the episode loop's (``config.EnvConfig``), not the
    environment constructor's."""
    import dataclasses

    from ppo_lightning.config import EnvConfig

    return tuple(f.name for f in dataclasses.fields(EnvConfig))


def _plain(node) -> dict:
    from omegaconf import OmegaConf

    return OmegaConf.to_container(node, resolve=True) if OmegaConf.is_config(node) else dict(node)


def first_record(path: str | None, field: str = "prompt") -> Record | None:
    """The first record of ``data.path`` (None where there is no file to read yet): what
    ``check_env`` resets one environment on before any model loads."""
    if path is None:
        return None
    from ppo_lightning.data.records import read_prompt_records

    records = read_prompt_records(path, field)
    return Record(records[0].prompt, dict(records[0].columns)) if records else None


def env_factory(node):
    """``() -> a new environment`` from the ``env`` node: ``_target_`` with every key that is
    not the loop's as a constructor argument; a ``ConfigError`` naming ``env._target_`` when it
    does not import or does not accept them."""
    import hydra

    from ppo_lightning.config.errors import ConfigError

    target = node.get("_target_")
    if not target:
        raise ConfigError("env: no env._target_; choose env=tools, or env=function env._target_=my_pkg.MyEnv")
    try:
        hydra.utils.get_object(target)
    except Exception as e:
        raise ConfigError(f"env._target_={target!r}: cannot import it ({e})") from None
    kwargs = {k: v for k, v in _plain(node).items() if k not in loop_keys()}

    def make():
        return hydra.utils.instantiate({"_target_": target, **kwargs}, _convert_="all")

    return make


def check_env(node, record=None, reward: bool = False) -> None:
    """Before any model loads: the environment class imports, one instance builds from the
    group's arguments (its tools import and have schemas), it has ``reset`` and ``step``, and, with
    ``record`` (the data's first, a ``Record``), its ``reset`` takes that record's columns; with
    ``reward`` (``reward=environment``) it gives a reward (``check_env_reward``). Every failure is
    one ``ConfigError`` naming the key or the class. The instance is closed after. A job calls this
    once (``jobs.factory.check_inputs``), or twice where its recipe writes the prompts: without
    the record before the build, with it after (``check_built_inputs``)."""
    from ppo_lightning.config.errors import ConfigError
    from ppo_lightning.envs.base import EnvError, check_protocol, check_reset, close_env

    make = env_factory(node)
    target = node.get("_target_")
    try:
        env = make()
    except ConfigError:
        raise
    except Exception as e:
        cause = e.__cause__ or e  # hydra wraps the constructor's error
        if isinstance(cause, ConfigError):  # the constructor's own check names its key
            raise cause from None
        raise ConfigError(f"env._target_={target!r}: cannot build it ({type(cause).__name__}: {cause})") from None
    try:
        check_protocol(env)
        if reward:
            check_env_reward(node, env)
        if record is not None:
            check_reset(env.reset(record), env)
    except ConfigError as e:
        raise e if str(e).startswith(("env.", "reward=")) else ConfigError(f"env._target_={target!r}: {e}") from None
    except EnvError as e:
        raise ConfigError(f"env._target_={target!r}: {e}") from None
    except Exception as e:
        raise ConfigError(
            f"env._target_={target!r}: {type(env).__name__}.reset raised {type(e).__name__} on the data's first record "
            f"({e}); it must take every record's columns"
        ) from None
    finally:
        error = close_env(env)
        if error is not None:
            raise ConfigError(f"env._target_={target!r}: {error}")


def check_env_reward(node, env=None) -> None:
    """``reward=environment``: the episode's reward comes from the environment alone: a TRL-style
    class's ``get_reward`` (``env=tools env.environment=...``), or the ``EnvStep.reward`` of each
    turn of a ``reset``/``step`` environment (``env=function``). Refused where there is no
    environment, or a tool environment of plain functions, which gives no reward at all. ``env``:
    an instance of the node's environment (``check_env``'s)."""
    from ppo_lightning.config.errors import ConfigError
    from ppo_lightning.envs.tools import ToolEnvironment, reward_owners

    if not node:
        raise ConfigError(
            "reward=environment takes the reward from the environment, but there is no environment (env=none); "
            "set env=function env._target_=my_pkg.MyEnv (EnvStep rewards) or env=tools "
            "env.environment=my_pkg.MyEnv (a class with get_reward), or choose a reward (reward=function reward.fn=...)"
        )
    if isinstance(env, ToolEnvironment) and not reward_owners(env):
        raise ConfigError(
            "reward=environment takes the reward from the environment's get_reward(), but "
            f"env._target_={node.get('_target_')!r} has none (its tools are plain functions); set "
            "env.environment=my_pkg.MyEnv (a class with get_reward), or choose a reward (reward=function reward.fn=...)"
        )


def build_runner(node, data_cfg, tokenizer, name: str, context: int | None = None) -> EpisodeRunner:
    """The ``EpisodeRunner`` of the ``env`` node for a tokenizer (``name``: its path, for errors):
    the chat template (``data.chat_template``, else the tokenizer's) checked to be
    prefix-preserving on the roles the run uses and, for a tool environment, to render tools.
    ``env.max_total_tokens: null`` becomes what fits, ``context`` (the model's positions) less
    ``data.max_prompt_length``; no budget where the context is unknown."""
    from ppo_lightning.config import EnvConfig
    from ppo_lightning.data.prompts import chat_template_of

    renderer = ChatRenderer(tokenizer, chat_template_of(data_cfg.chat_template))
    loop = {k: v for k, v in _plain(node).items() if k in loop_keys() and k != "_target_"}
    if loop.get("max_total_tokens") is None and context is not None:
        loop["max_total_tokens"] = context - data_cfg.max_prompt_length
    runner = EpisodeRunner(
        env_factory(node),
        renderer,
        EnvConfig(**loop),
        tokenizer,
        system_prompt=data_cfg.system_prompt,
        max_prompt_length=data_cfg.max_prompt_length,
        truncation=data_cfg.truncation,
    )
    tools = runner.probe_tools()
    if tools:
        renderer.check_renders_tools(name, tools)
    renderer.check_prefix_preserving(name, tools=bool(tools), system=data_cfg.system_prompt is not None)
    return runner
