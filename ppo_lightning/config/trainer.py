"""``trainer``: the hardware and Lightning's Trainer (devices, strategy, precision)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ppo_lightning.config.schema import param


@dataclass
class TrainerConfig:
    """Instantiated as ``lightning.Trainer`` (plus ``plugins=[AtomicCheckpointIO()]``); any other
    ``Trainer`` argument can be added with ``+trainer.<arg>=<value>``."""

    _target_: str = "lightning.Trainer"
    """Class instantiated."""
    accelerator: str = "auto"
    """cpu, gpu, auto, ..."""
    devices: Any = "auto"
    """Devices per node; -1 = all."""
    strategy: Any = "auto"
    """ddp (``trainer=ddp``; ``trainer=ddp_cpu``: 2 CPU processes), or FSDP2 through
    ``ppo_lightning.parallel.sharding.FSDP2Strategy`` (``trainer=fsdp``, ``fsdp_cpu``), which takes
    ``+trainer.strategy.gather_for_rollout=false`` (keep the rollout sharded: weights gathered per
    token instead of once per rollout) and ``+trainer.strategy.save_distributed_checkpoint=true``
    (per-rank shard files instead of one full-state file). Lightning's FSDP1 (``fsdp``) is refused."""
    num_nodes: int = param(1, ge=1)
    """Nodes; each runs ``trainer.devices`` processes, launched by torchrun or SLURM
    (docs/scaling.md). FSDP shards over all of them."""
    """Nodes."""
    precision: Any = "32-true"
    """32-true, bf16-mixed (``trainer=gpu``) or bf16-true. The rollout runs in the same precision
    context as the update; the value head, logprobs and losses are float32 in every one. float16
    (16-mixed, 16-true) is refused: use bf16. On a CPU without bf16 matmul instructions
    (AVX512-BF16 or AMX) bf16 runs many times slower than float32, and the run warns before it starts."""
    max_steps: int = param(100, ge=1, hint="the number of PPO iterations")
    """PPO: iterations (one rollout plus its updates each). Stages: optimizer steps. Also the
    horizon of the lr decay."""
    max_epochs: int = -1
    """Passes over the prompt set; -1 = until ``max_steps``."""
    log_every_n_steps: int = 1
    """Stages: how often ``train/*`` reach the loggers. PPO metrics are logged every iteration."""
    enable_progress_bar: bool = True
    """PPO: one bar of iterations out of ``max_steps``, with ``objective/scores`` and
    ``objective/kl`` (``train.callbacks.IterationProgressBar``, unless ``callbacks`` brings a bar).
    Stages: Lightning's bar."""
    enable_model_summary: bool = True
    """The parameter table at the start."""
    enable_checkpointing: bool = True
    """False also needs no ``ModelCheckpoint`` callbacks (``callbacks=none``): Lightning refuses them."""
    deterministic: Any = False
    """Lightning's ``deterministic`` switch."""
    default_root_dir: Optional[str] = "${paths.output_dir}"
    """Where Lightning puts what nothing else places (its default checkpoint with ``callbacks=none``)."""
    num_sanity_val_steps: int = 0
    """No sanity validation."""
    use_distributed_sampler: bool = False
    """Off: the PPO prompt loader and the stage loaders shard over ranks themselves, in an order a
    resumed run can replay."""
    limit_val_batches: Any = 0
    """PPO has no validation loop; ``task=sft`` / ``task=reward_model`` set 1.0."""
    val_check_interval: Any = None
    """Stages: validate every this many optimizer steps (``task=sft`` / ``task=reward_model`` set 50)."""
    check_val_every_n_epoch: Optional[int] = 1
    """Null lets ``val_check_interval`` count steps across epochs (``task=sft`` / ``task=reward_model`` set it)."""
