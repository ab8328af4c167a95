"""``optimizer``: the optimizer and the learning-rate schedule."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List

from ppo_lightning.config import choices
from ppo_lightning.config.schema import param


@dataclass
class OptimizerConfig:
    """The optimizer over the policy's trainable parameters (value head included), and its lr
    schedule, stepped once per PPO iteration (stages: once per optimizer step)."""

    name: str = param("adamw", choices=choices.OPTIMIZERS)
    """``torch.optim`` class; ``sgd`` uses ``lr`` and ``weight_decay`` only (no momentum)."""
    lr: float = param(1.0e-5, gt=0)
    """Base learning rate (``model=tiny``, ``model=reviews`` and the recipes' experiments set the rate
    their small models need)."""
    betas: List[float] = param(factory=lambda: [0.9, 0.999])
    """Adam/AdamW only."""
    eps: float = param(1.0e-5, gt=0)
    """Adam/AdamW only. 1e-5 rather than torch's 1e-8, as OpenAI's RLHF code ([N+])."""
    weight_decay: float = param(0.0, ge=0)
    """Decoupled (AdamW) or L2 (Adam, SGD) weight decay."""
    scheduler: str = param("constant", choices=choices.SCHEDULERS)
    """Decay from 1 to ``min_lr_ratio`` between step ``warmup_steps`` and ``trainer.max_steps``
    (``train/optim.py:lr_lambda``)."""
    warmup_steps: int = param(0, ge=0)
    """Steps (PPO iterations) of linear warmup: step i < w trains at lr (i + 1) / (w + 1)."""
    min_lr_ratio: float = param(0.0, ge=0, le=1)
    """Final lr / lr of the linear and cosine decays, reached at ``trainer.max_steps``."""
    fused: bool = True
    """torch's fused implementation (one kernel per parameter for the whole update; an AdamW step
    on the 2-layer benchmark model: 0.2 ms against 0.7 ms); false: ``foreach`` (one kernel per op
    over all parameters). Same math either way."""
