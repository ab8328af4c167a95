"""The keys a mode does not read: the ignored-unless rules (``IGNORED_UNLESS``, one per key and
the mode that reads it), and which of them the user set in a mode that ignores them
(``ignored_keys``, from the keys typed on the command line or in the experiment file:
``user_set_keys``). ``validate`` warns of each, once per job; ``docs/config.md`` renders the table."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
import dataclasses
from pathlib import Path

from omegaconf import OmegaConf

from ppo_lightning.config import choices
from ppo_lightning.config.root import SECTIONS


@dataclass(frozen=True)
class IgnoredUnless:
    """Key ``key`` is read only when ``mode`` holds (``active(cfg)``); set to anything but its
    schema default in another mode, it does nothing, and ``validate`` warns."""

    key: str
    mode: str
    active: Any  # (cfg) -> bool


_PPO = lambda cfg: cfg.task.name == "ppo"  # noqa: E731
_CRITIC = lambda cfg: choices.ESTIMATORS.spec(cfg.ppo.advantage).critic  # noqa: E731
_FUNCTION = lambda cfg: cfg.reward.kind == "function" and not cfg.reward.terms  # noqa: E731
_MODEL = lambda cfg: cfg.reward.kind == "model" and not cfg.reward.terms  # noqa: E731
_STOPS = lambda cfg: cfg.sampling.stop_at_eos  # noqa: E731
IGNORED_UNLESS = (
    IgnoredUnless("ppo.vf_coef", "ppo.advantage=gae (the only estimator with a critic)", _CRITIC),
    IgnoredUnless("ppo.vf_clip", "ppo.advantage=gae (the only estimator with a critic)", _CRITIC),
    IgnoredUnless("ppo.lam", "ppo.advantage=gae (GAE's lambda)", _CRITIC),
    IgnoredUnless(
        "ppo.clip",
        "ppo.clip_low or ppo.clip_high is null (each side defaults to ppo.clip)",
        lambda cfg: cfg.ppo.clip_low is None or cfg.ppo.clip_high is None,
    ),
    IgnoredUnless("rollout.allow_uncorrected", "rollout.staleness>=1", lambda cfg: cfg.rollout.staleness >= 1),
    IgnoredUnless("ppo.kl_target", "ppo.adaptive_kl=true", lambda cfg: cfg.ppo.adaptive_kl),
    IgnoredUnless("ppo.kl_horizon", "ppo.adaptive_kl=true", lambda cfg: cfg.ppo.adaptive_kl),
    IgnoredUnless("ppo.missing_eos_penalty", "sampling.stop_at_eos=true", _STOPS),
    IgnoredUnless("ppo.mask_truncated_completions", "sampling.stop_at_eos=true", _STOPS),
    IgnoredUnless("sampling.stop_token_ids", "sampling.stop_at_eos=true", _STOPS),
    IgnoredUnless("sampling.stop_strings", "sampling.stop_at_eos=true", _STOPS),
    IgnoredUnless(
        "reward.gain", "reward.normalize=false (normalisation fits gain and bias)", lambda cfg: not cfg.reward.normalize
    ),
    IgnoredUnless(
        "reward.bias", "reward.normalize=false (normalisation fits gain and bias)", lambda cfg: not cfg.reward.normalize
    ),
    IgnoredUnless("reward.normalize_samples", "reward.normalize=true", lambda cfg: cfg.reward.normalize),
    IgnoredUnless("reward.fn", "reward.kind=function and no reward.terms", _FUNCTION),
    IgnoredUnless("reward.kwargs", "reward.kind=function and no reward.terms", _FUNCTION),
    *(
        IgnoredUnless(f"reward.{k}", "reward.kind=model and no reward.terms", _MODEL)
        for k in ("name_or_path", "batch_size", "max_length", "dtype", "input", "label_index", "trust_remote_code")
    ),
    IgnoredUnless("data.hf_split", "data.hf_dataset is read (data.path is null)", lambda cfg: cfg.data.path is None),
    *(
        IgnoredUnless(
            f"trainer.{k}",
            "task=sft or task=reward_model (a PPO run has no validation loop)",
            lambda cfg: not _PPO(cfg),
        )
        for k in ("limit_val_batches", "val_check_interval", "check_val_every_n_epoch", "num_sanity_val_steps")
    ),
)
"""Keys that do nothing in some modes; ``validate`` warns when one is set there, and
``docs/config.md`` renders this table. (Combinations that would do something other than their docs
say are refused instead: ``rules._check_estimator_options``.)"""


def ignored_keys(cfg, user_keys: set[str] | None = None) -> list[str]:
    """``"<key>=<value> is ignored unless <mode>"`` for each key the user set (``user_keys``, see
    ``user_set_keys``) in a mode that does not read it (the PPO job's keys; the stages read their
    own). A group's YAML is not the user: ``reward=model`` then ``reward.terms.x.fn=...`` warns of
    no reward-model key the user did not type. With ``user_keys`` None (no Hydra run to read them
    from), a key counts as set when it differs from its schema default."""
    out = []
    for rule in IGNORED_UNLESS if cfg.task.name == "ppo" else ():
        if rule.active(cfg):
            continue
        value = OmegaConf.select(cfg, rule.key)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if user_keys is not None:
            typed = any(k == rule.key or k.startswith(rule.key + ".") for k in user_keys)
        else:
            section, name = rule.key.rsplit(".", 1)
            typed = value != _schema_default(next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name))
        if typed:
            out.append(f"{rule.key}={value!r} is ignored unless {rule.mode}")
    return out


def user_set_keys() -> set[str] | None:
    """The dotted keys the user set for this run: every command-line override (``+``, ``++`` and
    ``~`` stripped) and every key the chosen ``experiment/`` file sets. None outside a run that
    Hydra's app started (``hydra.compose`` in a script or a test): nothing says then which keys
    were typed."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    hc = HydraConfig.get()
    keys = {o.split("=", 1)[0].lstrip("+~") for o in hc.overrides.task}
    experiment = hc.runtime.choices.get("experiment")
    if experiment:
        keys |= _experiment_keys(hc, experiment)
    return keys


def _experiment_keys(hc, name: str) -> set[str]:
    """The dotted keys ``conf/experiment/<name>.yaml`` sets (``@package _global_``), from the
    primary config directory of the run."""
    for source in hc.runtime.config_sources:
        if source.provider == "main" and source.schema == "file":
            path = Path(source.path) / "experiment" / f"{name}.yaml"
            if path.is_file():
                node = OmegaConf.to_container(OmegaConf.load(path), resolve=False) or {}
                return set(_dotted(node, ""))
    return set()


def _dotted(node, prefix: str):
    for k, v in node.items():
        if prefix == "" and k == "defaults":
            continue
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            yield from _dotted(v, key + ".")
        else:
            yield key


def _schema_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
