"""The algorithm: pure math at the bottom, one PPO iteration on top.

- ``stats.py``: masked statistics over response tokens (means, variances, whitening);
- ``losses.py``: the clipped policy and value losses, their aggregation, logprobs, entropy;
- ``advantages.py``: GAE and the critic-free estimators (GRPO, RLOO, REINFORCE++);
- ``kl.py``: KL estimators (k1, k2, k3) and the KL coefficient's controllers;
- ``rollout.py``: one batch of prompts sampled, scored and turned into a ``Rollout``;
- ``algorithm.py``: ``PPO.collect(batch) -> Rollout`` and ``PPO.learn(Rollout) -> stats``.

The first four import no Lightning and no model: they test against naive loops without a Trainer.
"""

# The registering modules (config.choices.ESTIMATORS, KL_ESTIMATORS, LOSS_AGGREGATIONS): importing
# any part of the algorithm fills the choices that config validation reads.
from ppo_lightning.algo import advantages, kl, losses  # noqa: E402,F401
