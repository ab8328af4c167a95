"""The loss options (``ppo.clip_low`` / ``clip_high``, ``dual_clip``, ``loss_agg``, ``kl_in``,
``target_kl``): each against a naive per-token loop, and in a real run."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_lightning import ppo

torch.manual_seed(0)
B, R = 4, 6
MASK = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]],
                    dtype=torch.float32)
X = torch.randn(B, R)


def _naive_aggregate(x, mask, mode):
    rows = [[x[b, t].item() for t in range(R) if mask[b, t]] for b in range(B)]
    if mode == "token_mean":
        flat = [v for row in rows for v in row]
        return sum(flat) / len(flat)
    if mode == "seq_mean_token_mean":
        return sum(sum(row) / len(row) for row in rows) / B
    return sum(sum(row) for row in rows) / B  # seq_mean_token_sum


@pytest.mark.parametrize("mode", ppo.LOSS_AGGREGATIONS)
def test_aggregation_matches_its_definition_and_micro_batch_shares_add_up(mode):
    """token_mean: every token weighs the same; seq_mean_token_mean: every response (GRPO,
    DeepSeekMath eq. 3); seq_mean_token_sum: Dr. GRPO (Liu et al. 2025), no length division."""
    whole = ppo.aggregate(X, MASK, mode)
    assert whole.item() == pytest.approx(_naive_aggregate(X, MASK, mode), rel=1e-6)
    shares = sum(ppo.aggregate(X[s:s + 2], MASK[s:s + 2], mode, token_count=MASK.sum(), seq_count=B)
                 for s in (0, 2))
    assert shares.item() == pytest.approx(whole.item(), rel=1e-6)


def test_asymmetric_and_dual_clip_follow_the_per_token_formula():
    """Clip-higher (DAPO, Yu et al. 2025): clamp(ratio, 1 - eps_low, 1 + eps_high). Dual clip
    (Ye et al. 2020): for A < 0 the loss is min(max(-A r, -A clip(r)), -c A)."""
    old = torch.randn(B, R)
    new = old + torch.tensor([[-0.5, 0.5, 1.5, -1.5, 0.1, 2.5]]).expand(B, R)  # ratios far on both sides
    adv = torch.tensor([[1.0], [-1.0], [2.0], [-0.5]]).expand(B, R)
    low, high, c = 0.2, 0.28, 3.0
    loss, _ = ppo.ppo_policy_loss(new, old, adv, MASK, low, clip_high=high, dual_clip=c)
    want = []
    for b in range(B):
        for t in range(R):
            if not MASK[b, t]:
                continue
            r, a = math.exp(new[b, t].item() - old[b, t].item()), adv[b, t].item()
            v = max(-a * r, -a * min(max(r, 1 - low), 1 + high))
            if a < 0:
                v = min(v, -c * a)
            want.append(v)
    assert loss.item() == pytest.approx(sum(want) / len(want), rel=1e-5)
    # the dual clip bites here: without it the loss of the bad, much more likely tokens is larger
    assert ppo.ppo_policy_loss(new, old, adv, MASK, low, clip_high=high)[0] > loss


# ----------------------------------------------------------------------------- in a run
QUIET = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "callbacks=none",
         "export_dir=null", "logger=csv", "data.batch_size=8", "ppo.max_new_tokens=8"]


def _run(tmp_path, cache_dir, *overrides):
    from ppo_lightning.train import train
    from tests.conftest import compose_cfg, read_metrics

    train(compose_cfg([*QUIET, *overrides], tmp_path, cache_dir))
    return read_metrics(tmp_path / "metrics.csv")


def test_kl_in_the_loss_leaves_the_reward_alone_and_grows_from_zero(tmp_path, cache_dir):
    """``kl_in=loss``: the reward is the score alone (no per-token penalty), and the k3 KL loss is
    exactly 0 while the policy is the reference (the first update of the first iteration),
    positive once it has moved."""
    rows = _run(tmp_path, cache_dir, "ppo.kl_in=loss", "ppo.kl_coef=0.5", "trainer.max_steps=3", "ppo.ppo_epochs=1",
                "ppo.minibatch_size=8", "ppo.fuse_rollout_forward=false", "optimizer.lr=1e-2")
    for row in rows:
        assert row["objective/non_score_reward"] == 0.0 and row["objective/rlhf_reward"] == row["objective/scores"]
    assert rows[0]["loss/kl_avg"] == 0.0 and rows[0]["objective/kl"] == 0.0
    assert rows[-1]["loss/kl_avg"] > 0 and rows[-1]["objective/kl"] != 0.0


@pytest.mark.parametrize("target, epochs", [(1e-12, 1.0), (1e9, 4.0)])
def test_target_kl_stops_the_remaining_epochs(tmp_path, cache_dir, target, epochs):
    """Two minibatches per epoch: after the first epoch its second minibatch has moved the
    policy, so a tiny target stops there; a huge one never does."""
    rows = _run(tmp_path, cache_dir, f"ppo.target_kl={target}", "ppo.ppo_epochs=4", "ppo.minibatch_size=4",
                "trainer.max_steps=2")
    assert [r["policy/epochs"] for r in rows] == [epochs, epochs]


def test_clip_fractions_split_the_clipped_tokens_by_side():
    """TRL's GRPOTrainer: low = ratio < 1 - eps_low with A < 0, high = ratio > 1 + eps_high with
    A > 0; together they are the tokens where the clipped branch of the loss is active."""
    old = torch.randn(B, R)
    new = old + torch.tensor([[-0.5, 0.5, 1.5, -1.5, 0.1, 2.5]]).expand(B, R)
    adv = torch.tensor([[1.0], [-1.0], [2.0], [-0.5]]).expand(B, R)
    low, high = ppo.clip_fractions(new, old, adv, MASK, 0.2, 0.28)
    n_low = n_high = 0
    for b in range(B):
        for t in range(R):
            if MASK[b, t]:
                r, a = math.exp(new[b, t].item() - old[b, t].item()), adv[b, t].item()
                n_low += r < 0.8 and a < 0
                n_high += r > 1.28 and a > 0
    n = MASK.sum().item()
    assert (low.item(), high.item()) == pytest.approx((n_low / n, n_high / n))
    _, total = ppo.ppo_policy_loss(new, old, adv, MASK, 0.2, clip_high=0.28)
    assert (low + high).item() == pytest.approx(total.item())
