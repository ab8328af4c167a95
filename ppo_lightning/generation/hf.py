"""The ``hf`` generation backend: batched KV-cache sampling of a live Hugging Face causal LM.

``HFBackend`` samples the module itself (the policy, or the reference), so it has no weights of
its own to sync. The sampling loop (``generate``) runs each distinct prompt through the model's
forward once (a group's rows share it), then one token at a time through the model's forward or,
for an exact GPT-2, Llama, Qwen2 or GPT-NeoX, the lean step of ``fast_decode.py``; temperature,
top-k, top-p and min-p shape the draw (``inverse_cdf``, one uniform a row); a row stops at EOS, at
a stop token, or at the token that completes a stop string, then leaves the decode batch, and
everything after the first stop is masked (``stops.py``: stop strings are matched on the decoded
text). Callers go through ``HFBackend.generate`` with a ``SamplingParams``; ``generate`` itself
is the low-level function its tests and the sampler benchmarks call.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_lightning.generation import Generated, GenerationBackend
from ppo_lightning.generation.fast_decode import decoder_for
from ppo_lightning.generation.params import SamplingParams
from ppo_lightning.generation.stops import StopChecker
from ppo_lightning.models.policy import position_ids_from_mask
from ppo_lightning.models.shared_prompt import AUTO_MIN_PROMPT_TOKENS, prompt_groups
from ppo_lightning.models.signature import cache_kwarg, logits_to_keep
from ppo_lightning.models.weights import is_sharded


class HFBackend(GenerationBackend):
    """Samples ``lm`` (a live ``transformers`` causal LM, LoRA-wrapped or FSDP-sharded alike) with
    the tokenizer's EOS and pad ids. ``fast_decode``: an exact GPT-2, Llama, Qwen2 or GPT-NeoX
    decodes with the lean step (``generation.fast_decode``; the same logits to float32 rounding,
    about half the per-token overhead)."""

    samples_live_module = True

    def __init__(self, lm: nn.Module, tokenizer, fast_decode: bool = True, logprobs: bool = False):
        self.lm, self.fast_decode, self.tokenizer = lm, fast_decode, tokenizer
        self.logprobs = logprobs
        self.eos_token_id, self.pad_token_id = tokenizer.eos_token_id, tokenizer.pad_token_id

    def generate(
        self,
        prompt_ids: Tensor,
        attention_mask: Tensor,
        params: SamplingParams,
        generator: torch.Generator | None = None,
    ) -> Generated:
        """``Generated(responses, response_mask, logprobs)`` for left-padded ``prompt_ids [B, P]``.
        ``logprobs`` (``generation.logprobs``): the sampler's own logprobs of the tokens it drew,
        of the distribution it drew them from (``sampled_logprobs``), else None. PPO's old
        logprobs are the training forward's either way; these are the behaviour policy's as the
        sampler saw it, compared with the forward's by ``rollout/engine_*``."""
        return sample(
            self.lm,
            prompt_ids,
            attention_mask,
            params,
            eos_token_id=self.eos_token_id,
            pad_token_id=self.pad_token_id,
            generator=generator,
            fast_decode=self.fast_decode,
            tokenizer=self.tokenizer,
            logprobs=self.logprobs,
        )


def sample_next_token(
    logits: Tensor,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    greedy: bool = False,
    min_p: float = 0.0,
    uniforms: Tensor | None = None,
) -> Tensor:
    """Sample one token per row from ``logits [B, V]`` after temperature, top-k, top-p and min-p
    (``sampling_probs``), by inverse CDF from one uniform per row: ``uniforms [B]`` float64 in
    [0, 1), drawn from ``generator`` when not given (``_sample_loop`` draws them for every row of
    its chunk, so a row's token does not depend on which other rows are still sampling)."""
    if greedy:
        return logits.argmax(-1)
    probs = sampling_probs(logits, temperature, top_k, top_p, min_p)
    if uniforms is None:
        uniforms = torch.rand(probs.shape[0], generator=generator, dtype=torch.float64, device=probs.device)
    return inverse_cdf(probs, uniforms)


def token_logprobs(probs: Tensor, token: Tensor) -> Tensor:
    """``[B]``: the logprob of each row's ``token`` under ``probs [B, V]`` (``sampling_probs``),
    renormalised over the tokens its truncation keeps: the distribution the sampler draws from,
    what vLLM reports as its ``processed_logprobs`` and ``rollouts.engine.truncated_logprobs``
    computes from the training forward."""
    return (probs.gather(1, token[:, None]).squeeze(1) / probs.sum(-1)).log()


CDF_BLOCK = 1024
"""Tokens per block of ``inverse_cdf``'s two-level search (a row's vocabulary in ~150 blocks for
Qwen2's): small enough that the per-block cumulative sum is cheap, large enough that the block
sums are few."""


def inverse_cdf(probs: Tensor, uniforms: Tensor) -> Tensor:
    """The token ``i`` of each row of ``probs [B, V]`` (non-negative, any total) where ``u x total``
    falls in ``[cdf[i-1], cdf[i])``: a draw from ``probs / total`` for ``u = uniforms [B]``.

    Why not ``torch.multinomial``, or an exponential race (``argmax p / E``)? Both consume ``V``
    random numbers a row, and at Qwen2's vocabulary drawing them costs as much as the LM head's
    matmul; this takes one a row. Why two levels? A float32 running sum over 150k entries loses
    a small token's width to rounding near the top (spacing 6e-8 against widths of 1e-6), and a
    float64 one over the whole row is a slow sequential scan on CPU. So: block sums (a vectorised
    reduction), a float64 running sum over the blocks to pick one, then a float64 running sum
    inside that block alone, with the position in the block rescaled to that block's own total.
    A token of probability 0 (cut by top-k, top-p or min-p) is never drawn: each search returns
    the first entry whose running sum exceeds the target, and the target stays below the total."""
    B, V = probs.shape
    if V <= CDF_BLOCK:  # one block: the row's own running sum (a few ops, for small vocabularies)
        cdf = probs.cumsum(-1, dtype=torch.float64)
        return torch.searchsorted(cdf, _below(uniforms.unsqueeze(1) * cdf[:, -1:], cdf[:, -1:]), right=True)[:, 0]
    bs = CDF_BLOCK
    whole = V // bs * bs
    sums = probs[:, :whole].view(B, V // bs, bs).sum(-1)
    if whole < V:
        sums = torch.cat([sums, probs[:, whole:].sum(-1, keepdim=True)], 1)
    sums = sums.double()
    cdf = sums.cumsum(-1)  # [B, blocks]
    target = _below(uniforms.unsqueeze(1) * cdf[:, -1:], cdf[:, -1:])  # [B, 1]
    block = torch.searchsorted(cdf, target, right=True)  # [B, 1]: a block of positive mass
    mass = sums.gather(1, block)
    into = (target - (cdf.gather(1, block) - mass)) / mass  # the target's place in its block, ~[0, 1)
    index = block * bs + torch.arange(bs, device=probs.device)  # [B, bs]
    inside = index < V  # the last block may be short
    within = probs.gather(1, index.clamp_max(V - 1)).masked_fill_(~inside, 0.0).cumsum(-1, dtype=torch.float64)
    target = _below(into.clamp_min(0.0) * within[:, -1:], within[:, -1:])
    return (block * bs + torch.searchsorted(within, target, right=True)).squeeze(1)


def _below(x: Tensor, total: Tensor) -> Tensor:
    """``x`` capped at the float just below ``total``: rounding can carry ``u x total`` up to the
    total, where a search would land past the last token of positive probability."""
    return torch.minimum(x, torch.nextafter(total, total.new_zeros(())))


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
    """``(responses, response_mask)``: ``sample``'s, for a direct call with sampling keywords
    (``SamplingParams(**sampling)``) where ``params`` is not given."""
    params = params or SamplingParams(**sampling)
    kw = dict(eos_token_id=eos_token_id, pad_token_id=pad_token_id, generator=generator, tokenizer=tokenizer)
    return tuple(sample(lm, input_ids, attention_mask, params, fast_decode=fast_decode, **kw)[:2])


def sample(
    lm,
    input_ids: Tensor,
    attention_mask: Tensor,
    params: SamplingParams,
    *,
    eos_token_id: int,
    pad_token_id: int,
    generator: torch.Generator | None = None,
    fast_decode: bool = True,
    tokenizer=None,
    logprobs: bool = False,
) -> Generated:
    """Sample responses to left-padded prompts with a KV cache, as ``params`` say.

    Returns ``Generated``: ``responses [B, R]`` (pad after the first stop, ``R <= max_new_tokens``: the loop
    stops once every row has stopped) and ``response_mask [B, R]`` (1 up to and including the
    stop), and with ``logprobs`` each sampled token's logprob under the distribution it was drawn
    from (``token_logprobs``; 0 after the stop; else None). A row stops at EOS, at one of ``stop_token_ids``, or at the token that completes one of
    ``stop_strings`` in the decoded text (``tokenizer`` decodes; ``stops.StopChecker``). With
    ``stop_at_eos=False`` every row runs to ``max_new_tokens`` and neither stops it (benchmarks
    use this for a fixed workload).

    The prompt goes through the model's own forward (the prefill), once for rows that hold the
    same prompt (a group's ``num_generations`` rows: the cache is then copied to each). Each
    further token goes through it too, or, with ``fast_decode`` on a model
    ``fast_decode.decoder_for`` accepts (GPT-2, Llama, Qwen2, GPT-NeoX), through a lean step with
    the same logits (to float32 rounding) and about half the per-token overhead.

    ``chunk_size`` rows are sampled at a time (null: the whole batch): the KV cache, which grows
    with rows x (prompt + response) x layers x width, is then a chunk's. Chunks that stop early
    are padded to the longest chunk's length. Each row's tokens have the same distribution either
    way (greedy decoding gives the same tokens, a test), but the random stream is drawn in a
    different order, so a seeded run samples different tokens with a different chunk size.

    The loop runs as ``_sampling_mode`` says; its outputs become ordinary tensors (``_joined``),
    since the training step feeds them back through autograd.
    """
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
                logprobs,
            )
            for s in range(0, B, chunk_size)
        ]
    return _joined(parts, pad_token_id)


def _joined(parts: list[Generated], pad_token_id: int) -> Generated:
    """The chunks' ``Generated`` as one batch, each padded to the longest, in ordinary tensors (a
    lone chunk's cloned out of ``inference_mode``; ``torch.cat`` makes new ones)."""
    if len(parts) == 1:
        return Generated(*(None if t is None else t.clone() for t in parts[0]))
    R = max(g.responses.shape[1] for g in parts)

    def cat(ts: tuple[Tensor | None, ...], value: float) -> Tensor | None:
        return None if ts[0] is None else torch.cat([F.pad(t, (0, R - t.shape[1]), value=value) for t in ts])

    responses, masks, logprobs = zip(*parts)
    return Generated(cat(responses, pad_token_id), cat(masks, 0.0), cat(logprobs, 0.0))


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


class _Decode:
    """One chunk's decoding state: ``prefill`` runs each distinct prompt through the model's
    forward once into a fresh KV cache, copied to every row that holds it; then ``step(token, t,
    position)`` feeds token ``t`` of the rows still sampling and returns their next logits (through
    the lean ``fast_decode`` step where the model has one, else the model's forward on the cache),
    and ``keep(rows)`` drops the other rows' state."""

    def __init__(self, lm, max_new_tokens: int, fast_decode: bool):
        self.lm, self.max_new_tokens, self.fast_decode = lm, max_new_tokens, fast_decode
        self.cache_kw = cache_kwarg(lm)

    def prefill(self, input_ids: Tensor, attention_mask: Tensor) -> tuple[Tensor, Tensor]:
        """``(logits [B, V] of the first response token, its position [B, 1])``. Rows with the same
        prompt (``shared_prompt.prompt_groups``) share one row of the forward: its cache and logits
        are then indexed out to each, the same numbers a row of its own would give (to float32
        rounding: the forward's batch is smaller), at a group's share of the prefill's work.
        Prompts shorter than ``AUTO_MIN_PROMPT_TOKENS`` save less than finding the groups and
        copying the cache cost: each row is then its own."""
        from transformers import DynamicCache

        B, self.P = input_ids.shape
        groups = prompt_groups(input_ids, attention_mask, self.P) if self.P >= AUTO_MIN_PROMPT_TOKENS else None
        first, inverse = groups if groups is not None else (None, None)
        self.cache = DynamicCache(config=self.lm.config)
        self.full_mask = torch.ones(
            B, self.P + self.max_new_tokens, dtype=attention_mask.dtype, device=input_ids.device
        )
        self.full_mask[:, : self.P] = attention_mask
        position_ids = position_ids_from_mask(attention_mask)
        rows = slice(None) if first is None else first
        out = self.lm(
            input_ids=input_ids[rows],
            attention_mask=attention_mask[rows],
            position_ids=position_ids[rows],
            use_cache=True,
            **{self.cache_kw: self.cache},
            **logits_to_keep(self.lm, 1),
        )
        logits = out.logits[:, -1, :]
        if inverse is not None:  # each row its prompt's cache and logits
            self.cache.batch_select_indices(inverse)
            logits = logits[inverse]
        self.decoder = None
        if self.fast_decode:
            self.decoder = decoder_for(self.lm, self.cache, attention_mask, self.max_new_tokens)
        return logits, position_ids[:, -1:] + 1

    def step(self, token: Tensor, t: int, position: Tensor) -> Tensor:
        if self.decoder is not None:
            return self.decoder.step(token, position[:, 0])
        return self.lm(
            input_ids=token[:, None],
            attention_mask=self.full_mask[:, : self.P + t + 1],
            position_ids=position,
            use_cache=True,
            **{self.cache_kw: self.cache},
        ).logits[:, -1, :]

    def keep(self, rows: Tensor) -> None:
        """Keep the state of ``rows`` (indices into the current batch) alone, in that order."""
        if self.decoder is not None:
            self.decoder.keep(rows)
        else:
            self.cache.batch_select_indices(rows)
            self.full_mask = self.full_mask[rows]


def _sample_loop(
    lm,
    input_ids,
    attention_mask,
    params: SamplingParams,
    eos_token_id,
    pad_token_id,
    generator,
    fast_decode,
    tokenizer,
    logprobs: bool = False,
) -> Generated:
    """One chunk of rows: the prefill, then a token a step until every row has stopped (with
    ``stop_at_eos``) or ``max_new_tokens``; ``Generated`` ``[B, n]``. A row that stops leaves
    the decode batch (``_Decode.keep``), so a batch costs the sum of its lengths, not rows x the
    longest; every step still draws a uniform for each of the chunk's rows and hands each live
    row its own, so the tokens a seed gives do not depend on when the other rows stopped."""
    max_new_tokens, stop_at_eos = params.max_new_tokens, params.stop_at_eos
    stops = StopChecker(eos_token_id, params.stop_token_ids, params.stop_strings, tokenizer) if stop_at_eos else None
    B, device = input_ids.shape[0], input_ids.device
    state = _Decode(lm, max_new_tokens, fast_decode)
    logits, position = state.prefill(input_ids, attention_mask)
    responses = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    stopped_at = torch.full((B,), max_new_tokens, dtype=torch.long, device=device)  # each row's first stop
    limits = None  # each row's own limit (an episode's room left)
    if params.row_max_new_tokens is not None and stop_at_eos:
        limits = torch.tensor(params.row_max_new_tokens, dtype=torch.long, device=device)
    rows: Tensor | slice = slice(None)  # the rows still sampling, in the decode batch's order: all, until one stops
    sampled_lp = torch.zeros(B, max_new_tokens, device=device) if logprobs else None
    n = 0
    for t in range(max_new_tokens):
        uniforms = None
        if not params.greedy:
            uniforms = torch.rand(B, generator=generator, dtype=torch.float64, device=device)[rows]
        token, logp = _draw(logits, params, uniforms, logprobs)
        responses[rows, t] = token
        if logprobs:
            sampled_lp[rows, t] = logp
        n = t + 1
        if stop_at_eos:  # a stop ending at this token, or a row at its own limit: this token its last
            now = stops.at_last(responses[rows, max(0, n - stops.window) : n])
            if limits is not None:
                now |= limits[rows] <= n
            if bool(now.any()):  # a sync with the device; on GPU checking every few steps would save a little
                rows = torch.arange(B, device=device)[rows]  # as indices
                stopped_at[rows[now]] = t
                live = (~now).nonzero()[:, 0]
                if live.numel() == 0:
                    break
                rows, token, position = rows[live], token[live], position[live]
                state.keep(live)
        if n == max_new_tokens:
            break
        logits = state.step(token, t, position)
        position = position + 1
    responses = responses[:, :n]
    # 1 up to and including the first stop (without stop_at_eos, stopped_at is the end: every token)
    response_mask = (torch.arange(n, device=device)[None, :] <= stopped_at[:, None]).to(torch.float32)
    return Generated(responses, response_mask, None if sampled_lp is None else sampled_lp[:, :n] * response_mask)


def _draw(logits: Tensor, params: SamplingParams, uniforms: Tensor | None, logprobs: bool):
    """``(token [B], its logprob [B] or None)``: ``sample_next_token``'s draw; with ``logprobs``
    the same token and its ``token_logprobs`` from the same probabilities."""
    if not logprobs:
        token = sample_next_token(
            logits, params.temperature, params.top_k, params.top_p, None, params.greedy, params.min_p, uniforms
        )
        return token, None
    probs = sampling_probs(logits, params.temperature, params.top_k, params.top_p, params.min_p)
    token = logits.argmax(-1) if params.greedy else inverse_cdf(probs, uniforms)
    return token, token_logprobs(probs, token)
