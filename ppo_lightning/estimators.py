"""Critic-free advantage estimators: GRPO, RLOO and REINFORCE++, as pure tensor functions.

PPO's GAE needs a value function; these replace it with a baseline computed from the rollout
itself, so no value head runs, trains or is stored. GRPO and RLOO compare the ``G`` responses
sampled for one prompt (a group: ``G`` consecutive rows); REINFORCE++ normalises over the whole
batch. Each gives one advantage per token, the same for every token of a response (GRPO, RLOO)
or a return-to-go per token (REINFORCE++). Sources:

- [GRPO] Shao et al. 2024, "DeepSeekMath: Pushing the Limits of Mathematical Reasoning in Open
  Language Models", section 4.1.2 (outcome supervision): A_i = (r_i - mean(r)) / std(r) over
  the group; TRL's ``GRPOTrainer`` divides by ``std + 1e-4`` with the unbiased std.
- [DrGRPO] Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective": the
  division by the group std biases updates toward easy and hard prompts; drop it.
- [RLOO] Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for
  Learning from Human Feedback in LLMs" (after Kool et al. 2019): each sample's baseline is the
  mean reward of the other G - 1 samples of its prompt.
- [R++] Hu 2025, "REINFORCE++: An Efficient RLHF Algorithm with Robustness to Both Prompt and
  Reward Models": per-token rewards (the score at the last token, -beta * KL at every token),
  their discounted return-to-go, normalised over the global batch.
"""

from __future__ import annotations

import torch

from ppo_lightning.ppo import whiten

Tensor = torch.Tensor

GRPO_STD_EPS = 1e-4  # TRL's GRPOTrainer: (r - mean) / (std + 1e-4)
ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp")  # ppo.advantage; gae needs the value head
GROUP_ESTIMATORS = ("grpo", "rloo")  # need ppo.num_generations >= 2


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


def reinforce_pp_advantages(token_rewards: Tensor, mask: Tensor, gamma: float = 1.0,
                            distributed: bool = False) -> tuple[Tensor, Tensor]:
    """[R++] the return-to-go of the per-token rewards, whitened over every response token of
    the batch (all ranks' with ``distributed=True``). Returns ``(advantages, returns)``."""
    returns = returns_to_go(token_rewards, mask, gamma)
    return whiten(returns, mask, distributed=distributed), returns


def per_token(advantages: Tensor, mask: Tensor) -> Tensor:
    """A response's advantage ``[B]`` on each of its tokens ``[B, R]`` (0 off the response)."""
    return advantages[:, None].to(mask.dtype) * mask


def critic_free_advantages(estimator: str, token_rewards: Tensor, mask: Tensor, *, group_size: int,
                           gamma: float = 1.0, scale_by_std: bool = True,
                           distributed: bool = False) -> tuple[Tensor, Tensor]:
    """``(advantages, returns)`` ``[B, R]`` of a critic-free ``estimator`` from the per-token
    rewards (``-beta * KL_t``, plus the score at the last response token).

    GRPO and RLOO judge a response by its whole reward, the sum of its per-token rewards (the
    score plus the KL penalty: TRL's RLOO "rlhf_reward"; with ``kl_coef=0`` the score alone, as in
    GRPO on verifiable rewards), and give every token of it the response's advantage. Their
    ``returns`` are those sums on every token (a record; no value head learns from them).
    REINFORCE++ keeps the per-token rewards (``reinforce_pp_advantages``).
    """
    if estimator == "reinforce_pp":
        return reinforce_pp_advantages(token_rewards, mask, gamma, distributed)
    episode_reward = (token_rewards * mask).sum(1)
    if estimator == "grpo":
        adv = grpo_advantages(episode_reward, group_size, scale_by_std)
    elif estimator == "rloo":
        adv = rloo_advantages(episode_reward, group_size)
    else:
        raise ValueError(f"unknown critic-free estimator {estimator!r}; choose one of {ESTIMATORS[1:]}")
    return per_token(adv, mask), per_token(episode_reward, mask)


def group_reward_stats(rewards: Tensor, group_size: int) -> dict[str, Tensor]:
    """Per-group spread of the rewards, as TRL's GRPO and RLOO trainers log it: the mean over
    groups of the (unbiased) std within each group, and the fraction of groups whose rewards are
    all equal (zero advantage for every response: no learning signal from that prompt)."""
    g = _groups(rewards.float(), group_size)
    equal = g.amax(dim=1) == g.amin(dim=1)  # exactly, where a std could round to 1e-9
    return {"group_std": g.std(dim=1).mean(), "frac_zero_std": equal.float().mean()}
