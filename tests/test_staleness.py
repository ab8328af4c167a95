"""``rollout.staleness=K``: the rollout iteration ``i`` learns from is sampled by the policy after
update ``i - K`` (``generation.lagged.LaggedBackend``), corrected by ``ppo.engine_correction``."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose_cfg, read_metrics
from tests.helpers import assert_same_metrics

QUIET = [
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "trainer.enable_checkpointing=false",
    "logger=csv",
    "export_dir=null",
    "sampling.max_new_tokens=12",
]


def _lagged(tiny_lm_dir, staleness: int):
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.generation.lagged import LaggedBackend
    from ppo_lightning.models.policy import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_lm_dir))
    lm = load_causal_lm(str(tiny_lm_dir), tok)
    return lm, tok, LaggedBackend(HFBackend, lm, tok, staleness)


def _update(lm, i: int) -> None:
    """A stand-in for update ``i``: every trained weight moves."""
    with torch.no_grad():
        for p in lm.parameters():
            p.add_(0.01 * (i + 1))


def _same_weights(a, b) -> bool:
    return all(torch.equal(a.get_parameter(n), b.get_parameter(n)) for n, _ in a.named_parameters())


@pytest.mark.parametrize("staleness", [1, 2])
def test_the_sampler_holds_the_policy_k_updates_back_and_a_checkpoint_restores_it(tiny_lm_dir, staleness):
    """Before iteration ``i`` the copy holds version ``max(0, i - K)``: the live weights as they were
    after that many updates; its state (copy, versions, snapshots waiting) restores another
    sampler to the same point, which then follows the same versions."""
    import copy

    from ppo_lightning.generation.lagged import LaggedBackend
    from ppo_lightning.generation.hf import HFBackend

    lm, tok, lagged = _lagged(tiny_lm_dir, staleness)
    history = [copy.deepcopy(lm)]  # the live weights after each update: version v is history[v]
    for i in range(5):
        v = max(0, i - staleness)
        assert lagged.version == lagged.weights_version(i) == v and lagged.live_version == i
        assert _same_weights(lagged.lm, history[v]), (i, v)
        if i == 2:
            state = lagged.state_dict()
            other = LaggedBackend(HFBackend, lm, tok, staleness)  # a resumed run's: a copy of the live weights
            other.load_state_dict(state)
            assert other.version == v and _same_weights(other.lm, history[v])
        _update(lm, i)
        history.append(copy.deepcopy(lm))
        lagged.sync_weights()
        if i >= 2:
            other.sync_weights()
            assert other.version == lagged.version and _same_weights(other.lm, lagged.lm)


def test_the_samplers_tokens_carry_its_version_and_its_own_logprobs(tiny_lm_dir):
    """``generate`` returns the copy's logprobs of its tokens (the behaviour policy's), not the
    live policy's: after an update the two differ, and the copy's are the old weights' own."""
    from ppo_lightning.generation import SamplingParams
    from ppo_lightning.generation.hf import HFBackend

    lm, tok, lagged = _lagged(tiny_lm_dir, 1)
    enc = tok(["hello there", "a"], return_tensors="pt", padding=True)
    params = SamplingParams(max_new_tokens=6)
    before = lagged.generate(enc.input_ids, enc.attention_mask, params, torch.Generator().manual_seed(0))
    _update(lm, 0)
    lagged.sync_weights()  # version 1 is taken only once it is one update old
    after = lagged.generate(enc.input_ids, enc.attention_mask, params, torch.Generator().manual_seed(0))
    assert lagged.version == 0 and torch.equal(before.responses, after.responses)
    torch.testing.assert_close(before.logprobs, after.logprobs)
    live = HFBackend(lm, tok, logprobs=True).generate(
        enc.input_ids, enc.attention_mask, params, torch.Generator().manual_seed(0)
    )
    assert not torch.allclose(live.logprobs, after.logprobs)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ppo.engine_correction=none"], r"^rollout.staleness=1 with ppo.engine_correction=none: .*allow_uncorrected"),
        (["generation=vllm"], r"^rollout.staleness=1 with generation._target_=.*VLLMBackend: .*generation=hf"),
        (["trainer=fsdp_cpu"], r"^rollout.staleness=1 with trainer.strategy=.*FSDP2Strategy: .*whole"),
    ],
)
def test_what_staleness_cannot_run_with_is_refused_in_one_line(tmp_path, cache_dir, overrides, message):
    from ppo_lightning.config import validate
    from ppo_lightning.config.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        validate(compose_cfg(["rollout.staleness=1", *overrides], tmp_path, cache_dir))
    allowed = ["rollout.staleness=1", "ppo.engine_correction=none", "rollout.allow_uncorrected=true"]
    validate(compose_cfg(allowed, tmp_path, cache_dir))


def _run(tmp_path, cache_dir, name: str, overrides: list[str], steps: int = 3) -> list[dict]:
    from ppo_lightning.jobs.run import train

    out = tmp_path / name
    train(compose_cfg([*QUIET, f"trainer.max_steps={steps}", *overrides], out, cache_dir))
    return read_metrics(out / "metrics.csv")


@pytest.mark.parametrize("switch", [[], ["model.lora.r=4"]], ids=["full", "lora"])
def test_a_lagging_sampler_that_never_changes_gives_the_synchronous_run(tmp_path, cache_dir, switch):
    """With a learning rate too small to move a float32 weight (``1e-30``; ``optimizer.lr`` must be
    > 0) the policy never changes, so sampling it one update late changes
    nothing: every reward, loss and KL column of ``rollout.staleness=1`` equals the synchronous
    run's (the correction's weights are 1 to float32 rounding). The tokens it trains on are
    tagged one update stale after the first iteration, and the sampler's logprobs are the
    training forward's. With LoRA the copy's adapters are what moves."""
    sync = _run(tmp_path, cache_dir, "sync", ["optimizer.lr=1e-30", *switch])
    lagged = _run(tmp_path, cache_dir, "lagged", ["optimizer.lr=1e-30", "rollout.staleness=1", *switch])
    assert_same_metrics(sync, lagged, rel=1e-5, abs=1e-6)
    assert [row["rollout/staleness_mean"] for row in lagged] == [0.0, 1.0, 1.0]
    assert [row["rollout/staleness_max"] for row in lagged] == [0.0, 1.0, 1.0]
    assert all(row["rollout/engine_logprob_diff"] < 1e-5 for row in lagged)


def test_a_lagging_sampler_trains_on_one_update_old_samples_weighed_by_the_correction(tmp_path, cache_dir):
    """With a learning rate, ``rollout.staleness=1`` samples from the policy one update back: from
    the second iteration its logprobs differ from the old policy's (the correction's view of the
    staleness), its tokens are one update stale, and the run learns (finite losses, weights move)."""
    rows = _run(tmp_path, cache_dir, "lagged", ["rollout.staleness=1", "optimizer.lr=3e-3"], steps=4)
    assert rows[0]["rollout/engine_logprob_diff"] < 1e-5  # the first rollout: the initial policy, both sides
    assert all(row["rollout/engine_logprob_diff"] > 1e-4 for row in rows[1:])
    assert [row["rollout/staleness_max"] for row in rows] == [0.0, 1.0, 1.0, 1.0]
    assert all(row["rollout/engine_ess"] <= 1.0 + 1e-6 for row in rows)
    assert all(torch.isfinite(torch.tensor(row["loss/policy_avg"])) for row in rows)


@pytest.mark.slow  # two runs
def test_a_resumed_lagging_run_replays_the_uninterrupted_trajectory(tmp_path, cache_dir):
    """The lagging copy, its version and the snapshots waiting their turn are in the checkpoint:
    resumed at iteration 2 with ``rollout.staleness=2``, the run samples and learns what the run
    that was not stopped did."""
    from ppo_lightning.jobs.run import train

    overrides = [
        *[q for q in QUIET if q not in ("callbacks=none", "trainer.enable_checkpointing=false")],
        "rollout.staleness=2",
        "trainer.max_steps=4",
        "callbacks.model_checkpoint.every_n_train_steps=2",
    ]
    train(compose_cfg(overrides, tmp_path / "whole", cache_dir))
    whole = read_metrics(tmp_path / "whole" / "metrics.csv")
    ckpt = tmp_path / "whole" / "checkpoints" / "step_000002.ckpt"
    train(compose_cfg([*overrides, f"ckpt_path={ckpt}"], tmp_path / "resumed", cache_dir))
    resumed = read_metrics(tmp_path / "resumed" / "metrics.csv")
    assert [int(r["step"]) for r in resumed] == [2, 3]
    assert_same_metrics(whole[2:], resumed, rel=1e-5, abs=1e-6)
    assert [row["rollout/staleness_max"] for row in whole] == [0.0, 1.0, 2.0, 2.0]


def _naive_decoupled_loss(new, prox, behaviour, adv, mask, mode, agg, clip, high, dual, cap, norm_length):
    """The decoupled PPO loss written from its definition, token by token in float64 Python: the
    clip on ``pi_theta / pi_prox``, each token weighed by ``pi_prox / pi_behaviour`` as the
    correction ``mode`` says (per token or per response, capped or dropped past ``cap``), the
    tokens reduced as the aggregation ``agg`` says."""
    import math

    rows = []
    for i in range(len(mask)):
        tokens = [t for t in range(len(mask[i])) if mask[i][t]]
        seq_log_rho = sum(prox[i][t] - behaviour[i][t] for t in tokens)
        losses = []
        for t in tokens:
            log_rho = seq_log_rho if mode.startswith("sequence") else prox[i][t] - behaviour[i][t]
            if mode == "none":
                w = 1.0
            elif mode.endswith("truncate"):
                w = min(math.exp(log_rho), cap)
            else:
                w = 0.0 if log_rho > math.log(cap) else math.exp(log_rho)
            r, a = math.exp(new[i][t] - prox[i][t]), adv[i][t]
            loss = max(-a * r, -a * min(max(r, 1 - clip), 1 + high))
            if dual is not None and a < 0:
                loss = min(loss, -dual * a)
            losses.append(w * loss)
        rows.append(losses)
    n_seq = len(rows)
    if agg in ("token_mean", "token_mean_global"):
        return sum(map(sum, rows)) / max(sum(map(len, rows)), 1)
    if agg == "seq_mean_token_mean":
        return sum(sum(r) / max(len(r), 1) for r in rows) / n_seq
    if agg == "seq_mean_token_sum":
        return sum(sum(r) for r in rows) / n_seq
    return sum(sum(r) / norm_length for r in rows) / n_seq


@pytest.mark.parametrize("mode", ["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"])
def test_the_decoupled_loss_equals_a_naive_one_for_every_correction_and_aggregation(mode):
    """``ppo_policy_loss`` with ``engine_weights(pi_prox, pi_behaviour)`` (what ``finish_rollout``
    and ``PPO._loss`` compute for a stale rollout) against the naive definition: behaviour,
    proximal and current logprobs drawn at random, a row with an environment gap, a row with no
    policy token, clip-higher and the dual clip, every ``ppo.loss_agg``."""
    from ppo_lightning.algo.losses import Aggregation, engine_weights, ppo_policy_loss
    from ppo_lightning.config.choices import LOSS_AGGREGATIONS

    g = torch.Generator().manual_seed(0)
    B, R = 5, 7
    behaviour = -torch.rand(B, R, generator=g, dtype=torch.float64) * 3
    prox = behaviour + 0.4 * torch.randn(B, R, generator=g, dtype=torch.float64)  # K updates apart
    new = prox + 0.3 * torch.randn(B, R, generator=g, dtype=torch.float64)
    adv = torch.randn(B, R, generator=g, dtype=torch.float64)
    mask = torch.ones(B, R, dtype=torch.float64)
    mask[1, 2:4] = 0  # an environment's tokens between two turns
    mask[2] = 0  # a row with no policy token
    mask[3, 5:] = 0  # a response that ended early
    clip, high, dual, cap = 0.2, 0.28, 3.0, 2.0
    weights = engine_weights(prox, behaviour, mask, mode, cap)
    as_lists = [t.tolist() for t in (new, prox, behaviour, adv, mask)]
    for agg in LOSS_AGGREGATIONS:
        aggregation = Aggregation(agg, norm_length=R)
        for d in (None, dual):
            ours, _ = ppo_policy_loss(
                new, prox, adv, mask, clip, aggregation, clip_high=high, dual_clip=d, weights=weights
            )
            want = _naive_decoupled_loss(*as_lists, mode, agg, clip, high, d, cap, R)
            assert ours.item() == pytest.approx(want, rel=1e-12, abs=1e-12), (agg, d)
