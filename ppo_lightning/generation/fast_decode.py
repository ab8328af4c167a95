"""A lean per-token decode step for GPT-2, Llama, Qwen2 and GPT-NeoX models: the sampler's fast path.

Why: one decode step of a small model is a few dozen tiny ops (~0.35 ms on the 2-layer GPT-2
benchmark model, batch 8, CPU) wrapped in about as much Hugging Face Python per call: output
dataclasses, config-default merging, attention-mask construction, cache classes, attention
dispatch. The step here runs the same ops on the same modules' weights (layer norm or RMSNorm,
the projections, the model's own rotary embedding and ``apply_rotary_pos_emb``, scaled
dot-product attention, the model's own activation module) and keeps keys and values in buffers
allocated once per ``generate`` call, so a sampled token costs about half as much. The hidden
state it hands the LM head equals the model forward's (a test compares them bitwise on left-padded
prompts, per architecture); the head itself (``head_logits``) may run in another summation order
on a CPU, and its logits then equal the forward's to float32 rounding.

Only the sampler uses it, to choose which tokens are drawn. Every logprob and value PPO learns
from comes from the model's own forward over the finished sequences.

Scope, each class exactly (a subclass may change the forward): ``GPT2LMHeadModel`` without
cross-attention and with ``reorder_and_upcast_attn`` off (``GPT2Decoder``); ``LlamaForCausalLM``
and ``Qwen2ForCausalLM`` without sliding-window layers (``LlamaDecoder``); ``GPTNeoXForCausalLM``,
parallel residual or not, partial rotary included (``GPTNeoXDecoder``). The rotary ones with SDPA
attention and a rotary type whose frequencies are fixed at load (``ROTARY_TYPES``); all with no
active dropout, no module forward swapped (a hub kernel: ``forward_swapped``) and whole
(unsharded) plain ``nn.Linear`` / ``Conv1D`` weights, so no LoRA layers. Everything else
decodes through the model's forward (``decoder_for`` returns None; ``supports_fast_decode`` says
which); ``generation.fast_decode=false`` forces that.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_lightning.models.signature import model_class

from ppo_lightning.models.lora import underlying

ROTARY_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
"""Rotary embedding types the lean step accepts: their inverse frequencies and scaling are computed
once, when the model is built, so the model's rotary module is a pure function of the positions.
``dynamic`` and ``longrope`` recompute them from each call's positions and keep the result
between calls; they, and types not listed, decode through the model's forward."""


def decoder_for(lm: nn.Module, cache, attention_mask: Tensor, max_new_tokens: int) -> KVDecoder | None:
    """The lean decoder of ``lm``'s architecture, continuing from the prefill in ``cache``; None
    when ``lm`` must decode through its own forward (``supports_fast_decode``)."""
    cls = _decoder_class(lm)
    return None if cls is None else cls(lm, cache, attention_mask, max_new_tokens)


def supports_fast_decode(lm: nn.Module) -> bool:
    """Whether a lean decoder computes exactly what ``lm``'s own forward computes."""
    return _decoder_class(lm) is not None


def _decoder_class(lm: nn.Module) -> type[KVDecoder] | None:
    if underlying(lm) is not lm:
        return None  # a view of another LM (LoRA's adapters-off reference)
    # Whole, ordinary weights: not sharded views or DTensors (FSDP), which only the model's own
    # forward knows how to gather. A sharded model gathered for the whole rollout
    # (sharding.unsharded_for_rollout) holds whole weights, and samples this way.
    if not all(type(p) is nn.Parameter for p in lm.parameters()):
        return None
    if lm.training and any(isinstance(m, nn.Dropout) and m.p > 0 for m in lm.modules()):
        return None  # the model's forward would drop activations; the lean step would not
    if any(forward_swapped(m) for m in lm.modules()):
        return None  # a hub kernel or a patch runs in place of a module's own forward
    return next((cls for cls in (GPT2Decoder, LlamaDecoder, GPTNeoXDecoder) if cls.accepts(lm)), None)


def forward_swapped(module: nn.Module) -> bool:
    """Whether ``module`` runs a forward other than its class's: an instance attribute ``forward``
    on it, or on one of the function wrappers the ``kernels`` library routes its calls through
    (``_kernel_funcs``). That is how ``kernels.kernelize`` puts a hub kernel in place.

    Why not ``lm.use_kernels``: transformers 5 kernelizes every ``from_pretrained`` model when
    ``kernels`` is installed (a dependency of transformers), and sets that flag even where every
    layer fell back to its own forward, as on a CPU or without the hub. The flag would decline the
    lean step for every model loaded from disk."""
    return "forward" in vars(module) or any("forward" in vars(f) for f in getattr(module, "_kernel_funcs", {}).values())


HEAD_MM_MIN_ELEMENTS = 1 << 20
"""``head_logits`` computes ``(weight @ h^T)^T`` on a CPU from this many head weights: 8 rows on 2
threads here, ``F.linear`` against it, took 27 against 35 us for a 258 x 64 head, 67 against 138 us
for 2,048 x 64, and 2.7 against 1.2 ms for 8,192 x 256 (55 against 23 ms for Qwen2's 151,936 x 256)."""


def head_logits(h: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """The LM head on a decode step's final hidden states ``h [B, E]``: ``F.linear(h, weight,
    bias)``, equal to float32 rounding, and on a CPU in float32 computed as ``(weight @ h^T)^T``.

    Why: for the few rows of a decode batch the head is a matrix-vector product in disguise that
    reads the whole ``[V, E]`` weight once a step, and for Qwen2's vocabulary it is most of a
    step. MKL computes ``h @ weight^T`` (``F.linear``) with few rows 2-4x slower than
    ``weight @ h^T`` on an AVX2 EPYC (``python -m benchmarks.decode_head``: 38-42 ms against
    9-13 ms for 2-8 rows of a 151,936 x 256 head); the long side as the GEMM's rows streams the
    weight. The two sum each dot product in another order, so a logit may differ in its last
    bits: only the sampler reads these logits (to pick tokens), and every logprob PPO learns
    from comes from the model's forward. A lone row (the last completion still sampling) goes in
    twice: MKL's matrix-vector path streams the weight at half the rate of its two-column GEMM
    there (18 against 9.5 ms). Either way the weight is read once a step, so on a CPU whose BLAS
    does both shapes well neither costs more. A small head (under ``HEAD_MM_MIN_ELEMENTS``
    weights) stays ``F.linear``: there the extra transposes cost more than the GEMM's shape saves.
    Elsewhere (GPU, bfloat16) ``F.linear``, unmeasured against the alternative."""
    cpu_fp32 = h.device.type == "cpu" and h.dtype == weight.dtype == torch.float32
    if not cpu_fp32 or weight.numel() < HEAD_MM_MIN_ELEMENTS:
        return F.linear(h, weight, bias)
    if h.shape[0] == 1:
        return head_logits(torch.cat([h, h]), weight, bias)[:1]
    logits = torch.mm(weight, h.t()).t()
    return logits if bias is None else logits + bias


def _layer_norm(x: Tensor, ln: nn.LayerNorm) -> Tensor:
    return F.layer_norm(x, ln.normalized_shape, ln.weight, ln.bias, ln.eps)


def _linear(x: Tensor, layer: nn.Linear) -> Tensor:
    return F.linear(x, layer.weight, layer.bias)


def _rms_norm(x: Tensor, norm: nn.Module) -> Tensor:
    """``LlamaRMSNorm`` / ``Qwen2RMSNorm``'s forward, op for op: the mean square in float32, the
    weight applied in the input's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon)
    return norm.weight * h.to(x.dtype)


class KVDecoder:
    """Decoding state for one batch: the prompt's keys and values, with room for
    ``max_new_tokens`` more, and the prompt's padding as a key mask.

    ``cache`` is the ``DynamicCache`` filled by the model's own forward over the left-padded
    prompt (the prefill, where the causal and padding masks matter most); decoding then continues
    one token per call in ``step``: a subclass's ``hidden`` appends ``token [B]`` at ``position
    [B]`` and returns the final hidden state ``[B, E]`` (after the last norm), and ``head_logits``
    turns it into the next-token logits ``[B, V]``. A subclass's ``accepts(lm)`` says whether its
    ``hidden`` computes exactly ``lm``'s forward (beyond the checks of ``_decoder_class``).
    """

    blocks: nn.ModuleList  # the decoder layers, one cache layer each; set by the subclass

    def __init__(self, lm: nn.Module, cache, attention_mask: Tensor, max_new_tokens: int):
        self.lm = lm
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
        # Which keys each row may attend to: not its left padding. None when no row is padded
        # (the model's own mask is None then too).
        self.key_mask = None
        if not bool(attention_mask.all()):
            self.key_mask = torch.ones(B, 1, 1, P + max_new_tokens, dtype=torch.bool, device=attention_mask.device)
            self.key_mask[:, 0, 0, :P] = attention_mask.bool()

    def step(self, token: Tensor, position: Tensor) -> Tensor:
        """Append ``token [B]`` at ``position [B]``; the next-token logits ``[B, V]``."""
        head = self.lm.lm_head
        return head_logits(self.hidden(token, position), head.weight, head.bias)

    def keep(self, rows: Tensor) -> None:
        """Keep the buffers of ``rows`` (indices into the batch) alone, in that order: rows that
        stopped sampling leave the batch, and later steps compute only the others."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        if self.key_mask is not None:
            self.key_mask = self.key_mask.index_select(0, rows)


class GPT2Decoder(KVDecoder):
    """``GPT2LMHeadModel``: learned positions, ``Conv1D`` layers (``addmm``), one fused q/k/v
    projection laid out ``[3, H, D]``."""

    def __init__(self, lm: nn.Module, cache, attention_mask: Tensor, max_new_tokens: int):
        self.blocks = lm.transformer.h
        super().__init__(lm, cache, attention_mask, max_new_tokens)

    @classmethod
    def accepts(cls, lm: nn.Module) -> bool:
        from transformers import GPT2LMHeadModel
        from transformers.pytorch_utils import Conv1D

        if model_class(lm) is not GPT2LMHeadModel:
            return False
        config = lm.config
        if config.add_cross_attention or getattr(config, "reorder_and_upcast_attn", False):
            return False
        if config._attn_implementation != "sdpa":  # eager attention rounds differently
            return False
        if not isinstance(lm.lm_head, nn.Linear):
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

    def hidden(self, token: Tensor, position: Tensor) -> Tensor:
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
        return _layer_norm(x, t.ln_f)


class RotaryDecoder(KVDecoder):
    """What the rotary families share: cos/sin from the model's own rotary module, rotation by its
    model file's ``apply_rotary_pos_emb`` (a partial rotary included), and attention through the
    very SDPA function the model's attention calls, with the mask it would build. That function
    also picks how grouped-query attention runs (``enable_gqa``, the query heads folded onto the
    key heads, or the keys repeated), differently across transformers versions: calling it keeps
    the hidden state bitwise equal to the forward's on each."""

    backbone_name: str  # the LM's attribute holding the layers, rotary embedding and final norm

    def __init__(self, lm: nn.Module, cache, attention_mask: Tensor, max_new_tokens: int):
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

        self.backbone = getattr(lm, self.backbone_name)
        self.blocks = self.backbone.layers
        super().__init__(lm, cache, attention_mask, max_new_tokens)
        self.rotate = sys.modules[model_class(lm).__module__].apply_rotary_pos_emb
        self.attention = ALL_ATTENTION_FUNCTIONS["sdpa"]

    @staticmethod
    def accepts_rotary_sdpa(lm: nn.Module, backbone: nn.Module, rotary_class: type) -> bool:
        """SDPA attention, a rotary embedding of one of ``ROTARY_TYPES``, a plain embedding and head
        (hub kernels are declined for every architecture: ``forward_swapped``)."""
        return (
            lm.config._attn_implementation == "sdpa"
            and type(backbone.rotary_emb) is rotary_class
            and backbone.rotary_emb.rope_type in ROTARY_TYPES
            and type(lm.get_input_embeddings()) is nn.Embedding
            and type(lm.lm_head) is nn.Linear
        )

    def attend(self, attn: nn.Module, q: Tensor, k: Tensor, v: Tensor, kb: Tensor, vb: Tensor, cos, sin) -> Tensor:
        """Rotate ``q [B, H, 1, D]`` and ``k [B, Hkv, 1, D]``, append ``k`` and ``v`` to the layer's
        buffers ``kb``, ``vb``, attend; returns the heads' outputs ``[B, H * D]``."""
        L = self.length
        q, k = self.rotate(q, k, cos, sin)
        kb[:, :, L : L + 1] = k
        vb[:, :, L : L + 1] = v
        mask = None if self.key_mask is None else self.key_mask[..., : L + 1]
        o, _ = self.attention(attn, q, kb[:, :, : L + 1], vb[:, :, : L + 1], mask, dropout=0.0, scaling=attn.scaling)
        return o.reshape(q.shape[0], -1)  # [B, 1, H, D] -> [B, H * D]


class LlamaDecoder(RotaryDecoder):
    """``LlamaForCausalLM`` and ``Qwen2ForCausalLM`` (Llama with q/k/v biases, and optional
    sliding-window layers, which are declined): pre-RMSNorm blocks, separate q/k/v projections
    (grouped-query: fewer key/value heads), a gated MLP."""

    backbone_name = "model"

    @classmethod
    def accepts(cls, lm: nn.Module) -> bool:
        from transformers import LlamaForCausalLM, Qwen2ForCausalLM

        lm_class = model_class(lm)
        if lm_class not in (LlamaForCausalLM, Qwen2ForCausalLM):
            return False
        # the model file's own classes: modeling_llama.Llama*, modeling_qwen2.Qwen2*
        file, name = sys.modules[lm_class.__module__], lm_class.__name__.removesuffix("ForCausalLM")
        Model, Layer, Attention, MLP, Norm, Rotary = (
            getattr(file, name + part)
            for part in ("Model", "DecoderLayer", "Attention", "MLP", "RMSNorm", "RotaryEmbedding")
        )
        config, backbone = lm.config, lm.model
        if type(backbone) is not Model or not cls.accepts_rotary_sdpa(lm, backbone, Rotary):
            return False
        if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
            return False  # sliding-window layers: another mask
        if len(backbone.layers) != config.num_hidden_layers or type(backbone.norm) is not Norm:
            return False  # the forward runs layers[:num_hidden_layers]
        return all(
            model_class(b) is Layer  # FSDP2 swaps a sharded block's class: see through it
            and type(b.self_attn) is Attention
            and not (lm.training and b.self_attn.attention_dropout > 0)  # the forward would drop weights
            and type(b.mlp) is MLP
            and type(b.input_layernorm) is Norm
            and type(b.post_attention_layernorm) is Norm
            and all(
                type(p) is nn.Linear
                for p in (b.self_attn.q_proj, b.self_attn.k_proj, b.self_attn.v_proj, b.self_attn.o_proj)
            )
            and all(type(p) is nn.Linear for p in (b.mlp.gate_proj, b.mlp.up_proj, b.mlp.down_proj))
            for b in backbone.layers
        )

    def hidden(self, token: Tensor, position: Tensor) -> Tensor:
        m = self.backbone
        x = F.embedding(token, m.embed_tokens.weight)  # [B, E]
        B = x.shape[0]
        cos, sin = m.rotary_emb(x, position[:, None])  # [B, 1, D]
        for block, kb, vb in zip(self.blocks, self.keys, self.values):
            attn, mlp = block.self_attn, block.mlp
            h = _rms_norm(x, block.input_layernorm)
            q = _linear(h, attn.q_proj).view(B, -1, 1, attn.head_dim)
            k = _linear(h, attn.k_proj).view(B, -1, 1, attn.head_dim)
            v = _linear(h, attn.v_proj).view(B, -1, 1, attn.head_dim)
            x = x + _linear(self.attend(attn, q, k, v, kb, vb, cos, sin), attn.o_proj)
            h = _rms_norm(x, block.post_attention_layernorm)
            x = x + _linear(mlp.act_fn(_linear(h, mlp.gate_proj)) * _linear(h, mlp.up_proj), mlp.down_proj)
        self.length += 1
        return _rms_norm(x, m.norm)


class GPTNeoXDecoder(RotaryDecoder):
    """``GPTNeoXForCausalLM``: layer norms, one fused projection laid out ``[H, 3 * D]`` (each
    head's q, k, v side by side), rotary on the first ``rotary_pct`` of each head's dimensions, and
    a parallel residual (attention and MLP both read the block's input) or a sequential one."""

    backbone_name = "gpt_neox"

    @classmethod
    def accepts(cls, lm: nn.Module) -> bool:
        from transformers import GPTNeoXForCausalLM
        from transformers.models.gpt_neox import modeling_gpt_neox as neox

        if model_class(lm) is not GPTNeoXForCausalLM:
            return False
        backbone = lm.gpt_neox
        if type(backbone) is not neox.GPTNeoXModel or type(backbone.final_layer_norm) is not nn.LayerNorm:
            return False
        if not cls.accepts_rotary_sdpa(lm, backbone, neox.GPTNeoXRotaryEmbedding):
            return False
        return all(
            model_class(b) is neox.GPTNeoXLayer
            and type(b.attention) is neox.GPTNeoXAttention
            and not (lm.training and b.attention.attention_dropout > 0)
            and type(b.mlp) is neox.GPTNeoXMLP
            and type(b.input_layernorm) is nn.LayerNorm
            and type(b.post_attention_layernorm) is nn.LayerNorm
            and all(
                type(p) is nn.Linear
                for p in (b.attention.query_key_value, b.attention.dense, b.mlp.dense_h_to_4h, b.mlp.dense_4h_to_h)
            )
            for b in backbone.layers
        )

    def hidden(self, token: Tensor, position: Tensor) -> Tensor:
        m = self.backbone
        x = F.embedding(token, m.embed_in.weight)  # [B, E]
        B = x.shape[0]
        cos, sin = m.rotary_emb(x, position[:, None])  # [B, 1, rotary dims]
        for block, kb, vb in zip(self.blocks, self.keys, self.values):
            attn = block.attention
            qkv = _linear(_layer_norm(x, block.input_layernorm), attn.query_key_value)
            q, k, v = qkv.view(B, -1, 1, 3 * attn.head_size).chunk(3, dim=-1)  # each [B, H, 1, D]
            a = _linear(self.attend(attn, q, k, v, kb, vb, cos, sin), attn.dense)
            if block.use_parallel_residual:  # the sums in the model's order: rounding differs otherwise
                x = _neox_mlp(block, x) + a + x
            else:
                a = a + x
                x = _neox_mlp(block, a) + a
        self.length += 1
        return _layer_norm(x, m.final_layer_norm)


def _neox_mlp(block: nn.Module, x: Tensor) -> Tensor:
    mlp = block.mlp
    h = _linear(_layer_norm(x, block.post_attention_layernorm), mlp.dense_h_to_4h)
    return _linear(mlp.act(h), mlp.dense_4h_to_h)
