"""``eval``: evaluation during training on held-out prompts."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, Optional

from ppo_lightning.config.schema import param


@dataclass
class EvalConfig:
    """Evaluation during training, on held-out prompts (off unless ``path`` or ``split_fraction``
    gives some). At the start of iteration 0 (``before_training``) and of every
    ``every_n_iterations``-th iteration, and after the last, the policy answers each eval prompt
    ``num_samples`` times (its own seeded generator: the training trajectory is the same with eval
    on or off), sharded over ranks, scored by the run's reward; ``eval/*`` metrics are logged at
    that step (``docs/metrics.md``)."""

    path: Optional[str] = None
    """Eval prompt records, read as ``data.path`` is (same ``data.prompt_field``, template and
    system prompt)."""
    split_fraction: float = param(0.0, ge=0, lt=1)
    """With ``path`` null: hold this fraction of ``data.path``'s prompts out of training for eval
    (the same prompts for every ``seed``: the split has a seed of its own)."""
    every_n_iterations: Optional[int] = param(None, ge=1)
    """Evaluate before every n-th iteration (null: only before training and after the last)."""
    before_training: bool = True
    """Evaluate once before the first update: the "before" column of the curve."""
    num_samples: int = param(1, ge=1)
    """Responses per eval prompt: ``n`` in the ``@n`` metrics and the ``pass@k`` ones (k = 1, 2,
    4, ... up to n)."""
    temperature: float = param(0.0, ge=0)
    """0: greedy (then ``num_samples`` > 1 repeats one answer); else sampled at this temperature,
    with the run's top-k, top-p and stop sequences."""
    max_prompts: Optional[int] = param(None, ge=1)
    """Evaluate on the first this many eval prompts (null: all)."""
    pass_threshold: float = 1.0
    """A response passes when its score reaches this (``eval/pass@k``)."""
    pass_term: Optional[str] = None
    """The ``reward.terms`` term whose raw score decides a pass (null: the whole raw reward)."""
    metrics: Dict[str, str] = field(default_factory=dict)
    """Scores that are measured on the eval samples but are not the reward: name -> a function
    (``eval.metrics.sentiment=my_pkg.my_fn``, with or without ``+``), called as a reward function is (TRL's signature or
    ``(prompts, responses)``, columns by parameter name, None = does not apply) and logged as
    ``eval/metrics/<name>/mean@n``. A ground truth beside a learned reward tells a real gain from
    reward hacking (the default job's sentiment and grammar)."""
