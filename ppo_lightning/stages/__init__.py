"""The RLHF stages before PPO: supervised fine-tuning and reward modelling.

Each stage has the same shape, so one entry point can run any of them::

    module, datamodule = build_sft(cfg.model, cfg.optimizer, cfg.task)
    trainer.fit(module, datamodule=datamodule)
    save_sft(module, out_dir)            # -> PPO: model.name_or_path=<out_dir>

    module, datamodule = build_reward_model(cfg.model, cfg.optimizer, cfg.task)
    trainer.fit(module, datamodule=datamodule)
    save_reward_model(module, out_dir)   # -> PPO: reward=model reward.name_or_path=<out_dir>

A stage's data and batches are its own ``task.*`` keys (``task.path``, ``task.batch_size``, ...);
``data.*`` is PPO's prompts. ``STAGES`` maps a stage name to ``(config class, build, save)``.
"""

from ppo_lightning.stages.reward_model import (
    PairCollator,
    PreferenceDataModule,
    RewardModelConfig,
    RewardModelModule,
    bradley_terry_loss,
    build_reward_model,
    prepare_reward_tokenizer,
    tokenize_pairs,
)
from ppo_lightning.stages.reward_model import save as save_reward_model
from ppo_lightning.stages.sft import (
    IGNORE_INDEX,
    SFTCollator,
    SFTConfig,
    SFTDataModule,
    SFTModule,
    build_sft,
    sft_loss_sums,
    tokenize_sft,
)
from ppo_lightning.stages.sft import save as save_sft

STAGES = {
    "sft": (SFTConfig, build_sft, save_sft),
    "reward_model": (RewardModelConfig, build_reward_model, save_reward_model),
}

__all__ = [
    "STAGES",
    "IGNORE_INDEX",
    "SFTConfig",
    "SFTModule",
    "SFTDataModule",
    "SFTCollator",
    "build_sft",
    "save_sft",
    "tokenize_sft",
    "sft_loss_sums",
    "RewardModelConfig",
    "RewardModelModule",
    "PreferenceDataModule",
    "PairCollator",
    "build_reward_model",
    "save_reward_model",
    "prepare_reward_tokenizer",
    "tokenize_pairs",
    "bradley_terry_loss",
]
