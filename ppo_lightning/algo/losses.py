"""The PPO losses, as pure tensor functions (no Lightning, no models): the clipped policy and
value losses, how per-token losses become one number (``ppo.loss_agg``), logprobs and entropy.

Shapes: ``B`` rows (episodes), ``R`` response positions. Every function takes a ``mask`` that is 1
on real response tokens and 0 on prompt, pad and after-EOS positions; statistics are taken over
masked positions only. Names follow the math and the tutorial. Sources:

- The tutorial: the PPO tutorial this project started from, FareedKhan-dev/train-llm-from-scratch,
  ``src/post_training/ppo.py``.
- [N+] Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO".
- [GAE] Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE".
- [Z19] Ziegler et al. 2019, "Fine-Tuning Language Models from Human Preferences".
- [KL] J. Schulman, "Approximating KL Divergence" (k1/k2/k3 estimators), 2020.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.distributed as dist

from ppo_lightning.algo.stats import _all_reduce_sum, _select, masked_mean, masked_sum
from ppo_lightning.config.choices import AggregationSpec, LOSS_AGGREGATIONS

Tensor = torch.Tensor


def token_mean(x: Tensor, mask: Tensor, token_count: Tensor | None = None) -> Tensor:
    """``masked_mean`` over all tokens, or ``masked_sum / token_count``: a micro-batch's share of
    the token mean of the minibatch it belongs to (``token_count`` = the minibatch's tokens), so
    the shares of its micro-batches add up to exactly the minibatch's mean."""
    if token_count is None:
        return masked_mean(x, mask)
    return _select(x, mask).sum() / token_count.clamp(min=1)


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
    """A per-token loss ``[B, R]`` reduced to one number by the aggregation ``mode``
    (``ppo.loss_agg``, one of ``LOSS_AGGREGATIONS``, each registered below with its doc).

    ``token_count`` = the minibatch's tokens and ``seq_count`` = its responses, so micro-batches'
    shares add up to the minibatch's value; ``norm_length`` is Dr. GRPO's constant.
    """
    if mode not in LOSS_AGGREGATIONS:
        raise ValueError(f"unknown loss aggregation {mode!r}; choose one of {tuple(LOSS_AGGREGATIONS)}")
    return LOSS_AGGREGATIONS.implementation(mode)(x, mask, token_count, seq_count, norm_length)


def _per_response_mean(per_seq: Tensor, seq_count: Tensor | int | None) -> Tensor:
    n = per_seq.shape[0] if seq_count is None else seq_count
    return per_seq.sum() / (n.clamp(min=1) if isinstance(n, Tensor) else max(n, 1))


@LOSS_AGGREGATIONS.register("token_mean", AggregationSpec())
def _token_mean(x, mask, token_count, seq_count, norm_length) -> Tensor:
    """Every response token of the minibatch weighs the same (long responses weigh more);
    ``token_count`` = the minibatch's tokens (see ``token_mean``)."""
    return token_mean(x, mask, token_count)


@LOSS_AGGREGATIONS.register("token_mean_global", AggregationSpec(global_tokens=True))
def _token_mean_global(x, mask, token_count, seq_count, norm_length) -> Tensor:
    """The same, with ``token_count`` = ``global_token_count`` (every rank's tokens: the caller
    counts them, as the spec says)."""
    return token_mean(x, mask, token_count)


@LOSS_AGGREGATIONS.register("seq_mean_token_mean", AggregationSpec())
def _seq_mean_token_mean(x, mask, token_count, seq_count, norm_length) -> Tensor:
    """The mean over responses of each response's token mean (every response weighs the same:
    GRPO's original loss, DeepSeekMath eq. 3)."""
    return _per_response_mean(masked_sum(x, mask, dim=1) / mask.sum(1).clamp(min=1), seq_count)


@LOSS_AGGREGATIONS.register("seq_mean_token_sum", AggregationSpec())
def _seq_mean_token_sum(x, mask, token_count, seq_count, norm_length) -> Tensor:
    """The mean over responses of each response's token sum (no division by its length)."""
    return _per_response_mean(masked_sum(x, mask, dim=1), seq_count)


@LOSS_AGGREGATIONS.register("seq_mean_token_sum_norm", AggregationSpec())
def _seq_mean_token_sum_norm(x, mask, token_count, seq_count, norm_length) -> Tensor:
    """That, divided by the constant ``norm_length`` (``sampling.max_new_tokens``): Dr. GRPO's
    loss (Liu et al. 2025; TRL's ``dr_grpo``, verl's ``seq-mean-token-sum-norm``), free of the
    per-response length bias, at the scale of a token mean (a gradient ``norm_length`` times
    smaller than ``seq_mean_token_sum``'s, so ``ppo.max_grad_norm`` and ``ppo.ent_coef`` keep
    their meaning)."""
    if not norm_length:
        raise ValueError("loss_agg='seq_mean_token_sum_norm' divides by a constant length: pass norm_length")
    return _per_response_mean(masked_sum(x, mask, dim=1) / norm_length, seq_count)


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """How a minibatch's per-token losses become one number: ``aggregate``'s ``mode``
    (``ppo.loss_agg``) with the counts a micro-batch's share divides by (``token_count``: the
    minibatch's tokens, ``seq_count``: its responses) and ``norm_length`` (Dr. GRPO's constant).
    Every loss of one update is reduced alike, so the options travel as one object; called on
    ``(x, mask)`` it is ``aggregate``."""

    mode: str = "token_mean"
    token_count: Tensor | None = None
    seq_count: Tensor | int | None = None
    norm_length: int | None = None

    def __call__(self, x: Tensor, mask: Tensor) -> Tensor:
        return aggregate(x, mask, self.mode, self.token_count, self.seq_count, self.norm_length)


def engine_weights(old_logp: Tensor, engine_logp: Tensor, mask: Tensor, mode: str, cap: float) -> Tensor | None:
    """Importance weights ``[B, R]`` of the policy loss for samples drawn by an engine
    (``ppo.engine_correction``): ``rho_t = exp(old_logp_t - engine_logp_t)`` per response token,
    or its product over the response for the ``sequence_*`` modes; ``*_truncate`` caps it at
    ``cap`` (truncated importance sampling), ``*_mask`` sets it to 0 above ``cap`` (the sample is
    dropped). Zero off ``mask``; None for ``none``. Computed in log space, so a long response's
    product cannot overflow."""
    if mode == "none":
        return None
    log_rho = (old_logp - engine_logp) * mask
    if mode.startswith("sequence"):
        log_rho = log_rho.sum(1, keepdim=True).expand_as(mask)
    log_cap = math.log(cap)
    capped = torch.exp(torch.clamp(log_rho, max=log_cap))
    weights = capped if mode.endswith("truncate") else torch.where(log_rho > log_cap, 0.0, capped)
    return weights * mask


def ppo_policy_loss(
    new_logp: Tensor,
    old_logp: Tensor,
    advantages: Tensor,
    mask: Tensor,
    clip: float,
    agg: Aggregation = Aggregation(),
    *,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Clipped surrogate objective (as a loss to minimise) and the fraction of clipped tokens.

    ``pg_loss = max(-A * ratio, -A * clip(ratio, 1 - clip, 1 + clip_high))`` per token
    (``clip_high`` defaults to ``clip``; a larger one is DAPO's "clip-higher", Yu et al. 2025,
    which lets unlikely tokens gain probability faster), then reduced by ``agg`` (an ``Aggregation``).
    ``dual_clip = c > 1`` (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
    RL"): for negative advantages the loss is also capped at ``-c * A``, so a ratio far above 1
    on a bad token cannot produce an unbounded update. ``weights`` (``engine_weights``) weigh
    each token's loss. ``clip_frac`` (a token mean) counts tokens where the clipped branch was
    the active (larger) one.
    """
    logratio = new_logp - old_logp
    ratio = torch.exp(logratio)
    high = clip if clip_high is None else clip_high
    pg_loss1 = -advantages * ratio
    pg_loss2 = -advantages * torch.clamp(ratio, 1.0 - clip, 1.0 + high)
    per_token = torch.maximum(pg_loss1, pg_loss2)
    if dual_clip is not None:
        per_token = torch.where(advantages < 0, torch.minimum(per_token, -dual_clip * advantages), per_token)
    if weights is not None:
        per_token = per_token * weights
    loss = agg(per_token, mask)
    clip_frac = token_mean((pg_loss2 > pg_loss1).to(new_logp.dtype), mask, agg.token_count)
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
