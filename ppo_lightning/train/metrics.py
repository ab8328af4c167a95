"""An iteration's metrics: computed from its rollout and update statistics, reduced over ranks in
one collective, and logged once. Every name is documented in ``docs/metrics.md``; the names are
TRL's where TRL has one.
"""

from __future__ import annotations

import logging
import math
import re

import lightning as L
import torch
from torch import Tensor

from ppo_lightning.algo.advantages import group_reward_stats

from ppo_lightning.algo.stats import explained_variance, masked_mean
from ppo_lightning.envs.batch import COUNTED_METRICS
from ppo_lightning.algo.rollout import Rollout

log = logging.getLogger("ppo_lightning.train.module")  # the run log's name for the iteration's lines

PROGRESS_BAR_METRICS = ("objective/scores", "objective/kl")
UPDATE_METRICS = (
    "policy/approxkl_avg",
    "policy/clipfrac_avg",
    "policy/clipfrac_low_avg",
    "policy/clipfrac_high_avg",
    "policy/entropy_avg",
    "loss/policy_avg",
    "loss/value_avg",
    "val/clipfrac_avg",
    "val/ratio",
    "val/ratio_var",
)
VALUE_METRICS = ("loss/value_avg", "val/clipfrac_avg", "value/explained_variance")  # not logged without a critic
SUMMED_METRICS = ("val/num_eos_tokens", "perf/tokens_per_s", "rollout/masked_truncated", "rollout/unscored")


def iteration_metrics(
    r: Rollout,
    stats: dict[str, list[Tensor]],
    *,
    num_generations: int,
    has_critic: bool,
    time_rollout: float,
    time_update: float,
    runtime,
    mask_truncated: bool = False,
    engine_cap: float = 2.0,
) -> dict[str, float]:
    """The iteration's rollout and update statistics (``stats``: per-minibatch values), reduced
    over ranks in one collective (``runtime.reduce_mean``): means, except ``SUMMED_METRICS``."""
    mask = r.response_mask
    # with episodes, the score of a response is its episode's return: the final score and the
    # environment's turn rewards (on the training scale, as the advantages see them)
    scores = r.scores if r.turn_rewards is None else r.scores + r.turn_rewards.sum(1)
    local = {
        "objective/scores": scores.mean(),
        "objective/raw_scores": r.raw_scores.mean(),
        "objective/kl": r.kl.sum(1).mean(),  # k1, summed over the response, mean over rows
        "objective/entropy": (-r.logprobs * mask).sum(1).mean(),  # sampled-token estimate
        "objective/non_score_reward": r.non_score_reward.mean(),
        "objective/rlhf_reward": (scores + r.non_score_reward).mean(),
        "value/explained_variance": explained_variance(r.values, r.returns, mask),
        "rollout/response_length": mask.sum(1).mean(),
        **group_metrics(r, num_generations),
        **term_moments(r),
        **({"rollout/masked_truncated": (~r.contains_eos).float().sum()} if mask_truncated else {}),
        **({"rollout/unscored": (~r.scored).float().sum()} if r.scored is not None else {}),
        **(engine_mismatch(r, engine_cap) if r.engine_logprobs is not None else {}),
        "val/num_eos_tokens": r.contains_eos.float().sum(),
        "perf/tokens_per_s": mask.sum() / (time_rollout + time_update),
        **{k: torch.stack(v).mean() for k, v in stats.items()},
    }
    local.update(r.episodes.metrics(r.turn_rewards))  # env/*: none for the null environment
    for k in UPDATE_METRICS:  # an iteration whose updates were all skipped has none
        local.setdefault(k, torch.tensor(float("nan"), device=mask.device))
    if not has_critic:
        for k in VALUE_METRICS:
            local.pop(k, None)
    names = list(local)
    values = runtime.reduce_mean(torch.stack([local[k].float().detach() for k in names]))
    metrics = {k: float(v) for k, v in zip(names, values.cpu())}
    for k in (*SUMMED_METRICS, *COUNTED_METRICS):
        if k in metrics:
            metrics[k] *= runtime.world_size
    metrics.update(sparse_means(r, runtime, mask.device))
    for name in r.term_scores:  # over every rank's rows where the term applies
        count = metrics.pop(f"rewards/{name}/_count")
        total, square = metrics.pop(f"rewards/{name}/_sum"), metrics.pop(f"rewards/{name}/_square")
        mean = total / count if count > 0 else float("nan")
        metrics[f"rewards/{name}/mean"] = mean
        metrics[f"rewards/{name}/std"] = max(square / count - mean * mean, 0.0) ** 0.5 if count > 0 else float("nan")
    metrics.update({"perf/time_rollout_s": time_rollout, "perf/time_update_s": time_update})
    return metrics


def warn_of_empty_iteration(m: dict[str, float], rows: int, iteration: int, warned: set[str]) -> None:
    """One line, once per run (``warned`` holds what was said), where an iteration teaches nothing
    and would show it only as a loss of 0: no reward applied to any of its ``rows`` episodes
    (every one unscored), or, on the first iteration, every episode cut by a budget
    (``env.max_turns``, ``env.max_total_tokens``)."""
    if m.get("rollout/unscored") == rows and "unscored" not in warned:
        warned.add("unscored")
        log.warning(
            "PPO iteration %d: no reward applied to any of its %d episodes (every one unscored, masked out of the "
            "loss); check that the reward returns scores for these responses",
            iteration,
            rows,
        )
    if iteration == 0 and m.get("env/truncated_frac") == 1.0 and "truncated" not in warned:
        warned.add("truncated")
        log.warning(
            "PPO iteration 0: every episode was cut by a budget before the environment was done; raise "
            "env.max_turns or env.max_total_tokens (env/budget_cut_turns counts turns the token budget cut)"
        )


def sparse_means(r: Rollout, runtime, device) -> dict[str, float]:
    """Means over every rank of the metrics that only some ranks may have: each environment
    ``info`` key (over every step that reported it) and each reward's ``log_metric`` name (over
    the ranks that logged it), reduced over the union of the ranks' names in one collective."""
    sums = dict(r.episodes.info_sums())
    sums.update({k: (v, 1.0) for k, v in r.reward_logs.items()})
    names = runtime.union(sums)
    if not names:
        return {}
    local = torch.tensor([sums.get(k, (0.0, 0.0)) for k in names], dtype=torch.float64, device=device)
    total = runtime.reduce_sum(local).cpu()
    return {k: float(s / n) if n > 0 else float("nan") for k, (s, n) in zip(names, total.tolist())}


def engine_mismatch(r: Rollout, cap: float) -> dict[str, Tensor]:
    """How far the engine's sampling distribution is from the trainer's old policy on the tokens
    it sampled (kernels, precision, batching): the mean absolute logprob difference, the KL
    ``E_engine[log pi_engine - log pi_old]`` (k1 over the sampled tokens), the share of tokens
    whose ratio ``pi_old / pi_engine`` passes ``ppo.engine_correction_cap``, and the ratios'
    normalised effective sample size ``(sum rho)^2 / (n sum rho^2)`` (1: no mismatch). Both sides
    are of the distribution sampled from: under top-k / top-p / min-p, the trainer's logprobs
    under the same truncation (``Rollout.sampling_logprobs``). With ``rollout.staleness``, the
    staleness of the tokens (updates since the policy that sampled each): its mean and max."""
    mask = r.response_mask
    log_rho = (r.sampling_logprobs - r.engine_logprobs) * mask
    rho = torch.exp(log_rho.clamp(max=20.0)) * mask
    n = mask.sum().clamp(min=1)
    out = {
        "rollout/engine_logprob_diff": masked_mean(log_rho.abs(), mask),
        "rollout/engine_kl": masked_mean(-log_rho, mask),
        "rollout/engine_capped_frac": ((log_rho > math.log(cap)).float() * mask).sum() / n,
        "rollout/engine_ess": rho.sum() ** 2 / (n * (rho**2).sum()).clamp(min=1e-30),
    }
    if r.staleness is not None:
        out["rollout/staleness_mean"] = masked_mean(r.staleness.float(), mask)
        out["rollout/staleness_max"] = (r.staleness * (mask > 0)).amax().float()
    return out


def term_moments(r: Rollout) -> dict[str, Tensor]:
    """Each ``reward.terms`` term's raw scores where it applies (NaN where it returned None):
    their mean, the mean of their squares and the fraction of rows they apply to, each a mean
    over rows, so that the means over ranks give the statistics over every rank's rows."""
    out = {}
    for name, x in r.term_scores.items():
        applies = ~torch.isnan(x)
        v = x.nan_to_num(0.0)
        out[f"rewards/{name}/_sum"] = v.mean()
        out[f"rewards/{name}/_square"] = (v * v).mean()
        out[f"rewards/{name}/_count"] = applies.float().mean()
    return out


def group_metrics(r: Rollout, n: int) -> dict[str, Tensor]:
    """With ``n >= 2`` responses per prompt: how much the scores differ within a prompt's group,
    and the fraction of groups where they do not differ at all (GRPO and RLOO learn nothing from
    those prompts but the KL penalty)."""
    if n < 2:
        return {}
    stats = group_reward_stats(r.scores, n)
    return {"objective/group_reward_std": stats["group_std"], "objective/frac_zero_std_groups": stats["frac_zero_std"]}


def callback_metrics(trainer: L.Trainer) -> tuple[str, ...]:
    """The metrics ``self.log`` must carry into ``trainer.callback_metrics``: those a callback
    monitors (ModelCheckpoint, EarlyStopping, ...) or names in a filename template
    (``"..._{objective/rlhf_reward:.4f}"``), and the progress bar's. Each ``self.log`` costs
    ~0.5 ms on CPU, so nothing else goes that way; every metric goes to the loggers."""
    read = set(PROGRESS_BAR_METRICS) if trainer.progress_bar_callback is not None else set()
    for cb in trainer.callbacks:
        if isinstance(getattr(cb, "monitor", None), str):
            read.add(cb.monitor)
        if isinstance(getattr(cb, "filename", None), str):
            read.update(re.findall(r"\{([^}:]+)", cb.filename))
    return tuple(sorted(read))


def log_metrics(
    module: L.LightningModule, metrics: dict[str, float], for_callbacks: tuple[str, ...], batch_size: int
) -> None:
    """To every logger at step = the iteration just finished (one call per logger, not ~30
    ``self.log`` calls); through ``module.log`` only ``for_callbacks`` (``callback_metrics``)."""
    for lg in module.loggers:
        lg.log_metrics(metrics, step=module.global_step - 1)
    for k in for_callbacks:  # a monitor naming no metric: Lightning's own error
        if k in metrics:
            module.log(
                k,
                metrics[k],
                prog_bar=k in PROGRESS_BAR_METRICS,
                logger=False,
                on_step=True,
                on_epoch=False,
                batch_size=batch_size,
            )
