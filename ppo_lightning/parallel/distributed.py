"""What the PPO loop needs from the processes it runs on, in one place: ``Runtime``.

The loop (``algo/algorithm.py``) is written for one process; every concern that comes from running it
on several ranks, or in another precision, goes through a ``Runtime``:

- the precision context of the rollout's forwards (Lightning enters it around ``training_step``
  only, so the rollout enters it itself: the first update's ratio is then exactly 1);
- gathering FSDP2-sharded weights once per rollout rather than once per sampled token;
- decisions every rank must take alike (skip a non-finite update, stop at ``ppo.target_kl``),
  and means over ranks;
- backward, gradient accumulation without all-reduce, clipping and the optimizer step through
  the strategy (so Lightning's ``global_step`` counts iterations, not optimizer steps);
- each rank's sampling generator: its seed, and its state in checkpoints.

On one process every collective is the identity.
"""

from __future__ import annotations

import contextlib

import lightning as L
import torch
from torch import Tensor

from ppo_lightning.parallel.lightning_compat import no_gradient_sync, step_optimizer
from ppo_lightning.parallel.sharding import FSDP2Strategy, unsharded_for_rollout
from ppo_lightning.models.weights import full_tensor


class Runtime:
    """The ranks, precision and optimizer plumbing of a ``LightningModule``'s trainer."""

    def __init__(self, module: L.LightningModule):
        self.module = module
        self.plain_clipping = False  # set by setup(): clip with clip_grad_norm_ directly

    @property
    def trainer(self) -> L.Trainer:
        return self.module.trainer

    @property
    def world_size(self) -> int:
        return self.trainer.world_size

    def setup(self) -> None:
        """Decide how gradients are clipped (at fit start, once the trainer is known).

        Gradients that are not loss-scaled (fp32, bf16-mixed, bf16-true) on one device, DDP or
        FSDP2 are clipped directly (``clip_and_check``): Lightning's MixedPrecision refuses to
        clip for a fused optimizer even with bf16, where there is no scaler to undo. (FSDP2's
        gradients are DTensors: ``clip_grad_norm_`` reduces their norm across ranks.)
        """
        from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        plugin = self.trainer.precision_plugin
        self.plain_clipping = (
            type(plugin) in (Precision, MixedPrecision, HalfPrecision)
            and getattr(plugin, "scaler", None) is None
            and type(self.trainer.strategy) in (SingleDeviceStrategy, DDPStrategy, FSDP2Strategy)
        )

    # ------------------------------------------------------------------------- forwards
    def forward_context(self):
        """The precision plugin's forward context (autocast for bf16-mixed)."""
        return self.trainer.precision_plugin.forward_context()

    def gathered(self, *modules):
        """``sharding.unsharded_for_rollout(*modules)`` when the strategy gathers sharded weights
        once per rollout (``FSDP2Strategy.gather_for_rollout``); otherwise nothing."""
        if getattr(self.trainer.strategy, "gather_for_rollout", False):
            return unsharded_for_rollout(*modules)
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def rollout_context(self, *modules):
        """Both: the numerics of the update, and the weights of ``modules`` gathered once."""
        with self.forward_context(), self.gathered(*modules):
            yield

    # ------------------------------------------------------------------------- agreement
    def all_ranks(self, ok: bool) -> bool:
        """True only if ``ok`` on every rank: a skip must happen everywhere, or DDP's gradient
        all-reduce would wait forever for the rank that skipped its backward."""
        if self.world_size == 1:
            return ok
        return bool(self.trainer.strategy.reduce_boolean_decision(ok, all=True))

    def mean_over_ranks(self, x: Tensor) -> float:
        """The mean of a scalar over ranks (every rank gets the same number: a shared decision)."""
        return float(self.reduce_mean(x.detach()))

    def reduce_mean(self, x: Tensor) -> Tensor:
        return self.trainer.strategy.reduce(x, reduce_op="mean") if self.world_size > 1 else x

    def reduce_sum(self, x: Tensor) -> Tensor:
        return self.trainer.strategy.reduce(x, reduce_op="sum") if self.world_size > 1 else x

    def max_over_ranks(self, n: int) -> int:
        """The largest of every rank's ``n`` (every rank gets the same number)."""
        if self.world_size == 1:
            return n
        x = torch.tensor(float(n), device=self.module.device)
        return int(self.trainer.strategy.reduce(x, reduce_op="max"))

    def union(self, keys) -> list[str]:
        """The sorted union of every rank's ``keys``: metric names that some ranks may lack (an
        environment's info, a reward's ``log_metric``), so every rank reduces the same vector."""
        if self.world_size == 1:
            return sorted(set(keys))
        import torch.distributed as dist

        gathered: list = [None] * self.world_size
        dist.all_gather_object(gathered, sorted(set(keys)))
        return sorted(set().union(*gathered))

    # ------------------------------------------------------------------------- gradients
    def gradient_sync(self, sync: bool):
        """A context for a forward and its backward: ``sync=False`` accumulates gradients without
        all-reducing them (DDP's ``no_sync``; every micro-batch of a minibatch but the last)."""
        return contextlib.nullcontext() if sync else no_gradient_sync(self.trainer)

    def backward(self, loss: Tensor) -> None:
        """``loss.backward()`` through the precision plugin and the strategy."""
        self.module.manual_backward(loss)

    def clip_and_check(self, opt, max_norm: float) -> bool:
        """Clip to ``max_norm`` (when > 0); return whether the gradient norm is finite.

        With plain clipping (``setup``) this is what Lightning's ``clip_gradients`` runs,
        ``clip_grad_norm_`` over the optimizer's parameters, whose return value is the norm the
        finiteness check needs: one pass over the gradients instead of two. Other setups go
        through ``clip_gradients`` and a separate norm.
        """
        params = [p for group in opt.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return True
        if self.plain_clipping:
            if max_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            return bool(torch.isfinite(full_tensor(norm)))
        if max_norm > 0:
            self.module.clip_gradients(opt, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")
        return bool(torch.isfinite(full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params]))))

    def step(self, opt) -> None:
        """One optimizer step through the strategy, not counted as a Lightning step."""
        step_optimizer(self.trainer, opt)

    # ------------------------------------------------------------------------- generators
    def new_generator(self, seed: int, stride: int = 1000) -> torch.Generator:
        """A generator seeded ``seed + stride * rank``: each rank samples its own responses, or all
        ranks would draw correlated ones ([N+] "per-rank seeds")."""
        g = torch.Generator(device=self.module.device)
        return g.manual_seed(seed + stride * self.module.global_rank)

    def generator_states(self, generator: torch.Generator | None) -> list[Tensor] | None:
        """Every rank's generator state, rank order (a collective: Lightning builds the checkpoint
        on every rank; rank 0 writes it). Each rank resumes its own stream."""
        if generator is None:
            return None
        state = generator.get_state()
        if self.world_size == 1:
            return [state]
        # as int32: gloo's all_gather garbles uint8 tensors
        gathered = self.trainer.strategy.all_gather(state.to(self.module.device, torch.int32))  # [world, n]
        return [s.to("cpu", torch.uint8) for s in gathered]

    def restore_generator(self, states: list[Tensor], seed: int, step: int) -> tuple[torch.Generator, bool]:
        """This rank's generator from a checkpoint's ``states``: ``(generator, resumed)``. With a
        different number of ranks each rank starts a new stream instead, seeded by ``step`` too,
        not a copy of another rank's (``resumed`` False)."""
        if len(states) == self.world_size:
            g = torch.Generator(device=self.module.device)
            g.set_state(states[self.module.global_rank])
            return g, True
        return self.new_generator(seed + 7919 * step), False
