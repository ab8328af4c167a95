"""The critic-free estimators against naive references on hand-made groups (plain Python loops
over the formulas of each paper; ``ppo_lightning/estimators.py`` cites them)."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_lightning import estimators as E

# two prompts, three samples each: a group with spread, and one whose rewards are all equal
REWARDS = [1.0, 0.0, 0.5, 2.0, 2.0, 2.0]
G = 3


def _naive_std(xs: list[float]) -> float:
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))  # unbiased, as TRL's torch.std


def test_grpo_normalises_each_group_by_its_mean_and_std():
    """DeepSeekMath (Shao et al. 2024) section 4.1.2, outcome supervision:
    A_i = (r_i - mean(r_group)) / std(r_group); TRL's GRPOTrainer adds 1e-4 to the std."""
    want = []
    for s in range(0, len(REWARDS), G):
        group = REWARDS[s:s + G]
        m, sd = sum(group) / G, _naive_std(group)
        want += [(r - m) / (sd + 1e-4) for r in group]
    got = E.grpo_advantages(torch.tensor(REWARDS), G)
    assert got.tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert got[3:].tolist() == [0.0, 0.0, 0.0]  # equal rewards: no signal


def test_dr_grpo_only_subtracts_the_group_mean():
    """Liu et al. 2025 (Dr. GRPO): without the std division, A_i = r_i - mean(r_group)."""
    want = []
    for s in range(0, len(REWARDS), G):
        group = REWARDS[s:s + G]
        want += [r - sum(group) / G for r in group]
    got = E.grpo_advantages(torch.tensor(REWARDS), G, scale_by_std=False)
    assert got.tolist() == pytest.approx(want, abs=1e-7)


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    """Ahmadian et al. 2024 (RLOO), eq. for the leave-one-out baseline:
    A_i = r_i - 1/(k-1) * sum_{j != i} r_j."""
    want = []
    for s in range(0, len(REWARDS), G):
        group = REWARDS[s:s + G]
        want += [r - sum(group[j] for j in range(G) if j != i) / (G - 1) for i, r in enumerate(group)]
    got = E.rloo_advantages(torch.tensor(REWARDS), G)
    assert got.tolist() == pytest.approx(want, abs=1e-7)
    # the identity TRL's RLOO uses: k/(k-1) * (r - mean)
    g = torch.tensor(REWARDS).view(-1, G)
    assert got.tolist() == pytest.approx((G / (G - 1) * (g - g.mean(1, keepdim=True))).reshape(-1).tolist(), abs=1e-6)


def test_reinforce_pp_whitens_the_return_to_go_over_the_batch():
    """Hu 2025 (REINFORCE++), eqs. 8-10: r_t = -beta * KL_t, plus the score at the last token;
    A_t = sum_{s >= t} gamma^(s-t) r_s, then (A - mean) / std over every token of the batch."""
    gamma = 0.9
    rewards = torch.tensor([[-0.1, -0.2, 1.3, 0.0], [-0.05, 0.7, 0.0, 0.0], [0.2, -0.1, -0.3, 2.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.float32)
    returns = [[0.0] * 4 for _ in range(3)]
    for b in range(3):
        n = int(mask[b].sum())
        for t in range(n):
            returns[b][t] = sum(gamma ** (s - t) * rewards[b, s].item() for s in range(t, n))
    flat = [returns[b][t] for b in range(3) for t in range(int(mask[b].sum()))]
    m = sum(flat) / len(flat)
    sd = math.sqrt(sum((x - m) ** 2 for x in flat) / (len(flat) - 1))  # ppo.whiten: unbiased, as for GAE
    adv, ret = E.reinforce_pp_advantages(rewards, mask, gamma)
    assert ret.flatten().tolist() == pytest.approx([x for row in returns for x in row], abs=1e-6)
    for b in range(3):
        for t in range(4):
            want = (returns[b][t] - m) / math.sqrt(sd ** 2 + 1e-8) if mask[b, t] else 0.0
            assert adv[b, t].item() == pytest.approx(want, abs=1e-5), (b, t)


def test_per_token_spreads_a_response_advantage_over_its_tokens():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.float32)
    assert E.per_token(torch.tensor([2.0, -1.0]), mask).tolist() == [[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]


@pytest.mark.parametrize("fn", [E.grpo_advantages, E.rloo_advantages])
def test_group_estimators_refuse_groups_they_cannot_form(fn):
    with pytest.raises(ValueError, match="group_size must be >= 2"):
        fn(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(ValueError, match="do not split into groups of 3"):
        fn(torch.tensor([1.0, 2.0, 3.0, 4.0]), 3)
