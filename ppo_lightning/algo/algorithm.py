"""One PPO iteration, top to bottom: ``collect`` a rollout, then ``learn`` from it.

    rollout = algo.collect(batch)      # play and score episodes, old logprobs and values, advantages
    learned = algo.learn(rollout, opt)  # ppo_epochs x minibatches of clipped updates
    algo.end_iteration(kl, rows)        # KL controller; an engine with its own weights gets the new ones

The episodes come from a ``rollouts.RolloutWorker`` (sampling, environments, reward); the math is
in ``losses.py`` (policy and value losses), ``advantages.py`` (GAE, whitening, the critic-free
estimators), ``kl.py`` (KL estimators and controllers) and ``rollout.py`` (``finish_rollout``,
the update's record). The forwards are ``rollouts.forward``'s. Every concern of running on
several ranks or in another precision goes through ``self.runtime`` (``parallel.distributed.Runtime``);
on one process it is plain PyTorch. ``train.module.PPOModule`` adapts this to Lightning's hooks:
``collect`` in ``on_train_batch_start``, ``learn`` in ``training_step``.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import defaultdict
from typing import Iterator

import torch
from torch import Tensor, nn

from ppo_lightning.algo.kl import approx_kl, build_kl_controller, kl_estimator_for, kl_penalty
from ppo_lightning.algo.losses import (
    Aggregation,
    clip_fractions,
    global_token_count,
    ppo_policy_loss,
    ppo_value_loss,
    token_mean,
)
from ppo_lightning.algo.rollout import EngineView, Forwards, Rollout, ScoreShaping, finish_rollout
from ppo_lightning.algo.stats import masked_mean, masked_var
from ppo_lightning.config import PPOConfig
from ppo_lightning.config.choices import LOSS_AGGREGATIONS
from ppo_lightning.rollouts import Episodes, Prompts, RolloutWorker
from ppo_lightning.rollouts.engine import truncated_logprobs
from ppo_lightning.rollouts.forward import (
    PolicyOutput,
    Sequences,
    forward_logprobs,
    layout_for,
    policy_forward,
    row_prompts,
    row_windows,
    split_to,
    token_budget_groups,
)


@dataclasses.dataclass
class Learned:
    """What ``learn`` did: per-minibatch statistics, and the updates it skipped."""

    stats: dict[str, list[Tensor]]  # metric name -> one value per stepped minibatch; policy/epochs
    skipped: int  # updates skipped for a non-finite rollout, loss or gradient (weights untouched)
    nonfinite: str = ""  # what was non-finite, for the warning


class PPO:
    """PPO (or a critic-free estimator, ``cfg.advantage``) on ``policy`` against the frozen
    ``ref_lm``, on the episodes ``worker`` plays (``rollouts.RolloutWorker``: the policy's
    generation backend, the sampling, the environment, the reward). State across iterations:
    ``kl_ctl`` (the KL coefficient), ``generator`` (this rank's sampling and shuffling stream) and
    ``reward_norm`` (the score's ``(gain, bias)``), all checkpointed by the module.
    ``cfg.minibatch_size`` is the resolved one (``config.ppo.minibatch_size_for``, as
    ``jobs.factory`` passes it): rows, never null."""

    def __init__(self, policy, ref_lm: nn.Module, worker: RolloutWorker, cfg: PPOConfig, runtime):
        self.policy, self.ref_lm, self.worker, self.cfg, self.runtime = policy, ref_lm, worker, cfg, runtime
        self.kl_ctl = build_kl_controller(cfg.kl_coef, cfg.adaptive_kl, cfg.kl_target, cfg.kl_horizon)
        self.kl_estimator = kl_estimator_for(cfg.kl_in, cfg.kl_estimator)  # null: per placement
        self.reward_norm: tuple[float, float] | None = None  # set by the module: configured, fitted or restored
        self.generator: torch.Generator | None = None
        self.layout = layout_for(cfg, policy)
        # seq_mean_token_sum_norm's constant: the most policy tokens an episode can hold (with an
        # environment, every turn's: env.max_turns x max_new_tokens, at most env.max_total_tokens)
        self.norm_length = worker.max_policy_tokens if worker is not None else 0
        self._fused: tuple[Rollout, PolicyOutput] | None = None  # collect's forward, for learn's first update

    @property
    def temperature(self) -> float:
        """The sampling temperature: every logprob PPO takes divides the logits by it ([N+])."""
        return self.worker.params.temperature

    # ------------------------------------------------------------------------- part 1: collect
    def collect(self, batch: dict, policy_version: int = 0) -> Rollout:
        """Play ``num_generations`` episodes per prompt (a group, on consecutive rows) through the
        worker, take the old policy's logprobs and values and the reference's logprobs, and turn
        scores and KL into advantages. Runs in the update's numerics, weights gathered once.
        ``policy_version``: the iteration, recorded with the episodes."""
        c, t0 = self.cfg, time.perf_counter()
        prompts = Prompts.of(batch).repeated(c.num_generations)
        with self.runtime.rollout_context(self.policy, self.ref_lm):
            ep = self.worker.play(prompts, self.generator, policy_version)
            seq = Sequences.of(ep.query_responses, ep.attention_mask, ep.context_length)
            chunks = (c.rollout_forward_batch_size, c.lm_head_chunk_size)
            ref_logprobs, _ = forward_logprobs(None, self.ref_lm, *seq, self.temperature, *chunks, self.layout)
            logprobs, values, fused = self._old_logprobs_and_values(seq)
            kl_coef = self.kl_ctl.value if c.kl_in == "reward" else 0.0  # kl_in=loss: the update adds it
            r = finish_rollout(
                ep,
                Forwards(seq.position_ids, ref_logprobs, logprobs, values),
                kl_coef=kl_coef,
                kl_estimator=self.kl_estimator,
                cfg=c,
                shaping=ScoreShaping(
                    self.reward_norm,
                    c.missing_eos_penalty,
                    c.mask_truncated_completions,
                    self.worker.params.stop_at_eos,
                ),
                engine=engine_view(self.policy.lm, self.worker, ep, seq, c, policy_version),
                collect_time_s=time.perf_counter() - t0,
            )
        self._fused = None if fused is None else (r, fused)
        return r

    def _old_logprobs_and_values(self, seq: Sequences) -> tuple[Tensor, Tensor | None, PolicyOutput | None]:
        """The old policy's logprobs and values ``[B, R]`` (values None without a value head), and
        the forward they came from when it is fused (``ppo.fuse_rollout_forward``): when one
        minibatch and one micro-batch are the whole batch, the first update would run exactly
        this forward again, on the same rows and weights. It then runs once, with gradients,
        and the first update reuses it (``learn``)."""
        c, whole = self.cfg, seq.query_responses.shape[0]
        one_part = (c.micro_batch_size or whole) >= whole and c.micro_batch_tokens is None
        if c.fuse_rollout_forward and c.minibatch_size >= whole and one_part:
            with torch.enable_grad():
                out = self._policy_forward(seq)
            return out[2].detach(), (out[1].detach() if out[1] is not None else None), out
        logprobs, values = forward_logprobs(
            self.policy, None, *seq, self.temperature, c.rollout_forward_batch_size, c.lm_head_chunk_size, self.layout
        )
        return logprobs, values, None

    def _policy_forward(self, mb: Rollout | Sequences) -> PolicyOutput:
        c = self.cfg
        return policy_forward(self.policy, mb, self.temperature, c.lm_head_chunk_size, c.ent_coef > 0, self.layout)

    # ------------------------------------------------------------------------- part 2: learn
    def learn(self, r: Rollout, opt) -> Learned:
        """``ppo_epochs`` passes over shuffled minibatches of ``r``, one clipped update each,
        until ``target_kl`` stops them. A rollout that is not finite on every rank is skipped."""
        c, stats = self.cfg, defaultdict(list)
        per_epoch = max(1, r.batch_size // c.minibatch_size)
        # collect's forward with gradients, when fused: the first update's, used once and then stale
        fused, self._fused = (self._fused[1] if self._fused is not None and self._fused[0] is r else None), None
        if not self.runtime.all_ranks(bool(r.is_finite())):  # every update would be NaN
            return Learned(stats, c.ppo_epochs * per_epoch, r.describe_nonfinite(self.worker.tokenizer))
        done = skipped = 0
        nonfinite = ""
        for mb in (mb for _ in range(c.ppo_epochs) for mb in self._minibatches(r)):
            mb_stats, why = self._update(mb, opt, first_forward=fused if mb is r else None)
            fused = None
            if why == "target_kl":  # no further update this iteration
                break
            done, skipped, nonfinite = done + 1, skipped + (why is not None), why or nonfinite
            for k, v in (mb_stats or {}).items():
                stats[k].append(v)
        opt.zero_grad()  # free the gradients: the next rollout needs no copy of them
        stats["policy/epochs"] = [torch.tensor(done / per_epoch, device=r.scores.device)]
        return Learned(stats, skipped, nonfinite)

    def _minibatches(self, r: Rollout) -> Iterator[Rollout]:
        """One epoch's minibatches (``minibatch_rows``), or the whole rollout when one covers it."""
        if self.cfg.minibatch_size >= r.batch_size:
            yield r
            return
        for idx in minibatch_rows(r.batch_size, self.cfg, self.layout.shared_prompt, self.generator, r.scores.device):
            yield r.index(idx)

    def _update(self, mb: Rollout, opt, first_forward: PolicyOutput | None) -> tuple[dict | None, str | None]:
        """One clipped step on a minibatch: ``(statistics, None)``, or ``(None, why)`` when no step
        is taken (weights untouched; decided on every rank alike): ``why`` is what was non-finite,
        or ``"target_kl"`` when the minibatch's approximate KL to the rollout's policy, averaged
        over ranks, passed ``ppo.target_kl`` (Stable-Baselines3's early stop: measured by this
        minibatch's forward, so it counts every step before it).

        With ``ppo.micro_batch_size`` (or ``micro_batch_tokens``) the rows go through forward and
        backward a micro-batch at a time, gradients accumulating (all-reduced on the last): each
        micro-batch's losses are its share of the minibatch's token mean, so the step is the whole
        minibatch's.
        """
        c, rt = self.cfg, self.runtime
        # what every token mean divides by: this rank's tokens, or with token_mean_global every rank's
        n_tokens = (
            global_token_count(mb.response_mask)
            if LOSS_AGGREGATIONS.spec(c.loss_agg).global_tokens
            else mb.response_mask.sum()
        )
        parts, order = micro_batches(mb, c, self.runtime, self.layout.shared_prompt)
        stats: dict[str, Tensor] = {}
        new_logps = []
        opt.zero_grad()
        for i, part in enumerate(parts):
            with rt.gradient_sync(i == len(parts) - 1):
                loss, part_stats, new_logp = self._loss(
                    part, first_forward or self._policy_forward(part), n_tokens, mb.batch_size
                )
                if not rt.all_ranks(bool(torch.isfinite(loss))):
                    opt.zero_grad()
                    return None, f"loss {loss.item()}"
                rt.backward(loss)
            for k, v in part_stats.items():  # shares of the minibatch's mean
                stats[k] = stats[k] + v if k in stats else v
            new_logps.append(new_logp.detach())
        new_logp, mask = torch.cat(new_logps) if len(new_logps) > 1 else new_logps[0], mb.response_mask
        if order is not None:  # back to the minibatch's row order
            new_logp = new_logp[torch.argsort(order)]
        approxkl = approx_kl(new_logp, mb.logprobs, mask)
        if c.target_kl is not None and rt.mean_over_ranks(approxkl) > c.target_kl:
            opt.zero_grad()
            return None, "target_kl"
        if not rt.all_ranks(rt.clip_and_check(opt, c.max_grad_norm)):
            opt.zero_grad()
            return None, "gradient norm"
        rt.step(opt)
        with torch.no_grad():
            ratio = torch.exp(new_logp - mb.logprobs)
            return {
                "policy/approxkl_avg": approxkl,
                **stats,
                "val/ratio": masked_mean(ratio, mask),
                "val/ratio_var": masked_var(ratio, mask, unbiased=False),
            }, None

    def _loss(self, part: Rollout, forward: PolicyOutput, n_tokens: Tensor, seq_count: int):
        """``(loss, statistics, new logprobs)`` of a micro-batch: the clipped policy loss, plus
        ``vf_coef`` x the clipped value loss (with a critic), minus ``ent_coef`` x the entropy,
        plus ``kl_coef`` x the KL to the reference (``kl_in=loss``). Each token mean divides by
        the minibatch's ``n_tokens``, so micro-batches' losses add up to the minibatch's."""
        c, mask = self.cfg, part.response_mask
        entropies, new_values, new_logp = forward
        low, high = c.clip_low or c.clip, c.clip_high or c.clip
        agg = Aggregation(c.loss_agg, n_tokens, seq_count, self.norm_length)
        pg_loss, pg_clipfrac = ppo_policy_loss(
            new_logp,
            part.logprobs,
            part.advantages,
            mask,
            low,
            agg,
            clip_high=high,
            dual_clip=c.dual_clip,
            weights=part.engine_weights,
        )
        with torch.no_grad():
            clip_lo, clip_hi = clip_fractions(new_logp, part.logprobs, part.advantages, mask, low, high, n_tokens)
        with torch.set_grad_enabled(c.ent_coef > 0):  # entropy: a bonus, else a monitor
            entropy = token_mean(entropies, mask, n_tokens)
        stats = {
            "policy/clipfrac_avg": pg_clipfrac,
            "policy/clipfrac_low_avg": clip_lo,
            "policy/clipfrac_high_avg": clip_hi,
            "policy/entropy_avg": entropy.detach(),
            "loss/policy_avg": pg_loss.detach(),
        }
        if new_values is not None:  # critic-free estimators have no value loss, and no value metrics
            vf_loss, vf_clipfrac = ppo_value_loss(new_values, part.values, part.returns, mask, c.vf_clip, n_tokens)
            loss = pg_loss + c.vf_coef * vf_loss - c.ent_coef * entropy
            stats.update({"loss/value_avg": vf_loss.detach(), "val/clipfrac_avg": vf_clipfrac})
        else:
            loss = pg_loss - c.ent_coef * entropy
        if c.kl_in == "loss":  # GRPO: beta * KL(policy, reference), masked before the estimator
            kl_loss = agg(kl_penalty(new_logp, part.ref_logprobs, self.kl_estimator, mask), mask)
            loss = loss + self.kl_ctl.value * kl_loss
            stats["loss/kl_avg"] = kl_loss.detach()
        return loss, stats, new_logp

    # ------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """What the algorithm carries across iterations, for a checkpoint: the KL controller, the
        reward normalisation and every rank's sampling stream (a collective)."""
        backend = self.worker.backend.state_dict()  # a lagging sampler's weights (rollout.staleness)
        return {
            "kl_ctl": self.kl_ctl.state_dict(),
            "reward_norm": list(self.reward_norm) if self.reward_norm is not None else None,
            "generators": self.runtime.generator_states(self.generator),
            **({"backend": backend} if backend else {}),
        }

    def load_state_dict(self, state: dict, seed: int, step: int) -> tuple[int, bool] | None:
        """Restore ``state_dict``'s entries that a checkpoint holds (an older one may hold one
        ``generator``); with sampling streams, ``(how many, whether this rank resumed its own)``
        (a run on another number of ranks starts new streams from ``seed`` and ``step``)."""
        if "kl_ctl" in state:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
        if state.get("reward_norm") is not None:
            self.reward_norm = tuple(state["reward_norm"])
        if state.get("backend"):
            self.worker.backend.load_state_dict(state["backend"])
        states = state.get("generators") or ([state["generator"]] if state.get("generator") is not None else None)
        if not states:
            return None
        self.generator, resumed = self.runtime.restore_generator(states, seed, step)
        return len(states), resumed

    # ------------------------------------------------------------------------- between iterations
    def end_iteration(self, kl: float, rows: int) -> float | None:
        """The KL controller steps from the measured KL (``rows`` episodes over all ranks; a
        non-finite KL is skipped), and a backend with its own weights takes the new ones: the
        seconds that took (``perf/time_weight_sync_s``), or None for a backend with none."""
        if math.isfinite(kl):
            self.kl_ctl.update(kl, rows)
        return self.worker.sync_weights()


def engine_view(
    lm, worker: RolloutWorker, ep: Episodes, seq: Sequences, c: PPOConfig, policy_version: int = 0
) -> EngineView | None:
    """A backend's own logprobs of its samples (each turn's, in place, for episodes; None where
    the backend reports none, ``hf`` without ``generation.logprobs``, and then no view), with the policy ``lm``'s logprobs of the same
    distribution when the worker's sampling truncates it (top-k / top-p / min-p:
    ``truncated_logprobs``, one more no-grad forward, in the engine's order), and ``c``'s
    correction (``ppo.engine_correction``). Runs in the rollout's context (weights gathered, the
    update's numerics). ``policy_version``: the old policy's, which each token's staleness counts from."""
    if ep.engine_logprobs is None:
        return None
    params, sampling = worker.params, None
    if params.truncates:
        sampling = truncated_logprobs(
            lm, *seq, params, c.rollout_forward_batch_size, c.remove_padding, worker.backend.min_p_first
        )
    staleness = (policy_version - ep.token_versions).clamp(min=0) * (ep.response_mask > 0)
    return EngineView(ep.engine_logprobs, sampling, c.engine_correction, c.engine_correction_cap, staleness)


def minibatch_rows(rows: int, c: PPOConfig, whole_groups: bool, generator, device=None) -> list[Tensor]:
    """One epoch's minibatches of ``c.minibatch_size`` rows out of ``rows``: shuffled rows, or with
    ``whole_groups`` (prompts encoded once per group) shuffled whole groups of ``num_generations``
    consecutive rows, since a minibatch of random rows holds few rows of one prompt and shares little."""
    if whole_groups:
        n = c.num_generations
        groups = torch.randperm(rows // n, generator=generator, device=device)
        order = (groups[:, None] * n + torch.arange(n, device=device)).flatten()
    else:
        order = torch.randperm(rows, generator=generator, device=device)
    return list(order.split(c.minibatch_size))


def micro_batches(
    mb: Rollout, c: PPOConfig, runtime, shared_prompt: bool = False
) -> tuple[list[Rollout], Tensor | None]:
    """The micro-batches of a minibatch, and the row order they hold it in (None: in order).
    ``ppo.micro_batch_tokens``: rows by length, longest first, in groups within the budget
    (``token_budget_groups``; with ``shared_prompt``, by response length, each distinct prompt
    counted once), as many on every rank; ``micro_batch_size``: consecutive rows."""
    if c.micro_batch_tokens is not None:
        P = mb.context_length
        starts, stops = row_windows(mb.attention_mask, P)
        prompts = row_prompts(mb.query_responses, mb.attention_mask, P) if shared_prompt else None
        groups = token_budget_groups(starts, stops, c.micro_batch_tokens, prompts, P)
        groups = [g.to(mb.scores.device) for g in split_to(groups, runtime.max_over_ranks(len(groups)))]
        return [mb.index(g) for g in groups], torch.cat(groups)
    size = c.micro_batch_size if c.micro_batch_size and c.micro_batch_size < mb.batch_size else mb.batch_size
    if size == mb.batch_size:
        return [mb], None
    return [mb.index(slice(s, s + size)) for s in range(0, mb.batch_size, size)], None
