"""Response logprobs and entropy: from whole logits (``logprobs_from_logits``,
``entropy_from_logits``), or without the ``[batch, response, vocab]`` logits, the LM head in chunks.

An update needs, per response token, ``log pi(token)`` and the entropy of ``pi``. Computing them
from the LM's logits holds ``[B, R, V]`` float32 logits, their log-softmax and, for the backward,
the softmax: Qwen2's 151,936-entry vocabulary makes that 5 GB per tensor for 8 rows of 1,024
tokens. Here the LM head runs on ``chunk`` response positions at a time, each chunk under
activation checkpointing: the forward keeps only ``logp`` and ``entropy`` ``[B, R]`` (and each
chunk's input), and the backward recomputes one chunk's logits at a time. The numbers are those
of the plain path: the same operations (``F.linear``, the temperature, ``float()``, log-softmax)
on the same rows, so values and gradients agree to float32 rounding (tests/test_lean_head.py).

How: while the LM runs its own forward, its output-embedding module's ``forward`` is replaced by
one that returns ``(logp, entropy)`` stacked as ``[B, R, 2]`` in place of the logits. The head
runs where the LM calls it, so FSDP2's gathered weights are live there as they are for the plain
head, and the value head's pre-hook still catches the head's input. ``unsupported`` says when
this cannot be done (a head that is not a plain linear layer, logit soft-capping), and the
callers then take the plain path.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


def unsupported(lm: nn.Module) -> str | None:
    """Why ``lm``'s head cannot run in chunks here (None when it can)."""
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if type(head) is not nn.Linear:  # a LoRA-wrapped or custom head computes something else
        return f"its output embedding is a {type(head).__name__}, not a plain nn.Linear"
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    if getattr(config, "final_logit_softcapping", None):
        return "it soft-caps its logits (final_logit_softcapping)"
    return None


def _logp_and_entropy(hidden: Tensor, tokens: Tensor, weight: Tensor, bias: Tensor | None, temperature: float):
    """``log softmax(z)[token]`` and the entropy of ``softmax(z)``, ``z = (hidden W^T + b) / T``,
    in float32, with exactly the plain path's operations (``PPO._policy_forward``,
    ``logprobs_from_logits``, ``entropy_from_logits`` below)."""
    return logp_and_entropy_of_logits(F.linear(hidden, weight, bias), tokens, temperature)


def logp_and_entropy_of_logits(z: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """``_logp_and_entropy`` from the head's logits ``z``: divided by the temperature, in float32
    (also the first response position of ``shared_prompt``, whose logits come whole)."""
    if temperature != 1.0:
        z = z / temperature
    z = z.float()
    logp = torch.gather(F.log_softmax(z, dim=-1), -1, tokens.unsqueeze(-1)).squeeze(-1)
    entropy = torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(-1)
    return logp, entropy


def chunked_logp_and_entropy(
    hidden: Tensor, tokens: Tensor, head: nn.Linear, temperature: float, chunk: int, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """``(logp, entropy)`` ``[B, R]`` of ``tokens [B, R]`` under ``head`` applied to ``hidden
    [B, R, H]``, ``chunk`` positions at a time; with gradients, each chunk is checkpointed. With
    ``mask [B, R]``, only its positions are computed (the real response tokens: a batch's
    responses end at different lengths, and past its end a row is padding) and the rest are 0."""
    B, R, H = hidden.shape
    flat_h, flat_t = hidden.reshape(B * R, H), tokens.reshape(B * R)
    keep = None if mask is None else mask.reshape(B * R).nonzero().squeeze(1)
    if keep is not None and keep.numel() == B * R:
        keep = None  # every position is real: no gather, no scatter
    if keep is not None:
        flat_h, flat_t = flat_h[keep], flat_t[keep]
    grad = torch.is_grad_enabled()
    logps, entropies = [], []
    for s in range(0, flat_h.shape[0], chunk):
        args = (flat_h[s : s + chunk], flat_t[s : s + chunk], head.weight, head.bias, temperature)
        lp, ent = checkpoint(_logp_and_entropy, *args, use_reentrant=False) if grad else _logp_and_entropy(*args)
        logps.append(lp)
        entropies.append(ent)
    logp, entropy = _joined(logps, flat_h), _joined(entropies, flat_h)
    if keep is not None:
        zeros = logp.new_zeros(B * R)
        logp, entropy = zeros.scatter(0, keep, logp), zeros.scatter(0, keep, entropy)
    return logp.view(B, R), entropy.view(B, R)


def _joined(chunks: list[Tensor], like: Tensor) -> Tensor:
    """The chunks' values as one float32 vector (none: an empty one)."""
    if len(chunks) == 1:
        return chunks[0]
    return torch.cat(chunks) if chunks else like.new_zeros(0, dtype=torch.float32)


@contextmanager
def lean_head(lm: nn.Module, responses: Tensor, temperature: float, chunk: int, mask: Tensor | None = None):
    """While inside, ``lm``'s forward returns ``[B, R, 2]`` = ``(logp, entropy)`` of ``responses
    [B, R]`` in place of its logits (0 where ``mask``, the real response tokens, is 0). The LM
    must be called so that its head sees the positions that predict the responses as its input's
    last ``R + 1`` (``logits_to_keep=R + 1``, or the whole sequence): the last one predicts
    nothing and is dropped."""
    head = lm.get_output_embeddings()
    R = responses.shape[1]

    def forward(hidden: Tensor) -> Tensor:
        h = hidden[:, -(R + 1) : -1]
        return torch.stack(chunked_logp_and_entropy(h, responses, head, temperature, chunk, mask), dim=-1)

    head.forward = forward  # an instance attribute: nn.Module.__call__ (and its hooks) still run
    try:
        yield
    finally:
        del head.forward


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position: ``logsumexp(z) - sum p z``."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(-1)


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[token] at each position, in float32 for stability. [B, R, V] -> [B, R]"""
    logp = F.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, 2, tokens.unsqueeze(-1)).squeeze(-1)


def use_lean_head(lm: nn.Module, chunk: int | None) -> bool:
    """Whether to score responses with the lean head: a chunk size is set
    (``ppo.lm_head_chunk_size``) and ``lm``'s head allows it (``unsupported``)."""
    return bool(chunk) and unsupported(lm) is None


def head_outputs(
    out: Tensor, lean: bool, responses: Tensor, temperature: float, entropy: bool = True, entropy_grad: bool = True
) -> tuple[Tensor, Tensor | None]:
    """``(logprobs, entropy)`` ``[B, R]`` of ``responses`` from what the LM's head gave: the lean
    head's ``[B, R, 2]`` (``lean``), or the plain head's ``[B, R, V]`` logits of the response
    positions, divided by the sampling ``temperature`` ([N+] detail). ``entropy=False`` skips the
    plain path's entropy (None); ``entropy_grad=False`` keeps it out of the graph (a monitor: no
    softmax kept for the backward). The one place both paths are told apart, for the policy and
    the reference alike."""
    if lean:
        return out[..., 0], out[..., 1] if entropy else None
    logits = out / temperature if temperature != 1.0 else out
    ent = None
    if entropy:
        with torch.set_grad_enabled(torch.is_grad_enabled() and entropy_grad):
            ent = entropy_from_logits(logits.float())
    return logprobs_from_logits(logits, responses), ent
