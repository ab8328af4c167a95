"""``train(cfg)``: build everything a composed config describes and run PPO with a Lightning Trainer.

Order matters: every cheap check (config ranges, reward import, prompt file, context length)
runs before any model weights are loaded, so a typo fails in seconds.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import hydra
import lightning as L
from omegaconf import DictConfig, OmegaConf

from ppo_lightning.checkpoint import AtomicCheckpointIO
from ppo_lightning.config import validate
from ppo_lightning.data import PromptDataModule
from ppo_lightning.errors import ConfigError
from ppo_lightning.module import PPOModule
from ppo_lightning.policy import (PolicyWithValueHead, load_causal_lm, load_tokenizer,
                                  load_value_head, make_reference, save_policy)
from ppo_lightning.rewards import build_reward
from ppo_lightning.tiny import save_tiny_causal_lm

log = logging.getLogger(__name__)


def ensure_model_source(model_cfg, cache_dir: str) -> None:
    """Build the tiny offline model at ``model.name_or_path`` when ``model.build_tiny`` asks.

    Only inside ``paths.cache_dir``: a user who points ``model.name_or_path`` at a directory of
    their own gets that directory loaded (or a "no such directory" error), never a random model
    written there.
    """
    t = model_cfg.build_tiny
    target = Path(model_cfg.name_or_path).resolve()
    if t is None or (target / "config.json").exists():
        return
    if not target.is_relative_to(Path(cache_dir).resolve()):
        return  # resolve_source will report the missing directory
    log.info("building tiny GPT-2 (%d layers, %d dims) at %s", t.n_layer, t.n_embd, target)
    save_tiny_causal_lm(target, t.n_layer, t.n_head, t.n_embd, t.n_positions, t.seed)


def _context_length(lm) -> int | None:
    c = lm.config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(getattr(c, name, None), int):
            return getattr(c, name)
    return None


def instantiate_dict(group: DictConfig | None, key: str) -> list:
    """Instantiate every ``_target_`` entry of a named dict group (logger, callbacks)."""
    objs = []
    for name, node in (group or {}).items():
        if node is None:
            continue
        if not isinstance(node, DictConfig) or "_target_" not in node:
            raise ConfigError(f"{key}.{name}: expected a mapping with a _target_ (a class to build)")
        objs.append(hydra.utils.instantiate(node))
    return objs


def build(cfg: DictConfig) -> tuple[PPOModule, PromptDataModule, L.Trainer]:
    validate(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    reward_fn = build_reward(cfg.reward) if cfg.reward.kind == "function" else None  # import early

    ensure_model_source(cfg.model, cfg.paths.cache_dir)
    tokenizer = load_tokenizer(cfg.model.tokenizer_name_or_path or cfg.model.name_or_path,
                               trust_remote_code=cfg.model.trust_remote_code)
    datamodule = PromptDataModule(cfg.data, tokenizer, seed=cfg.seed)
    datamodule.load()

    lm = load_causal_lm(cfg.model.name_or_path, tokenizer, cfg.model.dtype, cfg.model.trust_remote_code)
    ctx = _context_length(lm)
    need = cfg.data.max_prompt_length + cfg.ppo.max_new_tokens
    if ctx is not None and need > ctx:
        raise ConfigError(f"data.max_prompt_length + ppo.max_new_tokens = {need} exceeds the model's "
                          f"context of {ctx} tokens; lower data.max_prompt_length or ppo.max_new_tokens")
    if cfg.model.gradient_checkpointing:
        lm.gradient_checkpointing_enable()
    policy = PolicyWithValueHead(lm)
    if cfg.model.value_head_path and not load_value_head(policy, cfg.model.value_head_path):
        raise ConfigError(f"model.value_head_path={cfg.model.value_head_path!r}: no value_head.safetensors there")
    ref_lm = make_reference(lm)
    if reward_fn is None:
        reward_fn = build_reward(cfg.reward)

    # plain dataclasses: attribute reads on a DictConfig cost ~50 us each, in the hot loop
    ppo_cfg, optim_cfg = OmegaConf.to_object(cfg.ppo), OmegaConf.to_object(cfg.optimizer)
    module = PPOModule(policy, ref_lm, reward_fn, tokenizer, ppo_cfg, optim_cfg, seed=cfg.seed)
    loggers = instantiate_dict(cfg.get("logger"), "logger")
    callbacks = instantiate_dict(cfg.get("callbacks"), "callbacks")
    trainer = hydra.utils.instantiate(cfg.trainer, logger=loggers or False, callbacks=callbacks,
                                      plugins=[AtomicCheckpointIO()])
    for lg in loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return module, datamodule, trainer


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run PPO as configured; returns every metric of the last iteration."""
    module, datamodule, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
    if cfg.export_dir and trainer.is_global_zero:
        path = save_policy(module.policy, module.tokenizer, cfg.export_dir)
        log.info("policy exported to %s (loads with AutoModelForCausalLM.from_pretrained)", path)
    return dict(module.last_metrics)
