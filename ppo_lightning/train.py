"""``train(cfg)``: build everything a composed config describes and run PPO with a Lightning Trainer.

Order matters: every cheap check (config ranges, reward import, prompt file, context length)
runs before any model weights are loaded, so a typo fails in seconds.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from ppo_lightning.checkpoint import AtomicCheckpointIO
from ppo_lightning.config import validate
from ppo_lightning.data import PromptDataModule
from ppo_lightning.errors import ConfigError
from ppo_lightning.module import PPOModule
from ppo_lightning.policy import (PolicyWithValueHead, load_causal_lm, load_tokenizer,
                                  load_value_head, make_reference, resolve_source, save_policy,
                                  context_length)
from ppo_lightning.recipes import get_recipe
from ppo_lightning.rewards import build_reward
from ppo_lightning.tiny import save_tiny_causal_lm

log = logging.getLogger(__name__)

# By design, not problems: the frozen reference and reward model stay in eval mode, and
# checkpoints hold the state after each PPO iteration's updates.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")


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
    """Module, prompts and Trainer for a composed config; every cheap check runs first."""
    module, datamodule = build_module(cfg)
    return module, datamodule, build_trainer(cfg)


def build_module(cfg: DictConfig) -> tuple[PPOModule, PromptDataModule]:
    validate(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    reward_fn = build_reward(cfg.reward) if cfg.reward.kind == "function" else None  # import early

    ensure_model_source(cfg.model, cfg.paths.cache_dir)
    tokenizer = load_tokenizer(cfg.model.tokenizer_name_or_path or cfg.model.name_or_path,
                               trust_remote_code=cfg.model.trust_remote_code)
    datamodule = PromptDataModule(cfg.data, tokenizer, seed=cfg.seed)
    datamodule.load()

    lm = load_causal_lm(cfg.model.name_or_path, tokenizer, cfg.model.dtype, cfg.model.trust_remote_code)
    ctx = context_length(lm.config)
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
        reward_fn.use_policy_tokens(tokenizer, cfg.reward.input)
    if cfg.model.value_head_init == "reward_model":
        init_value_head_from(policy, reward_fn)

    # plain dataclasses: attribute reads on a DictConfig cost ~50 us each, in the hot loop
    ppo_cfg, optim_cfg = OmegaConf.to_object(cfg.ppo), OmegaConf.to_object(cfg.optimizer)
    module = PPOModule(policy, ref_lm, reward_fn, tokenizer, ppo_cfg, optim_cfg, seed=cfg.seed,
                       normalize_reward_samples=cfg.reward.normalize_samples if cfg.reward.normalize else 0,
                       value_head_from_reward=cfg.model.value_head_init == "reward_model")
    return module, datamodule


def init_value_head_from(policy: PolicyWithValueHead, reward_model) -> None:
    """Copy the reward model's score head into the value head ([N+]: initialise the value
    function from the reward model), so early value estimates are already on the reward's scale."""
    head = reward_model.score_head()
    if head.weight.shape != policy.v_head.weight.shape:
        raise ConfigError(f"model.value_head_init=reward_model: reward head {tuple(head.weight.shape)} does "
                          f"not fit the value head {tuple(policy.v_head.weight.shape)} (hidden sizes differ)")
    with torch.no_grad():
        policy.v_head.weight.copy_(head.weight.float() * reward_model.gain)
        bias = head.bias.float() if head.bias is not None else torch.zeros(1)
        policy.v_head.bias.copy_(bias * reward_model.gain + reward_model.bias)


def build_trainer(cfg: DictConfig) -> L.Trainer:
    loggers = instantiate_dict(cfg.get("logger"), "logger")
    callbacks = instantiate_dict(cfg.get("callbacks"), "callbacks")
    trainer = hydra.utils.instantiate(cfg.trainer, logger=loggers or False, callbacks=callbacks,
                                      plugins=[AtomicCheckpointIO()])
    for lg in loggers:
        lg.log_hyperparams(OmegaConf.to_container(cfg, resolve=True))
    return trainer


def export(cfg: DictConfig) -> Path:
    """Write the policy in checkpoint ``ckpt_path`` to ``export_dir`` as an HF directory.

    ``python train.py task=export ckpt_path=.../last.ckpt export_dir=...`` with the run's own
    model / reward / data config: the module is rebuilt, the checkpoint's weights (policy and
    value head; the frozen reference is not in checkpoints) loaded with ``weights_only=True``.
    """
    if not cfg.ckpt_path:
        raise ConfigError("task=export needs ckpt_path=<a .ckpt file written by a PPO run>")
    if not cfg.export_dir:
        raise ConfigError("task=export needs export_dir=<directory to write the HF model to>")
    module, _ = build_module(cfg)
    state = torch.load(cfg.ckpt_path, map_location="cpu", weights_only=True)
    missing, unexpected = module.load_state_dict(state["state_dict"], strict=False)
    missing = [k for k in missing if not k.startswith(("ref_lm.", "reward_fn."))]
    if missing or unexpected:
        raise ConfigError(f"ckpt_path={cfg.ckpt_path!r} does not match model.name_or_path="
                          f"{cfg.model.name_or_path!r} (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]}); export with the config the run was trained with")
    path = save_policy(module.policy, module.tokenizer, cfg.export_dir)
    log.info("policy of %s exported to %s", cfg.ckpt_path, path)
    return path


def _under(path: str, root: Path) -> bool:
    return Path(path).resolve().is_relative_to(root.resolve())


def active_recipe(cfg: DictConfig):
    """The configured recipe, if the run uses anything it builds (its policy, reward model or
    prompts); a run that swapped all three for its own (``model=gpt2 reward=model data=file``)
    skips the recipe's build and its report."""
    if not cfg.recipe:
        return None
    recipe = get_recipe(cfg.recipe)
    root = recipe.root(cfg)
    used = [cfg.model.name_or_path, cfg.data.path,
            cfg.reward.name_or_path if cfg.reward.kind == "model" else None]
    if any(p and _under(p, root) for p in used):
        return recipe
    log.info("recipe=%s: the run uses none of its models or prompts; skipping it", cfg.recipe)
    return None


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run PPO as configured; returns every metric of the last iteration."""
    recipe = active_recipe(cfg)
    if recipe is not None:
        validate(cfg, check_files=False)
        # sources the recipe does not build must exist before it spends a minute building
        for key, value in (("model.name_or_path", cfg.model.name_or_path),
                           ("reward.name_or_path", cfg.reward.name_or_path if cfg.reward.kind == "model" else None)):
            if value and not _under(value, recipe.root(cfg)):
                resolve_source(value, key)
        recipe.prepare(cfg)  # first run builds its policy, reward model and prompts (cached)
    module, datamodule, trainer = build(cfg)
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
        if cfg.export_dir and trainer.is_global_zero:
            path = save_policy(module.policy, module.tokenizer, cfg.export_dir)
            log.info("policy exported to %s (loads with AutoModelForCausalLM.from_pretrained)", path)
        if recipe is not None and trainer.is_global_zero:
            table = recipe.evaluate(cfg, module, Path(cfg.paths.output_dir))
            print(f"\n{cfg.recipe}: held-out prompts, before and after PPO\n{table}\n", flush=True)
    finally:
        finish_loggers(trainer)
    return dict(module.last_metrics)


def finish_loggers(trainer: L.Trainer) -> None:
    """Close W&B runs explicitly: Lightning leaves them open, and a run closed only at interpreter
    exit may lose its last records (and a sweep's next job would log into the same run)."""
    from lightning.pytorch.loggers import WandbLogger

    if any(isinstance(lg, WandbLogger) for lg in trainer.loggers):
        import wandb

        wandb.finish()


TASKS = ("ppo", "sft", "reward_model", "export")


def run_task(cfg: DictConfig) -> dict[str, Any]:
    """Dispatch on ``task.name``; returns the metrics a sweeper may optimise."""
    name = cfg.task.get("name")
    if name not in TASKS:
        raise ConfigError(f"task.name={name!r}: choose task=ppo, task=sft, task=reward_model or task=export")
    if name == "export":
        export(cfg)
        return {}
    if name in ("sft", "reward_model"):
        return train_stage(cfg)
    return train(cfg)


def train_stage(cfg: DictConfig) -> dict[str, Any]:
    """``task=sft`` / ``task=reward_model``: the stages before PPO, through the same ``model``,
    ``optimizer``, ``trainer`` and ``logger`` groups; the result is saved as an HF directory at
    ``task.save_dir`` (a PPO policy / a ``reward=model`` directory)."""
    from ppo_lightning.stages import STAGES

    name = cfg.task.name
    _, build_fn, save_fn = STAGES[name]
    schema, _, _ = STAGES[name]
    stage_keys = {k: v for k, v in OmegaConf.to_container(cfg.task, resolve=True).items()
                  if k not in ("name", "save_dir")}
    try:  # the stage's dataclass types the task.* keys: task.val_fraction=abc fails here, by name
        OmegaConf.merge(OmegaConf.structured(schema), stage_keys)
    except Exception as e:  # omegaconf's ValidationError / ConfigKeyError
        key = getattr(e, "full_key", None) or "?"
        raise ConfigError(f"task.{key}: {str(getattr(e, 'msg', e)).splitlines()[0]}") from None
    if not cfg.task.get("save_dir"):
        raise ConfigError(f"task.save_dir is empty: set where task={name} writes its model")
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module, datamodule = build_fn(cfg.model, cfg.data, cfg.optimizer, stage_keys)
    trainer = build_trainer(cfg)
    try:
        if cfg.ckpt_path is None and trainer.limit_val_batches:
            trainer.validate(module, datamodule=datamodule, verbose=False)  # the starting point
        trainer.fit(module, datamodule=datamodule, ckpt_path=cfg.ckpt_path, weights_only=True)
        if trainer.is_global_zero:
            path = save_fn(module, cfg.task.save_dir)
            log.info("task=%s: model saved to %s", name, path)
    finally:
        finish_loggers(trainer)
    return dict(module.last_metrics)
