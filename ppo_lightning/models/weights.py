"""A module's weights whole, whether FSDP2 has sharded them or not: the full tensors and state
dict (collectives under FSDP), whole tensors loaded back into shards, and tied weights (GPT-2's
LM head is its token embedding) held once. The policy's export, the checkpoints, the sharding
and the vLLM weight sync read weights through here.
"""

from __future__ import annotations

import torch
from torch import nn

from ppo_lightning.models.lora import underlying


def load_full_state_dict(module: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Load whole (unsharded) tensors into a module whose parameters may be sharded: each is cut
    to this rank's shard as its parameter is placed (``distribute_tensor``). Keys the module lacks,
    and entries the state dict lacks (frozen weights left out of checkpoints), are skipped."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    current = module.state_dict()
    placed = {}
    for key, value in full.items():
        target = current.get(key)
        if target is None:
            continue
        if isinstance(target, DTensor):
            value = distribute_tensor(value.to(target.device, target.dtype), target.device_mesh, target.placements)
        placed[key] = value
    module.load_state_dict(placed, strict=False)


def tied_aliases(module: nn.Module) -> set[str]:
    """The state-dict names under which ``module`` holds a tensor it already holds under an
    earlier name: the second name of each tied weight (GPT-2's ``lm_head.weight`` is its token
    embedding). Loading the first name sets both."""
    seen: set[int] = set()
    aliases = set()
    for key, value in module.state_dict(keep_vars=True).items():
        if id(value) in seen:
            aliases.add(key)
        seen.add(id(value))
    return aliases


def drop_tied_aliases(module: nn.Module, whole: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``whole`` without ``tied_aliases(module)``. Gathered state dicts hold a tied weight as
    separate copies, where ``module.state_dict()`` shares one tensor: an export would write a
    50257 x 768 embedding twice."""
    aliases = tied_aliases(module)
    return {k: v for k, v in whole.items() if k not in aliases}


def is_sharded(module: nn.Module) -> bool:
    """Whether FSDP2 has sharded ``module`` or a part of it (of a view, its LM: ``underlying``)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in underlying(module).modules())


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value (a collective), or ``t`` itself: e.g. a gradient norm computed over
    sharded gradients, which every rank must see whole to agree on skipping a step."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(module: nn.Module) -> dict[str, torch.Tensor]:
    """The whole, unsharded state dict of ``module`` on CPU (a collective: every rank calls it;
    rank 0 gets the tensors). Plain modules return their own state dict."""
    if not is_sharded(module):
        return module.state_dict()
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
