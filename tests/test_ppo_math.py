"""The PPO math against naive references: plain Python loops over rows and tokens, or numbers
computed by hand in the comments.

Masks follow the real layout: zeros on the left (prompt positions), ones on the real response
tokens, zeros on the right (pad / after-EOS positions), with a different length in every row.
"""

from __future__ import annotations

import math

import pytest
import torch

from ppo_lightning.algo.advantages import compute_gae

from ppo_lightning.algo.kl import approx_kl, kl_k1, kl_k2, kl_k3, kl_penalty

from ppo_lightning.algo.losses import ppo_policy_loss, ppo_value_loss
from ppo_lightning.models.lean_head import entropy_from_logits, logprobs_from_logits

from ppo_lightning.algo.stats import explained_variance, masked_mean, masked_sum, masked_var, whiten
from ppo_lightning.algo.kl import AdaptiveKLController, FixedKLController, build_kl_controller
from ppo_lightning.generation import StopChecker
from ppo_lightning.generation.hf import CDF_BLOCK, inverse_cdf, sample_next_token

F64 = torch.float64

# (prompt positions, real tokens) per row; R = 8 positions; the rest of the row is pad.
ROWS = [(2, 4), (1, 7), (4, 1), (0, 3), (0, 8), (3, 0)]
R = 8


def make_mask(rows=ROWS, width=R, dtype=F64) -> torch.Tensor:
    mask = torch.zeros(len(rows), width, dtype=dtype)
    for b, (start, n) in enumerate(rows):
        mask[b, start : start + n] = 1
    return mask


def real_positions(mask: torch.Tensor, b: int) -> list[int]:
    return [t for t in range(mask.shape[1]) if mask[b, t] != 0]


def garbage_like(x: torch.Tensor, seed: int) -> torch.Tensor:
    """Large finite numbers of both signs (0 * garbage must be 0: no nan / inf)."""
    g = torch.Generator().manual_seed(seed)
    return 1e6 * torch.randn(x.shape, generator=g, dtype=x.dtype)


def with_garbage(x: torch.Tensor, mask: torch.Tensor, seed: int) -> torch.Tensor:
    return torch.where(mask != 0, x, garbage_like(x, seed))


def randn(*shape, seed: int, dtype=F64) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)


# ============================================================================ masked statistics
def naive_masked_values(x, mask) -> list[float]:
    return [float(x[b, t]) for b in range(x.shape[0]) for t in real_positions(mask, b)]


def test_masked_mean_and_var_match_naive():
    mask = make_mask()
    x = with_garbage(randn(len(ROWS), R, seed=0) * 3 + 2, mask, seed=1)
    vals = naive_masked_values(x, mask)
    n = len(vals)
    mean = sum(vals) / n
    var_biased = sum((v - mean) ** 2 for v in vals) / n
    var_unbiased = sum((v - mean) ** 2 for v in vals) / (n - 1)
    torch.testing.assert_close(masked_mean(x, mask), torch.tensor(mean, dtype=F64))
    torch.testing.assert_close(masked_var(x, mask), torch.tensor(var_unbiased, dtype=F64))
    torch.testing.assert_close(masked_var(x, mask, unbiased=False), torch.tensor(var_biased, dtype=F64))
    torch.testing.assert_close(masked_sum(x, mask), torch.tensor(sum(vals), dtype=F64))

    # per-row mean; the empty last row gives 0, not nan
    row_means = masked_mean(x, mask, dim=1)
    for b in range(len(ROWS)):
        row = [float(x[b, t]) for t in real_positions(mask, b)]
        expected = sum(row) / len(row) if row else 0.0
        assert row_means[b].item() == pytest.approx(expected, rel=1e-12, abs=1e-12)


def test_masked_var_of_one_element_is_zero_and_whiten_stays_finite():
    """A batch with a single response token (EOS sampled first) must not crash or blow up."""
    x = torch.tensor([[1e6, 3.0, -1e6]], dtype=F64)
    one = torch.tensor([[0.0, 1.0, 0.0]], dtype=F64)
    assert masked_var(x, one).item() == 0.0
    assert masked_var(x, one, unbiased=False).item() == 0.0
    assert torch.equal(whiten(x, one), torch.zeros_like(x))


def test_masked_statistics_ignore_inf_and_nan_at_masked_positions():
    """An overflowing ratio on a pad token (exp(100) = inf in float32) must not poison a mean."""
    new = torch.tensor([[0.0, 100.0]])
    mask = torch.tensor([[1.0, 0.0]])
    assert approx_kl(new, torch.zeros(1, 2), mask).item() == 0.0
    x = torch.tensor([[1.0, float("nan"), 3.0, float("inf")]])
    m = torch.tensor([[1.0, 0.0, 1.0, 0.0]])
    assert masked_mean(x, m).item() == 2.0
    assert masked_var(x, m).item() == 2.0


# ============================================================================ whiten
def test_whiten_matches_naive_and_uses_bessel_correction():
    mask = make_mask()
    x = with_garbage(randn(len(ROWS), R, seed=2) * 5 - 3, mask, seed=3)
    out = whiten(x, mask)

    vals = naive_masked_values(x, mask)
    n = len(vals)
    mean = sum(vals) / n
    var = sum((v - mean) ** 2 for v in vals) / (n - 1)  # unbiased, as the implementation
    for b in range(len(ROWS)):
        for t in range(R):
            expected = (float(x[b, t]) - mean) / math.sqrt(var + 1e-8) if mask[b, t] else 0.0
            assert out[b, t].item() == pytest.approx(expected, rel=1e-10, abs=1e-12)

    w = torch.tensor(naive_masked_values(out, mask), dtype=F64)
    assert abs(w.mean().item()) < 1e-10
    assert w.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-8)
    # with only n = 23 tokens the biased std is visibly below 1: the test tells the two apart
    assert w.std(unbiased=False).item() < 0.99
    assert torch.all(out[mask == 0] == 0)


def test_whiten_without_shifting_the_mean_keeps_it():
    mask = make_mask()
    x = with_garbage(randn(len(ROWS), R, seed=4) * 2 + 7, mask, seed=5)
    out = whiten(x, mask, shift_mean=False)
    mean = sum(naive_masked_values(x, mask)) / len(naive_masked_values(x, mask))
    w = torch.tensor(naive_masked_values(out, mask), dtype=F64)
    assert w.mean().item() == pytest.approx(mean, rel=1e-10)
    assert w.std(unbiased=True).item() == pytest.approx(1.0, abs=1e-8)
    assert torch.all(out[mask == 0] == 0)
    torch.testing.assert_close(out, (whiten(x, mask) + mean) * mask)


# ============================================================================ GAE
def raw_shift(values):
    """``values_next`` as the tutorial's trainer builds it (the PPO tutorial this project started
    from, FareedKhan-dev/train-llm-from-scratch, ``src/post_training/ppo.py``): ``values[:, 1:]``
    plus a zero column, unmasked."""
    return torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=1)


def naive_gae(rewards, values, mask, gamma, lam):
    adv = torch.zeros_like(values)
    ret = torch.zeros_like(values)
    for b in range(values.shape[0]):
        real = real_positions(mask, b)
        last = 0.0
        for t in reversed(real):
            next_v = float(values[b, t + 1]) if t + 1 in real else 0.0  # 0 after the last token
            delta = float(rewards[b, t]) + gamma * next_v - float(values[b, t])
            last = delta + gamma * lam * last
            adv[b, t] = last
            ret[b, t] = last + float(values[b, t])
    return adv, ret


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5), (1.0, 1.0), (0.99, 0.0), (0.5, 0.9)])
def test_compute_gae_matches_naive_loop(gamma, lam):
    mask = make_mask()
    rewards = randn(len(ROWS), R, seed=8) * mask
    values = randn(len(ROWS), R, seed=9) * mask
    adv, ret = compute_gae(rewards, values, raw_shift(values), mask, gamma, lam)
    exp_adv, exp_ret = naive_gae(rewards, values, mask, gamma, lam)
    torch.testing.assert_close(adv, exp_adv, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ret, exp_ret, rtol=1e-12, atol=1e-12)
    assert torch.all(adv[mask == 0] == 0)
    assert torch.all(ret[mask == 0] == 0)


def test_compute_gae_hand_computed():
    # prompt | 3 real tokens | pad. gamma = 1, lam = 1: A_t = sum of future rewards - V_t.
    mask = torch.tensor([[0, 1, 1, 1, 0]], dtype=F64)
    rewards = torch.tensor([[0, 0.0, 0.0, 1.0, 0]], dtype=F64)
    values = torch.tensor([[0, 0.5, 0.25, 0.75, 0]], dtype=F64)
    adv, ret = compute_gae(rewards, values, raw_shift(values), mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0, 0.5, 0.75, 0.25, 0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0, 1.0, 1.0, 1.0, 0]], dtype=F64))
    # gamma = 0.5, lam = 0: one-step TD errors r_t + 0.5 V_{t+1} - V_t, the last bootstraps from 0
    adv, ret = compute_gae(rewards, values, raw_shift(values), mask, 0.5, 0.0)
    torch.testing.assert_close(adv, torch.tensor([[0, -0.375, 0.125, 0.25, 0]], dtype=F64))
    torch.testing.assert_close(ret, torch.tensor([[0, 0.125, 0.375, 1.0, 0]], dtype=F64))


@pytest.mark.parametrize("gamma,lam", [(1.0, 0.95), (0.9, 0.5)])
def test_compute_gae_never_reads_prompt_or_pad_positions(gamma, lam):
    """The tutorial's convention: ``values_next`` is the raw shift, so the last real token's
    ``values_next`` is the value at the pad (or after-EOS) position behind it. ``compute_gae``
    must stop bootstrapping there (``nonterminal_t = mask[t + 1]``) whatever that value is."""
    mask = make_mask()
    rewards = randn(len(ROWS), R, seed=10) * mask
    values = randn(len(ROWS), R, seed=11) * mask
    clean = compute_gae(rewards, values, raw_shift(values), mask, gamma, lam)

    dirty_r = with_garbage(rewards, mask, seed=12)
    dirty_v = with_garbage(values, mask, seed=13)
    assert (dirty_v[mask == 0].abs() > 1e3).any()  # the garbage is really there
    dirty = compute_gae(dirty_r, dirty_v, raw_shift(dirty_v), mask, gamma, lam)
    for c, d in zip(clean, dirty):
        assert torch.equal(c, d)
        assert torch.all(d[mask == 0] == 0)


# ============================================================================ policy loss
def test_policy_loss_ratio_one_is_minus_mean_advantage():
    mask = make_mask()
    old = with_garbage(randn(len(ROWS), R, seed=14) - 2, mask, seed=15)
    adv = with_garbage(randn(len(ROWS), R, seed=16), mask, seed=17) / 1e3  # finite garbage
    loss, clip_frac = ppo_policy_loss(old.clone(), old, adv, mask, clip=0.2)
    vals = naive_masked_values(adv, mask)
    assert loss.item() == pytest.approx(-sum(vals) / len(vals), rel=1e-12)
    assert clip_frac.item() == 0.0


def _hand_policy_case():
    # position:      prompt   t1     t2     t3     t4     t5     pad
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0]], dtype=F64)
    adv = torch.tensor([[50.0, 1.0, -1.0, 2.0, -2.0, 1.0, -30.0]], dtype=F64)
    ratio = torch.tensor([[3.0, 1.5, 0.5, 0.5, 1.5, 1.1, 0.1]], dtype=F64)
    old = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -1.5, -2.5, -4.0]], dtype=F64)
    new = (old + ratio.log()).requires_grad_(True)
    return mask, adv, ratio, old, new


def test_policy_loss_hand_computed_clipping():
    mask, adv, ratio, old, new = _hand_policy_case()
    loss, clip_frac = ppo_policy_loss(new, old, adv, mask, clip=0.2)
    # t1: A=+1, r=1.5 -> max(-1.5, -1.2) = -1.2  clipped at 1 + 0.2
    # t2: A=-1, r=0.5 -> max( 0.5,  0.8) =  0.8  clipped at 1 - 0.2
    # t3: A=+2, r=0.5 -> max(-1.0, -1.6) = -1.0  NOT clipped (pessimistic unclipped branch)
    # t4: A=-2, r=1.5 -> max( 3.0,  2.4) =  3.0  NOT clipped
    # t5: A=+1, r=1.1 -> max(-1.1, -1.1) = -1.1  inside the trust region
    # prompt / pad tokens (A=50, r=3; A=-30, r=0.1) are ignored
    assert loss.item() == pytest.approx((-1.2 + 0.8 - 1.0 + 3.0 - 1.1) / 5, rel=1e-12)
    assert clip_frac.item() == pytest.approx(2 / 5, rel=1e-12)

    loss.backward()
    g = new.grad[0]
    # d/dlogp of -A * exp(logp - old) is -A * r; clipped and masked tokens get exactly 0
    assert g[1].item() == 0.0 and g[2].item() == 0.0
    assert g[0].item() == 0.0 and g[6].item() == 0.0
    assert g[3].item() == pytest.approx(-2.0 * 0.5 / 5, rel=1e-12)
    assert g[4].item() == pytest.approx(2.0 * 1.5 / 5, rel=1e-12)
    assert g[5].item() == pytest.approx(-1.0 * 1.1 / 5, rel=1e-12)


def test_policy_loss_matches_naive_loop():
    mask = make_mask()
    old = randn(len(ROWS), R, seed=18) - 3
    new = old + 0.4 * randn(len(ROWS), R, seed=19)
    adv = randn(len(ROWS), R, seed=20)
    clip = 0.2
    loss, clip_frac = ppo_policy_loss(new, old, adv, mask, clip)
    total, n_clipped, n = 0.0, 0, 0
    for b in range(len(ROWS)):
        for t in real_positions(mask, b):
            r = math.exp(float(new[b, t] - old[b, t]))
            a = float(adv[b, t])
            unclipped, clipped = -a * r, -a * min(max(r, 1 - clip), 1 + clip)
            total += max(unclipped, clipped)
            n_clipped += clipped > unclipped
            n += 1
    assert 0 < n_clipped < n  # both branches exercised
    assert loss.item() == pytest.approx(total / n, rel=1e-12)
    assert clip_frac.item() == pytest.approx(n_clipped / n, rel=1e-12)


# ============================================================================ value loss
def test_value_loss_hand_computed():
    # position:          prompt  t1    t2    t3    t4   pad
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0, 1.0, 0.0]], dtype=F64)
    old = torch.tensor([[9.0, 0.0, 0.0, 0.0, 1.0, -9.0]], dtype=F64)
    new = torch.tensor([[-9.0, 1.0, 0.1, 0.5, 0.5, 9.0]], dtype=F64)
    ret = torch.tensor([[100.0, 1.0, 1.0, -1.0, 0.0, -100.0]], dtype=F64)
    loss, clip_frac = ppo_value_loss(new, old, ret, mask, vf_clip=0.2)
    # t1: V_clip = 0.2: (1-1)^2 = 0     vs (0.2-1)^2 = 0.64 -> 0.64 clipped
    # t2: V_clip = 0.1: 0.81            vs 0.81             -> 0.81 not clipped (tie)
    # t3: V_clip = 0.2: (0.5+1)^2 = 2.25 vs (0.2+1)^2 = 1.44 -> 2.25 not clipped
    # t4: V_clip = 0.8: 0.25            vs 0.64             -> 0.64 clipped
    assert loss.item() == pytest.approx(0.5 * (0.64 + 0.81 + 2.25 + 0.64) / 4, rel=1e-12)
    assert clip_frac.item() == pytest.approx(2 / 4, rel=1e-12)

    # inside the clip range the loss is plain 0.5 * MSE over masked tokens
    near = old + torch.tensor([[5.0, 0.1, -0.1, 0.05, 0.0, 5.0]], dtype=F64)
    loss, clip_frac = ppo_value_loss(near, old, ret, mask, vf_clip=0.2)
    mse = sum(float(near[0, t] - ret[0, t]) ** 2 for t in range(1, 5)) / 4
    assert loss.item() == pytest.approx(0.5 * mse, rel=1e-12)
    assert clip_frac.item() == 0.0


# ============================================================================ KL estimators
def test_kl_estimators_formulas_and_signs():
    lp = randn(1000, seed=21) * 3 - 2
    lq = randn(1000, seed=22) * 3 - 2
    for i in range(0, 1000, 97):
        a, b = float(lp[i]), float(lq[i])
        assert kl_k1(lp, lq)[i].item() == pytest.approx(a - b, rel=1e-12, abs=1e-12)
        assert kl_k2(lp, lq)[i].item() == pytest.approx(0.5 * (a - b) ** 2, rel=1e-12, abs=1e-12)
        r = math.exp(b - a)
        assert kl_k3(lp, lq)[i].item() == pytest.approx((r - 1) - math.log(r), rel=1e-9, abs=1e-12)
    assert (kl_k1(lp, lq) < 0).any()
    assert (kl_k2(lp, lq) >= 0).all()
    assert (kl_k3(lp, lq) >= 0).all()
    assert (kl_k3(lp, lp) == 0).all()
    # k3 stays >= 0 in float32 for tiny and large log-ratios alike
    d = torch.tensor([-20.0, -1e-4, -1e-7, 0.0, 1e-7, 1e-4, 20.0])
    assert (kl_k3(torch.zeros(7), d) >= 0).all()


def test_kl_estimators_monte_carlo_against_exact_kl():
    p = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=F64)
    q = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=F64)
    exact = sum(float(pi) * math.log(float(pi) / float(qi)) for pi, qi in zip(p, q))  # ~0.7186
    idx = torch.multinomial(p, 200_000, replacement=True, generator=torch.Generator().manual_seed(0))
    logp, logq = p.log()[idx], q.log()[idx]
    # per-sample std of k1 and k3 is ~1.05, so the standard error is ~0.0024
    assert kl_k1(logp, logq).mean().item() == pytest.approx(exact, abs=0.015)
    assert kl_k3(logp, logq).mean().item() == pytest.approx(exact, abs=0.015)
    # k2 estimates E_p[0.5 log^2(p/q)] ~ 0.816, not the KL: its bias (~0.1) is far beyond noise
    k2_expected = 0.5 * sum(float(pi) * math.log(float(pi) / float(qi)) ** 2 for pi, qi in zip(p, q))
    k2_mean = kl_k2(logp, logq).mean().item()
    assert k2_mean == pytest.approx(k2_expected, abs=0.015)
    assert abs(k2_mean - exact) > 0.05


def test_kl_penalty_dispatches_and_rejects_unknown_names():
    lp, lq = randn(3, 5, seed=23), randn(3, 5, seed=24)
    for name, fn in [("k1", kl_k1), ("k2", kl_k2), ("k3", kl_k3)]:
        assert torch.equal(kl_penalty(lp, lq, name), fn(lp, lq))
    assert torch.equal(kl_penalty(lp, lq), kl_k1(lp, lq))  # default k1, as [Z19]
    with pytest.raises(ValueError, match="'k4'"):
        kl_penalty(lp, lq, "k4")


def test_approx_kl():
    mask = make_mask()
    old = randn(len(ROWS), R, seed=25) - 2
    assert approx_kl(old, old, mask).item() == 0.0
    new = old + 0.3 * randn(len(ROWS), R, seed=26)
    new = torch.where(mask != 0, new, old + 5.0)  # pad / prompt positions must not count
    vals = []
    for b in range(len(ROWS)):
        for t in real_positions(mask, b):
            d = float(new[b, t] - old[b, t])
            vals.append(math.exp(d) - 1 - d)
    assert approx_kl(new, old, mask).item() == pytest.approx(sum(vals) / len(vals), rel=1e-10)


# ============================================================================ logits helpers
def test_entropy_from_logits_matches_naive():
    logits = randn(3, 4, 11, seed=27) * 4
    logits[0, 0] = torch.tensor([30.0] + [-30.0] * 10, dtype=F64)  # almost deterministic
    ent = entropy_from_logits(logits)
    for b in range(3):
        for t in range(4):
            p = torch.softmax(logits[b, t], -1).tolist()
            expected = -sum(pi * math.log(pi) for pi in p if pi > 0)
            assert ent[b, t].item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    uniform = torch.zeros(2, 5, dtype=F64)
    torch.testing.assert_close(entropy_from_logits(uniform), torch.full((2,), math.log(5), dtype=F64))


def test_logprobs_from_logits_matches_log_softmax_gather():
    logits = randn(3, 5, 13, seed=28, dtype=torch.float32) * 3
    tokens = torch.randint(0, 13, (3, 5), generator=torch.Generator().manual_seed(29))
    out = logprobs_from_logits(logits, tokens)
    assert out.shape == (3, 5) and out.dtype == torch.float32
    for b in range(3):
        for t in range(5):
            row = logits[b, t].double()
            expected = float(row[tokens[b, t]] - torch.logsumexp(row, -1))
            assert out[b, t].item() == pytest.approx(expected, abs=1e-5)
    # half-precision logits come back as float32
    assert logprobs_from_logits(logits.bfloat16(), tokens).dtype == torch.float32


# ============================================================================ explained variance
def test_explained_variance():
    mask = make_mask()
    ret = with_garbage(randn(len(ROWS), R, seed=30), mask, seed=31)
    assert explained_variance(ret, ret, mask).item() == pytest.approx(1.0, abs=1e-12)
    mean = masked_mean(ret, mask)
    const = torch.full_like(ret, mean.item())
    assert explained_variance(const, ret, mask).item() == pytest.approx(0.0, abs=1e-10)

    values = with_garbage(ret + 0.5 * randn(len(ROWS), R, seed=32), mask, seed=33)
    r, v = naive_masked_values(ret, mask), naive_masked_values(values, mask)
    n = len(r)

    def var(xs):
        m = sum(xs) / n
        return sum((x - m) ** 2 for x in xs) / n

    expected = 1 - var([a - b for a, b in zip(r, v)]) / var(r)
    assert explained_variance(values, ret, mask).item() == pytest.approx(expected, rel=1e-10)


# ============================================================================ KL controllers
def test_adaptive_kl_controller_ziegler_update():
    # e = clip(KL / target - 1, -0.2, 0.2); beta <- beta * (1 + e * n_steps / horizon)
    c = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    c.update(6.6, 256)  # e = +0.1 -> 0.1 * (1 + 0.1 * 0.0256) = 0.100256
    assert c.value == pytest.approx(0.100256, rel=1e-12)
    c = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    c.update(5.4, 256)  # e = -0.1 -> 0.1 * (1 - 0.00256) = 0.099744
    assert c.value == pytest.approx(0.099744, rel=1e-12)
    c = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    c.update(60.0, 256)  # e = 9 clipped to +0.2 -> 0.1 * 1.00512
    assert c.value == pytest.approx(0.100512, rel=1e-12)
    c = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    c.update(0.0, 256)  # e = -1 clipped to -0.2 -> 0.1 * 0.99488
    assert c.value == pytest.approx(0.099488, rel=1e-12)
    c = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    c.update(6.0, 256)  # on target: unchanged
    assert c.value == pytest.approx(0.1, rel=1e-15)
    # updates compound multiplicatively
    c = AdaptiveKLController(0.2, target=1.0, horizon=100)
    c.update(1.5, 10)  # e = +0.2 (clipped) -> 0.2 * 1.02 = 0.204
    c.update(0.95, 50)  # e = -0.05 -> 0.204 * (1 - 0.025) = 0.1989
    assert c.value == pytest.approx(0.1989, rel=1e-12)


def test_fixed_kl_controller_and_state_dict_round_trip():
    f = FixedKLController(0.05)
    for kl in (0.0, 1.0, 100.0):
        f.update(kl, 64)
    assert f.value == 0.05
    g = FixedKLController(1.0)
    g.load_state_dict(f.state_dict())
    assert g.value == 0.05

    a = AdaptiveKLController(0.1, target=6.0, horizon=10_000)
    for kl in (7.0, 20.0, 3.0):
        a.update(kl, 128)
    b = AdaptiveKLController(0.7, target=6.0, horizon=10_000)
    b.load_state_dict(a.state_dict())
    assert b.value == a.value
    a.update(8.0, 128)
    b.update(8.0, 128)
    assert b.value == a.value

    assert type(build_kl_controller(0.1, True, 6.0, 10_000)) is AdaptiveKLController
    assert type(build_kl_controller(0.1, False, 6.0, 10_000)) is FixedKLController


# ============================================================================ sampling
def _draw(logits_row: torch.Tensor, n: int, seed: int, **kw) -> torch.Tensor:
    """``n`` independent samples from one row of logits (one row per draw)."""
    g = torch.Generator().manual_seed(seed)
    return sample_next_token(logits_row.expand(n, -1), generator=g, **kw)


def _freqs(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).double() / tokens.numel()


def test_greedy_and_top_k_one_are_argmax():
    logits = randn(64, 50, seed=34, dtype=torch.float32) * 2
    argmax = [max(range(50), key=lambda v: logits[b, v].item()) for b in range(64)]
    assert sample_next_token(logits, greedy=True).tolist() == argmax
    # greedy ignores temperature / top-k / top-p
    assert sample_next_token(logits, temperature=5.0, top_k=3, top_p=0.1, greedy=True).tolist() == argmax
    g = torch.Generator().manual_seed(0)
    assert sample_next_token(logits, top_k=1, generator=g).tolist() == argmax
    assert sample_next_token(logits, temperature=3.0, top_k=1, generator=g).tolist() == argmax


def test_top_k_never_samples_outside_the_top_k():
    V, k = 20, 4
    logits = randn(V, seed=35, dtype=torch.float32)
    top = set(sorted(range(V), key=lambda v: -logits[v].item())[:k])
    tokens = _draw(logits, 20_000, seed=1, top_k=k, temperature=2.0)
    assert set(tokens.tolist()) == top  # only the top k, and each of them
    # within the top k, the distribution is the renormalised softmax
    sub = torch.full((V,), float("-inf"))
    sub[list(top)] = logits[list(top)] / 2.0
    torch.testing.assert_close(_freqs(tokens, V), torch.softmax(sub.double(), -1), atol=0.015, rtol=0)
    # top_k >= V (or 0) is no filtering
    assert len(set(_draw(logits, 20_000, seed=2, top_k=V, temperature=3.0).tolist())) == V
    assert len(set(_draw(logits, 20_000, seed=3, top_k=0, temperature=3.0).tolist())) == V


def _top_p_support(probs: list[float], top_p: float, n: int = 5_000, seed: int = 0) -> set[int]:
    logits = torch.tensor(probs).log()
    return set(_draw(logits, n, seed=seed, top_p=top_p).tolist())


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = [0.5, 0.3, 0.15, 0.05]
    assert _top_p_support(probs, 0.7) == {0, 1}
    # boundary rule (see the comment in sample_next_token): a token is dropped once the mass of
    # the tokens before it reaches top_p; before token 2 the mass is 0.8 >= 0.8, so it is dropped
    assert _top_p_support(probs, 0.8) == {0, 1}
    assert _top_p_support(probs, 0.801) == {0, 1, 2}
    assert _top_p_support(probs, 0.79) == {0, 1}
    assert _top_p_support(probs, 0.96) == {0, 1, 2, 3}
    # the first token is always kept, even when alone it exceeds top_p
    assert _top_p_support(probs, 0.5) == {0}
    assert _top_p_support(probs, 0.1) == {0}
    # dyadic probabilities make the boundary exact in float32: mass before token 2 is exactly 0.75
    assert _top_p_support([0.5, 0.25, 0.125, 0.125], 0.75) == {0, 1}
    assert _top_p_support([0.5, 0.25, 0.125, 0.125], 0.5) == {0}
    # the vocabulary order does not matter: the filtered set is scattered back to token ids
    assert _top_p_support([0.05, 0.3, 0.15, 0.5], 0.7) == {3, 1}


def test_top_p_renormalises_the_kept_tokens():
    tokens = _draw(torch.tensor([0.5, 0.3, 0.15, 0.05]).log(), 40_000, seed=4, top_p=0.7)
    expected = torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0], dtype=F64)
    torch.testing.assert_close(_freqs(tokens, 4), expected, atol=0.015, rtol=0)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_matches_softmax_of_scaled_logits(temperature):
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5, -0.3])
    tokens = _draw(logits, 40_000, seed=5, temperature=temperature)
    expected = torch.softmax(logits.double() / temperature, -1)
    torch.testing.assert_close(_freqs(tokens, 5), expected, atol=0.015, rtol=0)


def _vocab_with_holes(B: int, seed: int) -> torch.Tensor:
    """``[B, V]`` probabilities over three and a half ``CDF_BLOCK``s, with tokens of probability 0
    scattered, a whole block of them, and the last token's block short."""
    V = 3 * CDF_BLOCK + CDF_BLOCK // 2 + 5
    probs = torch.softmax(randn(B, V, seed=seed, dtype=torch.float32) * 3, -1)
    probs[:, ::7] = 0.0
    probs[:, CDF_BLOCK : 2 * CDF_BLOCK] = 0.0
    return probs


def test_the_inverse_cdf_draw_is_the_search_over_the_whole_row():
    """The two-level search lands on the token a float64 running sum over the whole row gives,
    for uniforms from 0 to the largest below 1, and never on a token of probability 0."""
    probs = _vocab_with_holes(64, seed=36)
    u = torch.rand(64, generator=torch.Generator().manual_seed(7), dtype=F64)
    u[0], u[1] = 0.0, 1.0 - 2.0**-53
    cdf = probs.double().cumsum(-1)
    want = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(1), right=True).squeeze(1)
    want[1] = int(probs[1].nonzero().max())  # u -> 1: the last token of positive probability
    got = inverse_cdf(probs, u)
    assert got.tolist() == want.tolist()
    assert (probs.gather(1, got[:, None]) > 0).all()


def test_the_inverse_cdf_draw_has_the_rows_distribution_across_blocks():
    probs = _vocab_with_holes(1, seed=37)[0]
    n = 100_000
    u = torch.rand(n, generator=torch.Generator().manual_seed(8), dtype=F64)
    freqs = _freqs(torch.cat([inverse_cdf(probs.expand(10_000, -1), c) for c in u.split(10_000)]), probs.shape[0])
    assert freqs[probs == 0].sum() == 0
    p = probs.double() / probs.double().sum()
    kept = p > 0
    chi2 = (n * (freqs[kept] - p[kept]) ** 2 / p[kept]).sum().item()
    dof = int(kept.sum()) - 1
    assert abs(chi2 - dof) < 5 * math.sqrt(2 * dof), (chi2, dof)  # chi-square: mean dof, sd sqrt(2 dof)


# ============================================================================ mask after EOS
def naive_mask_after_eos(responses, eos):
    out = torch.zeros(responses.shape, dtype=torch.float32)
    for b in range(responses.shape[0]):
        for t in range(responses.shape[1]):
            out[b, t] = 1.0
            if responses[b, t] == eos:
                break
    return out


def test_mask_after_eos():
    eos = 2
    responses = torch.tensor(
        [
            [5, 7, 2, 0, 0, 0],  # EOS in the middle, pad after
            [2, 0, 0, 0, 0, 0],  # EOS first
            [5, 6, 7, 8, 9, 2],  # EOS last
            [5, 6, 7, 8, 9, 4],  # no EOS: all ones
            [3, 2, 5, 2, 6, 2],  # several EOS: cut at the first
            [1, 1, 2, 2, 1, 1],
        ]
    )
    out = StopChecker(eos).mask(responses)
    assert out.dtype == torch.float32
    expected = torch.tensor(
        [
            [1, 1, 1, 0, 0, 0],
            [1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 1, 1],
            [1, 1, 1, 1, 1, 1],
            [1, 1, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0],
        ],
        dtype=torch.float32,
    )
    assert torch.equal(out, expected)
    assert torch.equal(out, naive_mask_after_eos(responses, eos))

    random = torch.randint(0, 6, (32, 12), generator=torch.Generator().manual_seed(36))
    assert torch.equal(StopChecker(eos).mask(random), naive_mask_after_eos(random, eos))
