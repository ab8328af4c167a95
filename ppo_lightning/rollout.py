"""Rollouts: batched KV-cache sampling from left-padded prompts, then everything PPO needs to learn
from those samples, gathered in one ``Rollout`` (a dataclass of tensors). No Lightning here.

Layout of one rollout (``P`` prompt positions, ``R`` response positions, ``T = P + R``)::

    query_responses  [B, T]   <pad><pad> prompt tokens | response tokens <eos> <pad> <pad>
    attention_mask   [B, T]      0    0    1 ... 1     |   1  ...  1      1     0     0
    response_mask    [B, R]                            |   1  ...  1      1     0     0

Everything after the first EOS is masked out of every loss and statistic ([N+] detail).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppo_lightning import estimators, ppo
from ppo_lightning.fast_decode import GPT2Decoder, supports_fast_decode
from ppo_lightning.lora import model_class
from ppo_lightning.policy import PolicyWithValueHead, position_ids_from_mask
from ppo_lightning.rewards.base import normalized

StopSequences = tuple[tuple[int, ...], ...]  # token-id sequences that end a response (besides EOS)

class _Sequences:
    """What ``Rollout`` and ``Samples`` share: ``query_responses [B, T]`` = left-padded prompt
    (``context_length`` = P positions) + response."""

    query_responses: Tensor
    context_length: int

    @property
    def batch_size(self) -> int:
        return self.query_responses.shape[0]

    @property
    def responses(self) -> Tensor:
        return self.query_responses[:, self.context_length:]


@dataclasses.dataclass
class Rollout(_Sequences):
    """One PPO batch: sampled responses and the old policy's view of them. All tensors share B."""

    query_responses: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] long: prompt mask | response mask
    position_ids: Tensor  # [B, T] long: left padding skipped
    response_mask: Tensor  # [B, R] float: 1 on response tokens up to and including EOS
    logprobs: Tensor  # [B, R] old policy log pi(a_t | s_t), logits / temperature
    ref_logprobs: Tensor  # [B, R] reference model, same temperature
    values: Tensor  # [B, R] old V(s_t)
    kl: Tensor  # [B, R] per-token k1 = logprobs - ref_logprobs (for metrics)
    rewards: Tensor  # [B, R] -beta * KL_t, plus the score at the last real token
    non_score_reward: Tensor  # [B] sum over tokens of -beta * KL_t (the KL part of the return)
    advantages: Tensor  # [B, R] GAE, whitened over response tokens
    returns: Tensor  # [B, R] value targets: advantages (before whitening) + values
    scores: Tensor  # [B] reward of each full response: normalised, after the missing-EOS penalty
    raw_scores: Tensor  # [B] the reward's own output, before normalisation and penalty
    contains_eos: Tensor  # [B] bool
    context_length: int  # P

    def is_finite(self) -> Tensor:
        """Whether every score, logprob, value and advantage is finite (a 0-dim bool tensor)."""
        return torch.stack([torch.isfinite(t).all() for t in (
            self.scores, self.logprobs, self.ref_logprobs, self.values, self.advantages, self.returns)]).all()

    def index(self, idx: Tensor | slice) -> "Rollout":
        """The rows ``idx`` of every tensor: a minibatch, or a micro-batch of one."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return Rollout(**{k: v[idx] if isinstance(v, Tensor) else v for k, v in fields.items()})


# ----------------------------------------------------------------------------- sampling
def sample_next_token(logits: Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0,
                      generator: torch.Generator | None = None, greedy: bool = False) -> Tensor:
    """Sample one token per row from ``logits [B, V]`` after temperature, top-k and top-p."""
    if greedy:
        return logits.argmax(-1)
    logits = logits.float()
    if temperature != 1.0:  # x / 1.0 is x: skip the kernel
        logits = logits / temperature
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
    # Exponential race: argmax_i p_i / E_i with E_i ~ Exp(1) is a draw from p (each p_i / E_i is
    # the inverse of an Exp(p_i) arrival time; the first arrival is i with probability p_i).
    # -log(U) with U ~ U[0, 1) is Exp(1); U = 0 gives +inf, so that token cannot win. Same
    # distribution as torch.multinomial, ~3x cheaper per decode step on CPU.
    race = torch.rand(probs.shape, generator=generator, device=probs.device, dtype=probs.dtype)
    return probs.div_(race.log_().neg_()).argmax(-1)


@functools.lru_cache(maxsize=None)
def _forward_params(cls: type) -> frozenset[str]:
    """The argument names of a model class's ``forward`` (``inspect.signature`` costs ~30 us: once
    per class, not per call)."""
    return frozenset(inspect.signature(cls.forward).parameters)


def _cache_kwarg(lm) -> str:
    """transformers >= 5.24 names the KV cache argument ``cache``; earlier, ``past_key_values``."""
    return "cache" if "cache" in _forward_params(model_class(lm)) else "past_key_values"


def _logits_to_keep(lm, n: int) -> dict:
    """``logits_to_keep=n`` where the model takes it: the LM head then runs on the last ``n``
    positions only (the logits of the prompt are never used)."""
    return {"logits_to_keep": n} if "logits_to_keep" in _forward_params(model_class(lm)) else {}


def generate(lm, input_ids: Tensor, attention_mask: Tensor, *, max_new_tokens: int,
             eos_token_id: int, pad_token_id: int, temperature: float = 1.0, top_k: int = 0,
             top_p: float = 1.0, stop_at_eos: bool = True, greedy: bool = False,
             generator: torch.Generator | None = None, fast_decode: bool = True,
             chunk_size: int | None = None, stop_sequences: StopSequences = ()) -> tuple[Tensor, Tensor]:
    """Sample responses to left-padded prompts with a KV cache.

    Returns ``responses [B, R]`` (pad after the first stop, ``R <= max_new_tokens``: the loop
    stops once every row has stopped) and ``response_mask [B, R]`` (1 up to and including the
    stop). A row stops at EOS or at the last token of any of ``stop_sequences`` (token-id
    sequences: ``ppo.stop_token_ids`` and the tokenised ``ppo.stop_strings``). With
    ``stop_at_eos=False`` every row runs to ``max_new_tokens`` and neither stops it (benchmarks
    use this for a fixed workload).

    The prompt goes through the model's own forward (the prefill). Each further token goes through
    it too, or, with ``fast_decode`` on a model ``fast_decode.supports_fast_decode`` accepts
    (GPT-2), through a lean step with the same logits and about half the per-token overhead.

    ``chunk_size`` rows are sampled at a time (null: the whole batch): the KV cache, which grows
    with rows x (prompt + response) x layers x width, is then a chunk's. Chunks that stop early
    are padded to the longest chunk's length. Each row's tokens have the same distribution either
    way (greedy decoding gives the same tokens, a test), but the random stream is drawn in a
    different order, so a seeded run samples different tokens with a different chunk size.

    The loop runs under ``inference_mode`` (~10% faster per step than ``no_grad``); its outputs
    are cloned into ordinary tensors, since the training step feeds them back through autograd.
    A sharded LM (FSDP2) samples under ``no_grad``: its all-gather buffers, allocated on the
    first forward, are written in place again by every later one, in or out of the loop.
    """
    B = input_ids.shape[0]
    chunk_size = chunk_size or B
    was_training = lm.training  # a checkpointing policy stays in train mode, where Hugging Face
    lm.eval()                   # turns the KV cache off: sample in eval mode (dropout is 0 anyway)
    try:
        fast = fast_decode and supports_fast_decode(lm)
        with torch.no_grad() if _is_fsdp(lm) else torch.inference_mode():
            parts = [_sample_loop(lm, input_ids[s:s + chunk_size], attention_mask[s:s + chunk_size],
                                  max_new_tokens, eos_token_id, pad_token_id, temperature, top_k, top_p,
                                  stop_at_eos, greedy, generator, fast, stop_sequences)
                     for s in range(0, B, chunk_size)]
    finally:
        lm.train(was_training)
    if len(parts) == 1:
        responses, response_mask = parts[0]
        return responses.clone(), response_mask.clone()
    R = max(r.shape[1] for r, _ in parts)
    responses = torch.cat([F.pad(r, (0, R - r.shape[1]), value=pad_token_id) for r, _ in parts])
    response_mask = torch.cat([F.pad(m, (0, R - m.shape[1]), value=0.0) for _, m in parts])
    return responses, response_mask  # torch.cat made ordinary tensors


def _is_fsdp(module: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _sample_loop(lm, input_ids, attention_mask, max_new_tokens, eos_token_id, pad_token_id,
                 temperature, top_k, top_p, stop_at_eos, greedy, generator, fast, stop_sequences=()):
    from transformers import DynamicCache

    B, P = input_ids.shape
    device = input_ids.device
    cache_kw = _cache_kwarg(lm)
    cache = DynamicCache(config=lm.config)
    full_mask = torch.ones(B, P + max_new_tokens, dtype=attention_mask.dtype, device=device)
    full_mask[:, :P] = attention_mask
    position_ids = position_ids_from_mask(attention_mask)
    next_pos = position_ids[:, -1:] + 1  # [B, 1]
    keep = _logits_to_keep(lm, 1)
    out = lm(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
             use_cache=True, **{cache_kw: cache}, **keep)
    logits = out.logits[:, -1, :]
    decoder = GPT2Decoder(lm, cache, attention_mask, max_new_tokens) if fast else None
    responses = torch.full((B, max_new_tokens), pad_token_id, dtype=torch.long, device=device)
    finished = torch.zeros(B, dtype=torch.bool, device=device)
    n = 0
    for t in range(max_new_tokens):
        token = sample_next_token(logits, temperature, top_k, top_p, generator, greedy)
        if stop_at_eos:
            token = token.masked_fill(finished, pad_token_id)
        responses[:, t] = token
        n = t + 1
        if stop_at_eos:
            finished |= token == eos_token_id
            for seq in stop_sequences:  # a sequence ending at this token
                k = len(seq)
                if k <= n:
                    finished |= (responses[:, n - k:n] == responses.new_tensor(seq)).all(1)
            # .all() syncs with the device; on GPU checking every few steps would save a little
            if bool(finished.all()):
                break
        if t + 1 == max_new_tokens:
            break
        if decoder is not None:
            logits = decoder.step(token, next_pos[:, 0])
        else:
            logits = lm(input_ids=token[:, None], attention_mask=full_mask[:, :P + t + 1],
                        position_ids=next_pos, use_cache=True, **{cache_kw: cache}).logits[:, -1, :]
        next_pos = next_pos + 1
    responses = responses[:, :n]
    if stop_at_eos:
        response_mask = _mask_after_stop(responses, eos_token_id, stop_sequences)
    else:
        response_mask = torch.ones_like(responses, dtype=torch.float32)
    return responses, response_mask


def stop_hits(responses: Tensor, eos_token_id: int, stop_sequences: StopSequences = ()) -> Tensor:
    """``[B, R]`` bool: the response stops at position ``t`` (EOS there, or the last token of a
    stop sequence)."""
    hits = responses == eos_token_id
    for seq in stop_sequences:
        k = len(seq)
        if k <= responses.shape[1]:
            windows = responses.unfold(1, k, 1)  # [B, R - k + 1, k]: the k tokens ending at k-1 .. R-1
            hits[:, k - 1:] |= (windows == responses.new_tensor(seq)).all(-1)
    return hits


def _mask_after_stop(responses: Tensor, eos_token_id: int, stop_sequences: StopSequences = ()) -> Tensor:
    """1 on tokens up to and including the first stop (EOS or a stop sequence's last token), 0
    after it."""
    hits = stop_hits(responses, eos_token_id, stop_sequences).long()
    return ((hits.cumsum(-1) - hits) == 0).to(torch.float32)  # no stop strictly before t


# ----------------------------------------------------------------------------- scoring forwards
@torch.no_grad()
def forward_logprobs(policy: PolicyWithValueHead | None, lm, query_responses: Tensor,
                     attention_mask: Tensor, position_ids: Tensor, context_length: int,
                     temperature: float, chunk_size: int | None = None) -> tuple[Tensor, Tensor | None]:
    """Logprobs of the response tokens (and values, when ``policy`` is given), in row chunks.

    Logits are divided by the sampling temperature before the log-softmax, so the logprobs are
    those of the distribution the tokens were sampled from ([N+] detail).
    """
    B = query_responses.shape[0]
    chunk_size = chunk_size or B
    responses = query_responses[:, context_length:]
    logps, values = [], []
    for s in range(0, B, chunk_size):
        sl = slice(s, s + chunk_size)
        if policy is not None:
            logits, v = policy(query_responses[sl], attention_mask[sl], position_ids[sl], context_length)
            if v is not None:  # a policy without a value head (critic-free estimators) gives none
                values.append(v)
        else:
            R = query_responses.shape[1] - context_length
            logits = lm(input_ids=query_responses[sl], attention_mask=attention_mask[sl],
                        position_ids=position_ids[sl], use_cache=False,
                        **_logits_to_keep(lm, R + 1)).logits[:, -(R + 1):-1]
        if temperature != 1.0:
            logits = logits / temperature
        logps.append(ppo.logprobs_from_logits(logits, responses[sl]))
    return torch.cat(logps), (torch.cat(values) if values else None)


# ----------------------------------------------------------------------------- decoding
def decode_prompts_and_responses(tokenizer, input_ids: Tensor, responses: Tensor,
                                 response_mask: Tensor) -> tuple[list[str], list[str]]:
    """Prompt and response texts such that ``prompt + response`` is the decoded whole sequence.

    A response decoded on its own can lose the space (or other joiner) that the tokenizer only
    emits between tokens: word-level and SentencePiece tokenizers do. So the whole sequence is
    decoded and the response is what follows the decoded prompt; the reward then judges exactly
    the text a user would read.
    """
    pad = tokenizer.pad_token_id
    responses = responses.masked_fill(response_mask == 0, pad)
    prompts = tokenizer.batch_decode(input_ids, skip_special_tokens=True)
    full = tokenizer.batch_decode(torch.cat([input_ids, responses], dim=1), skip_special_tokens=True)
    alone = None
    texts = []
    for i, (p, f) in enumerate(zip(prompts, full)):
        if f.startswith(p):
            texts.append(f[len(p):])
        else:  # a tokenizer whose joint decoding rewrites the prompt: fall back to the response alone
            alone = alone or tokenizer.batch_decode(responses, skip_special_tokens=True)
            texts.append(alone[i])
    return prompts, texts


def score_responses(reward_fn: Callable, tokenizer, input_ids: Tensor, attention_mask: Tensor,
                    responses: Tensor, response_mask: Tensor) -> Tensor:
    """The scorer's raw score of each row, float32, on the rollout's device.

    A reward model that shares the policy's vocabulary (``RewardModel.token_input``) reads the
    token ids directly; every other scorer gets ``(prompts, responses)`` as decoded text.
    """
    if getattr(reward_fn, "token_input", False):
        ids = torch.cat([input_ids, responses], dim=1)
        mask = torch.cat([attention_mask, response_mask.to(attention_mask.dtype)], dim=1)
        return reward_fn.score_tokens(ids, mask).float().to(input_ids.device)
    prompt_texts, texts = decode_prompts_and_responses(tokenizer, input_ids, responses, response_mask)
    scores = reward_fn(prompt_texts, texts)
    return torch.as_tensor(scores, dtype=torch.float32).to(input_ids.device)


# ----------------------------------------------------------------------------- the whole step
@dataclasses.dataclass
class Samples(_Sequences):
    """Sampled, scored responses: the part of a rollout that does not need the policy's forward.

    ``finish_rollout`` completes it from the old policy's logprobs and values: a no-grad forward
    (``forward_logprobs``), or, when one PPO minibatch is the whole batch, the first update's own
    forward run early (``PPOModule._old_logprobs_and_values``).
    """

    query_responses: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T]
    position_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, R] float
    ref_logprobs: Tensor  # [B, R] (unmasked)
    scores: Tensor  # [B] normalised, after the missing-EOS penalty
    raw_scores: Tensor  # [B] the reward's own output
    contains_eos: Tensor  # [B] bool: stopped by EOS or a stop sequence
    context_length: int  # P


@torch.no_grad()
def sample_and_score(*, policy: PolicyWithValueHead, ref_lm, reward_fn: Callable, tokenizer,
                     input_ids: Tensor, attention_mask: Tensor, gen: dict,
                     missing_eos_penalty: float | None = None, forward_chunk_size: int | None = None,
                     reward_norm: tuple[float, float] = (1.0, 0.0),
                     generator: torch.Generator | None = None) -> Samples:
    """Sample responses to left-padded prompts; reference logprobs and reward scores for them.

    ``reward_norm = (gain, bias)``: the score is ``gain * raw + bias`` ([N+] reward
    normalisation, fitted by ``rewards.fit_normalization``; ``(1, 0)`` leaves it raw).
    """
    P = input_ids.shape[1]
    responses, response_mask = generate(
        policy.lm, input_ids, attention_mask, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, generator=generator, **gen)
    query_responses = torch.cat([input_ids, responses], dim=1)  # [B, T]
    full_mask = torch.cat([attention_mask, response_mask.to(attention_mask.dtype)], dim=1)
    position_ids = position_ids_from_mask(full_mask)
    ref_logprobs, _ = forward_logprobs(None, ref_lm, query_responses, full_mask, position_ids, P,
                                       gen["temperature"], forward_chunk_size)

    raw_scores = score_responses(reward_fn, tokenizer, input_ids, attention_mask, responses, response_mask)
    scores = normalized(raw_scores, reward_norm)
    contains_eos = (stop_hits(responses, tokenizer.eos_token_id, gen.get("stop_sequences", ())) & (response_mask > 0)).any(1)
    if missing_eos_penalty is not None and gen.get("stop_at_eos", True):
        scores = torch.where(contains_eos, scores, scores - missing_eos_penalty)  # [N+] detail
    return Samples(query_responses=query_responses, attention_mask=full_mask, position_ids=position_ids,
                   response_mask=response_mask, ref_logprobs=ref_logprobs, scores=scores,
                   raw_scores=raw_scores, contains_eos=contains_eos, context_length=P)


@torch.no_grad()
def finish_rollout(s: Samples, logprobs: Tensor, values: Tensor | None, *, kl_coef: float, gamma: float,
                   lam: float, kl_estimator: str = "k1", whiten_rewards: bool = False, advantage: str = "gae",
                   group_size: int = 1, scale_by_group_std: bool = True) -> Rollout:
    """The rollout of ``s`` given the old policy's ``logprobs`` and ``values`` ``[B, R]``:
    per-token rewards (-beta * KL, plus the score at the last real token), then the advantages:
    GAE on the values, whitened (``advantage="gae"``), or a critic-free estimator on groups of
    ``group_size`` consecutive rows (``estimators.critic_free_advantages``: the scores compared
    within a group, the KL penalty added per token; ``values`` None, and the rollout's values are
    zeros). ``whiten_rewards`` is GAE's alone: the critic-free estimators normalise the scores
    themselves, and whitening per-token rewards while keeping their mean would add a term
    proportional to each response's length to its return."""
    if whiten_rewards and advantage != "gae":
        raise ValueError(f"whiten_rewards is for advantage='gae' (got {advantage!r}): it would add a length bias")
    mask = s.response_mask
    values = torch.zeros_like(logprobs) if values is None else values
    logprobs, ref_logprobs, values = logprobs * mask, s.ref_logprobs * mask, values * mask
    kl = ppo.kl_k1(logprobs, ref_logprobs) * mask  # k1, for the objective/kl metric
    per_token_kl = kl if kl_estimator == "k1" else ppo.kl_penalty(logprobs, ref_logprobs, kl_estimator, mask)
    kl_rewards = -kl_coef * per_token_kl  # [B, R]
    non_score_reward = kl_rewards.sum(1)
    rewards = kl_rewards + estimators.score_at_last_token(s.scores, mask)
    if advantage == "gae":
        if whiten_rewards:
            rewards = ppo.whiten(rewards, mask, shift_mean=False, distributed=True)
        values_next = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)  # compute_gae masks it
        advantages, returns = ppo.compute_gae(rewards, values, values_next, mask, gamma, lam)
        advantages = ppo.whiten(advantages, mask, distributed=True)
    else:
        advantages, returns = estimators.critic_free_advantages(
            advantage, s.scores, kl_rewards, mask, group_size=group_size, gamma=gamma,
            scale_by_std=scale_by_group_std, distributed=True)
    return Rollout(query_responses=s.query_responses, attention_mask=s.attention_mask,
                   position_ids=s.position_ids, response_mask=mask, logprobs=logprobs,
                   ref_logprobs=ref_logprobs, values=values, kl=kl, rewards=rewards,
                   non_score_reward=non_score_reward, advantages=advantages, returns=returns,
                   scores=s.scores, raw_scores=s.raw_scores, contains_eos=s.contains_eos,
                   context_length=s.context_length)
