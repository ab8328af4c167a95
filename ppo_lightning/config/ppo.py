"""``ppo``: the algorithm's keys (clipping, GAE, KL, losses, epochs, minibatches, estimators)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from ppo_lightning.config import choices
from ppo_lightning.config.compat import _MovedPPOKeys
from ppo_lightning.config.schema import param


@dataclass
class PPOConfig(_MovedPPOKeys):
    """PPO's hyperparameters; names follow the tutorial the project started from
    (FareedKhan-dev/train-llm-from-scratch, ``src/post_training/ppo.py``)."""

    advantage: str = param("gae", choices=choices.ESTIMATORS)
    """How advantages are estimated. ``gae``: PPO's generalised advantage estimation with the
    value head (the critic). The critic-free estimators run no value head at all (no value
    forward, loss, parameters or optimizer state; ``vf_coef``, ``vf_clip`` and ``lam`` unused):
    ``grpo`` (each response's reward normalised within its prompt's group, DeepSeekMath),
    ``rloo`` (minus the mean reward of the group's other responses), both needing
    ``num_generations >= 2``; ``reinforce_pp`` (REINFORCE++: the per-token return-to-go,
    whitened over the batch). GRPO and RLOO compare the scores within a group and then add each
    token's return-to-go of the KL penalty (with ``kl_in=reward``), so KL noise cannot break the
    ties of a group whose scores are equal; REINFORCE++ whitens the score plus the KL penalty
    (``ppo_lightning/algo/advantages.py``)."""
    num_generations: int = param(1, ge=1)
    """Responses sampled per prompt. The rollout has ``data.batch_size * num_generations`` rows
    per rank, each prompt's responses on consecutive rows of one rank (a group: GRPO's and RLOO's
    statistics). ``minibatch_size`` counts these rows. Valid with every estimator."""
    scale_by_group_std: bool = True
    """GRPO only: divide by the group's score std (+1e-4). False subtracts the group mean only
    (Dr. GRPO: the division favours prompts that are almost always or almost never solved; pair
    it with ``loss_agg=seq_mean_token_sum_norm``). False with another estimator is refused."""
    clip: float = param(0.2, gt=0, hint="0.2 is the usual value")
    """Policy ratio clip epsilon: the ratio is clipped to [1 - clip, 1 + clip], unless
    ``clip_low`` / ``clip_high`` set a side."""
    clip_low: Optional[float] = param(None, gt=0, lt=1)
    """The lower clip epsilon (null: ``clip``): ratios below ``1 - clip_low`` are clipped."""
    clip_high: Optional[float] = param(None, gt=0)
    """The upper clip epsilon (null: ``clip``). Above ``clip_low`` it is DAPO's "clip-higher"
    (0.28 against 0.2): unlikely tokens may gain probability faster, which keeps entropy up."""
    dual_clip: Optional[float] = param(None, gt=1)
    """Dual clip's c (e.g. 3; null = off): for negative advantages the per-token loss is also
    capped at ``-c * A``, so a ratio far above 1 on a bad token cannot blow up the update."""
    loss_agg: str = param("token_mean", choices=choices.LOSS_AGGREGATIONS)
    """How the per-token policy loss (and the KL loss, ``kl_in=loss``) becomes one number:
    ``token_mean`` over this rank's minibatch tokens (the default; under DDP/FSDP the ranks'
    means are averaged, so a token on a rank with fewer tokens weighs more);
    ``token_mean_global``, over the tokens of every rank's minibatch (each token weighs the same
    wherever it was sampled: TRL's ``dapo``; one all-reduce of a count per update; the value loss
    and entropy then use the global count too); ``seq_mean_token_mean``, each response's token
    mean, averaged over responses (GRPO's original, DeepSeekMath eq. 3);
    ``seq_mean_token_sum``, each response's token sum, averaged; ``seq_mean_token_sum_norm``,
    that divided by the constant ``sampling.max_new_tokens`` (Dr. GRPO, TRL's ``dr_grpo``: no length bias,
    and gradients at a token mean's scale, so ``max_grad_norm`` keeps its meaning); with an
    environment the constant is the most policy tokens an episode can hold,
    ``min(env.max_turns x sampling.max_new_tokens, env.max_total_tokens)``. Exact under
    micro-batches. The value loss is a token mean."""
    kl_in: str = param("reward", choices=choices.KL_PLACEMENTS)
    """Where the KL to the reference enters: ``reward``, as ``-kl_coef * KL_t`` per token
    (PPO, RLOO, REINFORCE++; with GRPO and RLOO it is added after the group comparison of the
    scores), or ``loss``, as ``kl_coef *`` an estimate of the KL on the current policy's
    logprobs (k3 unless ``kl_estimator`` says k2), added to the loss and aggregated like it
    (GRPO, DeepSeekMath eq. 3); the reward is then the score alone."""
    target_kl: Optional[float] = param(None, gt=0)
    """Stop an iteration's updates at the first minibatch whose ``policy/approxkl_avg`` to the
    rollout's policy (measured by its own forward, so after every step before it; mean over
    ranks) exceeds this, without taking that minibatch's step (Stable-Baselines3's early stop;
    e.g. 0.02; null = off). ``policy/epochs`` logs how many epochs ran, fractions counting
    minibatches. The first minibatch of an iteration measures 0 and always steps."""
    vf_clip: float = param(0.2, gt=0, hint="0.2 is the usual value")
    """Value clip range around the rollout's values (in reward units)."""
    gamma: float = param(1.0, ge=0, le=1)
    """Per-token discount: in GAE, and in REINFORCE++'s return-to-go. GRPO and RLOO judge a
    response by its score as a whole and refuse ``gamma < 1``."""
    lam: float = param(0.95, ge=0, le=1)
    """GAE lambda."""
    kl_coef: float = param(0.05, ge=0)
    """beta in ``reward_t = -beta * KL_t`` (plus the score at the last response token); the
    initial value when ``adaptive_kl``. Weighed against normalised scores (``reward.normalize``)."""
    kl_estimator: Optional[str] = param(None, choices=choices.KL_ESTIMATORS)
    """Per-token KL estimator (Schulman's k1 = log p/q, k2 = (log p/q)^2 / 2, k3 = (q/p - 1) -
    log q/p); null = k1 in the reward, k3 in the loss (``choices.DEFAULT_KL_ESTIMATOR``). In the loss
    only k2 (its gradient is that of KL(policy || ref)) and k3 (that of KL(ref || policy)) are
    accepted: k1's gradient has expectation 0 under the policy's samples. ``objective/kl`` and
    the adaptive controller always use k1."""
    adaptive_kl: bool = False
    """Ziegler et al. controller: after each iteration ``beta <- beta * (1 + clip(KL / kl_target - 1,
    +-0.2) * B * W / kl_horizon)`` with KL = ``objective/kl`` (skipped when non-finite)."""
    kl_target: float = param(6.0, gt=0)
    """Target ``objective/kl`` (nats per sequence) of the adaptive controller."""
    kl_horizon: int = param(10000, gt=0)
    """Horizon (episodes) of the adaptive controller."""
    vf_coef: float = param(0.1, ge=0)
    """Weight of the value loss: loss = pg_loss + vf_coef * vf_loss - ent_coef * entropy."""
    ent_coef: float = param(0.0, ge=0)
    """Weight of the entropy bonus; with 0 the entropy is a monitor computed without gradient."""
    ppo_epochs: int = param(4, ge=1)
    """Passes over each rollout."""
    minibatch_size: Optional[int] = param(None, ge=1)
    """Episodes (rows) per gradient step, per rank; must divide the rollout's rows,
    ``data.batch_size * num_generations``. Null (the default): the largest divisor of those rows
    not above 8 (``minibatch_size_for``): 8 wherever 8 divides them, the whole rollout when it
    has 8 rows or fewer, so that any ``data.batch_size`` runs as it is. Updates per iteration:
    ``ppo_epochs * rows / minibatch_size``."""
    micro_batch_size: Optional[int] = param(None, ge=1)
    """Rows per forward and backward inside a minibatch (gradient accumulation); must divide
    ``minibatch_size``; null = the whole minibatch. Each micro-batch's losses are its share of the
    minibatch's token mean, so the step is the whole minibatch's (test): memory for activations
    scales with this, not with ``minibatch_size``."""
    remove_padding: bool = True
    """Run each policy and reference forward (the rollout's scoring and every update's) on the
    columns its rows use (``rollouts.forward.padding_window``): left of the earliest prompt token and
    right of the longest response are cut, so a micro-batch costs its longest row, not the
    rollout's width. The same logprobs, values and gradients to float32 rounding (test);
    false runs every forward on the whole ``[B, T]``."""
    shared_prompt_forward: Any = param("auto", choices=choices.SHARED_PROMPT_FORWARD)
    """Encode each distinct prompt once per forward (``models/shared_prompt.py``): the prompts of
    a forward's rows run once, and their ``num_generations`` responses attend to the cached keys
    and values. The same logprobs, values and gradients to float32 rounding (test), for
    ``(n - 1) / n`` less work on prompt tokens in the rollout's scoring forwards and in every
    update's forward and backward. Minibatches then hold whole groups (shuffled groups, not
    shuffled rows; ``micro_batch_size`` best a multiple of ``num_generations``; token-budget
    micro-batches sort rows by length and share little). ``auto``: on wherever it applies
    (``num_generations > 1``, ``minibatch_size`` a multiple of it, no
    ``model.gradient_checkpointing``, whose forward returns no cache, and an architecture it is
    tested on: GPT-2, Llama, Qwen2, GPT-NeoX; any other warns), in the forwards whose prompts span
    at least ``models.shared_prompt.AUTO_MIN_PROMPT_TOKENS`` (16) columns: below, a second model
    call costs more than the prompt positions it saves; ``true``: on at any prompt length, refused
    where one of the first three fails; ``false``: each row encodes its own prompt."""
    micro_batch_tokens: Optional[int] = param(None, ge=1)
    """Dynamic micro-batches: a minibatch's rows sorted by length (their ``padding_window`` width)
    and grouped so that each group's rows x width stays within this many tokens (a row longer
    than the budget goes alone); null = off. Each group's losses are its share of the minibatch's,
    as with ``micro_batch_size``, so the step is the same (test); activation memory is bounded by
    tokens, not rows, and a group of short rows does not pay for the longest. Under DDP and FSDP
    every rank runs as many groups as the rank that needs most (FSDP gathers weights per forward).
    Replaces ``micro_batch_size`` (set one of them)."""
    engine_correction: str = param("token_truncate", choices=choices.ENGINE_CORRECTIONS)
    """With an engine backend (``generation=vllm``; or ``hf`` with ``generation.logprobs``, whose
    sampler reports its own numbers) the samples come from the engine's
    distribution, not exactly the trainer's old policy (kernels, precision, batching): each
    token's policy loss is weighed by the importance ratio ``rho = pi_old / pi_engine`` of the
    sampled token (``algo.losses.engine_weights``; truncated importance sampling, as verl, TRL
    and ms-swift expose it). ``token_truncate``: ``min(rho, cap)``; ``token_mask``: ``rho``, or 0
    past the cap; ``sequence_*``: the same on the response's product of ratios, for every token
    of it. ``none``: no weights. With the ``hf`` backend (without ``generation.logprobs``) there is no engine view, and no weights. The
    mismatch is logged either way (``rollout/engine_*``). The default, ``token_truncate``, was
    chosen by measurement (``benchmarks/engine_correction.py``; docs/benchmarks.md): with a bf16
    engine on math_chat it reweighs the 9% of tokens whose ratio is off by more than 1e-3 and
    leaves the rest, where a sequence mode reweighs 85% (each token carries its response's whole
    product, which grows with the length); with a float32 engine its weights are 1 to float32
    rounding, and it caps the ratio where an engine drifts (a bf16 or fp16 engine, a failed sync).
    Under ``sampling.top_k``, ``top_p`` or ``min_p`` the engine reports logprobs of its truncated, renormalised distribution, so
    ``pi_old`` is taken under the same truncation (``rollouts.engine.truncated_logprobs``: one more
    no-grad forward a rollout) and the ratio holds the mismatch, not the truncation."""
    engine_correction_cap: float = param(2.0, gt=1)
    """The cap ``C`` of ``ppo.engine_correction`` (and of ``rollout/engine_capped_frac``)."""
    max_grad_norm: float = 1.0
    """Global L2 gradient-norm clip; <= 0 disables it."""
    whiten_rewards: bool = False
    """GAE only: whiten per-token rewards (KL penalty + score) before GAE over the response tokens
    of all ranks, keeping the mean (TRL's PPO). Refused with the critic-free estimators, which
    normalise the scores themselves: whitening per-token rewards while keeping their mean adds a
    term proportional to each response's length to its return. The ``objective/*`` metrics are
    taken before it."""
    missing_eos_penalty: Optional[float] = None
    """Subtracted from the score of responses without EOS (only with ``stop_at_eos``)."""
    mask_truncated_completions: bool = False
    """Leave responses cut at ``sampling.max_new_tokens`` (no EOS or stop sequence) out of every
    loss: their tokens are masked, so they teach nothing (DAPO's overlong filtering; TRL's
    ``mask_truncated_completions``). Their scores still count in the group statistics of GRPO and
    RLOO, as in TRL. Logs ``rollout/masked_truncated``. Only with ``sampling.stop_at_eos``."""
    max_nonfinite_iterations: int = param(3, ge=1)
    """Stop the run (``NonFiniteError``, exit 1) after this many PPO iterations in a row with a
    skipped update (non-finite reward, rollout, loss or gradient; weights untouched, counted in
    ``health/skipped_updates``)."""
    rollout_forward_batch_size: Optional[int] = param(None, ge=1)
    """Rows per policy / reference scoring forward during the rollout (bounds memory; null = the
    whole batch). The reward model uses ``reward.batch_size``."""
    lm_head_chunk_size: Optional[int] = param(256, ge=1)
    """Response positions per chunk of the LM head when scoring responses (``lean_head``): the
    float32 ``[positions, vocab]`` logits, log-softmax and softmax exist for one chunk at a time,
    and the backward recomputes them chunk by chunk, instead of ``[batch, response, vocab]`` at
    once. The same logprobs, entropies and gradients to float32 rounding. It matters for large
    vocabularies: on a Qwen2-vocabulary workload (151,936 entries, 8 x 256 response tokens) the
    peak fell from 5.6 to 3.1 GB for 12% more update time; the small workload's time and memory
    did not change (docs/scaling.md, Memory switches). Used by the update, the rollout's old and reference
    logprobs and evaluation, whenever the head is a plain linear layer (else the plain head). It
    computes the real response tokens only, not the padding after a row's end (reads 0).
    null: the whole ``[batch, response, vocab]`` logits at once."""
    fuse_rollout_forward: bool = True
    """When one minibatch is the whole batch, the rollout's old-policy forward runs with gradients
    and the first update reuses it (``algo.algorithm.PPO._old_logprobs_and_values``): the same numbers
    (the weights have not moved), one policy forward fewer per iteration. False always runs a
    separate no-grad forward."""
    rollout_dump: bool = False
    """Write each iteration's episodes to ``rollouts/iter_<k>.jsonl`` in the run directory (one
    file per rank under DDP: ``iter_<k>.rank<r>.jsonl``), for debugging: per line the record's
    columns, ``prompt_ids`` and ``response_ids`` (no padding), ``loss_mask`` (one 0/1 per
    response id: 1 where the policy's own token trains), ``messages``, ``reward`` (raw),
    ``score`` (what PPO learned from) and ``turns``. Single-turn runs too (one assistant message)."""


MINIBATCH_ROWS_AT_MOST = 8
"""The rows of a minibatch that ``ppo.minibatch_size=null`` never exceeds: the key's former fixed
default, so that every rollout it divided keeps its minibatches (and its numbers)."""


def minibatch_size_for(p: Any, rows: int) -> int:
    """``ppo.minibatch_size`` resolved for a rollout of ``rows`` rows per rank (``data.batch_size *
    num_generations``): the key where it is set, else the largest divisor of ``rows`` not above
    ``MINIBATCH_ROWS_AT_MOST``. ``p`` is the ``ppo`` node or a ``PPOConfig``. The one resolution:
    the checks (``config.rules``) and the run (``jobs.factory``, whose ``PPOConfig`` the update
    reads) both call this."""
    if p.minibatch_size is not None:
        return p.minibatch_size
    return largest_divisor(rows, MINIBATCH_ROWS_AT_MOST)


def largest_divisor(n: int, at_most: int) -> int:
    """The largest divisor of ``n`` not above ``at_most`` (1 at least)."""
    return max(k for k in range(1, max(1, min(n, at_most)) + 1) if n % k == 0)
