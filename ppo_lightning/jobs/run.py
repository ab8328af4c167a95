"""The jobs the entry point ``train.py`` runs, by ``task.name``: PPO (``train``), the SFT and
reward-model stages (``train_stage``) and ``export``. Building the parts of a run is
``factory.py``'s job; the recipes' builds and before/after tables are ``recipes/``'s.
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from ppo_lightning.parallel.checkpoint import full_disk_error, last_good_checkpoint, OutputWriteError
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.config.ignored import user_set_keys
from ppo_lightning.jobs.factory import build, build_module, check_built_inputs, check_inputs
from ppo_lightning.jobs.trainer import build_trainer
from ppo_lightning.train.loggers import finish_wandb
from ppo_lightning.models.policy import save_policy
from ppo_lightning.parallel.preemption import EXIT_STATUS, Preempted, handle_sigterm
from ppo_lightning.jobs.recipe import built_root, load_recipe, prepare

log = logging.getLogger(__name__)

# By design, not problems: the frozen reference and reward model stay in eval mode, and
# checkpoints hold the state after each PPO iteration's updates.
warnings.filterwarnings("ignore", message=r"Found \d+ module\(s\) in eval mode")
warnings.filterwarnings("ignore", message=r"Using ModelCheckpoint with manual optimization")


def export(cfg: DictConfig) -> Path:
    """Write the policy in checkpoint ``ckpt_path`` to ``export_dir`` as an HF directory.

    ``python train.py task=export ckpt_path=.../last.ckpt export_dir=...`` with the run's own
    model / reward / data config: the module is rebuilt, the checkpoint's weights (policy and
    value head, or LoRA's adapters and value head; frozen weights are rebuilt from their sources,
    ``PPOModule.checkpointed``) loaded with ``weights_only=True``.
    """
    if not cfg.ckpt_path:
        raise ConfigError("task=export needs ckpt_path=<a .ckpt file written by a PPO run>")
    if not cfg.export_dir:
        raise ConfigError("task=export needs export_dir=<directory to write the HF model to>")
    module, _ = build_module(cfg)
    state = torch.load(cfg.ckpt_path, map_location="cpu", weights_only=True)
    missing, unexpected = module.load_state_dict(state["state_dict"], strict=False)
    missing = [k for k in missing if module.checkpointed(k)]
    if missing or unexpected:
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path!r} does not match model.name_or_path="
            f"{cfg.model.name_or_path!r} (missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}); export with the config the run was trained with"
        )
    path = save_policy(module.policy, module.tokenizer, cfg.export_dir)
    log.info("policy of %s exported to %s", cfg.ckpt_path, path)
    return path


def train(cfg: DictConfig) -> dict[str, Any]:
    """Run PPO as configured; returns every metric of the last iteration.

    Every input is checked once: first all but the paths the job's recipe builds
    (``check_inputs``), then the recipe, if the job names one, builds what is missing and its
    paths are checked (``check_built_inputs``), then the run is built and fit.
    """
    recipe = load_recipe(cfg.recipe) if cfg.recipe else None
    built = built_root(cfg) if recipe is not None else None
    check_inputs(cfg, built_by_recipe=built)
    if recipe is not None:
        prepare(recipe, cfg)  # first run builds its policy, reward model and prompts (cached)
        check_built_inputs(cfg, built)
    module, datamodule, trainer = build(cfg, checked=True)
    try:
        fit(trainer, module, datamodule, cfg.ckpt_path)
        if cfg.export_dir:  # every rank: a sharded policy is gathered first
            path = save_policy(module.policy, module.tokenizer, cfg.export_dir, write=trainer.is_global_zero)
            if trainer.is_global_zero:
                log.info("policy exported to %s (loads with AutoModelForCausalLM.from_pretrained)", path)
        if recipe is not None and trainer.is_global_zero:
            table = recipe.evaluate(cfg, module, Path(cfg.paths.output_dir))
            print(f"\n{cfg.recipe}: held-out prompts, before and after PPO\n{table}\n", flush=True)
    finally:
        # whatever stopped the run (SIGTERM, an error): idle environments kept for reuse close now
        module.worker.runner.close()
        finish_loggers(trainer)
    return dict(module.last_metrics)


def fit(trainer: L.Trainer, module, datamodule, ckpt_path: str | None) -> None:
    """``trainer.fit``; a file of the run that cannot be written (a checkpoint, ``metrics.csv``, a
    dump: a full disk, a quota, a read-only mount) stops the run with the last good checkpoint
    named in the error (``OutputWriteError``). Only the rank that writes raises it; Lightning's
    launcher then stops the other processes (checkpoints: every rank raises it together)."""
    try:
        trainer.fit(module, datamodule=datamodule, ckpt_path=ckpt_path, weights_only=True)
    except Exception as e:
        error = e if isinstance(e, OutputWriteError) else full_disk_error(e, trainer.default_root_dir)
        if error is None:
            raise
        error.checkpoint, error.iteration = last_good_checkpoint(trainer) or (None, None)
        if error is e:
            raise
        raise error from e


def finish_loggers(trainer: L.Trainer) -> None:
    """Close the job's W&B run (``loggers.finish_wandb``). Called from ``finally``: a run that an
    exception ends is closed with a non-zero exit code (W&B shows it failed), 143 for a SIGTERM
    stop."""
    from lightning.pytorch.loggers import WandbLogger

    if any(isinstance(lg, WandbLogger) for lg in trainer.loggers):
        error = sys.exc_info()[1]
        finish_wandb(exit_code=0 if error is None else EXIT_STATUS if isinstance(error, Preempted) else 1)


TASKS = ("ppo", "sft", "reward_model", "export")


def run_task(cfg: DictConfig) -> dict[str, Any]:
    """Dispatch on ``task.name``; returns the metrics a sweeper may optimise. SIGTERM raises
    ``preemption.Preempted`` (after a checkpoint, during PPO training)."""
    name = cfg.task.get("name")
    if name not in TASKS:
        raise ConfigError(f"task.name={name!r}: choose task=ppo, task=sft, task=reward_model or task=export")
    with handle_sigterm():
        if name == "export":
            export(cfg)
            return {}
        if name in ("sft", "reward_model"):
            return train_stage(cfg)
        return train(cfg)


def _warn_of_ppo_batch_keys(cfg: DictConfig) -> None:
    """A stage's batches are ``task.batch_size`` / ``shuffle`` / ``num_workers``. The same
    ``data.*`` keys on the command line set PPO's prompt loader, which a stage never builds (they
    once set the stages' batches too): one warning each, naming the key that does. A warning, not
    a refusal: override lists shared by several jobs (scripts, sweeps) set ``data.*`` for PPO."""
    given = user_set_keys() or set()
    for key in ("batch_size", "shuffle", "num_workers"):
        if f"data.{key}" in given:
            log.warning(
                "data.%s is PPO's prompt loader's and does nothing for task=%s, which batches by task.%s (%s here)",
                key,
                cfg.task.name,
                key,
                cfg.task.get(key),
            )


def train_stage(cfg: DictConfig) -> dict[str, Any]:
    """``task=sft`` / ``task=reward_model``: the stages before PPO, through the same ``model``,
    ``optimizer``, ``trainer`` and ``logger`` groups; the result is saved as an HF directory at
    ``task.save_dir`` (a PPO policy / a ``reward=model`` directory)."""
    from ppo_lightning.stages import STAGES

    name = cfg.task.name
    _, build_fn, save_fn = STAGES[name]
    # conf/task/<name>.yaml types task.* by SFTTask / RewardModelTask at composition; the stage
    # itself checks ranges (and unknown keys, for a config built without Hydra)
    stage_keys = {
        k: v for k, v in OmegaConf.to_container(cfg.task, resolve=True).items() if k not in ("name", "save_dir")
    }
    if not cfg.task.get("save_dir"):
        raise ConfigError(f"task.save_dir is empty: set where task={name} writes its model")
    _warn_of_ppo_batch_keys(cfg)
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    module, datamodule = build_fn(cfg.model, cfg.optimizer, stage_keys, cache_dir=cfg.paths.cache_dir)
    trainer = build_trainer(cfg)
    try:
        if cfg.ckpt_path is None and trainer.limit_val_batches:
            trainer.validate(module, datamodule=datamodule, verbose=False)  # the starting point
        fit(trainer, module, datamodule, cfg.ckpt_path)
        if trainer.is_global_zero:
            path = save_fn(module, cfg.task.save_dir)
            log.info("task=%s: model saved to %s", name, path)
    finally:
        finish_loggers(trainer)
    return dict(module.last_metrics)
