"""Pins the behaviour of each private Lightning call in ``ppo_lightning/parallel/lightning_compat.py``.

A Lightning release that moves or changes one of them fails here, by name, rather than as a PPO
run whose ``global_step`` counts optimizer steps instead of iterations.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from ppo_lightning.parallel.lightning_compat import attached_trainer, count_iteration, step_optimizer


class ManualModule(L.LightningModule):
    """Manual optimisation; each training_step records what each compat call did."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False
        self.layer = torch.nn.Linear(3, 1)
        self.seen: list[dict] = []

    def configure_optimizers(self):
        return torch.optim.SGD(self.layer.parameters(), lr=0.1)

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(self.layer(batch).pow(2).sum())
        w0, step0 = self.layer.weight.detach().clone(), self.trainer.global_step
        step_optimizer(self.trainer, opt)
        w1, step1 = self.layer.weight.detach().clone(), self.trainer.global_step
        step_optimizer(self.trainer, opt)  # a second optimizer step in the same iteration
        step2 = self.trainer.global_step
        count_iteration(opt)
        self.seen.append({"moved": not torch.equal(w0, w1), "steps": (step0, step1, step2, self.trainer.global_step)})


def test_step_optimizer_steps_and_count_iteration_counts_once():
    module = ManualModule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(torch.randn(10, 3), batch_size=2))
    assert len(module.seen) == 3  # max_steps counts iterations, not the 2 optimizer steps in each
    for i, s in enumerate(module.seen):
        assert s["moved"], "step_optimizer must update the weights"
        assert s["steps"] == (i, i, i, i + 1), "optimizer steps must not count; count_iteration adds one"
    assert trainer.global_step == 3


def test_count_iteration_does_not_step_the_optimizer():
    module = ManualModule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    before = {}

    def training_step(batch, batch_idx):
        opt = module.optimizers()
        opt.zero_grad()
        module.manual_backward(module.layer(batch).pow(2).sum())  # gradients present, not applied
        before["w"] = module.layer.weight.detach().clone()
        count_iteration(opt)
        before["after"] = module.layer.weight.detach().clone()

    module.training_step = training_step
    trainer.fit(module, DataLoader(torch.randn(4, 3), batch_size=2))
    assert torch.equal(before["w"], before["after"])
    assert trainer.global_step == 1


def test_attached_trainer_is_none_until_the_module_is_attached():
    module = ManualModule()
    assert attached_trainer(module) is None
    with pytest.raises(RuntimeError):
        module.trainer  # the public property raises on a detached module: why the compat call exists
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(torch.randn(4, 3), batch_size=2))
    assert attached_trainer(module) is trainer


def test_no_gradient_sync_is_ddps_no_sync_through_the_strategy():
    """On one device a no-op context; on DDP the strategy's ``block_backward_sync`` (DDP's
    ``no_sync``). tests/test_ddp.py checks the accumulated update across 2 processes."""
    from lightning.pytorch.strategies import DDPStrategy

    from ppo_lightning.parallel.lightning_compat import no_gradient_sync

    assert callable(getattr(DDPStrategy, "block_backward_sync", None))
    module = ManualModule()
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, DataLoader(torch.randn(4, 3), batch_size=2))
    x = torch.randn(2, 3)
    module.zero_grad()
    with no_gradient_sync(trainer):
        module.layer(x).sum().backward()
    g = module.layer.weight.grad.clone()
    module.layer(x).sum().backward()  # accumulates onto the first
    torch.testing.assert_close(module.layer.weight.grad, 2 * g)
