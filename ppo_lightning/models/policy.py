"""The policy (a Hugging Face causal LM with a value head), the frozen reference, load and save.

One forward of ``PolicyWithValueHead`` gives both the next-token logits and a scalar value per
position: the value head is a linear layer on the LM's final hidden states, sharing the backbone
(the tutorial's design: the PPO tutorial this project started from,
FareedKhan-dev/train-llm-from-scratch, ``src/post_training/ppo.py``; cheaper than TRL's separate
value model). Its output starts at exactly zero, so the first value loss is the raw return scale
and the critic cannot mislead the first update.
"""

from __future__ import annotations

import copy
import functools
import os
import socket
from pathlib import Path
from urllib.parse import urlparse

import torch
import torch.nn.functional as F
from torch import nn

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.models.lean_head import head_outputs, use_lean_head
from ppo_lightning.models.shared_prompt import prompt_groups, response_outputs

VALUE_HEAD_FILE = "value_head.safetensors"
DEFAULT_PAD_TOKEN = "<|pad|>"

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}  # choices.DTYPES


# ----------------------------------------------------------------------------- model sources
def resolve_source(name_or_path: str, key: str) -> str:
    """Check that ``name_or_path`` can be loaded, failing fast with a message naming ``key``.

    A local directory is used as is, if ``save_pretrained`` wrote it (a ``config.json``, or a
    tokenizer's ``tokenizer_config.json``). Anything else is a hub id: it works if it is in the
    local HF cache or the hub answers within a few seconds. Without this check ``from_pretrained``
    retries for half a minute and ends in a long traceback.
    """
    expanded = os.path.expanduser(str(name_or_path))
    if os.path.isdir(expanded):
        if not any(os.path.isfile(os.path.join(expanded, f)) for f in ("config.json", "tokenizer_config.json")):
            raise ConfigError(
                f"{key}={name_or_path!r}: the directory holds no config.json, so it is no model written by "
                f"save_pretrained. Point {key} at one (config.json, weights, tokenizer files), or at a hub id."
            )
        return expanded
    # Hub ids are "name" or "org/name"; anything else that is not a directory is a bad path.
    first = expanded.split("/")[0]
    looks_like_path = (
        str(name_or_path).startswith((".", "/", "~"))
        or expanded.count("/") > 1
        or ("/" in expanded and os.path.isdir(first))
    )
    if looks_like_path:
        raise ConfigError(
            f"{key}={name_or_path!r}: no such directory. Point {key} at a directory written by "
            "save_pretrained (config.json, weights, tokenizer files), or at a Hugging Face hub id."
        )
    if _in_hf_cache(expanded):
        return expanded
    if not _hub_reachable():
        raise ConfigError(
            f"{key}={name_or_path!r} is not a local directory and the Hugging Face hub cannot be "
            "reached from this machine (and the model is not in the local HF cache). Point "
            f"{key} at a local directory holding the model (one written by save_pretrained, e.g. "
            f"{key}=/path/to/{expanded.split('/')[-1]}), or use model=tiny to build a small "
            "GPT-2-architecture model offline."
        )
    return expanded


def _in_hf_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:
        return False


@functools.lru_cache(maxsize=1)
def _hub_reachable(timeout: float = 3.0) -> bool:
    if os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes"):
        return False
    try:
        from huggingface_hub import constants

        endpoint = urlparse(constants.ENDPOINT)
        host, port = endpoint.hostname, endpoint.port or (443 if endpoint.scheme == "https" else 80)
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except (OSError, ImportError):
        return False


# ----------------------------------------------------------------------------- tokenizer
def load_tokenizer(name_or_path: str, key: str = "model.name_or_path", trust_remote_code: bool = False):
    """Left-padding tokenizer with an EOS token and a pad token distinct from EOS.

    A pad equal to EOS would make EOS indistinguishable from padding ([N+] detail), so a new
    ``<|pad|>`` token is added when the tokenizer has no pad or reuses EOS; the caller must then
    resize the embeddings (``PolicyWithValueHead`` loaders do).
    """
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        resolve_source(name_or_path, key), padding_side="left", trust_remote_code=trust_remote_code
    )
    if tokenizer.eos_token_id is None:
        raise ConfigError(
            f"{key}={name_or_path!r}: the tokenizer has no EOS token, so responses cannot end. "
            "Use a tokenizer that defines eos_token (tokenizer.eos_token = ...; save_pretrained)."
        )
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        tokenizer.add_special_tokens({"pad_token": DEFAULT_PAD_TOKEN})
    return tokenizer


# ----------------------------------------------------------------------------- the policy
def disable_dropout(model: nn.Module) -> None:
    """Dropout off everywhere: logprobs must be a deterministic function of the weights, or the
    PPO ratio is not 1 at the start of an update ([N+] "disable dropout")."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0
    config = getattr(model, "config", None)
    if config is not None:
        for name, value in list(vars(config).items()):
            if isinstance(value, float) and ("dropout" in name or name.endswith("pdrop")):
                setattr(config, name, 0.0)


def fuse_activations(model: nn.Module) -> int:
    """Run GPT-2's ``gelu_new`` as one fused kernel; returns how many modules were swapped.

    ``gelu_new`` (``NewGELUActivation``: GPT-2, GPT-J, CodeGen, ...) is the tanh approximation
    0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) written as ~8 elementwise ops, each a kernel launch
    forward and more backward. ``nn.GELU(approximate="tanh")`` is the same formula in one kernel
    (outputs agree to ~2e-7): on the 2-layer benchmark model it makes a forward+backward ~15%
    faster. Only the module changes; the config, and so every saved or exported checkpoint, still
    says ``gelu_new``.
    """
    from transformers.activations import NewGELUActivation

    swapped = 0
    for parent in model.modules():
        for name, child in list(parent.named_children()):
            if type(child) is NewGELUActivation:
                setattr(parent, name, nn.GELU(approximate="tanh"))
                swapped += 1
    return swapped


def load_causal_lm(
    name_or_path: str,
    tokenizer,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    key: str = "model.name_or_path",
):
    from transformers import AutoModelForCausalLM

    source = resolve_source(name_or_path, key)
    model = AutoModelForCausalLM.from_pretrained(source, dtype=TORCH_DTYPES[dtype], trust_remote_code=trust_remote_code)
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    disable_dropout(model)
    fuse_activations(model)
    return model


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Hugging Face's per-layer activation (gradient) checkpointing, non-reentrant.

    transformers >= 5.24 names it ``activation_checkpointing_enable`` (the old name warns)."""
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _keep_head_input(module: nn.Module, args: tuple) -> None:
    """Forward pre-hook on the LM head: keep its input (the final hidden state) on the module.
    A plain function, so ``copy.deepcopy`` of the LM (the reference) copies no policy with it."""
    if getattr(module, "catch_input", False):  # only inside PolicyWithValueHead.forward
        module.head_input = args[0]


class PolicyWithValueHead(nn.Module):
    """A causal LM and a value head on its last hidden state; one forward gives both."""

    def __init__(self, lm: nn.Module, peft_model=None, value_head: bool = True):
        """``peft_model``: the ``peft`` model wrapping ``lm`` when LoRA adapters were injected into
        it (``lora.apply_lora``); kept outside the module tree, since its weights are ``lm``'s.
        ``value_head=False`` (the critic-free estimators): no value head; values are None."""
        super().__init__()
        self.lm = lm
        self.__dict__["peft_model"] = peft_model
        hidden = lm.config.get_text_config().hidden_size
        self.v_head: nn.Linear | None = None
        if value_head:
            # Kept in float32 whatever the LM's dtype: the value is a regression target.
            self.v_head = nn.Linear(hidden, 1, dtype=torch.float32)
            nn.init.zeros_(self.v_head.weight)  # V(s) = 0 at the start ([N+] value head init)
            nn.init.zeros_(self.v_head.bias)
        # The value head reads the LM head's input: the final (normed) hidden state, at exactly
        # the positions the LM head runs on. Caught by a pre-hook, which is ~7% cheaper than
        # output_hidden_states=True (every layer's states kept); that is the fallback.
        head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") and value_head else None
        self._hooked = isinstance(head, nn.Module)
        if self._hooked:
            head.register_forward_pre_hook(_keep_head_input)

    @property
    def config(self):
        return self.lm.config

    @property
    def checkpointing(self) -> bool:
        """Whether the LM recomputes its layers' activations in the backward pass."""
        return any(getattr(m, "gradient_checkpointing", False) is True for m in self.lm.modules())

    def enable_gradient_checkpointing(self) -> None:
        """Recompute each decoder block's activations in the backward pass instead of keeping
        them: activation memory grows with the number of blocks' inputs, not their internals.

        Hugging Face checkpoints only while the LM is in train mode, so it stays there (dropout is
        zeroed, so train mode changes no number); ``generation.hf.generate`` switches it to eval while it
        samples, where the KV cache needs ``use_cache``. Non-reentrant checkpointing: it needs no
        input that requires grad, and works under ``no_grad``.
        """
        if not getattr(self.lm, "supports_gradient_checkpointing", False):
            raise ConfigError(
                f"model.gradient_checkpointing=true: {type(self.lm).__name__} does not support gradient checkpointing"
            )
        enable_activation_checkpointing(self.lm)
        self.lm.train()

    def train(self, mode: bool = True):
        """Lightning sets train mode on fit; the LM keeps eval mode unless it checkpoints."""
        super().train(mode)
        if not self.checkpointing:
            self.lm.eval()
        return self

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        context_length: int,
        lean: tuple[torch.Tensor, float, int, torch.Tensor] | None = None,
        shared: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits and values at the positions that predict response tokens (values None without
        a value head).

        ``input_ids`` is ``[B, T]`` = left-padded prompt (``context_length`` = P) + response (R).
        Position ``t`` predicts token ``t + 1``, so the response is scored by positions
        ``P-1 .. T-2``. Returns ``logits [B, R, V]`` (raw; divide by temperature for logprobs)
        and ``values [B, R]`` (V of the state before each response token). With ``lean =
        (responses, temperature, chunk, mask)`` the head runs in chunks on ``mask``'s positions
        (``lean_head``) and the first tensor is ``[B, R, 2]``: the responses' tempered logprobs
        and entropies. ``shared``: rows that hold the same prompt encode it once
        (``shared_prompt``; the same numbers). One dispatch for the policy and the reference:
        ``shared_prompt.response_outputs``.
        """
        R = input_ids.shape[1] - context_length
        head = self.lm.get_output_embeddings() if self._hooked and self.v_head is not None else None
        groups = None
        if shared and R > 1 and (self.v_head is None or head is not None):
            groups = prompt_groups(input_ids, attention_mask, context_length)
        if head is not None:
            head.catch_input, head.head_input = True, None
        try:
            args = (input_ids, attention_mask, position_ids, context_length, groups, lean, head)
            logits, hidden = response_outputs(self.lm, *args, hidden=self.v_head is not None)
        finally:
            if head is not None:
                head.catch_input, head.head_input = False, None  # do not hold the graph past this call
        if self.v_head is None:  # no critic: the LM alone
            return logits, None
        # The value is a regression target: computed in float32 whatever the LM's precision. Autocast
        # would run the linear layer in bf16 even on float32 inputs, and bf16-true stores it in bf16.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            values = F.linear(hidden.float(), self.v_head.weight.float(), self.v_head.bias.float()).squeeze(-1)
        return logits, values  # [B, R, V], [B, R]

    def score_responses(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        context_length: int,
        temperature: float,
        chunk: int | None = None,
        entropy_grad: bool = True,
        shared: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(logprobs, entropy, values)`` ``[B, R]`` of the response tokens ``input_ids[:,
        context_length:]`` under the policy at ``temperature`` (values None without a value head).

        ``chunk``: the lean LM head (``lean_head``), this many response positions at a time, when
        the LM's head allows it (``lean_head.unsupported``); else, and with None, the plain head's
        ``[B, R, V]`` logits. ``entropy_grad=False`` keeps the plain path's entropy out of the
        graph (a monitor: no softmax kept for the backward); the lean path's costs nothing extra.
        ``shared``: each distinct prompt encoded once (``shared_prompt``).
        """
        responses = input_ids[:, context_length:]
        real = attention_mask[:, context_length:]  # the lean head computes these positions only
        lean = (responses, temperature, chunk, real) if use_lean_head(self.lm, chunk) else None
        out, values = self(input_ids, attention_mask, position_ids, context_length, lean, shared)
        logprobs, entropy = head_outputs(out, lean is not None, responses, temperature, entropy_grad=entropy_grad)
        return logprobs, entropy, values


def make_reference(lm: nn.Module, dtype: str | None = None) -> nn.Module:
    """A frozen copy of the initial policy LM, in ``dtype`` (default: the LM's): the anchor of the
    KL penalty."""
    ref = copy.deepcopy(lm)
    head = ref.get_output_embeddings() if hasattr(ref, "get_output_embeddings") else None
    if isinstance(head, nn.Module):  # the policy's value-head hook came along with the copy
        head._forward_pre_hooks.clear()
    if dtype is not None:
        ref.to(TORCH_DTYPES[dtype])
    return freeze(ref)


def freeze(lm: nn.Module) -> nn.Module:
    """No gradients, eval mode, dropout off: a reference or reward model."""
    lm.requires_grad_(False)
    lm.eval()
    disable_dropout(lm)
    return lm


def context_length(config) -> int | None:
    """The position limit of a model config (None when it has none, e.g. rotary models)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        if isinstance(getattr(c, name, None), int):
            return getattr(c, name)
    return None


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: the first real token is position 0 ([N+] detail)."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


# ----------------------------------------------------------------------------- save / load
def save_policy(policy: PolicyWithValueHead, tokenizer, directory: str | os.PathLike, write: bool = True) -> Path:
    """An HF directory (safetensors + tokenizer + generation config) that plain
    ``AutoModelForCausalLM.from_pretrained`` loads, with the value head beside it (if it has one).

    A LoRA policy is written merged (adapters folded into the base weights), plus its adapters
    alone under ``adapter/``. A sharded (FSDP) policy is gathered first: every rank must call
    this, and only ranks with ``write`` (rank 0) write."""
    from safetensors.torch import save_file

    from ppo_lightning.models.weights import drop_tied_aliases, full_state_dict, is_sharded

    directory = Path(directory)
    lm_state = None  # the LM's own state dict
    if is_sharded(policy):
        whole = drop_tied_aliases(policy, full_state_dict(policy))  # a collective; tied weights once
        lm_state = {k.removeprefix("lm."): v for k, v in whole.items() if k.startswith("lm.")}
        v_state = {k.removeprefix("v_head."): v for k, v in whole.items() if k.startswith("v_head.")}
    else:
        v_state = policy.v_head.state_dict() if policy.v_head is not None else {}
    if not write:
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    if policy.peft_model is not None:
        from ppo_lightning.models.lora import ADAPTER_DIR, merged_state_dict, save_adapter

        policy.lm.save_pretrained(directory, state_dict=merged_state_dict(policy.lm, lm_state), safe_serialization=True)
        save_adapter(policy.peft_model, directory / ADAPTER_DIR, lm_state)
    else:
        policy.lm.save_pretrained(directory, state_dict=lm_state, safe_serialization=True)
    tokenizer.save_pretrained(directory)
    if v_state:  # none for the critic-free estimators
        save_file({k: v.detach().cpu().contiguous() for k, v in v_state.items()}, str(directory / VALUE_HEAD_FILE))
    return directory


def load_value_head(policy: PolicyWithValueHead, directory: str | os.PathLike) -> bool:
    """Load ``value_head.safetensors`` from ``directory`` if present; returns whether it did."""
    from safetensors.torch import load_file

    path = Path(directory) / VALUE_HEAD_FILE
    if not path.exists():
        return False
    policy.v_head.load_state_dict(load_file(str(path)))
    return True
