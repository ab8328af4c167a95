"""``model`` (the policy), ``model.lora``, ``model.build_tiny`` and ``ref`` (the frozen reference)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional

from omegaconf import MISSING

from ppo_lightning.config import choices
from ppo_lightning.config.compat import LORA_DROPOUT_REMOVED
from ppo_lightning.config.schema import param


@dataclass
class TinyModelConfig:
    """A random causal LM over a byte vocabulary (256 bytes + EOS + pad), built offline (``models/tiny.py``)."""

    arch: str = param("gpt2", choices=choices.TINY_ARCHITECTURES)
    """Architecture: GPT-2, or Llama, Qwen2 and GPT-NeoX layouts of the same size."""

    n_layer: int = param(2, ge=1)
    """Transformer layers."""
    n_head: int = param(2, ge=1)
    """Attention heads."""
    n_embd: int = param(64, ge=1)
    """Hidden size."""
    n_positions: int = param(256, ge=1)
    """Context length (bounds ``data.max_prompt_length + sampling.max_new_tokens``)."""
    seed: int = 0
    """Init seed of the random weights."""


@dataclass
class LoRAConfig:
    """Low-rank adapters through ``peft`` (``pip install -e ".[lora]"``): the base weights stay
    frozen and only the adapters and the value head train. The reference is then the same network
    with its adapters switched off (no second copy of the weights); checkpoints hold the adapters,
    the value head and the optimizer; export writes the merged model plus ``adapter/``."""

    r: int = param(0, ge=0, hint="0 turns LoRA off: full fine-tuning")
    """Adapter rank; 0 = off (full fine-tuning). 8 to 64 are usual."""
    alpha: float = param(32.0, gt=0)
    """Scale of the adapters' update: ``W + (alpha / r) B A``."""
    dropout: Optional[Any] = field(default=None, metadata={"removed": LORA_DROPOUT_REMOVED})
    target_modules: Optional[List[str]] = None
    """Names of the layers to adapt (e.g. ``[q_proj,v_proj]``); null = every linear layer but
    the output head, per architecture (GPT-2: c_attn, c_proj, c_fc; Llama and Qwen2: q/k/v/o_proj,
    gate/up/down_proj; GPT-NeoX: query_key_value, dense, dense_h_to_4h, dense_4h_to_h)."""


@dataclass
class ModelConfig:
    """The policy: any Hugging Face causal LM, with a value head on its last hidden state. The
    frozen reference is a copy of the initial model."""

    name_or_path: str = MISSING
    """Hub id (``gpt2``) or a local directory written by ``save_pretrained``. Checked before
    anything loads: a directory is used as is, a path-like string that is not a directory fails,
    a hub id must be in the HF cache or the hub must answer within ~3 s. A path a recipe builds
    (``${recipe_dir:<name>}``) is checked after the job's recipe has built it.
    ``data.max_prompt_length + sampling.max_new_tokens`` must fit the model's context."""
    tokenizer_name_or_path: Optional[str] = None
    """Tokenizer source when it differs from ``name_or_path``. It pads on the left and must define
    EOS; a ``<|pad|>`` token is added (embeddings resized) when it has no pad or pad == EOS."""
    dtype: str = param("float32", choices=choices.DTYPES)
    """Weights dtype of the policy and reference (the value head stays float32). Mixed precision
    is ``trainer.precision``."""
    trust_remote_code: bool = False
    """Run model and tokenizer code shipped with the checkpoint. Off unless you trust its source."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (Hugging Face's, non-reentrant)
    instead of keeping them: the same gradients (test), less memory, slower updates. The policy's LM
    then stays in train mode (dropout is zeroed) and samples in eval mode (KV cache)."""
    value_head_path: Optional[str] = None
    """Directory holding ``value_head.safetensors`` (e.g. a previous ``export_dir``) to start the
    value head from (else zeros). The file must exist."""
    value_head_init: str = param("zeros", choices=choices.VALUE_HEAD_INITS)
    """zeros: V = 0 at the start (unless ``value_head_path``). reward_model: copy the reward
    model's linear score head, mapped by the reward normalisation (needs ``reward.kind=model`` and
    the same hidden size; meaningful when policy and reward model share a backbone)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (``LoRAConfig``); off unless ``model.lora.r > 0``."""
    build_tiny: Optional[TinyModelConfig] = None
    """If set, ``name_or_path`` is inside ``paths.cache_dir`` and holds no ``config.json`` yet:
    build a tiny random GPT-2 there first (``model=tiny``). An existing directory is reused as
    is, so changing ``build_tiny.*`` needs a new ``name_or_path``."""


@dataclass
class RefConfig:
    """The frozen reference, the anchor of the KL penalty. Its memory: one more copy of the
    policy's weights in ``ref.dtype`` (params x 4 bytes in float32, x 2 in bfloat16), none with
    LoRA (the policy with its adapters off is the reference)."""

    name_or_path: Optional[str] = None
    """null: the policy's initial weights (a copy made after loading ``model.name_or_path``; with
    LoRA, the policy itself with its adapters off). Else a hub id or ``save_pretrained`` directory
    over the policy's vocabulary, e.g. the SFT model when the policy starts from another checkpoint.
    Checked like ``model.name_or_path``."""
    dtype: Optional[str] = param(None, choices=choices.DTYPES)
    """Weights dtype of the reference; null = ``model.dtype``. ``bfloat16`` halves its memory; under
    ``trainer.precision=bf16-mixed`` its matmuls run in bf16 anyway, so only the rounding of its
    weights differs, but the first iteration's KL is then not exactly 0."""
