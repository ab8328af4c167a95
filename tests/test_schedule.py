"""The learning-rate schedule (``optimizer.scheduler``, ``warmup_steps``, ``min_lr_ratio``) against
the formula written out, step by step."""

from __future__ import annotations

import math

import pytest

from ppo_lightning.train.optim import lr_lambda


def naive(scheduler: str, warmup: int, total: int, floor: float, step: int) -> float:
    if step < warmup:  # linear warmup that never starts at 0
        return (step + 1) / (warmup + 1)
    if scheduler == "constant":
        return 1.0
    t = min(step - warmup, total - warmup) / (total - warmup)
    shape = 1 - t if scheduler == "linear" else (1 + math.cos(math.pi * t)) / 2
    return floor + (1 - floor) * shape


@pytest.mark.parametrize("scheduler", ["constant", "linear", "cosine"])
@pytest.mark.parametrize("warmup, floor", [(0, 0.0), (3, 0.0), (2, 0.1)])
def test_the_lr_multiplier_is_the_schedule_written_out(scheduler, warmup, floor):
    total = 10
    f = lr_lambda(scheduler, warmup, total, floor)
    for step in range(total + 3):  # past the end: the floor holds
        assert f(step) == pytest.approx(naive(scheduler, warmup, total, floor, step), abs=1e-12), step


def test_decays_reach_the_floor_at_the_last_step_and_warmup_rises_to_one():
    for scheduler in ("linear", "cosine"):
        f = lr_lambda(scheduler, 2, 10, 0.1)
        assert f(0) == pytest.approx(1 / 3) and f(1) == pytest.approx(2 / 3) and f(2) == pytest.approx(1.0)
        assert f(10) == pytest.approx(0.1) and f(50) == pytest.approx(0.1)
        assert all(f(s) >= f(s + 1) for s in range(2, 12))  # no rise after the warmup
