"""The PPO math, as pure tensor functions (no Lightning, no models).

Shapes: ``B`` rows (episodes), ``R`` response positions. Every function takes a ``mask`` that is 1
on real response tokens and 0 on prompt, pad and after-EOS positions; statistics are taken over
masked positions only. Names follow the math and the tutorial; sources of each detail:

- The tutorial: the PPO tutorial this project started from, FareedKhan-dev/train-llm-from-scratch,
  ``src/post_training/ppo.py``.
- [N+] Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO".
- [GAE] Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE".
- [Z19] Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences".
- [KL] J. Schulman, "Approximating KL Divergence" (k1/k2/k3 estimators), 2020.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ppo_lightning.choices import DEFAULT_KL_ESTIMATOR, LOSS_AGGREGATIONS, LOSS_KL_ESTIMATORS  # noqa: F401

Tensor = torch.Tensor


# ----------------------------------------------------------------------------- masked statistics
def _all_reduce_sum(*xs: Tensor) -> tuple[Tensor, ...]:
    """Sum tensors across ranks when a process group is up (DDP); identity otherwise."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return xs
    flat = torch.stack([x.detach().to(torch.float64) for x in xs])
    dist.all_reduce(flat)
    return tuple(flat.to(xs[0].dtype).unbind(0))


def _select(x: Tensor, mask: Tensor) -> Tensor:
    """``x`` where ``mask`` is 1, else 0: selected, not multiplied, so an inf or NaN at a masked
    position (an overflowing ratio on a pad token) cannot leak into a statistic."""
    return torch.where(mask.bool(), x, torch.zeros((), dtype=x.dtype, device=x.device))


def masked_sum(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    return _select(x, mask).sum() if dim is None else _select(x, mask).sum(dim)


def masked_mean(x: Tensor, mask: Tensor, dim: int | None = None) -> Tensor:
    """Mean of ``x`` over positions where ``mask`` is 1 (0 if the mask is empty)."""
    if dim is None:
        return _select(x, mask).sum() / mask.sum().clamp(min=1)
    return _select(x, mask).sum(dim) / mask.sum(dim).clamp(min=1)


def masked_var(x: Tensor, mask: Tensor, unbiased: bool = True, distributed: bool = False) -> Tensor:
    """Variance of ``x`` over masked positions (Bessel-corrected by default, as the tutorial does).

    With ``distributed=True`` the sums are all-reduced, giving the statistic over every rank's
    batch: each rank then whitens with the same mean and std ([N+] "statistics across ranks").
    """
    mean, _, n = _masked_moments(x, mask, distributed)
    var = _masked_moments((x - mean) ** 2, mask, distributed)[0]
    if unbiased and n > 1:  # Bessel's correction; a single element has variance 0 either way
        var = var * n / (n - 1)
    return var


def _masked_moments(x: Tensor, mask: Tensor, distributed: bool) -> tuple[Tensor, Tensor, Tensor]:
    s, n = masked_sum(x, mask), mask.sum().to(x.dtype)
    if distributed:
        s, n = _all_reduce_sum(s, n)
    return s / n.clamp(min=1), s, n


def whiten(x: Tensor, mask: Tensor, shift_mean: bool = True, distributed: bool = False) -> Tensor:
    """Normalise ``x`` to mean 0 / std 1 over masked positions; masked-out positions become 0.

    Advantages are whitened over response tokens only ([N+] detail: prompt and pad positions
    would otherwise drag the statistics). ``shift_mean=False`` keeps the mean (used for reward
    whitening, where the sign of the reward carries information).
    """
    mean = _masked_moments(x, mask, distributed)[0]
    var = masked_var(x, mask, distributed=distributed)
    whitened = (x - mean) * torch.rsqrt(var + 1e-8)
    if not shift_mean:
        whitened = whitened + mean
    return whitened * mask


# ----------------------------------------------------------------------------- advantages
def compute_gae(
    rewards: Tensor, values: Tensor, values_next: Tensor, resp_mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    """Generalised advantage estimation [GAE] over masked response tokens.

    ``delta_t = r_t + gamma * nonterminal_t * V(s_{t+1}) - V(s_t)``,
    ``A_t = delta_t + gamma * lam * nonterminal_t * A_{t+1}``, with ``nonterminal_t =
    resp_mask[t + 1]`` (0 at the last position): bootstrapping stops where the next action is not
    a response action, whatever ``values_next`` holds there. So the tutorial's raw shift,
    ``values_next = cat(values[:, 1:], 0)``, is safe: the last real token never reads the value
    at the pad or after-EOS position behind it ([N+]: GAE must not bootstrap from positions that
    are not part of the response). A is 0 wherever ``resp_mask`` is 0.
    Returns ``(advantages, returns)`` with ``returns = advantages + values`` (the value target).
    """
    mask = resp_mask.to(values.dtype)
    nonterminal = torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], dim=1)  # [B, R]: mask[t+1]
    values = values * mask
    deltas = (rewards * mask + gamma * values_next * nonterminal - values) * mask  # [B, R]
    advantages = torch.zeros_like(values)
    lastgaelam = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        lastgaelam = (deltas[:, t] + gamma * lam * nonterminal[:, t] * lastgaelam) * mask[:, t]
        advantages[:, t] = lastgaelam
    returns = (advantages + values) * mask
    return advantages, returns


def policy_token_order(mask: Tensor) -> Tensor | None:
    """``[B, R]`` indices that move each row's policy tokens (``mask`` 1) to its front, in order,
    for a mask with gaps (a multi-turn episode, whose environment tokens sit between the policy's
    turns); None for a mask that is already a prefix (a single-turn response).

    GAE and every return-to-go step over policy tokens only: gathered with these indices
    (``to_policy_tokens``), an environment span is neither a step nor a discount, and the value
    bootstrapped after a turn's last token is that of the next turn's first token. The results go
    back to their positions with ``from_policy_tokens``."""
    m = mask > 0
    if not (m[:, 1:] & ~m[:, :-1]).any():  # no token after a gap
        return None
    return torch.sort((~m).to(torch.int8), dim=1, stable=True).indices


def to_policy_tokens(x: Tensor, order: Tensor | None) -> Tensor:
    return x if order is None else x.gather(1, order)


def from_policy_tokens(x: Tensor, order: Tensor | None) -> Tensor:
    return x if order is None else torch.zeros_like(x).scatter(1, order, x)


# ----------------------------------------------------------------------------- losses
def token_mean(x: Tensor, mask: Tensor, token_count: Tensor | None = None) -> Tensor:
    """``masked_mean`` over all tokens, or ``masked_sum / token_count``: a micro-batch's share of
    the token mean of the minibatch it belongs to (``token_count`` = the minibatch's tokens), so
    the shares of its micro-batches add up to exactly the minibatch's mean."""
    if token_count is None:
        return masked_mean(x, mask)
    return _select(x, mask).sum() / token_count.clamp(min=1)


# ppo.loss_agg. token_mean_global is token_mean with the token count of every rank's minibatch
# (``global_token_count``), which the caller passes as ``token_count``.


def global_token_count(mask: Tensor) -> Tensor:
    """The mean over ranks of the response tokens in each rank's ``mask`` (itself on one process).

    A rank whose loss is ``sum of its per-token losses / global_token_count`` contributes, once
    DDP or FSDP averages the gradients over ranks, ``sum / (all ranks' tokens)``: the token mean
    of the whole global minibatch, each token weighing the same wherever it was sampled (TRL's
    ``dapo`` loss, verl's token-mean). A per-rank token mean (``token_mean``) weighs a token on a
    rank with short responses more than one on a rank with long responses.
    """
    n = mask.sum().to(torch.float32)
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return n
    return _all_reduce_sum(n)[0] / dist.get_world_size()


def aggregate(
    x: Tensor,
    mask: Tensor,
    mode: str = "token_mean",
    token_count: Tensor | None = None,
    seq_count: Tensor | int | None = None,
    norm_length: int | None = None,
) -> Tensor:
    """A per-token loss ``[B, R]`` reduced to one number (``ppo.loss_agg``):

    - ``token_mean``: every response token of the minibatch weighs the same (long responses weigh
      more); ``token_count`` = the minibatch's tokens (see ``token_mean``);
    - ``token_mean_global``: the same, with ``token_count`` = ``global_token_count`` (every rank's
      tokens: the caller counts them);
    - ``seq_mean_token_mean``: the mean over responses of each response's token mean (every
      response weighs the same: GRPO's original loss, DeepSeekMath eq. 3);
    - ``seq_mean_token_sum``: the mean over responses of each response's token sum (no division
      by its length);
    - ``seq_mean_token_sum_norm``: that, divided by the constant ``norm_length``
      (``sampling.max_new_tokens``): Dr. GRPO's loss (Liu et al. 2025; TRL's ``dr_grpo``, verl's
      ``seq-mean-token-sum-norm``), free of the per-response length bias, at the scale of a
      token mean (a gradient ``norm_length`` times smaller than ``seq_mean_token_sum``'s, so
      ``ppo.max_grad_norm`` and ``ppo.ent_coef`` keep their meaning).

    ``seq_count`` = the minibatch's responses, so micro-batches' shares add up to the minibatch's
    value, as ``token_count`` does for ``token_mean``.
    """
    if mode in ("token_mean", "token_mean_global"):
        return token_mean(x, mask, token_count)
    per_seq = masked_sum(x, mask, dim=1)
    if mode == "seq_mean_token_mean":
        per_seq = per_seq / mask.sum(1).clamp(min=1)
    elif mode == "seq_mean_token_sum_norm":
        if not norm_length:
            raise ValueError("loss_agg='seq_mean_token_sum_norm' divides by a constant length: pass norm_length")
        per_seq = per_seq / norm_length
    elif mode != "seq_mean_token_sum":
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {LOSS_AGGREGATIONS}")
    n = per_seq.shape[0] if seq_count is None else seq_count
    return per_seq.sum() / (n.clamp(min=1) if isinstance(n, Tensor) else max(n, 1))


def ppo_policy_loss(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float,
    token_count: Tensor | None = None,
    *,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    agg: str = "token_mean",
    seq_count: Tensor | int | None = None,
    norm_length: int | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped surrogate objective (as a loss to minimise) and the fraction of clipped tokens.

    ``pg_loss = max(-A * ratio, -A * clip(ratio, 1 - clip, 1 + clip_high))`` per token
    (``clip_high`` defaults to ``clip``; a larger one is DAPO's "clip-higher", Yu et al. 2025,
    which lets unlikely tokens gain probability faster), then ``aggregate``d (``agg``).
    ``dual_clip = c > 1`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
    RL"): for negative advantages the loss is also capped at ``-c * A``, so a ratio far above 1
    on a bad token cannot produce an unbounded update. ``clip_frac`` (a token mean) counts
    tokens where the clipped branch was the active (larger) one.
    """
    logratio = new_logp - old_logp
    ratio = torch.exp(logratio)
    high = clip if clip_high is None else clip_high
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + high)
    per_token = torch.maximum(pg_loss1, pg_loss2)
    if dual_clip is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -dual_clip * advantages), per_token)
    loss = aggregate(per_token, mask, agg, token_count, seq_count, norm_length)
    clip_frac = token_mean((pg_loss2 > pg_loss1).to(new_logp.dtype), mask, token_count)
    return loss, clip_frac


def clip_fractions(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip_low: float,
    clip_high: float,
    token_count: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """The clipped tokens by side, as TRL's GRPOTrainer logs them (``clip_ratio/low_mean``,
    ``high_mean``): ``ratio < 1 - clip_low`` with ``A < 0`` (the loss would push a bad token's
    probability further down) and ``ratio > 1 + clip_high`` with ``A > 0`` (a good token's further
    up). Token means; they add up to ``ppo_policy_loss``'s clip fraction."""
    ratio = torch.exp(new_logp - old_logp)
    low = (ratio < 1.0 - clip_low) & (advantages < 0)
    high = (ratio > 1.0 + clip_high) & (advantages > 0)
    return (
        token_mean(low.to(new_logp.dtype), mask, token_count),
        token_mean(high.to(new_logp.dtype), mask, token_count),
    )


def ppo_value_loss(
    new_values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    vf_clip: float,
    token_count: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped value loss ``0.5 * max((V - R)^2, (V_clip - R)^2)`` and its clip fraction.

    ``V_clip = V_old + clip(V - V_old, -vf_clip, vf_clip)`` keeps the value head from moving far
    from the rollout's values in one phase ([N+] "value function loss clipping").
    """
    v_clipped = old_values + torch.clamp(new_values - old_values, -vf_clip, vf_clip)
    vf_loss1 = (new_values - returns) ** 2
    vf_loss2 = (v_clipped - returns) ** 2
    loss = 0.5 * token_mean(torch.maximum(vf_loss1, vf_loss2), mask, token_count)
    clip_frac = token_mean((vf_loss2 > vf_loss1).to(new_values.dtype), mask, token_count)
    return loss, clip_frac


# ----------------------------------------------------------------------------- KL and entropy
def kl_k1(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k1 = log p - log q: unbiased for KL(p||q) under samples of p, high variance, can be < 0."""
    return logp - ref_logp


def kl_k2(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k2 = 0.5 (log p - log q)^2: biased, low variance, always >= 0 [KL]."""
    return 0.5 * (logp - ref_logp) ** 2


KL_LOG_RATIO_CLAMP = 20.0  # |log r| bound inside k3 (verl's kl_penalty clamps at 20 too)


def kl_k3(logp: Tensor, ref_logp: Tensor) -> Tensor:
    """k3 = (r - 1) - log r with r = q / p: unbiased, always >= 0 [KL].

    ``log r`` is clamped to +-20 before the exponential: beyond it ``exp`` overflows float32
    (at 88.7) and a single token would give an infinite loss, and a NaN gradient even where a
    mask later drops it (0 * inf). Within the clamp the value and gradient are exact.
    """
    log_r = (ref_logp - logp).clamp(-KL_LOG_RATIO_CLAMP, KL_LOG_RATIO_CLAMP)
    return torch.expm1(log_r) - log_r


KL_ESTIMATOR_FNS = {"k1": kl_k1, "k2": kl_k2, "k3": kl_k3}  # choices.KL_ESTIMATORS


def kl_estimator_for(kl_in: str, estimator: str | None) -> str:
    """The KL estimator a run uses: ``ppo.kl_estimator``, or null's default for ``ppo.kl_in``."""
    return DEFAULT_KL_ESTIMATOR[kl_in] if estimator is None else estimator


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str = "k1", mask: Tensor | None = None) -> Tensor:
    """Per-token KL(policy || reference) estimate ([Z19] uses k1 in the reward).

    With ``mask``, both log-probabilities are taken as 0 off the mask before the estimator runs,
    so a pad or after-EOS position (whose logprob can be anything, e.g. -100) gives 0 and a zero
    gradient, never an overflow that a later mask would turn into 0 * inf = NaN.
    """
    if mask is not None:
        logp, ref_logp = _select(logp, mask), _select(ref_logp, mask)
    try:
        return KL_ESTIMATOR_FNS[estimator](logp, ref_logp)
    except KeyError:
        raise ValueError(f"unknown KL estimator {estimator!r}; choose one of {sorted(KL_ESTIMATOR_FNS)}")


def approx_kl(new_logp: Tensor, old_logp: Tensor, mask: Tensor) -> Tensor:
    """Approximate KL(old || new) over a PPO update, the k3 estimator (as CleanRL logs it).

    A monitor, not a loss: a value far above ~0.02 means the update moved the policy too far.
    """
    logratio = new_logp - old_logp
    return masked_mean(torch.expm1(logratio) - logratio, mask)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the categorical distribution at each position: ``logsumexp(z) - sum p z``."""
    pd = torch.softmax(logits, dim=-1)
    return torch.logsumexp(logits, dim=-1) - (pd * logits).sum(-1)


def logprobs_from_logits(logits: Tensor, tokens: Tensor) -> Tensor:
    """log softmax(logits)[token] at each position, in float32 for stability. [B, R, V] -> [B, R]"""
    logp = F.log_softmax(logits.float(), dim=-1)
    return torch.gather(logp, 2, tokens.unsqueeze(-1)).squeeze(-1)


def explained_variance(values: Tensor, returns: Tensor, mask: Tensor) -> Tensor:
    """1 - Var[returns - values] / Var[returns] over masked tokens: 1 is perfect, <= 0 is useless."""
    var_y = masked_var(returns, mask, unbiased=False)
    return 1.0 - masked_var(returns - values, mask, unbiased=False) / var_y.clamp(min=1e-8)
