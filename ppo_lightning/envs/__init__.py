"""Multi-turn episodes: environments and tools the policy talks to, trained on its own tokens only.

- ``base.py``: the protocol, ``Environment`` with ``reset(record)`` and ``step(messages) -> EnvStep``;
- ``tools.py``: ``ToolEnvironment`` (typed functions, or a TRL ``environment_factory`` class, as tools);
- ``parsers.py``: tool calls read in the model family's format (``env.parser``);
- ``calculator.py``: a safe arithmetic tool;
- ``template.py``: the prompt rendered once, each environment answer as the chat template's delta;
- ``episodes.py``: the loop that plays a batch of records as episodes (``EpisodeRunner``).

The ``env`` config group chooses one (``env=none``, the default, is single-turn). ``build_runner``
turns the group into an ``EpisodeRunner``; ``check_env`` checks it before any model loads.
"""

from __future__ import annotations

from ppo_lightning.envs.base import Environment, EnvError, EnvStep
from ppo_lightning.envs.calculator import calculator
from ppo_lightning.envs.episodes import Episode, EpisodeBatch, EpisodeRunner, Record
from ppo_lightning.envs.template import ChatRenderer
from ppo_lightning.envs.tools import ToolEnvironment

__all__ = [
    "ChatRenderer",
    "EnvError",
    "EnvStep",
    "Environment",
    "Episode",
    "EpisodeBatch",
    "EpisodeRunner",
    "Record",
    "ToolEnvironment",
    "build_runner",
    "calculator",
    "check_env",
    "check_env_reward",
    "env_factory",
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


def check_env(node) -> None:
    """Before any model loads: the environment class imports, and one instance builds from the
    group's arguments (its tools import and have schemas)."""
    from ppo_lightning.config.errors import ConfigError

    make = env_factory(node)
    try:
        make()
    except ConfigError:
        raise
    except Exception as e:
        cause = e.__cause__ or e  # hydra wraps the constructor's error
        if isinstance(cause, ConfigError):  # the constructor's own check names its key
            raise cause from None
        raise ConfigError(
            f"env._target_={node.get('_target_')!r}: cannot build it ({type(cause).__name__}: {cause})"
        ) from None


def check_env_reward(node) -> None:
    """``reward=environment``: the environment must score its own episodes (a TRL-style class
    with ``get_reward``, ``env=tools env.environment=...``)."""
    from ppo_lightning.envs.tools import reward_owner
    from ppo_lightning.config.errors import ConfigError

    if not node or reward_owner(env_factory(node)()) is None:
        raise ConfigError(
            "reward=environment takes the reward from the environment's get_reward(), but "
            + (f"env._target_={node.get('_target_')!r} has none" if node else "there is no environment (env=none)")
            + "; set env=tools env.environment=my_pkg.MyEnv (a class with get_reward), or choose a reward "
            "(reward=function reward.fn=...)"
        )


def build_runner(node, data_cfg, tokenizer, name: str) -> EpisodeRunner:
    """The ``EpisodeRunner`` of the ``env`` node for a tokenizer (``name``: its path, for errors):
    the chat template (``data.chat_template``, else the tokenizer's) checked to be
    prefix-preserving on the roles the run uses and, for a tool environment, to render tools."""
    from ppo_lightning.config import EnvConfig
    from ppo_lightning.data.prompts import chat_template_of

    renderer = ChatRenderer(tokenizer, chat_template_of(data_cfg.chat_template))
    loop = {k: v for k, v in _plain(node).items() if k in loop_keys() and k != "_target_"}
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
