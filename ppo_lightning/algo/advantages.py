"""Advantages, as pure tensor functions (no Lightning, no models): PPO's GAE over the value
function, and the critic-free estimators GRPO, RLOO and REINFORCE++.

Shapes: ``B`` rows (episodes), ``R`` response positions. Every function takes a ``mask`` that is 1
on real response tokens and 0 on prompt, pad and after-EOS positions; statistics are taken over
masked positions only. Multi-turn episodes have gaps (the environment's tokens): ``policy_token_order`` gathers
each row's policy tokens to its front, so that GAE and every return-to-go step over them only.

Critic-free advantage estimators: GRPO, RLOO and REINFORCE++, as pure tensor functions.

PPO's GAE needs a value function; these replace it with a baseline computed from the rollout
itself, so no value head runs, trains or is stored. GRPO and RLOO compare the scores of the
``G`` responses sampled for one prompt (a group: ``G`` consecutive rows) and give every token of
a response its score advantage, plus, when the KL is in the reward, that token's return-to-go
of the KL penalty (``critic_free_advantages``); REINFORCE++ whitens the per-token return-to-go
of score plus penalty over the whole batch. Sources:

- [GRPO] Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
  Language Models", section 4.1.2 (outcome supervision): A_i = (r_i - mean(r)) / std(r) over
  the group; TRL's ``GRPOTrainer`` divides by ``std + 1e-4`` with the unbiased std.
- [DrGRPO] Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective": the
  division by the group std biases updates toward easy and hard prompts; drop it.
- [RLOO] Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
  Learning from Human Feedback in LLMs" (after Kool et al. 2019): each sample's baseline is the
  mean reward of the other G - 1 samples of its prompt.
- [ORLHF] OpenRLHF, ``openrlhf/trainer/ppo_utils/experience_maker.py``: group_norm and rloo
  normalise the score, then add ``-beta * KL`` per token and take the return-to-go.
- [R++] Hu 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and
  Reward Models": per-token rewards (the score at the last token, -beta * KL at every token),
  their discounted return-to-go, normalised over the global batch.
- [GAE] Schulman et al. 2016, "High-Dimensional Continuous Control Using GAE".
- [N+] Huang et al. 2024, "The N+ Implementation Details of RLHF with PPO".
"""

from __future__ import annotations

import torch

from ppo_lightning.algo.stats import whiten
import dataclasses
from typing import NamedTuple

from ppo_lightning.config.choices import ESTIMATORS, EstimatorSpec

Tensor = torch.Tensor


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


# ----------------------------------------------------------------------------- critic-free estimators
GRPO_STD_EPS = 1e-4  # TRL's GRPOTrainer: (r - mean) / (std + 1e-4)


def _groups(rewards: Tensor, group_size: int) -> Tensor:
    """``[B]`` -> ``[B / G, G]``: consecutive rows are one prompt's samples."""
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    return rewards.view(-1, group_size)


def grpo_advantages(rewards: Tensor, group_size: int, scale_by_std: bool = True) -> Tensor:
    """[GRPO] group-normalised outcome reward, one value per response ``[B]``.

    ``(r_i - mean_group(r)) / (std_group(r) + 1e-4)`` with the unbiased std (as TRL); with
    ``scale_by_std=False`` only the mean is subtracted [DrGRPO]. A group whose rewards are all
    equal gives 0 to each of its responses: it carries no signal.
    """
    if group_size < 2:
        raise ValueError("GRPO compares the responses to one prompt: group_size must be >= 2")
    g = _groups(rewards.float(), group_size)
    adv = g - g.mean(dim=1, keepdim=True)
    if scale_by_std:
        adv = adv / (g.std(dim=1, keepdim=True) + GRPO_STD_EPS)
    return adv.reshape(-1)


def rloo_advantages(rewards: Tensor, group_size: int) -> Tensor:
    """[RLOO] ``r_i - mean_{j != i} r_j`` within each group, one value per response ``[B]``.

    Equal to ``G / (G - 1) * (r_i - mean_group(r))``; the baseline excludes the sample itself, so
    the estimate of the policy gradient stays unbiased.
    """
    if group_size < 2:
        raise ValueError("RLOO's baseline is the other responses to the same prompt: group_size must be >= 2")
    g = _groups(rewards.float(), group_size)
    baseline = (g.sum(dim=1, keepdim=True) - g) / (group_size - 1)
    return (g - baseline).reshape(-1)


def returns_to_go(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0) -> Tensor:
    """``G_t = sum_{s >= t} gamma^(s - t) r_s`` over each row's response tokens ``[B, R]`` (0 where
    ``mask`` is 0)."""
    mask = mask.to(token_rewards.dtype)
    r = token_rewards * mask
    out = torch.zeros_like(r)
    running = torch.zeros_like(r[:, 0])
    for t in reversed(range(r.shape[1])):
        running = r[:, t] + gamma * running * mask[:, t]
        out[:, t] = running * mask[:, t]
    return out


def reinforce_pp_advantages(
    token_rewards: Tensor, mask: Tensor, gamma: float = 1.0, distributed: bool = False
) -> tuple[Tensor, Tensor]:
    """[R++] the return-to-go of the per-token rewards, whitened over every response token of
    the batch (all ranks' with ``distributed=True``). Returns ``(advantages, returns)``."""
    returns = returns_to_go(token_rewards, mask, gamma)
    return whiten(returns, mask, distributed=distributed), returns


def per_token(advantages: Tensor, mask: Tensor) -> Tensor:
    """A response's advantage ``[B]`` on each of its tokens ``[B, R]`` (0 off the response)."""
    return advantages[:, None].to(mask.dtype) * mask


def score_at_last_token(scores: Tensor, mask: Tensor) -> Tensor:
    """``scores [B]`` placed on each row's last response token ``[B, R]`` (0 elsewhere): the
    score is the reward of the whole response, earned by its last action ([N+] detail). In a
    multi-turn episode that is the policy's last token: ``mask`` is 1 on the policy's tokens."""
    R = mask.shape[1]
    last = R - 1 - (mask > 0).flip(1).to(torch.int8).argmax(1)  # index of the last masked token
    return torch.zeros_like(mask, dtype=torch.float32).scatter(1, last[:, None], scores[:, None].float()) * mask


def group_reward_stats(scores: Tensor, group_size: int) -> dict[str, Tensor]:
    """Per-group spread of the scores, as TRL's GRPO and RLOO trainers log it: the mean over
    groups of the (unbiased) std within each group, and the fraction of groups whose scores are
    all equal (the same score advantage for every response: GRPO and RLOO learn nothing from
    that prompt but the KL penalty). The scores, not score plus KL penalty: the KL breaks ties
    that carry no signal."""
    g = _groups(scores.float(), group_size)
    equal = g.amax(dim=1) == g.amin(dim=1)  # exactly, where a std could round to 1e-9
    return {"group_std": g.std(dim=1).mean(), "frac_zero_std": equal.float().mean()}


# ----------------------------------------------------------------------------- the registry
@dataclasses.dataclass(frozen=True)
class AdvantageInputs:
    """One rollout's inputs to an estimator. Every ``[B, R]`` tensor is in policy-token order
    (``to_policy_tokens``: a multi-turn episode's environment spans moved out of the way, so an
    environment span is neither a step nor a discount); single-turn masks are already so."""

    scores: Tensor  # [B] the reward terms' score of each response (normalised, after the EOS penalty)
    kl_rewards: Tensor  # [B, R] -beta * KL_t (zeros when the KL is a loss term, ppo.kl_in=loss)
    mask: Tensor  # [B, R] 1 on the policy's tokens
    values: Tensor  # [B, R] the old values (zeros without a critic)
    turn_rewards: Tensor | None = None  # [B, R] multi-turn: each turn's EnvStep.reward on its last token
    gamma: float = 1.0
    lam: float = 0.95
    group_size: int = 1  # ppo.num_generations: consecutive rows are one prompt's samples
    scale_by_std: bool = True  # ppo.scale_by_group_std
    whiten_rewards: bool = False  # ppo.whiten_rewards (the critic's estimator only)
    distributed: bool = True  # statistics over every rank's tokens


class Advantages(NamedTuple):
    advantages: Tensor  # [B, R]
    returns: Tensor  # [B, R] the value target (GAE), or the return-to-go of the rewards (a record)
    rewards: Tensor  # [B, R] the per-token rewards the estimate stands on (a record)


def token_rewards(x: AdvantageInputs, scores: Tensor | None = None) -> Tensor:
    """The per-token rewards: the KL penalty on every token, the score (``scores``, else
    ``x.scores``) on the last one, each turn's reward on its turn's last token."""
    rewards = x.kl_rewards + score_at_last_token(x.scores if scores is None else scores, x.mask)
    return rewards if x.turn_rewards is None else rewards + x.turn_rewards


def estimate(name: str, x: AdvantageInputs) -> Advantages:
    """The advantages of estimator ``name`` (``ppo.advantage``). Reward whitening is the critic's
    alone: the critic-free estimators normalise the scores themselves, and whitening per-token
    rewards while keeping their mean would add a term proportional to each response's length."""
    if x.whiten_rewards and not ESTIMATORS.spec(name).critic:
        raise ValueError(f"whiten_rewards is for an estimator with a critic (got {name!r}): it would add a length bias")
    return ESTIMATORS.implementation(name)(x)


@ESTIMATORS.register("gae", EstimatorSpec(critic=True, groups=False, turn_rewards="token"))
def gae(x: AdvantageInputs) -> Advantages:
    """PPO's: GAE over the critic's values on the per-token rewards (optionally whitened without
    their mean shifted, [N+]), then the advantages whitened over every response token."""
    rewards = token_rewards(x)
    if x.whiten_rewards:
        rewards = whiten(rewards, x.mask, shift_mean=False, distributed=x.distributed)
    values_next = torch.cat([x.values[:, 1:], torch.zeros_like(x.values[:, :1])], dim=1)  # compute_gae masks it
    advantages, returns = compute_gae(rewards, x.values, values_next, x.mask, x.gamma, x.lam)
    return Advantages(whiten(advantages, x.mask, distributed=x.distributed), returns, rewards)


def _group_estimate(x: AdvantageInputs, score_advantages: Tensor, totals: Tensor) -> Advantages:
    """GRPO's and RLOO's: a response's score advantage on each of its tokens plus each token's
    return-to-go of the KL penalty: ``A_t = group_advantage(score)_i - beta * sum_{s >= t} KL_s``
    (OpenRLHF's group_norm and rloo). Comparing ``score - beta * sum KL`` instead would let the
    KL's sampling noise break the ties of a group whose scores are all equal, and GRPO's std
    division would then blow that noise up to advantages of about +-1 whatever beta is: a group
    that carries no signal would train as hard as one that does. Here such a group's advantages
    are the KL penalty's alone, of size beta * KL."""
    advantages = per_token(score_advantages, x.mask) + returns_to_go(x.kl_rewards, x.mask)
    returns = returns_to_go(x.kl_rewards + score_at_last_token(totals, x.mask), x.mask)
    return Advantages(advantages, returns, token_rewards(x))


def _episode_totals(x: AdvantageInputs) -> Tensor:
    """Each response's score plus, in a multi-turn episode, its turn rewards: what a group compares."""
    return x.scores if x.turn_rewards is None else x.scores + x.turn_rewards.sum(1)


@ESTIMATORS.register("grpo", EstimatorSpec(critic=False, groups=True, group_std=True, turn_rewards="total"))
def grpo(x: AdvantageInputs) -> Advantages:
    """[GRPO] each response's total against its group's mean, divided by the group's std
    (``scale_by_std``; [DrGRPO] without)."""
    totals = _episode_totals(x)
    return _group_estimate(x, grpo_advantages(totals, x.group_size, x.scale_by_std), totals)


@ESTIMATORS.register("rloo", EstimatorSpec(critic=False, groups=True, turn_rewards="total"))
def rloo(x: AdvantageInputs) -> Advantages:
    """[RLOO] each response's total against the mean of the other responses to its prompt."""
    totals = _episode_totals(x)
    return _group_estimate(x, rloo_advantages(totals, x.group_size), totals)


@ESTIMATORS.register("reinforce_pp", EstimatorSpec(critic=False, groups=False, turn_rewards="token"))
def reinforce_pp(x: AdvantageInputs) -> Advantages:
    """[R++] the per-token rewards' return-to-go, whitened over the batch; turn rewards stay on
    their turns."""
    rewards = token_rewards(x)
    advantages, returns = reinforce_pp_advantages(rewards, x.mask, x.gamma, x.distributed)
    return Advantages(advantages, returns, rewards)
