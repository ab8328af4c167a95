"""KL coefficient controllers: the beta in ``reward_t = -beta * KL_t (+ score at the last token)``.

``FixedKLController`` keeps beta constant. ``AdaptiveKLController`` is Ziegler et al. (2019),
section 2.2: a proportional controller that moves beta so the measured per-sequence KL tracks a
target, ``e = clip(KL / target - 1, -0.2, 0.2)``, ``beta <- beta * (1 + e * n_steps / horizon)``.
Both expose ``state_dict`` so a resumed run continues with the same beta.
"""

from __future__ import annotations


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
