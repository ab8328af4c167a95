"""``PPOModule``: one PPO iteration per Lightning batch, in two parts.

1. ``on_train_batch_start``: sample responses to the batch's prompts and score them, then the old
   policy's logprobs and values, per-token rewards and advantages: one ``Rollout``.
2. ``training_step``: ``ppo_epochs`` passes over shuffled minibatches of that rollout, one clipped
   update each (``_update``, manual optimisation), then the end of the iteration (``_end_iteration``:
   step counter, scheduler, KL controller, counters) and its metrics.

The module orchestrates; the math lives in ``ppo.py`` and ``rollout.py``. Lightning's
``global_step`` counts PPO iterations (not the many optimizer steps inside one), so
``trainer.max_steps``, checkpoint intervals and logger steps all speak in iterations.
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
import time
from collections import defaultdict
from typing import Iterator

import lightning as L
import torch
from torch import Tensor, nn

from ppo_lightning import estimators, ppo
from ppo_lightning.errors import ConfigError
from ppo_lightning.generation import BackendFactory, SamplingParams, StopSequences, default_backend
from ppo_lightning.kl_control import build_kl_controller
from ppo_lightning.lightning_compat import count_iteration, no_gradient_sync, step_optimizer
from ppo_lightning.optim import configure_optimizers
from ppo_lightning.policy import PolicyWithValueHead
from ppo_lightning.rewards import fit_normalization, normalized
from ppo_lightning.rollout import Rollout, Samples, finish_rollout, forward_logprobs, sample_and_score, score_responses
from ppo_lightning.sharding import (FSDP2Strategy, full_tensor, initialize_root, is_sharded, shard_module,
                                    tied_aliases, unsharded_for_rollout)

log = logging.getLogger(__name__)

PROGRESS_BAR_METRICS = ("objective/scores", "objective/kl")
UPDATE_METRICS = ("policy/approxkl_avg", "policy/clipfrac_avg", "policy/clipfrac_low_avg", "policy/clipfrac_high_avg",
                  "policy/entropy_avg", "loss/policy_avg",
                  "loss/value_avg", "val/clipfrac_avg", "val/ratio", "val/ratio_var")
VALUE_METRICS = ("loss/value_avg", "val/clipfrac_avg", "value/explained_variance")  # not logged without a critic

PolicyOutput = tuple[Tensor, Tensor, Tensor]  # tempered logits [B, R, V], values [B, R], logprobs [B, R]


def stop_sequences(tokenizer, token_ids, strings) -> StopSequences:
    """``ppo.stop_token_ids`` (one token each) and ``ppo.stop_strings`` tokenised without special
    tokens, as the token-id sequences the samplers stop on (``SamplingParams.stop_sequences``)."""
    seqs = [(int(i),) for i in token_ids]
    for text in strings:
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise ConfigError(f"ppo.stop_strings: {text!r} is no token in the policy's tokenizer; remove it")
        seqs.append(ids)
    vocab = len(tokenizer)
    bad = [i for i in token_ids if not 0 <= int(i) < vocab]
    if bad:
        raise ConfigError(f"ppo.stop_token_ids: {bad} outside the tokenizer's {vocab} ids")
    return tuple(seqs)


class NonFiniteError(RuntimeError):
    """Too many PPO iterations in a row produced non-finite rewards, losses or gradients."""


class PPOModule(L.LightningModule):
    """PPO on a causal LM with a value head, against a frozen reference and a reward scorer.

    ``policy``: trained; ``ref_lm``: frozen copy of the initial LM (KL anchor); ``reward_fn``:
    ``(prompts, responses) -> raw scores``; ``ppo_cfg`` / ``optim_cfg``: ``PPOConfig`` /
    ``OptimizerConfig`` (see ``config.py``). ``backend``: the generation backend's factory (the
    ``generation`` config group; ``hf`` by default), called once for the policy (``sampler``) and
    once for the reference (``ref_sampler``); ``sampling``: how both sample, for every caller.
    ``reward_norm``: the ``(gain, bias)`` every raw score
    goes through, or None to fit it on ``normalize_reward_samples`` reference samples when the run
    starts (``_fit_reward_normalization``). ``value_head_from_reward``: the value head was copied
    from the reward model's raw head, so the fitted gain and bias are applied to it too.
    """

    def __init__(self, policy: PolicyWithValueHead, ref_lm: nn.Module, reward_fn, tokenizer,
                 ppo_cfg, optim_cfg, seed: int = 0, reward_norm: tuple[float, float] | None = (1.0, 0.0),
                 normalize_reward_samples: int = 256, value_head_from_reward: bool = False,
                 backend: BackendFactory | None = None):
        super().__init__()
        self.automatic_optimization = False
        self.strict_loading = False  # frozen weights are not checkpointed (see checkpointed)
        self.policy = policy
        self.ref_lm = ref_lm
        self.reward_fn = reward_fn  # registered as a submodule when it is a reward model
        self.tokenizer = tokenizer
        self.ppo_cfg = ppo_cfg
        self.sampling = SamplingParams.from_config(
            ppo_cfg, stop_sequences(tokenizer, ppo_cfg.stop_token_ids, ppo_cfg.stop_strings))
        self.kl_estimator = ppo.kl_estimator_for(ppo_cfg.kl_in, ppo_cfg.kl_estimator)  # null: per placement
        make = backend or default_backend()
        self.sampler = make(policy.lm, tokenizer, fast_decode=ppo_cfg.fast_decode)
        self.ref_sampler = make(ref_lm, tokenizer, fast_decode=ppo_cfg.fast_decode)
        self.optim_cfg = optim_cfg
        self.seed = seed
        self.reward_norm = reward_norm  # (gain, bias); None until fitted
        self.normalize_reward_samples = normalize_reward_samples
        self.value_head_from_reward = value_head_from_reward
        self.kl_ctl = build_kl_controller(ppo_cfg.kl_coef, ppo_cfg.adaptive_kl, ppo_cfg.kl_target,
                                          ppo_cfg.kl_horizon)
        self.episode = 0  # prompts consumed, summed over ranks
        self.skipped_updates = 0  # updates skipped for a non-finite loss or gradient
        self.nonfinite_streak = 0  # consecutive iterations with a skip
        self._last_nonfinite = ""
        self.generator: torch.Generator | None = None
        self.rollout: Rollout | None = None  # this iteration's, from on_train_batch_start
        self._first_forward: PolicyOutput | None = None  # see _old_logprobs_and_values
        self.last_metrics: dict[str, float] = {}  # every metric of the last iteration
        self._time_rollout = 0.0
        self._trainer_metrics: tuple[str, ...] = ()  # set in on_fit_start
        self._plain_clipping = False  # set in on_fit_start: clip_grad_norm_ directly
        self._unsaved_policy_keys: frozenset[str] | None = None  # see checkpointed

    # ------------------------------------------------------------------------- setup
    def configure_model(self) -> None:
        """Under ``FSDP2Strategy`` (``trainer=fsdp``, ``fsdp_cpu``): shard the policy and the
        reference over the data-parallel mesh (``sharding.shard_module``). Other strategies: nothing."""
        if isinstance(self.trainer.strategy, FSDP2Strategy):
            shard_module(self, self.device_mesh["data_parallel"])

    def configure_optimizers(self):
        return configure_optimizers(self, [p for p in self.policy.parameters() if p.requires_grad],
                                    self.optim_cfg)

    def on_fit_start(self) -> None:
        # Each rank samples with its own seed, or all ranks would draw correlated responses
        # ([N+] "per-rank seeds"). Minibatch shuffling uses the same generator. A resumed run
        # restores every rank's generator from the checkpoint (before this hook, or after it
        # under sharded strategies, which then replace this one).
        if self.generator is None:
            self.generator = torch.Generator(device=self.device)
            self.generator.manual_seed(self.seed + 1000 * self.global_rank)
        self.ref_lm.eval()
        if is_sharded(self.policy):
            initialize_root(self.policy, self.device)
        from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
        from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy

        # Gradients that are not loss-scaled (fp32, bf16-mixed, bf16-true) on one device, DDP or
        # FSDP2: clip them directly (see _clip_and_check_gradients). Lightning's MixedPrecision
        # refuses to clip for a fused optimizer even with bf16, where there is no scaler to undo.
        # (FSDP2's gradients are DTensors: clip_grad_norm_ reduces their norm across ranks.)
        plugin = self.trainer.precision_plugin
        self._plain_clipping = (type(plugin) in (Precision, MixedPrecision, HalfPrecision)
                                and getattr(plugin, "scaler", None) is None
                                and type(self.trainer.strategy) in (SingleDeviceStrategy, DDPStrategy, FSDP2Strategy))
        # What `self.log` must carry into trainer.callback_metrics: the metrics a callback
        # monitors (ModelCheckpoint, EarlyStopping, ...) and the progress bar's. Each `self.log`
        # costs ~0.5 ms on CPU, so nothing else goes that way; every metric goes to the loggers.
        # A ModelCheckpoint's filename template ("..._{objective/rlhf_reward:.4f}") reads them too.
        read = set(PROGRESS_BAR_METRICS) if self.trainer.progress_bar_callback is not None else set()
        for cb in self.trainer.callbacks:
            if isinstance(getattr(cb, "monitor", None), str):
                read.add(cb.monitor)
            if isinstance(getattr(cb, "filename", None), str):
                read.update(re.findall(r"\{([^}:]+)", cb.filename))
        self._trainer_metrics = tuple(sorted(read))

    @torch.no_grad()
    def _fit_reward_normalization(self) -> None:
        """Score reference-policy samples on the run's prompts; fix gain/bias from them ([N+]):
        ``rewards.fit_normalization``.

        Runs once per run (a resumed run restores gain/bias from the checkpoint). Uses its own
        seeded generator so it does not shift the training run's sampling stream.
        """
        loader = self.trainer.datamodule
        g = torch.Generator(device=self.device).manual_seed(self.seed + 7919 + self.global_rank)
        need = self.normalize_reward_samples // max(1, self.trainer.world_size)
        if need < 1:  # config.validate refuses it when the process count is known before launch
            raise ConfigError(f"reward.normalize_samples={self.normalize_reward_samples} is split over "
                              f"{self.trainer.world_size} ranks and leaves none for some; set it to at least "
                              f"{2 * self.trainer.world_size}")
        raw = []
        for batch in loader.normalization_batches(need):
            ids, am = batch["input_ids"].to(self.device), batch["attention_mask"].to(self.device)
            resp, mask = self.ref_sampler.generate(ids, am, self.sampling, g)
            # the same scoring path (token ids or decoded text) as the rollouts
            raw.append(score_responses(self.reward_fn, self.tokenizer, ids, am, resp, mask))
        reduce = None
        if self.trainer.world_size > 1:
            reduce = lambda t: self.trainer.strategy.reduce(t.to(self.device), reduce_op="sum")  # noqa: E731
        gain, bias = fit_normalization(torch.cat(raw), reduce, source=getattr(self.reward_fn, "name", "the reward"))
        self.reward_norm = (gain, bias)
        if self.value_head_from_reward:  # copied from the raw head: put it on the new scale too
            with torch.no_grad():
                self.policy.v_head.weight.mul_(gain)
                self.policy.v_head.bias.mul_(gain).add_(bias)
        log.info("reward normalisation from %d reference samples: gain %.4g, bias %.4g", sum(map(len, raw)), gain, bias)

    @torch.no_grad()
    def score(self, prompts: list[str], responses: list[str]) -> Tensor:
        """The training reward of texts: the reward's raw scores through the run's normalisation."""
        return normalized(torch.as_tensor(self.reward_fn(prompts, responses), dtype=torch.float32), self.reward_norm)

    # ------------------------------------------------------------------------- part 1: rollout
    def on_train_batch_start(self, batch: dict, batch_idx: int) -> None:
        if self.reward_norm is None:  # once per run: a resumed run restored it from the checkpoint
            # (here, not in on_fit_start: sharded strategies restore checkpoints after on_fit_start)
            with self.trainer.precision_plugin.forward_context(), self._gathered(self.ref_lm):
                self._fit_reward_normalization()  # in the rollouts' numerics
        # Lightning runs only training_step in the precision plugin's context (autocast for
        # bf16-mixed): the rollout enters it itself, so sampling, the reference, the reward model
        # and the old logprobs see the numerics the update sees (ratio exactly 1 at the start).
        # Under FSDP the policy and reference are gathered once for the whole rollout, not once
        # per sampled token (sharding.unsharded_for_rollout), unless the strategy says otherwise.
        with self.trainer.precision_plugin.forward_context(), self._gathered(self.policy, self.ref_lm):
            self._rollout(batch)

    def _gathered(self, *modules):
        """``sharding.unsharded_for_rollout(*modules)`` when the strategy gathers sharded weights
        once per rollout (``FSDP2Strategy.gather_for_rollout``); otherwise nothing."""
        if getattr(self.trainer.strategy, "gather_for_rollout", False):
            return unsharded_for_rollout(*modules)
        return contextlib.nullcontext()

    def _rollout(self, batch: dict) -> None:
        c = self.ppo_cfg
        t0 = time.perf_counter()
        input_ids, attention_mask = batch["input_ids"], batch["attention_mask"]
        if c.num_generations > 1:  # each prompt's samples on consecutive rows of this rank: a group
            input_ids = input_ids.repeat_interleave(c.num_generations, dim=0)
            attention_mask = attention_mask.repeat_interleave(c.num_generations, dim=0)
        samples = sample_and_score(
            sampler=self.sampler, params=self.sampling, ref_lm=self.ref_lm, reward_fn=self.reward_fn,
            tokenizer=self.tokenizer, input_ids=input_ids, attention_mask=attention_mask,
            missing_eos_penalty=c.missing_eos_penalty, forward_chunk_size=c.rollout_forward_batch_size,
            reward_norm=self.reward_norm, generator=self.generator)
        logprobs, values = self._old_logprobs_and_values(samples)
        kl_coef = self.kl_ctl.value if c.kl_in == "reward" else 0.0  # kl_in=loss: the update adds it
        self.rollout = finish_rollout(samples, logprobs, values, kl_coef=kl_coef, gamma=c.gamma, lam=c.lam,
                                      kl_estimator=self.kl_estimator,
                                      whiten_rewards=c.whiten_rewards,
                                      advantage=c.advantage, group_size=c.num_generations,
                                      scale_by_group_std=c.scale_by_group_std)
        self._time_rollout = time.perf_counter() - t0

    def _old_logprobs_and_values(self, samples: Samples) -> tuple[Tensor, Tensor | None]:
        """The old policy's logprobs and values of the sampled responses ``[B, R]`` (values None
        without a value head).

        The fused first forward (``ppo.fuse_rollout_forward``): when one minibatch (and one
        micro-batch) is the whole batch, the first update would run exactly this forward again, on
        the same rows with the same weights. So it runs once, with gradients, and is kept in
        ``_first_forward`` for that update (``_forward``); its detached outputs are the old
        logprobs and values. This is the
        only place the two parts of an iteration share a forward.
        """
        c = self.ppo_cfg
        whole = samples.batch_size
        if c.fuse_rollout_forward and c.minibatch_size >= whole and (c.micro_batch_size or whole) >= whole:
            with torch.enable_grad():
                self._first_forward = self._policy_forward(samples)
            _, values, logprobs = self._first_forward
            return logprobs.detach(), (values.detach() if values is not None else None)
        return forward_logprobs(self.policy, None, samples.query_responses, samples.attention_mask,
                                samples.position_ids, samples.context_length, c.temperature,
                                c.rollout_forward_batch_size)

    def _policy_forward(self, mb: Rollout | Samples) -> PolicyOutput:
        """Tempered logits ``[B, R, V]``, values ``[B, R]`` and logprobs of the responses ``[B, R]``."""
        logits, values = self.policy(mb.query_responses, mb.attention_mask, mb.position_ids, mb.context_length)
        if self.ppo_cfg.temperature != 1.0:  # as in the rollout's logprobs
            logits = logits / self.ppo_cfg.temperature
        return logits, values, ppo.logprobs_from_logits(logits, mb.responses)

    def _forward(self, mb: Rollout) -> PolicyOutput:
        """The update's forward: the rollout's own when it was fused into it, else a new one."""
        if self._first_forward is not None and mb is self.rollout:
            out, self._first_forward = self._first_forward, None
            return out
        return self._policy_forward(mb)

    # ------------------------------------------------------------------------- part 2: updates
    def training_step(self, batch: dict, batch_idx: int) -> None:
        """``ppo_epochs`` passes over the rollout's minibatches, one ``_update`` each; then the end
        of the iteration (``_end_iteration``) and its metrics."""
        c, r = self.ppo_cfg, self.rollout
        t0 = time.perf_counter()
        lr, kl_coef = self.lr_schedulers().get_last_lr()[0], self.kl_ctl.value  # what this iteration uses
        stats: dict[str, list[Tensor]] = defaultdict(list)
        per_epoch = max(1, r.batch_size // c.minibatch_size)  # minibatches per epoch
        skipped = done = 0  # updates skipped (non-finite); minibatches run, stepped or skipped
        if self._all_ranks(bool(r.is_finite())):
            stop = False
            for _ in range(c.ppo_epochs):
                for mb in self._minibatches(r):
                    mb_stats, stop = self._update(mb)
                    if stop:  # past ppo.target_kl: no further update this iteration
                        break
                    done += 1
                    skipped += mb_stats is None
                    for k, v in (mb_stats or {}).items():
                        stats[k].append(v)
                if stop:
                    break
            self.optimizers().zero_grad()  # free the gradients: the next rollout needs no copy of them
        else:  # every update would be NaN
            skipped = c.ppo_epochs * per_epoch
            self._last_nonfinite = self._describe_nonfinite(r)
        self._first_forward = None  # not used when the iteration was skipped
        if self.device.type == "cuda":
            torch.cuda.synchronize()  # count queued kernels in the timers
        stats["policy/epochs"] = [torch.tensor(done / per_epoch, device=self.device)]
        metrics = self._rollout_metrics(r, stats, time.perf_counter() - t0)
        self._end_iteration(r.batch_size, skipped, metrics["objective/kl"])
        metrics.update({"objective/kl_coef": kl_coef, "lr": lr, "episode": float(self.episode),
                        "health/skipped_updates": float(self.skipped_updates)})
        self._log_metrics(metrics, r.batch_size)
        self._stop_if_nonfinite_streak()

    def _minibatches(self, r: Rollout) -> Iterator[Rollout]:
        """One epoch's minibatches: shuffled rows, or the whole rollout when one minibatch covers it
        (the loss is a mean, so row order is moot)."""
        mbs = self.ppo_cfg.minibatch_size
        if mbs >= r.batch_size:
            yield r
            return
        for idx in torch.randperm(r.batch_size, generator=self.generator, device=self.device).split(mbs):
            yield r.index(idx)

    def _update(self, mb: Rollout) -> tuple[dict[str, Tensor] | None, bool]:
        """One clipped PPO step on a minibatch: ``(its statistics, False)``; ``(None, False)`` when
        it was skipped for a non-finite loss or gradient norm; ``(None, True)`` when its approximate
        KL to the rollout's policy, averaged over ranks, passed ``ppo.target_kl``: the step is not
        taken and the iteration's updates end (Stable-Baselines3's early stop: the KL is measured
        by this minibatch's forward, so it counts every step before it). Weights are untouched
        unless a step is taken, and every decision is taken on all ranks.

        With ``ppo.micro_batch_size`` the minibatch's rows go through forward and backward a
        micro-batch at a time, gradients accumulating: each micro-batch's losses are its share of
        the minibatch's token mean (``ppo.token_mean``), so the gradient, and the step, are the
        whole minibatch's. Gradients are all-reduced once, on the last micro-batch.
        """
        c, opt = self.ppo_cfg, self.optimizers()
        # the token count every token mean divides by: this rank's minibatch, or with
        # loss_agg=token_mean_global the mean over ranks (so DDP's gradient average is the global mean)
        n_tokens = (ppo.global_token_count(mb.response_mask) if c.loss_agg == "token_mean_global"
                    else mb.response_mask.sum())
        parts = self._micro_batches(mb)
        stats: dict[str, Tensor] = {}
        new_logps = []
        opt.zero_grad()
        for i, part in enumerate(parts):
            with contextlib.nullcontext() if i == len(parts) - 1 else no_gradient_sync(self.trainer):
                mask = part.response_mask
                logits, new_values, new_logp = self._forward(part)
                low, high = c.clip_low or c.clip, c.clip_high or c.clip
                pg_loss, pg_clipfrac = ppo.ppo_policy_loss(
                    new_logp, part.logprobs, part.advantages, mask, low, n_tokens,
                    clip_high=high, dual_clip=c.dual_clip, agg=c.loss_agg, seq_count=mb.batch_size,
                    norm_length=c.max_new_tokens)
                with torch.no_grad():
                    clipped_low, clipped_high = ppo.clip_fractions(new_logp, part.logprobs, part.advantages, mask,
                                                                   low, high, n_tokens)
                if new_values is not None:
                    vf_loss, vf_clipfrac = ppo.ppo_value_loss(new_values, part.values, part.returns, mask,
                                                              c.vf_clip, n_tokens)
                else:  # critic-free: no value loss, and no value metrics
                    vf_loss, vf_clipfrac = torch.zeros((), device=mask.device), None
                with torch.set_grad_enabled(c.ent_coef > 0):  # entropy: a bonus, else a monitor
                    entropy = ppo.token_mean(ppo.entropy_from_logits(logits.float()), mask, n_tokens)
                loss = pg_loss + c.vf_coef * vf_loss - c.ent_coef * entropy
                if c.kl_in == "loss":  # GRPO: beta * KL(policy, reference) (k3 by default), aggregated
                    # like the policy loss; masked before the estimator (a pad's logprob is arbitrary)
                    kl_loss = ppo.aggregate(ppo.kl_penalty(new_logp, part.ref_logprobs, self.kl_estimator, mask), mask,
                                            c.loss_agg, n_tokens, mb.batch_size, c.max_new_tokens)
                    loss = loss + self.kl_ctl.value * kl_loss
                if not self._all_ranks(bool(torch.isfinite(loss))):
                    opt.zero_grad()  # weights untouched
                    self._last_nonfinite = f"loss {loss.item()}"
                    return None, False
                self.manual_backward(loss)
            for k, v in (("policy/clipfrac_avg", pg_clipfrac), ("policy/clipfrac_low_avg", clipped_low),
                         ("policy/clipfrac_high_avg", clipped_high), ("policy/entropy_avg", entropy.detach()),
                         ("loss/policy_avg", pg_loss.detach()), ("loss/value_avg", vf_loss.detach()),
                         ("val/clipfrac_avg", vf_clipfrac),
                         *((("loss/kl_avg", kl_loss.detach()),) if c.kl_in == "loss" else ())):
                if k in VALUE_METRICS and new_values is None:
                    continue
                stats[k] = stats[k] + v if k in stats else v  # shares of the minibatch's mean
            new_logps.append(new_logp.detach())
        mask, new_logp = mb.response_mask, torch.cat(new_logps) if len(new_logps) > 1 else new_logps[0]
        approxkl = ppo.approx_kl(new_logp, mb.logprobs, mask)
        if c.target_kl is not None and self._mean_over_ranks(approxkl) > c.target_kl:
            opt.zero_grad()  # weights untouched
            return None, True
        if not self._all_ranks(self._clip_and_check_gradients(opt)):
            opt.zero_grad()  # weights untouched
            self._last_nonfinite = "gradient norm"
            return None, False
        step_optimizer(self.trainer, opt)

        with torch.no_grad():
            ratio = torch.exp(new_logp - mb.logprobs)
            return {"policy/approxkl_avg": approxkl, **stats, "val/ratio": ppo.masked_mean(ratio, mask),
                    "val/ratio_var": ppo.masked_var(ratio, mask, unbiased=False)}, False

    def _micro_batches(self, mb: Rollout) -> list[Rollout]:
        """The minibatch in ``ppo.micro_batch_size`` rows at a time (itself when unset or larger)."""
        size = self.ppo_cfg.micro_batch_size
        if not size or size >= mb.batch_size:
            return [mb]
        return [mb.index(slice(s, s + size)) for s in range(0, mb.batch_size, size)]

    def _end_iteration(self, batch_size: int, skipped: int, kl: float) -> None:
        """What changes once per iteration, however many updates it took: the step counter, the
        scheduler, the KL controller (from the measured KL), the episode and skip counters."""
        count_iteration(self.optimizers())
        self.lr_schedulers().step()
        self.sampler.sync_weights(self.policy.lm.named_parameters())  # an engine with its own copy
        world = self.trainer.world_size
        if math.isfinite(kl):
            self.kl_ctl.update(kl, batch_size * world)
        self.episode += batch_size * world
        self.skipped_updates += skipped
        self.nonfinite_streak = self.nonfinite_streak + 1 if skipped else 0
        if skipped:
            log.warning("PPO iteration %d: skipped %d update(s) with non-finite %s; weights untouched",
                        self.global_step - 1, skipped, self._last_nonfinite)

    def _stop_if_nonfinite_streak(self) -> None:
        """Raise ``NonFiniteError`` after ``ppo.max_nonfinite_iterations`` skipping iterations in a row."""
        if self.nonfinite_streak >= self.ppo_cfg.max_nonfinite_iterations:
            raise NonFiniteError(
                f"{self.nonfinite_streak} PPO iterations in a row had non-finite values (last: "
                f"{self._last_nonfinite}); stopping (ppo.max_nonfinite_iterations="
                f"{self.ppo_cfg.max_nonfinite_iterations}). Checkpoints written so far are intact. Check the "
                "reward function, or lower optimizer.lr.")

    def _mean_over_ranks(self, x: Tensor) -> float:
        """The mean of a scalar over ranks (every rank gets the same number: a shared decision)."""
        if self.trainer.world_size > 1:
            x = self.trainer.strategy.reduce(x.detach(), reduce_op="mean")
        return float(x)

    def _all_ranks(self, ok: bool) -> bool:
        """True only if ``ok`` on every rank: a skip must happen everywhere, or DDP's gradient
        all-reduce would wait forever for the rank that skipped its backward."""
        if self.trainer.world_size == 1:
            return ok
        return bool(self.trainer.strategy.reduce_boolean_decision(ok, all=True))

    def _clip_and_check_gradients(self, opt) -> bool:
        """Clip to ``ppo.max_grad_norm`` (when > 0); return whether the gradient norm is finite.

        With a plain strategy and unscaled gradients (one device or DDP; 32-true, bf16-mixed or
        bf16-true) this is what Lightning's ``clip_gradients`` runs, ``clip_grad_norm_`` over the
        optimizer's parameters, whose return value is the norm the finiteness check needs: one
        pass over the gradients instead of two. Other setups (FSDP's sharded norm) go through
        ``self.clip_gradients`` and a separate norm.
        """
        max_norm = self.ppo_cfg.max_grad_norm
        params = [p for group in opt.optimizer.param_groups for p in group["params"] if p.grad is not None]
        if not params:
            return True
        if self._plain_clipping:
            if max_norm > 0:
                norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
            else:
                norm = torch.nn.utils.get_total_norm([p.grad for p in params])
            return bool(torch.isfinite(full_tensor(norm)))
        if max_norm > 0:
            self.clip_gradients(opt, gradient_clip_val=max_norm, gradient_clip_algorithm="norm")
        return bool(torch.isfinite(full_tensor(torch.nn.utils.get_total_norm([p.grad for p in params]))))

    def _describe_nonfinite(self, r: Rollout) -> str:
        bad = (~torch.isfinite(r.scores)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            prompt = self.tokenizer.decode(r.query_responses[i, :r.context_length], skip_special_tokens=True)
            return f"reward {r.scores[i].item()} for prompt {prompt[:60]!r}"
        return "logprobs, values or advantages in the rollout"

    # ------------------------------------------------------------------------- metrics
    def _rollout_metrics(self, r: Rollout, stats: dict[str, list[Tensor]], time_update: float) -> dict[str, float]:
        """The iteration's rollout and update statistics, reduced over ranks in one collective:
        means, except ``val/num_eos_tokens`` and ``perf/tokens_per_s``, which are sums."""
        mask = r.response_mask
        local = {
            "objective/scores": r.scores.mean(),
            "objective/raw_scores": r.raw_scores.mean(),
            "objective/kl": r.kl.sum(1).mean(),  # k1, summed over the response, mean over rows
            "objective/entropy": (-r.logprobs * mask).sum(1).mean(),  # sampled-token estimate
            "objective/non_score_reward": r.non_score_reward.mean(),
            "objective/rlhf_reward": (r.scores + r.non_score_reward).mean(),
            "value/explained_variance": ppo.explained_variance(r.values, r.returns, mask),
            "rollout/response_length": mask.sum(1).mean(),
            **self._group_metrics(r),
            "val/num_eos_tokens": r.contains_eos.float().sum(),
            "perf/tokens_per_s": mask.sum() / (self._time_rollout + time_update),
            **{k: torch.stack(v).mean() for k, v in stats.items()},
        }
        for k in UPDATE_METRICS:  # an iteration whose updates were all skipped has none
            local.setdefault(k, torch.tensor(float("nan"), device=mask.device))
        if self.policy.v_head is None:
            for k in VALUE_METRICS:
                local.pop(k, None)
        names = list(local)
        values = torch.stack([local[k].float().detach() for k in names])
        world = self.trainer.world_size
        if world > 1:
            values = self.trainer.strategy.reduce(values, reduce_op="mean")
        metrics = {k: float(v) for k, v in zip(names, values.cpu())}
        for k in ("val/num_eos_tokens", "perf/tokens_per_s"):
            metrics[k] *= world
        metrics.update({"perf/time_rollout_s": self._time_rollout, "perf/time_update_s": time_update})
        return metrics

    def _group_metrics(self, r: Rollout) -> dict[str, Tensor]:
        """With several responses per prompt: how much the scores differ within a prompt's group,
        and the fraction of groups where they do not differ at all (GRPO and RLOO learn nothing
        from those prompts but the KL penalty)."""
        n = self.ppo_cfg.num_generations
        if n < 2:
            return {}
        stats = estimators.group_reward_stats(r.scores, n)
        return {"objective/group_reward_std": stats["group_std"],
                "objective/frac_zero_std_groups": stats["frac_zero_std"]}

    def _log_metrics(self, metrics: dict[str, float], batch_size: int) -> None:
        """To every logger at step = the iteration just finished; through ``self.log`` only what
        callbacks and the progress bar read (see ``on_fit_start``)."""
        self.last_metrics = metrics
        for lg in self.loggers:  # one call per logger instead of ~30 `self.log` calls
            lg.log_metrics(metrics, step=self.global_step - 1)
        for k in self._trainer_metrics:  # a monitor naming no metric: Lightning's own error
            if k in metrics:
                self.log(k, metrics[k], prog_bar=k in PROGRESS_BAR_METRICS, logger=False, on_step=True,
                         on_epoch=False, batch_size=batch_size)

    # ------------------------------------------------------------------------- checkpoints
    def checkpointed(self, key: str) -> bool:
        """Whether a state-dict entry is saved in checkpoints. Frozen weights are not: the reference
        and reward model, and with LoRA the policy's base weights; each is rebuilt from its source
        (``model.name_or_path``, ``ref.*``, ``reward.*``) when a run resumes or exports. Nor is the
        second name of a tied weight (GPT-2's ``lm_head.weight`` is its token embedding): loading
        the first sets both, and a gathered (FSDP) state dict would hold it as a second copy."""
        if key.startswith(("ref_lm.", "reward_fn.")):
            return False
        if self._unsaved_policy_keys is None:
            frozen = {k for k, v in self.policy.state_dict(keep_vars=True).items()
                      if isinstance(v, nn.Parameter) and not v.requires_grad}
            self._unsaved_policy_keys = frozenset(f"policy.{k}" for k in frozen | tied_aliases(self.policy))
        return key not in self._unsaved_policy_keys

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        sd = checkpoint["state_dict"]
        for k in [k for k in sd if not self.checkpointed(k)]:
            del sd[k]
        checkpoint["ppo_state"] = {
            "kl_ctl": self.kl_ctl.state_dict(),
            "episode": self.episode,
            "skipped_updates": self.skipped_updates,
            "nonfinite_streak": self.nonfinite_streak,
            "reward_norm": list(self.reward_norm) if self.reward_norm is not None else None,
            "generators": self._generator_states(),
        }

    def _generator_states(self) -> list[Tensor] | None:
        """Every rank's sampling-generator state, rank order (a collective: Lightning builds the
        checkpoint on every rank; rank 0 writes it). Each rank resumes its own stream."""
        if self.generator is None:
            return None
        state = self.generator.get_state()
        if self.trainer.world_size == 1:
            return [state]
        # as int32: gloo's all_gather garbles uint8 tensors
        gathered = self.trainer.strategy.all_gather(state.to(self.device, torch.int32))  # [world, n]
        return [s.to("cpu", torch.uint8) for s in gathered]

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        state = checkpoint.get("ppo_state", {})
        if "kl_ctl" in state:
            self.kl_ctl.load_state_dict(state["kl_ctl"])
        self.episode = int(state.get("episode", 0))
        self.skipped_updates = int(state.get("skipped_updates", 0))
        self.nonfinite_streak = int(state.get("nonfinite_streak", 0))
        if state.get("reward_norm") is not None:
            self.reward_norm = tuple(state["reward_norm"])
        states = state.get("generators") or ([state["generator"]] if state.get("generator") is not None else None)
        if states:
            rank, world = self.global_rank, self.trainer.world_size
            self.generator = torch.Generator(device=self.device)
            if len(states) == world:
                self.generator.set_state(states[rank])
            else:  # a different number of ranks: a new stream per rank, not a copy of another's
                self.generator.manual_seed(self.seed + 1000 * rank + 7919 * int(checkpoint.get("global_step", 0)))
                if rank == 0:
                    log.warning("the checkpoint holds the sampling streams of %d rank(s); this run has %d, so "
                                "each rank starts a new stream (the trajectory differs from an uninterrupted run)",
                                len(states), world)
