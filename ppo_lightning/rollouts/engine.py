"""An engine backend's view of its own samples: the logprobs it reports of the tokens it drew
(``Generated.logprobs``) are of the distribution it sampled, truncation included, so the trainer's
side of the comparison (``rollout/engine_*``, ``ppo.engine_correction``) is the old policy's
logprobs under the same truncation: ``truncated_logprobs``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ppo_lightning.generation import SamplingParams
from ppo_lightning.generation.hf import sampling_probs
from ppo_lightning.models.signature import logits_to_keep
from ppo_lightning.rollouts.forward import pad_responses, row_chunks


TRUNCATED_LOGPROB_FLOOR = -30.0
"""``truncated_logprobs`` of a token outside the trainer's truncation (a tie at its boundary that
the engine broke the other way): a finite floor, so the mismatch metrics stay finite and the
token's correction weight is ~0."""


@torch.no_grad()
def truncated_logprobs(
    lm,
    query_responses: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    context_length: int,
    params: SamplingParams,
    chunk_size: int | None = None,
    remove_padding: bool = True,
    min_p_first: bool = False,
) -> Tensor:
    """Logprobs ``[B, R]`` of the response tokens under the distribution the sampler drew them
    from, truncation included: logits / temperature, then top-k, top-p and min-p as the ``hf``
    sampler applies them (``generation.hf.sampling_probs``; ``min_p_first``: in the engine's
    order, ``GenerationBackend.min_p_first``), renormalised over the tokens kept.

    An engine reports its logprobs of that distribution (vLLM's ``processed_logprobs``), and
    ``forward_logprobs`` gives the full softmax's: the two differ by the log of the mass the
    truncation keeps, whatever the engine's numerics. The engine's mismatch and its correction
    (``ppo.engine_correction``) compare these instead. One no-grad forward per chunk of
    ``chunk_size`` rows, each on its ``padding_window``; the truncation one position's ``[V]``
    row at a time per response column (``[rows, V]``)."""
    R = query_responses.shape[1] - context_length
    out = []
    for ids, mask, pos, P in row_chunks(
        query_responses, attention_mask, position_ids, context_length, chunk_size, remove_padding
    ):
        width = ids.shape[1] - P
        logits = lm(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **logits_to_keep(lm, width + 1)
        ).logits[:, -(width + 1) : -1]
        logp = torch.empty(ids.shape[0], width, device=ids.device)
        for t in range(width):
            z = logits[:, t]
            probs = sampling_probs(z, params.temperature, params.top_k, params.top_p, params.min_p, min_p_first)
            picked = probs.gather(-1, ids[:, P + t, None]).squeeze(-1)
            logp[:, t] = (picked / probs.sum(-1)).log().clamp(min=TRUNCATED_LOGPROB_FLOOR)
        out.append(pad_responses(logp, R))
    return torch.cat(out)
