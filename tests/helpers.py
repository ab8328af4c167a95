"""Callbacks the tests inject through Hydra (``+callbacks.<name>._target_=tests.helpers.X``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


class SaveRankWeights(L.Callback):
    """At the end of fit, every rank writes its policy weights to ``<dir>/rank<k>.pt``."""

    def __init__(self, dir: str):
        self.dir = Path(dir)

    def on_train_end(self, trainer, pl_module) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().clone() for k, v in pl_module.policy.state_dict().items()}
        torch.save(state, self.dir / f"rank{trainer.global_rank}.pt")


class KillAtStep(L.Callback):
    """SIGKILLs its own process when iteration ``step`` is about to start: a crash mid-run."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            import os
            import signal

            os.kill(os.getpid(), signal.SIGKILL)


_CALLS = {"n": 0}


def nan_on_odd_calls(prompts, responses):
    """A reward that returns NaN for one prompt on every other call (a flaky scorer)."""
    _CALLS["n"] += 1
    scores = [sum(c.isalpha() for c in r) / max(1, len(r)) for r in responses]
    if _CALLS["n"] % 2 == 0:
        scores[1] = float("nan")
    return scores


def always_nan(prompts, responses):
    return [float("nan")] * len(prompts)


def wrong_length(prompts, responses):
    return [0.0] * (len(prompts) - 1)


def not_numbers(prompts, responses):
    return ["good"] * len(prompts)


def raises_on_a(prompts, responses):
    return [1.0 / ("a" not in p) for p in prompts]
