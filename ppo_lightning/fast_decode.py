"""A lean per-token decode step for GPT-2-architecture models: the sampler's fast path.

Why: one decode step of a small GPT-2 is a few dozen tiny ops (~0.35 ms on the 2-layer benchmark
model, batch 8, CPU) wrapped in about as much Hugging Face Python per call: output dataclasses,
config-default merging, attention-mask construction, cache classes, attention dispatch. The step
here runs the same ops on the same modules' weights (layer norm, ``Conv1D`` as ``addmm``,
``scaled_dot_product_attention``, the model's own activation module) and keeps keys and values in
buffers allocated once per ``generate`` call, so a sampled token costs about half as much. Its
logits equal the model forward's (a test compares them bitwise on left-padded prompts).

Only the sampler uses it, to choose which tokens are drawn. Every logprob and value PPO learns
from comes from the model's own forward over the finished sequences.

Scope: exactly ``GPT2LMHeadModel`` (a subclass may change the forward) without cross-attention,
with ``reorder_and_upcast_attn`` off, no active dropout and whole (unsharded) weights. Everything else decodes through the
model's forward (``supports_fast_decode`` says which); ``generation.fast_decode=false`` forces that.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_lightning.policy import model_class, underlying


def supports_fast_decode(lm: nn.Module) -> bool:
    """Whether ``GPT2Decoder`` computes exactly what ``lm``'s own forward computes."""
    try:
        from transformers import GPT2LMHeadModel
        from transformers.pytorch_utils import Conv1D
    except ImportError:  # pragma: no cover - transformers is a dependency
        return False
    if underlying(lm) is not lm or model_class(lm) is not GPT2LMHeadModel:
        return False  # a view of another LM (LoRA's adapters-off reference), or not GPT-2
    config = lm.config
    if config.add_cross_attention or getattr(config, "reorder_and_upcast_attn", False):
        return False
    if lm.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in lm.modules()):
        return False  # the model's forward would drop activations; the lean step would not
    if not isinstance(lm.lm_head, nn.Linear):
        return False
    # Whole, ordinary weights: not sharded views or DTensors (FSDP), which only the model's own
    # forward knows how to gather. A sharded model gathered for the whole rollout
    # (sharding.unsharded_for_rollout) holds whole weights, and samples this way.
    if not all(type(p) is nn.Parameter for p in lm.parameters()):
        return False
    E = config.n_embd
    return all(
        type(b.attn.c_attn) is Conv1D
        and type(b.attn.c_proj) is Conv1D
        and type(b.mlp.c_fc) is Conv1D
        and type(b.mlp.c_proj) is Conv1D
        and hasattr(b.attn, "scaling")
        and tuple(b.attn.c_attn.weight.shape) == (E, 3 * E)
        for b in lm.transformer.h
    )


def _layer_norm(x: Tensor, ln: nn.LayerNorm) -> Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


class GPT2Decoder:
    """Decoding state for one batch: the prompt's keys and values, with room for
    ``max_new_tokens`` more, and the prompt's padding as a key mask.

    ``cache`` is the ``DynamicCache`` filled by the model's own forward over the left-padded
    prompt (the prefill, where the causal and padding masks matter most); decoding then continues
    here, one token per ``step``.
    """

    def __init__(self, lm: nn.Module, cache, attention_mask: Tensor, max_new_tokens: int):
        self.lm = lm
        self.blocks = lm.transformer.h
        B, P = attention_mask.shape
        self.length = P  # positions held in the buffers
        self.keys, self.values = [], []
        for i in range(len(self.blocks)):
            k, v = cache.layers[i].keys, cache.layers[i].values  # [B, H, P, D]
            kb = k.new_empty(B, k.shape[1], P + max_new_tokens, k.shape[3])
            vb = v.new_empty(B, v.shape[1], P + max_new_tokens, v.shape[3])
            kb[:, :, :P] = k
            vb[:, :, :P] = v
            self.keys.append(kb)
            self.values.append(vb)
        # Which keys each row may attend to: not its left padding. None when no row is padded.
        self.key_mask = None
        if not bool(attention_mask.all()):
            self.key_mask = torch.ones(B, 1, 1, P + max_new_tokens, dtype=torch.bool, device=attention_mask.device)
            self.key_mask[:, 0, 0, :P] = attention_mask.bool()

    def step(self, token: Tensor, position: Tensor) -> Tensor:
        """Append ``token [B]`` at ``position [B]``; return the next-token logits ``[B, V]``."""
        t, L = self.lm.transformer, self.length
        x = F.embedding(token, t.wte.weight) + F.embedding(position, t.wpe.weight)  # [B, E]
        B, E = x.shape
        mask = None if self.key_mask is None else self.key_mask[..., : L + 1]
        for block, kb, vb in zip(self.blocks, self.keys, self.values):
            attn, mlp = block.attn, block.mlp
            h = _layer_norm(x, block.ln_1)
            q, k, v = (
                torch.addmm(attn.c_attn.bias, h, attn.c_attn.weight).view(B, 3, attn.num_heads, attn.head_dim).unbind(1)
            )  # each [B, H, D]
            kb[:, :, L] = k
            vb[:, :, L] = v
            o = F.scaled_dot_product_attention(
                q[:, :, None], kb[:, :, : L + 1], vb[:, :, : L + 1], attn_mask=mask, scale=attn.scaling
            )  # [B, H, 1, D]
            x = x + torch.addmm(attn.c_proj.bias, o.reshape(B, E), attn.c_proj.weight)
            h = mlp.act(torch.addmm(mlp.c_fc.bias, _layer_norm(x, block.ln_2), mlp.c_fc.weight))
            x = x + torch.addmm(mlp.c_proj.bias, h, mlp.c_proj.weight)
        self.length = L + 1
        head = self.lm.lm_head
        return F.linear(_layer_norm(x, t.ln_f), head.weight, head.bias)
