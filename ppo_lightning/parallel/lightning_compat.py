"""The private Lightning calls of the training loop, in one place.

What else touches Lightning's insides, and where: ``sharding.FSDP2Strategy`` subclasses
``ModelParallelStrategy`` and sets or reads two of its private attributes
(``_data_parallel_size``, ``_save_distributed_checkpoint``), exercised by ``tests/test_fsdp.py``;
``checkpoint.stop_every_rank_on_write_error`` wraps the public ``Strategy.save_checkpoint``.

Lightning minor releases move private names; keeping them here means one file to fix and one test
file (``tests/test_lightning_compat.py``) that pins what each call must do, so an upgrade that
breaks one fails there, by name, instead of as a wrong step count in a training run.

Why each is needed: a PPO iteration takes many optimizer steps (``ppo_epochs`` × minibatches) but
must count as one Lightning step, so that ``trainer.max_steps``, checkpoint intervals and the
loggers' step all speak in iterations. ``LightningOptimizer.step()`` would count every optimizer
step, so the module steps through the strategy directly (``step_optimizer``) and counts the
iteration once (``count_iteration``).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

from lightning.pytorch.core.optimizer import do_nothing_closure

if TYPE_CHECKING:
    import lightning as L
    from lightning.pytorch.core.optimizer import LightningOptimizer


def step_optimizer(trainer: "L.Trainer", optimizer: "LightningOptimizer") -> None:
    """One optimizer step through the strategy (precision plugin, sharded-strategy hooks), without
    the progress hooks ``LightningOptimizer.step()`` runs around it: ``global_step`` is unchanged.

    The gradients are already computed, so the closure the strategy calls is Lightning's no-op.
    """
    trainer.strategy.optimizer_step(optimizer.optimizer, do_nothing_closure)


def count_iteration(optimizer: "LightningOptimizer") -> None:
    """Advance ``trainer.global_step`` by exactly one, as one ``LightningOptimizer.step()`` would.

    These are the two progress hooks the manual-optimisation loop installs on the optimizer
    (``_on_before_step`` / ``_on_after_step``); no optimizer step runs.
    """
    optimizer._on_before_step()
    optimizer._on_after_step()


def no_gradient_sync(trainer: "L.Trainer"):
    """A context in which backward passes accumulate gradients without all-reducing them (DDP's
    ``no_sync``, through the strategy); a no-op on one process. For all micro-batches of a
    minibatch but the last."""
    block = getattr(trainer.strategy, "block_backward_sync", None)
    return block() if block is not None else contextlib.nullcontext()


def attached_trainer(module: "L.LightningModule") -> "L.Trainer | None":
    """The trainer a module is attached to, or None (``module.trainer`` raises when detached)."""
    return module._trainer
