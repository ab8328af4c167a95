"""What a call to a model takes: the class whose ``forward`` runs (seen through LoRA views and
FSDP2's wrapper classes) and the keyword arguments that forward accepts, which differ between
architectures and transformers versions."""

from __future__ import annotations

import functools
import inspect

from torch import nn

from ppo_lightning.models.lora import underlying


def model_class(lm: nn.Module) -> type:
    """The class whose ``forward`` a call to ``lm`` runs (its signature says which keyword
    arguments the model takes; ``fast_decode`` accepts exact classes only): ``underlying(lm)``'s,
    and for a module FSDP2 has sharded the class it was (``fully_shard`` swaps in a subclass
    ``FSDP<Name>(FSDPModule, <Name>)`` that adds hooks and no computation)."""
    from torch.distributed.fsdp import FSDPModule

    lm = underlying(lm)
    cls = type(lm)
    if isinstance(lm, FSDPModule) and cls.__name__ == f"FSDP{cls.__bases__[-1].__name__}":
        return cls.__bases__[-1]
    return cls


@functools.lru_cache(maxsize=None)
def forward_params(cls: type) -> frozenset[str]:
    """The argument names of a model class's ``forward`` (``inspect.signature`` costs ~30 us: once
    per class, not per call)."""
    return frozenset(inspect.signature(cls.forward).parameters)


def cache_kwarg(lm) -> str:
    """transformers >= 5.24 names the KV cache argument ``cache``; earlier, ``past_key_values``."""
    return "cache" if "cache" in forward_params(model_class(lm)) else "past_key_values"


def logits_to_keep(lm, n: int) -> dict:
    """``logits_to_keep=n`` where the model takes it: the LM head then runs on the last ``n``
    positions only (the logits of the prompt are never used)."""
    return {"logits_to_keep": n} if "logits_to_keep" in forward_params(model_class(lm)) else {}
