"""``sampling``: how the policy samples its rollouts (temperature, top-k/p, min-p, stops)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ppo_lightning.config.schema import param


@dataclass
class SamplingConfig:
    """How responses are sampled: by the rollout, by reward normalisation's reference samples and
    by the recipes' evaluations alike (``generation.SamplingParams``, built once per run). Which
    engine samples is the ``generation`` group."""

    max_new_tokens: int = param(32, ge=1)
    """Response length limit (with an environment, each policy turn's); sampling stops early once
    every row has stopped. Also the constant ``ppo.loss_agg=seq_mean_token_sum_norm`` divides by
    (with an environment: ``env.max_turns`` times it, at most ``env.max_total_tokens``)."""
    temperature: float = param(1.0, gt=0, hint="logprobs divide by it")
    """Sampling temperature. Every log-probability (policy, reference, update ratio, entropy) is
    taken from logits / temperature; top-k/top-p truncation is not applied to them (as in TRL
    and OpenAI's RLHF code)."""
    top_k: int = param(0, ge=0, hint="0 turns it off")
    """Sample from the k most likely tokens (0 = off)."""
    top_p: float = param(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off); at least one token is always kept."""
    min_p: float = param(0.0, ge=0, lt=1, hint="0 turns it off")
    """Drop tokens whose probability is below ``min_p`` times the most likely token's (0 = off),
    after temperature, top-k and top-p (Hugging Face's order; vLLM applies it before top-k and
    top-p, so with those set the backends differ, and ``generation=vllm`` warns)."""
    stop_at_eos: bool = True
    """Stop a response at its first EOS (or stop token / string). False runs every response to
    ``max_new_tokens``, EOS an ordinary token, ``ppo.missing_eos_penalty`` ignored (benchmarks)."""
    stop_token_ids: List[int] = field(default_factory=list)
    """More token ids that end a response, as EOS does (kept, the last token of the response)."""
    stop_strings: List[str] = field(default_factory=list)
    """Strings that end a response, matched on the decoded text as Hugging Face's
    ``StopStringCriteria`` and vLLM's ``stop=`` match them: the response stops at the token that
    completes the string, however the tokenizer split it (that token is kept whole, with any text
    it holds after the string). A response that stops on one counts as ended for
    ``ppo.missing_eos_penalty``."""
    chunk_size: Optional[int] = param(None, ge=1)
    """Rows sampled at a time (null = the whole batch): bounds the KV cache,
    which grows with rows x (prompt + response) x layers x width. Greedy decoding gives the same
    tokens either way (test); a seeded sampling run draws different tokens with a different value."""
