"""The ``hf`` generation backend: batched KV-cache sampling of a live Hugging Face causal LM.

``HFBackend`` samples the module itself (the policy, or the reference), so it has no weights of
its own to sync. The sampling loop (``generate``) runs the prompt through the model's forward,
then one token at a time through the model's forward or, for an exact GPT-2, Llama, Qwen2 or
GPT-NeoX, the lean step of ``fast_decode.py``; temperature, top-k, top-p and min-p shape the
draw; a row stops at EOS, at a stop token, or at the token that completes a stop string, and
everything after the first stop is masked (``stops.py``: stop strings are matched on the decoded text). Callers go through ``HFBackend.generate`` with a ``SamplingParams``; ``generate`` itself
is the low-level function its tests and the sampler benchmarks call.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_lightning.generation.fast_decode import decoder_for
from ppo_lightning.generation.params import SamplingParams
from ppo_lightning.generation.stops import StopChecker
from ppo_lightning.models.policy import position_ids_from_mask
from ppo_lightning.models.signature import cache_kwarg, logits_to_keep
from ppo_lightning.models.weights import is_sharded


class HFBackend:
    """Samples ``lm`` (a live ``transformers`` causal LM, LoRA-wrapped or FSDP-sharded alike) with
    the tokenizer's EOS and pad ids. ``fast_decode``: an exact GPT-2, Llama, Qwen2 or GPT-NeoX
    decodes with the lean step (``generation.fast_decode``; the same logits, about half the
    per-token overhead)."""

    samples_live_module = True

    def __init__(self, lm: nn.Module, tokenizer, fast_decode: bool = True):
        self.lm, self.fast_decode, self.tokenizer = lm, fast_decode, tokenizer
        self.sampled_logprobs = None  # the logprobs PPO uses are the training forward's
        self.eos_token_id, self.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id

    def generate(
        self,
        prompt_ids: Tensor,
        attention_mask: Tensor,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """``(responses [B, R], response_mask [B, R])`` for left-padded ``prompt_ids [B, P]``."""
        return generate(
            self.lm,
            prompt_ids,
            attention_mask,
            params,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            generator=generator,
            fast_decode=self.fast_decode,
            tokenizer=self.tokenizer,
        )

    def sync_weights(self) -> None:
        """Nothing to do: this backend samples the module the optimizer updates."""

    def close(self) -> None:
        """Nothing to free: the module is the policy's."""


def sample_next_token(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    min_p: float = 0.0,
) -> Tensor:
    """Sample one token per row from ``logits [B, V]`` after temperature, top-k, top-p and min-p
    (``sampling_probs``)."""
    if greedy:
        return logits.argmax(-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
    # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a draw from p (each p_i / E_i is
    # the inverse of an Exp(p_i) arrival time; the first arrival is i with probability p_i).
    # -log(U) with U ~ U[0, 1) is Exp(1); U = 0 gives +inf, so that token cannot win. Same
    # distribution as torch.multinomial, ~3x cheaper per decode step on CPU.
    race = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype)
    return probs.div_(race.log_().neg_()).argmax(-1)


def sampling_probs(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    min_p_first: bool = False,
) -> Tensor:
    """The distribution each token is drawn from ``[B, V]``: ``logits`` after temperature, top-k,
    top-p and min-p, in Hugging Face's order of logits processors (``generate``'s
    ``_get_logits_processor``), float32; min-p's probabilities are not renormalised (the draw
    does not need it). ``min_p_first``: min-p before top-k and top-p, vLLM's order (its sampler
    applies the argmax-invariant processors first); the two differ only with top-p and min-p
    both set, where min-p first leaves top-p a renormalised distribution to count mass in."""
    logits = logits.float()
    if temperature != 1.0:  # x / 1.0 is x: skip the kernel
        logits = logits / temperature
    if min_p_first and min_p > 0.0:
        probs = torch.softmax(logits, dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), float("-inf"))
        min_p = 0.0
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass of the tokens before it already reaches top_p (keeps >= 1)
        drop = (probs.cumsum(-1) - probs) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = torch.softmax(logits, dim=-1)
    if min_p > 0.0:  # HF's MinPLogitsWarper: below min_p x the top probability (the top token stays)
        probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0.0)
    return probs


def generate(
    lm,
    input_ids: Tensor,
    attention_mask: Tensor,
    params: SamplingParams | None = None,
    *,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    fast_decode: bool = True,
    tokenizer=None,
    **sampling,
) -> tuple[Tensor, Tensor]:
    """Sample responses to left-padded prompts with a KV cache, as ``params`` say (or a
    ``SamplingParams(**sampling)`` built from keywords, for a direct call).

    Returns ``responses [B, R]`` (pad after the first stop, ``R <= max_new_tokens``: the loop
    stops once every row has stopped) and ``response_mask [B, R]`` (1 up to and including the
    stop). A row stops at EOS, at one of ``stop_token_ids``, or at the token that completes one of
    ``stop_strings`` in the decoded text (``tokenizer`` decodes; ``stops.StopChecker``). With
    ``stop_at_eos=False`` every row runs to ``max_new_tokens`` and neither stops it (benchmarks
    use this for a fixed workload).

    The prompt goes through the model's own forward (the prefill). Each further token goes through
    it too, or, with ``fast_decode`` on a model ``fast_decode.decoder_for`` accepts (GPT-2,
    Llama, Qwen2, GPT-NeoX), through a lean step with the same logits and about half the
    per-token overhead.

    ``chunk_size`` rows are sampled at a time (null: the whole batch): the KV cache, which grows
    with rows x (prompt + response) x layers x width, is then a chunk's. Chunks that stop early
    are padded to the longest chunk's length. Each row's tokens have the same distribution either
    way (greedy decoding gives the same tokens, a test), but the random stream is drawn in a
    different order, so a seeded run samples different tokens with a different chunk size.

    The loop runs as ``_sampling_mode`` says; its outputs become ordinary tensors (``_joined``),
    since the training step feeds them back through autograd.
    """
    params = params or SamplingParams(**sampling)
    B = input_ids.shape[0]
    chunk_size = params.chunk_size or B
    with _sampling_mode(lm):
        parts = [
            _sample_loop(
                lm,
                input_ids[s : s + chunk_size],
                attention_mask[s : s + chunk_size],
                params.rows(slice(s, s + chunk_size)),
                eos_token_id,
                pad_token_id,
                generator,
                fast_decode,
                tokenizer,
            )
            for s in range(0, B, chunk_size)
        ]
    return _joined(parts, pad_token_id)


def _joined(parts: list[tuple[Tensor, Tensor]], pad_token_id: int) -> tuple[Tensor, Tensor]:
    """The chunks' ``(responses, response_mask)`` as one batch, each padded to the longest, in
    ordinary tensors (a lone chunk's cloned out of ``inference_mode``; ``torch.cat`` makes new ones)."""
    if len(parts) == 1:
        responses, response_mask = parts[0]
        return responses.clone(), response_mask.clone()
    R = max(r.shape[1] for r, _ in parts)
    responses = torch.cat([F.pad(r, (0, R - r.shape[1]), value=pad_token_id) for r, _ in parts])
    response_mask = torch.cat([F.pad(m, (0, R - m.shape[1]), value=0.0) for _, m in parts])
    return responses, response_mask


@contextmanager
def _sampling_mode(lm):
    """Eval mode for the loop (a checkpointing policy stays in train mode, where Hugging Face turns
    the KV cache off; dropout is 0 anyway), the LM's own mode restored after, under
    ``inference_mode`` (~10% faster per step than ``no_grad``). A sharded LM (FSDP2) samples
    under ``no_grad``: its all-gather buffers, allocated on the first forward, are written in
    place again by every later one, in or out of the loop."""
    was_training = lm.training
    lm.eval()
    try:
        with torch.no_grad() if is_sharded(lm) else torch.inference_mode():
            yield
    finally:
        lm.train(was_training)


def _prefill(lm, input_ids: Tensor, attention_mask: Tensor, max_new_tokens: int, fast_decode: bool):
    """The prompt's forward into a fresh KV cache: ``(logits [B, V] of the first response token,
    next_pos [B, 1], step)``, where ``step(token, t, next_pos)`` feeds token ``t`` and gives the
    next logits (through the lean ``fast_decode`` step where the model has one)."""
    from transformers import DynamicCache

    B, P = input_ids.shape
    cache_kw = cache_kwarg(lm)
    cache = DynamicCache(config=lm.config)
    full_mask = torch.ones(B, P + max_new_tokens, dtype=attention_mask.dtype, device=input_ids.device)
    full_mask[:, :P] = attention_mask
    position_ids = position_ids_from_mask(attention_mask)
    next_pos = position_ids[:, -1:] + 1  # [B, 1]
    keep = logits_to_keep(lm, 1)
    out = lm(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=True,
        **{cache_kw: cache},
        **keep,
    )
    decoder = decoder_for(lm, cache, attention_mask, max_new_tokens) if fast_decode else None

    def step(token: Tensor, t: int, next_pos: Tensor) -> Tensor:
        if decoder is not None:
            return decoder.step(token, next_pos[:, 0])
        return lm(
            input_ids=token[:, None],
            attention_mask=full_mask[:, : P + t + 1],
            position_ids=next_pos,
            use_cache=True,
            **{cache_kw: cache},
        ).logits[:, -1, :]

    return out.logits[:, -1, :], next_pos, step


def _sample_loop(
    lm, input_ids, attention_mask, params: SamplingParams, eos_token_id, pad_token_id, generator, fast_decode, tokenizer
):
    """One chunk of rows: the prefill, then a token a step until every row has stopped (with
    ``stop_at_eos``) or ``max_new_tokens``; ``(responses [B, n], response_mask [B, n])``."""
    max_new_tokens, stop_at_eos = params.max_new_tokens, params.stop_at_eos
    stops = StopChecker(eos_token_id, params.stop_token_ids, params.stop_strings, tokenizer) if stop_at_eos else None
    B, device = input_ids.shape[0], input_ids.device
    logits, next_pos, step = _prefill(lm, input_ids, attention_mask, max_new_tokens, fast_decode)
    responses = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    stopped_at = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)  # each row's first stop
    limits = None  # each row's own limit (an episode's room left); an ended row's position stays put
    if params.row_max_new_tokens is not None and stop_at_eos:
        limits = torch.tensor(params.row_max_new_tokens, dtype=torch.long, device=device)
    n = 0
    for t in range(max_new_tokens):
        token = sample_next_token(
            logits, params.temperature, params.top_k, params.top_p, generator, params.greedy, params.min_p
        )
        if stop_at_eos:
            token = token.masked_fill(finished, pad_token_id)
        responses[:, t] = token
        n = t + 1
        if stop_at_eos:  # a stop ending at this token, in a row still running
            now = stops.at_last(responses[:, :n]) & ~finished
            if limits is not None:  # a row at its own limit ends here too, this token its last
                now |= (limits <= n) & ~finished
            stopped_at = torch.where(now, t, stopped_at)
            finished |= now
            # .all() syncs with the device; on GPU checking every few steps would save a little
            if bool(finished.all()):
                break
        if t + 1 == max_new_tokens:
            break
        logits = step(token, t, next_pos)
        next_pos = next_pos + 1 if limits is None else next_pos + (~finished).long()[:, None]
    responses = responses[:, :n]
    if stop_at_eos:  # 1 up to and including the first stop
        response_mask = (torch.arange(n, device=device)[None, :] <= stopped_at[:, None]).to(torch.float32)
    else:
        response_mask = torch.ones_like(responses, dtype=torch.float32)
    return responses, response_mask
