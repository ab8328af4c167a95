"""The loss options (``ppo.clip_low`` / ``clip_high``, ``dual_clip``, ``loss_agg``, ``kl_in``,
``target_kl``): each against a naive per-token loop, and in a real run."""

from __future__ import annotations

import math

import pytest
import torch

from ppo_lightning.algo.kl import kl_k3, kl_penalty

from ppo_lightning.algo.losses import aggregate, clip_fractions, global_token_count, ppo_policy_loss

from ppo_lightning.algo.stats import masked_mean

from ppo_lightning.config.choices import LOSS_AGGREGATIONS

torch.manual_seed(0)
B, R = 4, 6
MASK = torch.tensor(
    [[1, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0], [1, 0, 0, 0, 0, 0], [1, 1, 1, 1, 0, 0]], dtype=torch.float32
)
X = torch.randn(B, R)
MAX_NEW_TOKENS = 10  # the constant seq_mean_token_sum_norm divides by (sampling.max_new_tokens >= R)


def _naive_aggregate(x, mask, mode):
    rows = [[x[b, t].item() for t in range(R) if mask[b, t]] for b in range(B)]
    if mode in ("token_mean", "token_mean_global"):  # one process: the global count is the local one
        flat = [v for row in rows for v in row]
        return sum(flat) / len(flat)
    if mode == "seq_mean_token_mean":
        return sum(sum(row) / len(row) for row in rows) / B
    if mode == "seq_mean_token_sum_norm":  # Dr. GRPO's code: sum over every token / (B * max length)
        return sum(sum(row) for row in rows) / (B * MAX_NEW_TOKENS)
    return sum(sum(row) for row in rows) / B  # seq_mean_token_sum


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_aggregation_matches_its_definition_and_micro_batch_shares_add_up(mode):
    """token_mean: every token weighs the same; seq_mean_token_mean: every response (GRPO,
    DeepSeekMath eq. 3); seq_mean_token_sum: no length division; seq_mean_token_sum_norm: that
    over a constant length (Dr. GRPO, Liu et al. 2025; TRL's dr_grpo)."""
    whole = aggregate(X, MASK, mode, norm_length=MAX_NEW_TOKENS)
    assert whole.item() == pytest.approx(_naive_aggregate(X, MASK, mode), rel=1e-6)
    count = global_token_count(MASK)
    shares = sum(
        aggregate(X[s : s + 2], MASK[s : s + 2], mode, token_count=count, seq_count=B, norm_length=MAX_NEW_TOKENS)
        for s in (0, 2)
    )
    assert shares.item() == pytest.approx(whole.item(), rel=1e-6)


def test_seq_mean_token_sum_norm_needs_its_constant():
    with pytest.raises(ValueError, match="norm_length"):
        aggregate(X, MASK, "seq_mean_token_sum_norm")


def test_k3_at_an_extreme_pad_logprob_has_a_finite_zero_gradient():
    """``kl_in=loss`` computes k3 on the current logprobs, whose pad positions hold anything (the
    rollout's reference logprobs there are 0). At a pad logprob of -100, exp(log r) = exp(100)
    overflows float32; masked after the estimator, the backward pass would give 0 * inf = NaN.
    Masked before it, the pad position contributes 0 and a zero gradient."""
    new = torch.tensor([[-1.0, -2.0, -100.0]], requires_grad=True)
    ref = torch.tensor([[-1.05, -1.9, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    loss = aggregate(kl_penalty(new, ref, "k3", mask), mask, "token_mean")
    loss.backward()
    assert torch.isfinite(new.grad).all() and new.grad[0, 2] == 0
    want = [(1 - math.exp(r - n)) / 2 for n, r in ((-1.0, -1.05), (-2.0, -1.9))]  # d/dn k3 / 2 tokens
    assert new.grad[0, :2].tolist() == pytest.approx(want, rel=1e-5)


def test_k3_clamps_the_log_ratio_on_real_tokens_too():
    """A real token the policy has all but ruled out (log r = 100) gives a large finite k3, not
    inf: the log-ratio is clamped to +-20 before the exponential (verl clamps there too)."""
    new = torch.tensor([[-100.0, -1.0]], requires_grad=True)
    ref = torch.tensor([[0.0, -1.0]])
    k3 = kl_k3(new, ref)
    k3.sum().backward()
    assert torch.isfinite(k3).all() and torch.isfinite(new.grad).all()
    assert k3[0, 0].item() == pytest.approx(math.expm1(20.0) - 20.0, rel=1e-5) and k3[0, 1] == 0


def test_asymmetric_and_dual_clip_follow_the_per_token_formula():
    """Clip-higher (DAPO, Yu et al. 2025): clamp(ratio, 1 - eps_low, 1 + eps_high). Dual clip
    (Ye et al. 2020): for A < 0 the loss is min(max(-A r, -A clip(r)), -c A)."""
    old = torch.randn(B, R)
    new = old + torch.tensor([[-0.5, 0.5, 1.5, -1.5, 0.1, 2.5]]).expand(B, R)  # ratios far on both sides
    adv = torch.tensor([[1.0], [-1.0], [2.0], [-0.5]]).expand(B, R)
    low, high, c = 0.2, 0.28, 3.0
    loss, _ = ppo_policy_loss(new, old, adv, MASK, low, clip_high=high, dual_clip=c)
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
    assert ppo_policy_loss(new, old, adv, MASK, low, clip_high=high)[0] > loss


# ----------------------------------------------------------------------------- in a run
QUIET = [
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "export_dir=null",
    "logger=csv",
    "data.batch_size=8",
    "sampling.max_new_tokens=8",
]


def _run(tmp_path, cache_dir, *overrides):
    from ppo_lightning.jobs.run import train
    from tests.conftest import compose_cfg, read_metrics

    train(compose_cfg([*QUIET, *overrides], tmp_path, cache_dir))
    return read_metrics(tmp_path / "metrics.csv")


KL_LOSS_RUN = (
    "ppo.kl_in=loss",
    "ppo.kl_coef=0.5",
    "trainer.max_steps=3",
    "ppo.ppo_epochs=1",
    "ppo.minibatch_size=8",
    "ppo.fuse_rollout_forward=false",
    "optimizer.lr=1e-2",
)


def test_kl_in_the_loss_leaves_the_reward_alone_and_grows_from_zero(tmp_path, cache_dir):
    """``kl_in=loss``: the reward is the score alone (no per-token penalty), and the k3 KL loss is
    exactly 0 while the policy is the reference (the first update of the first iteration),
    positive once it has moved."""
    rows = _run(tmp_path, cache_dir, *KL_LOSS_RUN)
    for row in rows:
        assert row["objective/non_score_reward"] == 0.0 and row["objective/rlhf_reward"] == row["objective/scores"]
    assert rows[0]["loss/kl_avg"] == 0.0 and rows[0]["objective/kl"] == 0.0
    assert rows[-1]["loss/kl_avg"] > 0 and rows[-1]["objective/kl"] != 0.0


def test_kl_in_the_loss_uses_the_chosen_estimator(tmp_path, cache_dir):
    """``ppo.kl_estimator=k2`` in the loss is k2, not k3: the two runs agree until the first
    update that sees a moved policy (iteration 1's rollout is the same: at iteration 0 both KL
    losses and their gradients are 0), where 0.5 (log r)^2 and (r - 1) - log r differ."""
    k3 = _run(tmp_path / "k3", cache_dir, *KL_LOSS_RUN)
    k2 = _run(tmp_path / "k2", cache_dir, *KL_LOSS_RUN, "ppo.kl_estimator=k2")
    assert k2[1]["objective/scores"] == k3[1]["objective/scores"]  # the same samples
    assert k2[1]["loss/kl_avg"] > 0 and k2[1]["loss/kl_avg"] != pytest.approx(k3[1]["loss/kl_avg"], rel=1e-3)


@pytest.mark.parametrize(
    "target, minibatch, epochs, want",
    [
        (1e-12, 4, 4, 0.5),  # two minibatches an epoch: the second sees the first's step and stops
        (1e-12, 8, 2, 1.0),  # one minibatch an epoch: epoch 2's forward sees epoch 1's step and stops
        (1e9, 4, 4, 4.0),
    ],
)  # never
def test_target_kl_stops_at_the_first_minibatch_past_it(tmp_path, cache_dir, target, minibatch, epochs, want):
    """The KL is measured by each minibatch's forward, before its step, so it counts every step
    taken before it; the minibatch that passes the target takes no step. (Measured per epoch
    from the minibatches' own pre-step KL, one minibatch an epoch with two epochs could never
    stop: epoch 1's only KL is exactly 0.)"""
    rows = _run(
        tmp_path,
        cache_dir,
        f"ppo.target_kl={target}",
        f"ppo.ppo_epochs={epochs}",
        f"ppo.minibatch_size={minibatch}",
        "trainer.max_steps=2",
    )
    assert [r["policy/epochs"] for r in rows] == [want, want]


def test_dr_grpo_loss_divides_by_the_constant_max_new_tokens(tmp_path, cache_dir):
    """``seq_mean_token_sum_norm`` is ``seq_mean_token_sum`` / ``sampling.max_new_tokens`` (not the
    rollout's longest response): one update on the same first rollout shows it."""
    one = ("ppo.minibatch_size=8", "ppo.ppo_epochs=1", "trainer.max_steps=1")
    total = _run(tmp_path / "sum", cache_dir, *one, "ppo.loss_agg=seq_mean_token_sum")[0]["loss/policy_avg"]
    normed = _run(tmp_path / "norm", cache_dir, *one, "ppo.loss_agg=seq_mean_token_sum_norm")[0]["loss/policy_avg"]
    assert total != 0 and normed == pytest.approx(total / 8, rel=1e-5)  # QUIET: sampling.max_new_tokens=8


def test_clip_fractions_split_the_clipped_tokens_by_side():
    """TRL's GRPOTrainer: low = ratio < 1 - eps_low with A < 0, high = ratio > 1 + eps_high with
    A > 0; together they are the tokens where the clipped branch of the loss is active."""
    old = torch.randn(B, R)
    new = old + torch.tensor([[-0.5, 0.5, 1.5, -1.5, 0.1, 2.5]]).expand(B, R)
    adv = torch.tensor([[1.0], [-1.0], [2.0], [-0.5]]).expand(B, R)
    low, high = clip_fractions(new, old, adv, MASK, 0.2, 0.28)
    n_low = n_high = 0
    for b in range(B):
        for t in range(R):
            if MASK[b, t]:
                r, a = math.exp(new[b, t].item() - old[b, t].item()), adv[b, t].item()
                n_low += r < 0.8 and a < 0
                n_high += r > 1.28 and a > 0
    n = MASK.sum().item()
    assert (low.item(), high.item()) == pytest.approx((n_low / n, n_high / n))
    _, total = ppo_policy_loss(new, old, adv, MASK, 0.2, clip_high=0.28)
    assert (low + high).item() == pytest.approx(total.item())


# ----------------------------------------------------------------------------- across ranks
def _token_mean_worker(out: str) -> None:
    """One rank (``fork_ranks`` sets torchrun's environment): a linear per-token loss under DDP
    on this rank's rows, whose masks hold a different number of tokens on each rank; writes the
    averaged gradient of each aggregation."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(3, 1))
    x, mask = _RANK_X[rank], _RANK_MASK[rank]
    grads = {}
    for mode in ("token_mean", "token_mean_global"):
        model.zero_grad()
        count = global_token_count(mask) if mode == "token_mean_global" else mask.sum()
        aggregate(model(x).squeeze(-1), mask, mode, token_count=count).backward()
        grads[mode] = model.module.weight.grad.clone()
    torch.save(grads, f"{out}/rank{rank}.pt")
    dist.barrier()  # an orderly end: no rank exits while gloo still talks to it
    del model  # DDP's reducer before its process group: freed after it, gloo's threads can abort the exit
    dist.destroy_process_group()


_RANK_X = [torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(r)) for r in range(2)]
_RANK_MASK = [
    torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]], dtype=torch.float32),  # 9 tokens
    torch.tensor([[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]], dtype=torch.float32),
]  # 3 tokens


@pytest.mark.slow  # two processes
def test_token_mean_global_is_the_token_mean_of_every_ranks_tokens(tmp_path):
    """Two gloo ranks with 9 and 3 response tokens, DDP averaging the gradients: with
    ``token_mean_global`` the gradient is that of the token mean over all 12 tokens on one
    process; the per-rank ``token_mean`` weighs each of rank 1's tokens 3x as much instead."""
    from tests.helpers import fork_ranks

    p = fork_ranks(lambda: _token_mean_worker(str(tmp_path)), 2, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:]
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)  # the same init as the ranks'
    x, mask = torch.cat(_RANK_X), torch.cat(_RANK_MASK)
    masked_mean(model(x).squeeze(-1), mask).backward()
    for g in got:
        torch.testing.assert_close(g["token_mean_global"], model.weight.grad)
    assert not torch.allclose(got[0]["token_mean"], model.weight.grad, atol=1e-4)


ENGINE_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def _naive_engine_weight(old, engine, mask, b, t, mode, cap):
    if not mask[b, t]:
        return 0.0
    if mode.startswith("token"):
        rho = math.exp(old[b, t] - engine[b, t])
    else:
        rho = math.exp(sum(old[b, s] - engine[b, s] for s in range(R) if mask[b, s]))
    if mode.endswith("truncate"):
        return min(rho, cap)
    return rho if rho <= cap else 0.0


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_engine_weights_match_their_definition(mode):
    """``ppo.engine_correction``: rho = pi_old / pi_engine of the sampled token (or the product
    over the response), capped at 2 or dropped past it, zero off the mask; against a per-token loop."""
    from ppo_lightning.algo.losses import engine_weights

    g = torch.Generator().manual_seed(3)
    old = -torch.rand(B, R, generator=g) * 3
    engine = old + torch.randn(B, R, generator=g) * 0.6  # some ratios pass the cap, some do not
    w = engine_weights(old, engine, MASK, mode, cap=2.0)
    want = torch.tensor(
        [[_naive_engine_weight(old, engine, MASK, b, t, mode, 2.0) for t in range(R)] for b in range(B)]
    )
    torch.testing.assert_close(w, want, rtol=1e-5, atol=1e-6)
    assert ((want > 0) & (want < 2.0)).any()  # the test holds both kinds of token
    assert mode.endswith("mask") or (want == 2.0).any()


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_engine_weights_leave_the_loss_unchanged_when_the_engine_is_the_trainer(mode):
    """No mismatch (the engine's logprobs are the trainer's, as with ``hf`` numerics): every
    weight is exactly 1 on the response, and the policy loss and its gradient are the unweighted ones."""
    from ppo_lightning.algo.losses import engine_weights

    old = -torch.rand(B, R) * 3
    w = engine_weights(old, old.clone(), MASK, mode, cap=2.0)
    assert torch.equal(w, MASK)
    new = (old + 0.1 * torch.randn(B, R)).requires_grad_()
    adv = torch.randn(B, R)
    plain, _ = ppo_policy_loss(new, old, adv, MASK, 0.2)
    (g_plain,) = torch.autograd.grad(plain, new)
    weighted, _ = ppo_policy_loss(new, old, adv, MASK, 0.2, weights=w)
    (g_weighted,) = torch.autograd.grad(weighted, new)
    assert weighted.item() == plain.item() and torch.equal(g_weighted, g_plain)


def test_engine_mismatch_metrics_against_their_definitions():
    """``rollout/engine_*``: the mean |difference|, the k1 KL, the share of tokens past the cap and
    the normalised effective sample size of the ratios, over the response tokens."""
    from types import SimpleNamespace

    from ppo_lightning.train.metrics import engine_mismatch

    g = torch.Generator().manual_seed(4)
    old = -torch.rand(B, R, generator=g) * 3
    engine = old + torch.randn(B, R, generator=g) * 0.6
    m = engine_mismatch(
        SimpleNamespace(sampling_logprobs=old, engine_logprobs=engine, response_mask=MASK, staleness=None), cap=2.0
    )
    tokens = [(b, t) for b in range(B) for t in range(R) if MASK[b, t]]
    rho = [math.exp(old[b, t] - engine[b, t]) for b, t in tokens]
    assert m["rollout/engine_logprob_diff"].item() == pytest.approx(
        sum(abs(old[b, t] - engine[b, t]) for b, t in tokens).item() / len(tokens), rel=1e-5
    )
    assert m["rollout/engine_kl"].item() == pytest.approx(
        sum(engine[b, t] - old[b, t] for b, t in tokens).item() / len(tokens), rel=1e-5
    )
    assert m["rollout/engine_capped_frac"].item() == pytest.approx(sum(x > 2.0 for x in rho) / len(tokens))
    assert m["rollout/engine_ess"].item() == pytest.approx(
        sum(rho) ** 2 / (len(rho) * sum(x * x for x in rho)), rel=1e-5
    )


@pytest.mark.parametrize("mode", ENGINE_MODES)
def test_an_engines_own_logprobs_weigh_the_update_as_a_naive_weighted_loss(mode):
    """``ppo.engine_correction`` from the sampler to the update: a backend that reports logprobs
    of its own (``Generated.logprobs``, as the vLLM backends do) that differ from the trainer's
    old logprobs makes the update's loss (``PPO._loss``) and its gradient exactly those of a
    naive per-token loop weighing each token's clipped loss by its ``rho = pi_old / pi_engine``
    (capped or dropped as ``mode`` says); with ``none``, the unweighted loss, which differs."""
    from ppo_lightning.algo.algorithm import PPO
    from ppo_lightning.algo.rollout import EngineView
    from ppo_lightning.config import PPOConfig
    from ppo_lightning.generation import SamplingParams
    from ppo_lightning.rollouts import RolloutWorker
    from tests.helpers import finish, samples

    g = torch.Generator().manual_seed(11)
    P = 2
    attention = torch.cat([torch.ones(B, P), MASK], 1).long()
    s = samples(
        query_responses=torch.randint(0, 50, (B, P + R), generator=g),
        attention_mask=attention,
        position_ids=(attention.cumsum(1) - 1).clamp(min=0),
        response_mask=MASK,
        ref_logprobs=-torch.rand(B, R, generator=g) * 3,
        scores=torch.randn(B, generator=g),
        raw_scores=torch.randn(B, generator=g),
        contains_eos=torch.ones(B, dtype=torch.bool),
        context_length=P,
    )
    old = -torch.rand(B, R, generator=g) * 3
    values = torch.randn(B, R, generator=g)
    engine_logp = (old + torch.randn(B, R, generator=g) * 0.6) * MASK  # the backend's Generated.logprobs
    new_logp = old + torch.randn(B, R, generator=g) * 0.3  # some ratios past the clip, some within
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS)

    def loss_and_grad(correction: str):
        cfg = PPOConfig(engine_correction=correction, engine_correction_cap=2.0, vf_coef=0.0, ent_coef=0.0)
        algo = PPO(None, None, RolloutWorker(None, sampling, None, None), cfg, None)
        view = EngineView(engine_logp, None, cfg.engine_correction, cfg.engine_correction_cap)
        r = finish(s, old, values, kl_coef=0.0, kl_estimator="k1", cfg=cfg, engine=view)
        x = new_logp.clone().requires_grad_()
        loss, _, _ = algo._loss(r, (torch.zeros(B, R), values, x), MASK.sum(), B)
        (grad,) = torch.autograd.grad(loss, x)
        return loss.detach(), grad, r

    loss, grad, r = loss_and_grad(mode)
    x = new_logp.clone().requires_grad_()
    naive = 0.0
    for b in range(B):
        for t in range(R):
            if MASK[b, t]:
                w = _naive_engine_weight(old, engine_logp, MASK, b, t, mode, 2.0)
                ratio, a = torch.exp(x[b, t] - old[b, t]), r.advantages[b, t]
                naive = naive + w * torch.maximum(-a * ratio, -a * torch.clamp(ratio, 0.8, 1.2))
    naive = naive / MASK.sum()
    (naive_grad,) = torch.autograd.grad(naive, x)
    torch.testing.assert_close(loss, naive.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, naive_grad, rtol=1e-5, atol=1e-6)
    unweighted, unweighted_grad, _ = loss_and_grad("none")
    assert not torch.allclose(loss, unweighted) and not torch.allclose(grad, unweighted_grad)
