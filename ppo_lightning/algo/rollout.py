"""The update's record: ``Rollout``, everything PPO learns from, derived in one place
(``finish_rollout``) from a worker's ``rollouts.Episodes`` and the trainer's own forwards over
them (the old policy's logprobs and values, the reference's logprobs): the training scores, the
per-token KL penalty, the advantages and returns, an engine's correction weights. No Lightning
here, and no model: the forwards are ``rollouts.forward``'s.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from ppo_lightning.algo.advantages import (
    AdvantageInputs,
    estimate,
    from_policy_tokens,
    policy_token_order,
    to_policy_tokens,
)
from ppo_lightning.algo.kl import kl_k1, kl_penalty
from ppo_lightning.algo.losses import engine_weights
from ppo_lightning.rollouts.records import PromptResponseRows

Normalization = tuple[float, float]  # (gain, bias) of reward normalisation


def normalized(raw: Tensor, norm: Normalization | None) -> Tensor:
    """The training score of raw scores, ``gain * raw + bias`` ([N+] reward normalisation;
    ``norm`` None or ``(1, 0)`` leaves them raw): the one place the map is written, for the
    rollouts and for every other caller that scores text as training does."""
    gain, bias = norm or (1.0, 0.0)
    return raw * gain + bias


@dataclasses.dataclass(frozen=True)
class ScoreShaping:
    """How an episode's raw return becomes its training score: ``norm = (gain, bias)`` maps it to
    ``gain * raw + bias`` ([N+] reward normalisation, fitted by ``rewards.fit_normalization``;
    None leaves it raw; turn rewards are scaled by the gain); ``missing_eos_penalty`` is taken
    from responses that never stopped ([N+]); ``mask_truncated`` takes those out of every loss
    (DAPO's overlong filtering). ``stop_at_eos``: whether responses stop at all (``sampling``)."""

    norm: Normalization | None = None
    missing_eos_penalty: float | None = None
    mask_truncated: bool = False
    stop_at_eos: bool = True

    @property
    def gain(self) -> float:
        return (self.norm or (1.0, 0.0))[0]

    def scores(self, raw_scores: Tensor, contains_eos: Tensor) -> Tensor:
        """The training score of each row: normalised, then the missing-EOS penalty."""
        scores = normalized(raw_scores, self.norm)
        if self.missing_eos_penalty is not None and self.stop_at_eos:
            scores = torch.where(contains_eos, scores, scores - self.missing_eos_penalty)  # [N+] detail
        return scores

    def kept(self, scored: Tensor, contains_eos: Tensor) -> Tensor:
        """``[B]`` bool: the rows that stay in every loss. Out: responses no reward applies to (raw
        score 0, as TRL), and with ``mask_truncated`` those cut at ``max_new_tokens``."""
        return scored & contains_eos if self.mask_truncated and self.stop_at_eos else scored


@dataclasses.dataclass(frozen=True)
class EngineView:
    """An engine backend's samples as the update weighs them: its own ``logprobs [B, R]``, the old
    policy's under the sampling's truncation (``sampling_logprobs``: ``rollouts.engine.truncated_logprobs``,
    or the old logprobs when the sampling truncates nothing), and the correction mode
    (``ppo.engine_correction``) with its cap; ``staleness [B, R]``, the updates between the policy
    version that sampled each token and the old policy's (0 but with ``rollout.staleness``)."""

    logprobs: Tensor
    sampling_logprobs: Tensor | None
    correction: str
    cap: float
    staleness: Tensor | None = None


@dataclasses.dataclass(frozen=True)
class Rollout(PromptResponseRows):
    """One PPO batch: the sampled episodes and the old policy's view of them. All tensors share B.
    What ``values``, ``advantages`` and ``returns`` hold depends on ``ppo.advantage``."""

    query_responses: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] long: prompt mask | response mask
    position_ids: Tensor  # [B, T] long: left padding skipped
    response_mask: Tensor  # [B, R] float: 1 on the policy's tokens up to and including EOS; 0 on rows out of the loss
    logprobs: Tensor  # [B, R] old policy log pi(a_t | s_t), logits / temperature
    ref_logprobs: Tensor  # [B, R] reference model, same temperature
    values: Tensor  # [B, R] gae: the value head's V(s_t) at sampling time; critic-free: zeros
    kl: Tensor  # [B, R] per-token k1 = logprobs - ref_logprobs (for metrics)
    rewards: Tensor  # [B, R] -beta * KL_t (kl_in=reward), plus the score at the last real token
    non_score_reward: Tensor  # [B] sum over tokens of -beta * KL_t (the KL part of the return)
    advantages: Tensor  # [B, R] what the policy loss weighs each token by: gae, whitened GAE;
    # grpo / rloo, the group-relative score plus the KL return-to-go; reinforce_pp, whitened returns
    returns: Tensor  # [B, R] gae: value targets, advantages (before whitening) + values; else a record
    scores: Tensor  # [B] reward of each full response: normalised, after the missing-EOS penalty
    raw_scores: Tensor  # [B] the episode's raw return: the reward's own output plus the turns' rewards
    contains_eos: Tensor  # [B] bool
    context_length: int  # P
    term_scores: dict[str, Tensor]  # reward.terms: raw [B] each
    scored: Tensor | None  # [B] bool: some reward applies (False: it returned None; masked out)
    turn_rewards: Tensor | None  # [B, R] multi-turn: each turn's EnvStep.reward (times the gain) on its last token
    engine_logprobs: Tensor | None  # [B, R] an engine backend's logprobs of its samples (metrics)
    sampling_logprobs: Tensor | None  # [B, R] the old policy's under the sampling's truncation: what
    # engine_logprobs are compared with
    engine_weights: Tensor | None  # [B, R] ppo.engine_correction's weights of the policy loss
    staleness: Tensor | None  # [B, R] updates since the policy that sampled each token (engine view only)
    episodes: object  # multi-turn: the envs.EpisodeBatch as played (metrics, dumps); None: single-turn
    reward_logs: dict[str, float]  # rewards/<term>/<name>: log_metric
    records: tuple[list, list] | None  # each row's prompt as written and its columns (rollout dumps)
    collect_time_s: float  # wall time of sampling, scoring and the rollout's forwards

    def is_finite(self) -> Tensor:
        """Whether every score, logprob, value and advantage is finite (a 0-dim bool tensor)."""
        return torch.stack(
            [
                torch.isfinite(t).all()
                for t in (self.scores, self.logprobs, self.ref_logprobs, self.values, self.advantages, self.returns)
            ]
        ).all()

    def describe_nonfinite(self, tokenizer) -> str:
        """What is not finite, for the warning: the first bad score with its prompt, or the rest."""
        bad = (~torch.isfinite(self.scores)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            prompt = tokenizer.decode(self.query_responses[i, : self.context_length], skip_special_tokens=True)
            return f"reward {self.scores[i].item()} for prompt {prompt[:60]!r}"
        return "logprobs, values or advantages in the rollout"

    def index(self, idx: Tensor | slice) -> "Rollout":
        """The rows ``idx`` of every tensor: a minibatch, or a micro-batch of one. What belongs to
        the whole iteration (the episodes as played, the reward's logs, the records) stays out."""
        values = ((f.name, getattr(self, f.name)) for f in dataclasses.fields(self))
        rows = {k: v[idx] for k, v in values if isinstance(v, Tensor)}
        term_scores = {k: v[idx] for k, v in self.term_scores.items()}
        return dataclasses.replace(self, **rows, term_scores=term_scores, episodes=None, reward_logs={}, records=None)


@dataclasses.dataclass(frozen=True)
class Forwards:
    """The trainer's forwards over a batch of episodes: their ``position_ids [B, T]``, the
    reference's ``ref_logprobs [B, R]`` and the old policy's ``logprobs [B, R]`` and ``values
    [B, R]`` (None without a value head)."""

    position_ids: Tensor
    ref_logprobs: Tensor
    logprobs: Tensor
    values: Tensor | None


@torch.no_grad()
def finish_rollout(
    ep,
    forwards: Forwards,
    *,
    kl_coef: float,
    kl_estimator: str,
    cfg,
    shaping: ScoreShaping = ScoreShaping(),
    engine: EngineView | None = None,
    collect_time_s: float = 0.0,
) -> Rollout:
    """The rollout of the episodes ``ep`` (``rollouts.Episodes``) given the trainer's ``forwards``
    over them: the training scores (``shaping``), the rows kept in the loss, the per-token KL
    penalty (``-kl_coef`` x the ``kl_estimator`` KL), then the advantages of the estimator
    ``cfg.advantage`` names (a ``config.PPOConfig``; ``algo.advantages.ESTIMATORS``: GAE on the
    values, or a critic-free one, whose values are None and the rollout's zeros), and with an
    ``engine`` its correction weights. The one place a ``Rollout`` is made from episodes."""
    keep = shaping.kept(ep.scored, ep.contains_eos)
    mask = ep.response_mask if keep.all() else ep.response_mask * keep[:, None]
    scores = shaping.scores(ep.raw_scores, ep.contains_eos)
    turn_rewards = None if ep.turn_rewards is None else ep.turn_rewards * shaping.gain * mask
    values = torch.zeros_like(forwards.logprobs) if forwards.values is None else forwards.values
    logprobs, ref_logprobs, values = forwards.logprobs * mask, forwards.ref_logprobs * mask, values * mask
    kl = kl_k1(logprobs, ref_logprobs) * mask  # k1, for the objective/kl metric
    per_token_kl = kl if kl_estimator == "k1" else kl_penalty(logprobs, ref_logprobs, kl_estimator, mask)
    kl_rewards = -kl_coef * per_token_kl  # [B, R]
    advantages, returns, rewards = advantages_of(scores, kl_rewards, mask, values, turn_rewards, cfg)
    sampling = weights = None
    if engine is not None:
        sampling = logprobs if engine.sampling_logprobs is None else engine.sampling_logprobs
        weights = engine_weights(sampling, engine.logprobs, mask, engine.correction, engine.cap)
    return Rollout(
        query_responses=ep.query_responses,
        attention_mask=ep.attention_mask,
        position_ids=forwards.position_ids,
        response_mask=mask,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        kl=kl,
        rewards=rewards,
        non_score_reward=kl_rewards.sum(1),
        advantages=advantages,
        returns=returns,
        scores=scores,
        raw_scores=ep.returns,
        contains_eos=ep.contains_eos,
        context_length=ep.context_length,
        term_scores=ep.term_scores,
        scored=ep.scored,
        turn_rewards=turn_rewards,
        engine_logprobs=None if engine is None else engine.logprobs,
        sampling_logprobs=sampling,
        engine_weights=weights,
        staleness=None if engine is None else engine.staleness,
        episodes=ep.played,
        reward_logs=ep.reward_logs,
        records=ep.records,
        collect_time_s=collect_time_s,
    )


def advantages_of(
    scores: Tensor, kl_rewards: Tensor, mask: Tensor, values: Tensor, turn_rewards: Tensor | None, cfg
) -> tuple[Tensor, Tensor, Tensor]:
    """``(advantages, returns, rewards)`` ``[B, R]`` of the estimator ``cfg.advantage``. Multi-turn:
    the estimator sees the policy's tokens only, each row's gathered to its front (an environment
    span is neither a step nor a discount); the results go back to their positions."""
    order = policy_token_order(mask)
    inputs = AdvantageInputs(
        scores=scores,
        kl_rewards=to_policy_tokens(kl_rewards, order),
        mask=to_policy_tokens(mask, order),
        values=to_policy_tokens(values, order),
        turn_rewards=None if turn_rewards is None else to_policy_tokens(turn_rewards, order),
        gamma=cfg.gamma,
        lam=cfg.lam,
        group_size=cfg.num_generations,
        scale_by_std=cfg.scale_by_group_std,
        whiten_rewards=cfg.whiten_rewards,
    )
    return tuple(from_policy_tokens(x, order) for x in estimate(cfg.advantage, inputs))
