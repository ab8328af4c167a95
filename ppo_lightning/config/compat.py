"""Keys that moved or were removed: each stays in its schema as a null placeholder, so that
setting it composes and then fails validation with one line naming its new home or why it went,
instead of Hydra's "not in the schema"."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional
import dataclasses

from omegaconf import OmegaConf

from ppo_lightning.config.errors import ConfigError


LORA_DROPOUT_REMOVED = (
    "PPO needs logprobs that are a deterministic function of the weights (dropout would "
    "make the first update's ratio differ from 1); the adapters train without dropout"
)


DATA_WORKERS_REMOVED = (
    "the PPO prompt loader runs in the main process (its prompts are tokenised once, before "
    "any model loads); a stage's loader workers are task.num_workers"
)


REMOVED_KEYS = {"model.lora.dropout": LORA_DROPOUT_REMOVED, "data.num_workers": DATA_WORKERS_REMOVED}
"""Keys that were removed, and why; placeholders like the moved ones."""


MOVED_MODULES = {"ppo_lightning.tasks": "ppo_lightning.recipes"}
"""Modules that moved, and their new paths: a config value that names the old one (a reward
function, an environment class) fails with one line naming the new path."""


def is_placeholder(f: dataclasses.Field) -> bool:
    """Whether a schema field only holds the place of a moved or removed key."""
    return "moved_to" in f.metadata or "removed" in f.metadata


def moved(new_home: str):
    """A placeholder for a key that moved to ``new_home`` (see ``MOVED_KEYS``); not documented."""
    return field(default=None, metadata={"moved_to": new_home})


@dataclass
class _MovedPPOKeys:
    """The sampling keys that were ``ppo.*`` (``MOVED_KEYS``)."""

    max_new_tokens: Optional[Any] = moved("sampling.max_new_tokens")
    temperature: Optional[Any] = moved("sampling.temperature")
    top_k: Optional[Any] = moved("sampling.top_k")
    top_p: Optional[Any] = moved("sampling.top_p")
    stop_at_eos: Optional[Any] = moved("sampling.stop_at_eos")
    stop_token_ids: Optional[Any] = moved("sampling.stop_token_ids")
    stop_strings: Optional[Any] = moved("sampling.stop_strings")
    rollout_generate_batch_size: Optional[Any] = moved("sampling.chunk_size")
    fast_decode: Optional[Any] = moved("generation.fast_decode")


MOVED_KEYS = {f"ppo.{f.name}": f.metadata["moved_to"] for f in dataclasses.fields(_MovedPPOKeys)}
"""Keys that moved, and their new homes (read from the placeholders above). Each old key stays in
its schema as a null placeholder, so that setting it (on the command line or in a YAML file)
composes and then fails validation with one line naming the new key, instead of Hydra's "not in
the schema"."""


def check_moved_keys(cfg) -> None:
    """A moved key that is set fails with one line: its new home, with the value to write there;
    a removed one says why it went."""
    for old, why in REMOVED_KEYS.items():
        if OmegaConf.select(cfg, old) is not None:
            raise ConfigError(f"{old} was removed: {why}; unset it")
    for old, new in MOVED_KEYS.items():
        value = OmegaConf.select(cfg, old)
        if value is not None:
            shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            raise ConfigError(f"{old} moved to {new}: write {new}={shown!r} instead")


def check_moved_modules(cfg) -> None:
    """A value that names a moved module (``reward.fn=ppo_lightning.tasks.arithmetic.data.reward_fn``)
    fails with one line: the key, and the value to write instead."""
    for key, value in _strings(OmegaConf.to_container(cfg, resolve=False), ""):
        for old, new in MOVED_MODULES.items():
            if value == old or value.startswith(old + "."):
                raise ConfigError(
                    f"{key}={value!r}: {old} is now {new}; write {key}={new + value[len(old) :]!r} instead"
                )


def _strings(node: Any, key: str):
    """``(dotted key, value)`` of every string in a container (a list's items under its key)."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, f"{key}.{k}" if key else str(k))
    elif isinstance(node, list):
        for v in node:
            yield from _strings(v, key)
    elif isinstance(node, str):
        yield key, node
