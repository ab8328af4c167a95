"""``rollout``: how rollouts relate to the updates (``rollout.staleness``)."""

from __future__ import annotations

from dataclasses import dataclass

from ppo_lightning.config.schema import param


@dataclass
class RolloutConfig:
    """Which policy samples each iteration's rollout (docs/async.md)."""

    staleness: int = param(0, ge=0)
    """K: the rollout iteration ``i`` learns from was sampled by the policy after update ``i - K``
    (at most ``i`` updates back in the first iterations). 0, the default, is the synchronous loop:
    each rollout sampled by the policy it trains. K >= 1 samples from a copy of the policy's
    weights that lags K updates behind (``generation.lagged.LaggedBackend``), each token tagged
    with the version that sampled it; the update clips ``pi_theta / pi_old`` on the policy at the
    start of the update and weighs each token by ``pi_old / pi_behaviour`` (``ppo.engine_correction``:
    staleness and engine mismatch are one correction), as decoupled PPO does. Deterministic: the
    same seed gives the same run, with a learning rate too small to move a weight the synchronous run's, and a resumed run
    the uninterrupted one's (the lagging weights are in the checkpoint). This in-process form
    gives the semantics of an asynchronous worker without its overlap; ``generation=hf`` only,
    unsharded."""
    allow_uncorrected: bool = False
    """With ``rollout.staleness >= 1``, allow ``ppo.engine_correction=none``: every token then
    trains as if the current policy had sampled it, and the clip no longer bounds the update
    against the policy that did (refused unless this is set)."""
