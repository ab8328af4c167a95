"""Fully sharded data parallel (FSDP2, ``torch.distributed.fsdp.fully_shard``) through Lightning.

``FSDP2Strategy`` is Lightning's ``ModelParallelStrategy`` with its data-parallel mesh over every
device (no tensor parallelism) and full-state checkpoints; ``PPOModule.configure_model`` calls
``shard_module`` under it. What is sharded, and why:

- the policy: each decoder block is its own FSDP group (its weights all-gathered just for its
  forward and backward), then the LM (embeddings, final norm, output head), then the policy root
  (the value head). The LM is a group of its own because the sampler calls it directly, without
  the policy's forward;
- the frozen reference: the same way, so it costs 1/world of its weights per rank. With LoRA it is
  the policy itself, adapters off;
- the reward model: replicated. It has its own tokenizer and architecture, is usually the smaller
  model, and runs one forward per rollout.

Rollouts: sampling runs one forward per token; with per-block all-gathers that is
``max_new_tokens`` all-gathers of every weight. ``unsharded_for_rollout`` instead gathers each
group once for the whole rollout and reshards after it (``FSDP2Strategy(gather_for_rollout=True)``,
the default): the rollout then holds the full policy and reference weights for its duration,
and the update runs sharded. ``trainer.strategy.gather_for_rollout=false`` keeps the rollout
sharded too (one block's full weights at a time, gathered again for every token), for models
whose full weights do not fit beside the rollout's KV cache.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import shutil
from pathlib import Path

import torch
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn

from ppo_lightning.models.weights import is_sharded, load_full_state_dict
from ppo_lightning.parallel.checkpoint import replace_directory, SHARDED_META, write_error


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` for fully sharded data parallel: the data-parallel mesh covers
    every device of every node (``ModelParallelStrategy()``'s "auto" would make it the number of
    nodes and shard nothing on one node), tensor parallelism off.

    Checkpoints are full-state (``save_distributed_checkpoint=False``): the weights and optimizer
    state are gathered to rank 0 and written as one file through the trainer's checkpoint IO
    (atomically: a kill mid-write leaves the previous checkpoint). One file resumes under any
    world size or strategy and exports with ``task=export``; the cost is that rank 0 holds the
    full state in CPU memory while it writes. Pass ``save_distributed_checkpoint=True`` for a
    directory of per-rank shards instead (models whose full state does not fit in rank 0's RAM).

    ``gather_for_rollout``: gather the policy and reference once per rollout (True: one
    all-gather per weight, full weights held while sampling) or per forward (False: sharded
    memory throughout, ``max_new_tokens`` times the communication); see the module docstring.
    """

    def __init__(self, save_distributed_checkpoint: bool = False, gather_for_rollout: bool = True, **kwargs) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )
        self.gather_for_rollout = gather_for_rollout

    @property
    def data_parallel_devices(self) -> int:
        """The size of the data-parallel (sharding) mesh: every process of every node."""
        return self.num_nodes * self.num_processes

    def setup_environment(self) -> None:
        self._data_parallel_size = self.data_parallel_devices
        super().setup_environment()

    def lightning_module_state_dict(self) -> dict:
        """The module's trainable state, gathered whole to rank 0 (full-state checkpoints). Frozen
        weights (the reference, the reward model, LoRA's base) are not gathered at all: checkpoints
        leave them out anyway (``PPOModule.checkpointed``, which also drops the second copy of a
        tied weight), and gathering the reference to rank 0 at every checkpoint would cost a full
        copy of it in rank 0's memory."""
        if self._save_distributed_checkpoint:
            return super().lightning_module_state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(
            self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
        )

    def optimizer_state(self, optimizer) -> dict:
        """The optimizer state keyed by parameter names (not by position), gathered when
        checkpoints are full-state: a resumed run, sharded or not, finds each moment by name."""
        if self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer wraps it
        return get_optimizer_state_dict(
            self.model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )

    def load_checkpoint(self, checkpoint_path, weights_only: bool | None = None) -> dict:
        """A full-state checkpoint file: every rank reads it and takes its own shards of the
        weights and optimizer state (``set_model_state_dict`` / ``set_optimizer_state_dict`` on
        the whole module, which place each tensor as its parameter is sharded). Frozen weights
        that checkpoints leave out (``PPOModule.checkpointed``) keep their loaded values. A
        directory is a sharded checkpoint (``_load_sharded_checkpoint``)."""
        from pathlib import Path

        path = Path(self.broadcast(checkpoint_path))
        if path.is_dir():
            return self._load_sharded_checkpoint(path, weights_only)
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        checkpoint = torch.load(
            path, map_location="cpu", mmap=True, weights_only=True if weights_only is None else weights_only
        )
        load_full_state_dict(self.model, checkpoint.pop("state_dict"))
        options = StateDictOptions(full_state_dict=True, strict=False)
        for optimizer, state in zip(self.optimizers, checkpoint.pop("optimizer_states", [])):
            set_optimizer_state_dict(self.model, optimizer, state, options=options)
        return checkpoint

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        """A sharded checkpoint is written whole or not at all, as a full-state file is
        (``checkpoint.AtomicCheckpointIO``): every rank writes its shards into ``<name>.tmp``, then
        rank 0 swaps it in for the old directory (two renames, the old one removed after). A
        kill mid-write leaves the previous checkpoint; a write that fails (a full disk) removes
        the temporary directory and raises ``CheckpointWriteError`` on every rank, since
        torch.distributed.checkpoint tells every rank of any rank's failure."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        path = Path(self.broadcast(str(filepath)))
        tmp = path.with_name(path.name + ".tmp")
        if self.global_rank == 0 and tmp.exists():
            shutil.rmtree(tmp)  # what a killed save left
        self.barrier()
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
        except BaseException as e:  # torch.distributed.checkpoint's CheckpointException is one
            if self.global_rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            error = write_error(e, path)
            if error is None:
                raise
            raise error from e
        self.barrier()
        if self.global_rank == 0:
            replace_directory(tmp, path)
        self.barrier()

    def _load_sharded_checkpoint(self, path, weights_only: bool | None) -> dict:
        """A sharded checkpoint (``save_distributed_checkpoint=True``): each rank reads its own
        shards of the weights and optimizer state with torch.distributed.checkpoint. Only the
        entries it holds are asked for: the frozen weights and the second copy of a tied weight
        that ``PPOModule.checkpointed`` leaves out keep their loaded values, as with a full-state
        file (Lightning's loader asks for every entry of the module and fails on those)."""
        from torch.distributed.checkpoint import FileSystemReader, load
        from torch.distributed.checkpoint.state_dict import (
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
            set_optimizer_state_dict,
            StateDictOptions,
        )

        saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
        weights = {k: v for k, v in get_model_state_dict(self.model).items() if f"state_dict.{k}" in saved}
        load({"state_dict": weights}, checkpoint_id=path)
        set_model_state_dict(self.model, weights, options=StateDictOptions(strict=False))
        for idx, optimizer in enumerate(self.optimizers):
            state = {f"optimizer_{idx}": get_optimizer_state_dict(self.model, optimizer)}
            load(state, checkpoint_id=path)
            set_optimizer_state_dict(self.model, optimizer, state[f"optimizer_{idx}"])
        return torch.load(path / SHARDED_META, map_location="cpu", weights_only=weights_only is not False)


def decoder_blocks(lm: nn.Module) -> list[nn.Module]:
    """The repeated decoder blocks of a Hugging Face model, found by the classes the model
    declares it must not split across devices (``_no_split_modules``: ``GPT2Block``,
    ``LlamaDecoderLayer``, ``Qwen2DecoderLayer``, ``GPTNeoXLayer``, ...)."""
    names = set(getattr(lm, "_no_split_modules", None) or ())
    blocks = [m for m in lm.modules() if type(m).__name__ in names]
    if not blocks:
        raise ValueError(
            f"{type(lm).__name__} declares no decoder block classes (_no_split_modules); cannot shard it block by block"
        )
    return blocks


def shard_lm(lm: nn.Module, mesh, root: nn.Module | None = None) -> None:
    """``fully_shard`` each decoder block, then the LM, then ``root`` (a module holding the LM)."""
    from torch.distributed.fsdp import fully_shard

    for block in decoder_blocks(lm):
        fully_shard(block, mesh=mesh)
    fully_shard(lm, mesh=mesh)
    if root is not None:
        fully_shard(root, mesh=mesh)


def shard_module(module, mesh) -> None:
    """Shard the policy and the frozen reference of a ``PPOModule`` over ``mesh`` (idempotent)."""
    from ppo_lightning.models.lora import DisabledAdapters

    if is_sharded(module.policy):
        return
    shard_lm(module.policy.lm, mesh, root=module.policy)
    if not isinstance(module.ref_lm, DisabledAdapters):
        shard_lm(module.ref_lm, mesh)


@torch.no_grad()
def initialize_root(policy: nn.Module, device: torch.device) -> None:
    """Run one 2-token forward through the sharded policy, so FSDP initialises it as the root of
    its groups. FSDP requires a tree's first forward to enter at its root, and the sampler calls
    the LM (a group inside the policy) directly."""
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    policy(ids, torch.ones_like(ids), torch.arange(2, device=device)[None], 1)


def _fsdp_modules(*modules: nn.Module) -> Iterator:
    from torch.distributed.fsdp import FSDPModule

    for module in modules:
        for m in module.modules():
            if isinstance(m, FSDPModule):
                yield m


@contextlib.contextmanager
def unsharded_for_rollout(*modules: nn.Module):
    """Gather every FSDP group of ``modules`` once, keep them gathered through every forward
    inside the block (sampling: one per token), and reshard at the end. A no-op for modules
    that are not sharded."""
    groups = list(_fsdp_modules(*modules))
    if not groups:
        yield
        return
    for g in groups:
        g.set_reshard_after_forward(False, recurse=False)
        g.unshard()
    try:
        yield
    finally:
        for g in groups:
            g.reshard()
            g.set_reshard_after_forward(True, recurse=False)
