"""KL to the reference: Schulman's k1/k2/k3 estimators per token, the approximate KL between
the old and new policy, and the controllers of the KL coefficient beta.

Shapes: ``B`` rows (episodes), ``R`` response positions. Every function takes a ``mask`` that is 1
on real response tokens and 0 on prompt, pad and after-EOS positions; statistics are taken over
masked positions only. Sources:

- The tutorial: the PPO tutorial this project started from, FareedKhan-dev/train-llm-from-scratch,
  ``src/post_training/ppo.py``.
- [N+] Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO".
- [GAE] Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE".
- [Z19] Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences".
- [KL] J. Schulman, "Approximating KL Divergence" (k1/k2/k3 estimators), 2020.
"""

from __future__ import annotations

import torch

from ppo_lightning.algo.stats import _select, masked_mean
from ppo_lightning.config.choices import DEFAULT_KL_ESTIMATOR, KL_ESTIMATORS, KLEstimatorSpec

Tensor = torch.Tensor


@KL_ESTIMATORS.register("k1", KLEstimatorSpec(in_loss=False))
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log p - log q: unbiased for KL(p||q) under samples of p, high variance, can be < 0."""
    return logp - ref_logp


@KL_ESTIMATORS.register("k2", KLEstimatorSpec(in_loss=True))
def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 (log p - log q)^2: biased, low variance, always >= 0 [KL]."""
    return 0.5 * (logp - ref_logp) ** 2


KL_LOG_RATIO_CLAMP = 20.0  # |log r| bound inside k3 (verl's kl_penalty clamps at 20 too)


@KL_ESTIMATORS.register("k3", KLEstimatorSpec(in_loss=True))
def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = (r - 1) - log r with r = q / p: unbiased, always >= 0 [KL].

    ``log r`` is clamped to +-20 before the exponential: beyond it ``exp`` overflows float32
    (at 88.7) and a single token would give an infinite loss, and a NaN gradient even where a
    mask later drops it (0 * inf). Within the clamp the value and gradient are exact.
    """
    log_r = (ref_logp - logp).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return torch.expm1(log_r) - log_r


def kl_estimator_for(kl_in: str, estimator: str | None) -> str:
    """The KL estimator a run uses: ``ppo.kl_estimator``, or null's default for ``ppo.kl_in``."""
    return DEFAULT_KL_ESTIMATOR[kl_in] if estimator is None else estimator


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k1", mask: Tensor | None = None) -> Tensor:
    """Per-token KL(policy || reference) estimate ([Z19] uses k1 in the reward).

    With ``mask``, both log-probabilities are taken as 0 off the mask before the estimator runs,
    so a pad or after-EOS position (whose logprob can be anything, e.g. -100) gives 0 and a zero
    gradient, never an overflow that a later mask would turn into 0 * inf = NaN.
    """
    if mask is not None:
        logp, ref_logp = _select(logp, mask), _select(ref_logp, mask)
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATORS)}")
    return KL_ESTIMATORS.implementation(estimator)(logp, ref_logp)


def approx_kl(new_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """Approximate KL(old || new) over a PPO update, the k3 estimator (as CleanRL logs it).

    A monitor, not a loss: a value far above ~0.02 means the update moved the policy too far.
    """
    logratio = new_logp - old_logp
    return masked_mean(torch.expm1(logratio) - logratio, mask)


# ----------------------------------------------------------------------------- the KL coefficient
# KL coefficient controllers: the beta in ``reward_t = -beta * KL_t (+ score at the last token)``.
#
# ``FixedKLController`` keeps beta constant. ``AdaptiveKLController`` is Ziegler et al. (2019),
# section 2.2: a proportional controller that moves beta so the measured per-sequence KL tracks a
# target, ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``.
# Both expose ``state_dict`` so a resumed run continues with the same beta.


class FixedKLController:
    def __init__(self, init_kl_coef: float):
        self.value = float(init_kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = float(state["value"])


class AdaptiveKLController(FixedKLController):
    def __init__(self, init_kl_coef: float, target: float, horizon: int):
        super().__init__(init_kl_coef)
        self.target = float(target)
        self.horizon = int(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        """``current_kl``: mean per-sequence KL (k1 summed over response tokens);
        ``n_steps``: episodes in the batch that measured it."""
        proportional_error = min(max(current_kl / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def build_kl_controller(kl_coef: float, adaptive: bool, target: float, horizon: int):
    if adaptive:
        return AdaptiveKLController(kl_coef, target, horizon)
    return FixedKLController(kl_coef)
