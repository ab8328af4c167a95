"""Only the policy's tokens train: in a multi-turn rollout the environment's tokens sit between the
policy's turns, attended to but out of every loss. GAE steps over policy tokens only (an environment
span is neither a step nor a discount), turn rewards sit on their turns' last tokens, group
estimators compare episode totals, and no estimator's loss depends on the environment's logits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ppo_lightning.algo.advantages import from_policy_tokens, policy_token_order, to_policy_tokens

from ppo_lightning.models.lean_head import entropy_from_logits, logprobs_from_logits
from ppo_lightning.config.choices import ESTIMATORS, LOSS_AGGREGATIONS
from ppo_lightning.config import PPOConfig
from tests.helpers import Played, finish, samples

B, P, R, V = 4, 3, 14, 11
# 1 = a policy token, 0 = the environment's (between turns) or padding (after the episode)
MASKS = [
    [1, 1, 1, 0, 0, 1, 1, 0, 0, 0, 1, 1, 0, 0],  # three turns, two answers, padding
    [1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1],  # one long turn
    [1, 0, 0, 0, 1, 0, 1, 1, 1, 0, 0, 0, 0, 0],  # one-token turns
    [1, 1, 0, 1, 1, 0, 1, 1, 0, 1, 1, 1, 1, 0],
]
TURN_ENDS = [[2, 6, 11], [13], [0, 4, 8], [1, 4, 7, 12]]


def _samples(seed: int = 0, turn_rewards: bool = True) -> tuple[Played, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mask = torch.tensor(MASKS, dtype=torch.float32)
    attention = torch.cat([torch.ones(B, P), torch.ones(B, R)], 1).long()
    for i, ends in enumerate(TURN_ENDS):
        attention[i, P + ends[-1] + 1 :] = 0  # padding after the episode's last policy token
    turn = torch.zeros(B, R)
    for i, ends in enumerate(TURN_ENDS):
        for t in ends[:-1]:
            turn[i, t] = float(torch.randn((), generator=g))
    s = samples(
        query_responses=torch.randint(0, V, (B, P + R), generator=g),
        attention_mask=attention,
        position_ids=(attention.cumsum(1) - 1).clamp(min=0),
        response_mask=mask,
        ref_logprobs=-torch.rand(B, R, generator=g) * 3,
        scores=torch.randn(B, generator=g),
        raw_scores=torch.randn(B, generator=g),
        contains_eos=torch.ones(B, dtype=torch.bool),
        context_length=P,
        turn_rewards=turn * mask if turn_rewards else None,
    )
    logprobs, values = -torch.rand(B, R, generator=g) * 3, torch.randn(B, R, generator=g)
    return s, logprobs, values


def naive_gae(rewards, values, positions, gamma, lam):
    """GAE over a list of policy positions, as if nothing sat between them."""
    adv, last = {}, 0.0
    for j in reversed(range(len(positions))):
        t = positions[j]
        v_next = values[positions[j + 1]] if j + 1 < len(positions) else 0.0
        delta = rewards[t] + gamma * v_next - values[t]
        last = delta + gamma * lam * last
        adv[t] = last
    return adv


@pytest.mark.parametrize("gamma, lam", [(1.0, 0.95), (0.9, 0.8)])
def test_gae_steps_over_policy_tokens_only_against_a_naive_loop_over_turns(gamma, lam):
    s, logprobs, values = _samples()
    beta = 0.1
    r = finish(s, logprobs, values, kl_coef=beta, kl_estimator="k1", cfg=PPOConfig(gamma=gamma, lam=lam))
    for i in range(B):
        pos = [t for t in range(R) if MASKS[i][t]]
        rewards = {
            t: -beta * (float(logprobs[i, t]) - float(s.ref_logprobs[i, t])) + float(s.turn_rewards[i, t]) for t in pos
        }
        rewards[pos[-1]] += float(s.scores[i])  # the score on the final policy token
        vals = {t: float(values[i, t]) for t in pos}
        adv = naive_gae(rewards, vals, pos, gamma, lam)
        for t in range(R):
            want = adv[t] + vals[t] if t in adv else 0.0
            assert float(r.returns[i, t]) == pytest.approx(want, abs=1e-5), (i, t)
    env = torch.tensor(MASKS) == 0
    assert (r.advantages[env] == 0).all() and (r.returns[env] == 0).all() and (r.kl[env] == 0).all()


def test_single_turn_masks_take_the_unchanged_path():
    prefix = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0], [0, 0, 0, 0]], dtype=torch.float32)
    assert policy_token_order(prefix) is None
    order = policy_token_order(torch.tensor(MASKS, dtype=torch.float32))
    x = torch.randn(B, R)
    assert torch.equal(
        from_policy_tokens(to_policy_tokens(x, order), order) * torch.tensor(MASKS), x * torch.tensor(MASKS)
    )


def test_turn_rewards_sit_on_their_turns_and_group_estimators_compare_episode_totals():
    s, logprobs, values = _samples(1)
    r = finish(s, logprobs, None, kl_coef=0.0, kl_estimator="k1", cfg=PPOConfig(advantage="rloo", num_generations=2))
    totals = s.scores + s.turn_rewards.sum(1)
    want = torch.stack([totals[0] - totals[1], totals[1] - totals[0], totals[2] - totals[3], totals[3] - totals[2]])
    mask = torch.tensor(MASKS, dtype=torch.float32)
    assert torch.allclose(r.advantages, want[:, None] * mask, atol=1e-6)
    r = finish(s, logprobs, None, kl_coef=0.0, kl_estimator="k1", cfg=PPOConfig(advantage="reinforce_pp", gamma=0.5))
    # REINFORCE++: the return-to-go over policy tokens, a turn reward discounted once per policy
    # step, on every row (the score on the episode's last policy token)
    for i in range(B):
        pos = [t for t in range(R) if MASKS[i][t]]
        G, running = {}, 0.0
        for t in reversed(pos):
            running = float(s.turn_rewards[i, t]) + (float(s.scores[i]) if t == pos[-1] else 0.0) + 0.5 * running
            G[t] = running
        assert [float(r.returns[i, t]) for t in pos] == pytest.approx([G[t] for t in pos], abs=1e-5), i


def _algo(advantage: str, agg: str, kl_in: str):
    from ppo_lightning.algo.algorithm import PPO
    from ppo_lightning.generation import SamplingParams
    from ppo_lightning.rollouts import RolloutWorker

    cfg = PPOConfig(
        advantage=advantage,
        loss_agg=agg,
        kl_in=kl_in,
        num_generations=2,
        ent_coef=0.01,
        kl_coef=0.1,
        shared_prompt_forward=False,  # no policy here: nothing to encode
    )
    return PPO(None, None, RolloutWorker(None, SamplingParams(max_new_tokens=R), None, None), cfg, None), cfg


@pytest.mark.parametrize("advantage", ESTIMATORS)
@pytest.mark.parametrize("agg", LOSS_AGGREGATIONS)
def test_the_environments_logits_have_no_effect_on_any_loss(advantage, agg):
    """For every estimator and loss aggregation (and the KL in the loss for the critic-free
    ones): the gradient of the loss with respect to the logits at the environment's positions
    is exactly zero, and changing those logits (and values) arbitrarily leaves the loss as it is."""
    if agg == "token_mean_global":
        agg = "token_mean"  # one process: the same count
    kl_in = "loss" if advantage in ("grpo", "rloo") else "reward"
    s, logprobs, values = _samples(2)
    algo, cfg = _algo(advantage, agg, kl_in)
    critic = advantage == "gae"
    rollout = finish(
        s, logprobs, values if critic else None, kl_coef=0.05, kl_estimator="k3" if kl_in == "loss" else "k1", cfg=cfg
    )
    responses = rollout.responses
    env = torch.tensor(MASKS) == 0
    g = torch.Generator().manual_seed(5)
    base_logits = torch.randn(B, R, V, generator=g)
    base_values = torch.randn(B, R, generator=g)

    def loss_of(logits, v):
        logp = logprobs_from_logits(logits, responses)
        entropy = entropy_from_logits(logits)
        n_tokens = rollout.response_mask.sum()
        loss, _, _ = algo._loss(rollout, (entropy, v if critic else None, logp), n_tokens, B)
        return loss

    logits = base_logits.clone().requires_grad_(True)
    v = base_values.clone().requires_grad_(True)
    loss = loss_of(logits, v)
    loss.backward()
    assert (logits.grad[env] == 0).all() and logits.grad[~env].abs().sum() > 0
    if critic:
        assert (v.grad[env] == 0).all() and v.grad[~env].abs().sum() > 0
    wild = base_logits.clone()
    wild[env] = torch.randn(int(env.sum()), V, generator=g) * 1e3
    wild_v = base_values.masked_fill(env, 1e6)
    assert torch.equal(loss_of(wild, wild_v).detach(), loss.detach())


def test_the_rollout_keeps_turn_rewards_in_its_record_of_rewards():
    s, logprobs, values = _samples(3)
    r = finish(s, logprobs, values, kl_coef=0.0, kl_estimator="k1", cfg=PPOConfig())
    assert torch.allclose(r.rewards.sum(1), s.scores + s.turn_rewards.sum(1), atol=1e-6)
    single = dataclasses.replace(s, episodes=dataclasses.replace(s.episodes, turn_rewards=None))
    r1 = finish(single, logprobs, values, kl_coef=0.0, kl_estimator="k1", cfg=PPOConfig())
    assert torch.allclose(r1.rewards.sum(1), s.scores, atol=1e-6)
