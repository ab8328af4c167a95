"""Each prompt once per group (``ppo.shared_prompt_forward``): one forward of the distinct
prompts, whose keys and values the responses then attend to.

With ``ppo.num_generations = n`` a rollout holds every prompt ``n`` times, and a scoring forward
over ``[B, P + R]`` computes each prompt's ``P`` positions ``n`` times over: the same numbers,
since a prompt's positions attend only to the prompt. Here the LM runs twice instead:

1. on the distinct prompts ``[U, P]`` (``prompt_groups``), keeping their KV cache and the logits
   of the last prompt position (which predict each row's first response token);
2. on the responses ``[B, R]``, each row attending to its prompt's cached keys and values
   (the cache indexed by row: ``Cache.batch_select_indices``) and to its own response.

Every real position gets the logits (and final hidden state) of the one-pass forward, to float32
rounding (tests/test_shared_prompt.py). The gradients are exact too: indexing the cache by row
is a gather, whose backward sums the group's ``n`` gradients into its prompt's keys and values,
which is the repeated-prompt path's sum over the ``n`` copies.

What it saves: ``(n - 1) / n`` of the prompt positions' work, in the rollout's scoring forwards
(old policy, reference) and in every update's forward and backward. The rows of one forward must
hold whole groups for it to pay: minibatches then draw whole groups (``algo.algorithm``).

Scope: the architectures in ``MODEL_TYPES`` (tested each); any other runs the one-pass forward,
with a warning. Not under gradient checkpointing: Hugging Face returns no cache from a
checkpointed forward (``config.rules``).
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
from torch import Tensor, nn

from ppo_lightning.models.lean_head import lean_head, logp_and_entropy_of_logits
from ppo_lightning.models.signature import cache_kwarg, logits_to_keep

AUTO_MIN_PROMPT_TOKENS = 16
"""``ppo.shared_prompt_forward=auto`` encodes each prompt once in a forward whose prompt columns
are at least this many; below, each row encodes its own. The shared forward is two model calls
instead of one, and a short prompt saves less than the second call's fixed cost: on the ``tiny``
workload (8-token prompts, 4 completions each, a 2-layer model) sharing ran GRPO at about 0.8x
the one-call forward, on ``small`` (32-token prompts, 6 layers of 384) at about 1.2x
(``python -m benchmarks.throughput --workload tiny|small --trainer grpo --override
ppo.shared_prompt_forward=true|false``). ``true`` shares at any width."""

MODEL_TYPES = frozenset({"gpt2", "llama", "qwen2", "gpt_neox"})
"""``config.model_type`` of the architectures whose forward continues exactly from a cache of
another batch's prompts, each tested against its one-pass forward."""


def unsupported(lm: nn.Module) -> str | None:
    """Why ``lm`` cannot encode prompts once per group (None when it can)."""
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        return f"{type(lm).__name__} (model_type {model_type!r}) is not one of {sorted(MODEL_TYPES)}"
    return None


def prompt_groups(input_ids: Tensor, attention_mask: Tensor, context_length: int) -> tuple[Tensor, Tensor] | None:
    """``(first, inverse)``: the first row holding each distinct prompt ``[U]`` and each row's
    prompt among them ``[B]`` (prompt tokens and padding alike); None when no prompt repeats."""
    prompts = torch.cat([input_ids[:, :context_length], attention_mask[:, :context_length].to(input_ids)], 1)
    distinct, inverse = torch.unique(prompts, dim=0, return_inverse=True)
    B, U = prompts.shape[0], distinct.shape[0]
    if U == B:
        return None
    rows = torch.arange(B, device=input_ids.device)
    first = torch.full((U,), B, device=input_ids.device).scatter_reduce(0, inverse, rows, reduce="amin")
    return first, inverse


def _caught(head: nn.Module | None) -> Tensor | None:
    """The LM head's input from the last call (``policy._keep_head_input``), released."""
    if head is None:
        return None
    hidden, head.head_input = head.head_input, None
    return hidden


def shared_prompt_forward(
    lm: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    context_length: int,
    groups: tuple[Tensor, Tensor],
    lean: tuple[float, int, Tensor | None] | None = None,
    head: nn.Module | None = None,
) -> tuple[Tensor, Tensor | None]:
    """The LM head's output at the ``R`` positions that predict the response tokens
    ``input_ids[:, context_length:]``: ``[B, R, V]`` logits, or with ``lean = (temperature,
    chunk, mask)`` the lean head's ``[B, R, 2]`` tempered logprobs and entropies; and, when ``head``
    catches its input (the value head's hook), the final hidden states there ``[B, R, H]``. The
    lean head's ``(temperature, chunk, mask)`` computes ``mask``'s positions only (None: all).
    ``groups``: ``prompt_groups`` of the rows. Needs ``R >= 2``."""
    from transformers import DynamicCache

    first, inverse = groups
    P, R = context_length, input_ids.shape[1] - context_length
    cache, cache_kw = DynamicCache(config=lm.config), cache_kwarg(lm)
    z0 = lm(
        input_ids=input_ids[first, :P],
        attention_mask=attention_mask[first, :P],
        position_ids=position_ids[first, :P],
        use_cache=True,
        **{cache_kw: cache},
        **logits_to_keep(lm, 1),
    ).logits[:, -1:][inverse]  # [B, 1, V]: each row's first response token
    h0 = _caught(head)
    cache.batch_select_indices(inverse)  # each row its prompt's keys and values; the backward sums a group's
    responses = input_ids[:, P:]
    rest_lean = None if lean is None else (lean[0], lean[1], None if lean[2] is None else lean[2][:, 1:])
    with lean_head(lm, responses[:, 1:], *rest_lean) if lean is not None else nullcontext():
        rest = lm(
            input_ids=responses,
            attention_mask=attention_mask,
            position_ids=position_ids[:, P:],
            use_cache=True,
            **{cache_kw: cache},
            **logits_to_keep(lm, R),
        ).logits
    hidden = _caught(head)
    if lean is not None:  # the first position's logprob and entropy, as the lean head computes them
        temperature = lean[0]
        out = torch.cat([torch.stack(logp_and_entropy_of_logits(z0, responses[:, :1], temperature), -1), rest], 1)
    else:
        out = torch.cat([z0, rest[:, -R:-1]], 1)
    if hidden is not None:
        hidden = torch.cat([h0[:, -1:][inverse], hidden[:, -R:-1]], 1)
    return out, hidden


def response_outputs(
    lm: nn.Module,
    input_ids: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    context_length: int,
    groups: tuple[Tensor, Tensor] | None = None,
    lean: tuple[Tensor, float, int, Tensor | None] | None = None,
    head: nn.Module | None = None,
    hidden: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """The LM's outputs at the ``R`` positions that predict the response tokens
    ``input_ids[:, context_length:]``, for the policy and the reference alike: ``[B, R, V]``
    logits, or with ``lean = (responses, temperature, chunk, mask)`` the lean head's ``[B, R, 2]``
    tempered logprobs and entropies; and with ``hidden`` the final hidden states there
    ``[B, R, H]`` (``head``'s caught input where it catches, else the model's last hidden
    states), else None. ``groups`` (``prompt_groups``, ``R >= 2``): each prompt encoded once
    (``shared_prompt_forward``, the same numbers; ``hidden`` then needs ``head``). Otherwise one
    call over the whole ``[B, T]``, its head on the last ``R + 1`` positions where the model
    takes ``logits_to_keep``."""
    if groups is not None:
        return shared_prompt_forward(
            lm, input_ids, attention_mask, position_ids, context_length, groups, lean[1:] if lean else None, head
        )
    R = input_ids.shape[1] - context_length
    with lean_head(lm, *lean) if lean is not None else nullcontext():
        out = lm(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            output_hidden_states=hidden and head is None,
            use_cache=False,
            **logits_to_keep(lm, R + 1),
        )
    logits = out.logits if lean is not None else out.logits[:, -(R + 1) : -1]  # [B, R, V] (or [B, R, 2])
    if not hidden:
        return logits, None
    states = head.head_input if head is not None else out.hidden_states[-1]
    return logits, states[:, -(R + 1) : -1]  # [B, R, H]: the states before each response token
