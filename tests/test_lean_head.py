"""The lean LM head (``ppo.lm_head_chunk_size``): the same logprobs, entropies, values and
gradients as the plain head's ``[B, R, V]`` logits, on every architecture we test; a run with it
gives the plain run's metrics; a head it cannot chunk takes the plain path."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from ppo_lightning.models.lean_head import unsupported
from ppo_lightning.models.policy import PolicyWithValueHead, position_ids_from_mask
from ppo_lightning.rollouts.forward import forward_logprobs
from ppo_lightning.models.tiny import ARCHITECTURES, causal_lm_config
from tests import helpers
from tests.conftest import compose_cfg, read_metrics


def _lm(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(causal_lm_config(arch, 2, 2, 16, 64)).eval()


@pytest.fixture
def chunk_calls(monkeypatch):
    """How many chunks the lean head computed (forward and recomputed in the backward): a test
    that passed because the plain path ran instead would see none."""
    from ppo_lightning.models import lean_head

    calls = []
    inner = lean_head._logp_and_entropy

    def counted(*args):
        calls.append(args[0].shape[0])
        return inner(*args)

    monkeypatch.setattr(lean_head, "_logp_and_entropy", counted)
    return calls


def _batch(B=3, P=5, R=7):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 256, (B, P + R), generator=g)
    am = torch.ones_like(ids)
    am[0, :2] = 0  # a left-padded prompt
    return ids, am, position_ids_from_mask(am), P


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("value_head", [True, False])
def test_lean_scores_and_gradients_equal_the_plain_heads(arch, value_head, chunk_calls):
    """Chunks of 5 positions over 3 x 7 (a last chunk of 1), temperature 0.7: logprobs,
    entropies, values and every parameter's gradient of a loss on all three agree with the plain
    path's to float32 rounding."""
    ids, am, pos, P = _batch()
    results = []
    for chunk in (None, 5):
        policy = PolicyWithValueHead(_lm(arch), value_head=value_head)
        if value_head:
            nn.init.normal_(policy.v_head.weight, std=0.1)  # a zero head would hide a wrong hidden state
        logp, ent, values = policy.score_responses(ids, am, pos, P, 0.7, chunk)
        w = torch.linspace(-1, 1, logp.numel()).view_as(logp)
        loss = (w * logp).sum() + (w.flip(0) * ent).sum() + (values.sum() if value_head else 0)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append((logp.detach(), ent.detach(), None if values is None else values.detach(), grads))
    assert sorted(chunk_calls) == [1, 1] + [5] * 8  # 21 positions: forward, then recomputed in the backward
    (lp0, e0, v0, g0), (lp1, e1, v1, g1) = results
    torch.testing.assert_close(lp1, lp0, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e1, e0, rtol=1e-5, atol=1e-6)
    if value_head:
        torch.testing.assert_close(v1, v0, rtol=1e-5, atol=1e-6)
    assert g0.keys() == g1.keys() and len(g0) > 4
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_the_reference_scores_through_the_lean_head_too(arch, chunk_calls):
    lm = _lm(arch)
    ids, am, pos, P = _batch()
    plain, _ = forward_logprobs(None, lm, ids, am, pos, P, 1.3)
    lean, _ = forward_logprobs(None, lm, ids, am, pos, P, 1.3, head_chunk=4)
    torch.testing.assert_close(lean, plain, rtol=1e-5, atol=1e-6)
    assert chunk_calls == [4, 4, 4, 4, 4, 1]  # no gradients: no recomputation
    assert lm.get_output_embeddings().__dict__.get("forward") is None  # the head is itself again


def test_under_bf16_autocast_the_lean_head_computes_what_the_plain_head_does():
    policy = PolicyWithValueHead(_lm("llama"))
    ids, am, pos, P = _batch()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = policy.score_responses(ids, am, pos, P, 1.0, None)
        lean = policy.score_responses(ids, am, pos, P, 1.0, 6)
    for a, b in zip(plain, lean):
        assert b.dtype == a.dtype == torch.float32
        # the same bf16 products row by row (exactly equal here): not merely within bf16's rounding
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-6)


def test_a_head_it_cannot_chunk_takes_the_plain_path(chunk_calls):
    lm = _lm("gpt2")
    assert unsupported(lm) is None
    lm.lm_head = nn.Sequential(lm.lm_head)  # any head that is not a plain linear layer
    assert "not a plain nn.Linear" in unsupported(lm)
    ids, am, pos, P = _batch()
    policy = PolicyWithValueHead(lm)
    plain = policy.score_responses(ids, am, pos, P, 1.0, None)
    lean = policy.score_responses(ids, am, pos, P, 1.0, 4)
    for a, b in zip(plain, lean):
        assert torch.equal(a, b)
    assert chunk_calls == []


def test_a_run_with_the_lean_head_gives_the_plain_runs_metrics(tmp_path, cache_dir, chunk_calls):
    """Three PPO iterations of the tiny job, two minibatches, entropy bonus on (its gradient
    flows through the chunks): every metric agrees, the first update's ratio is 1."""
    from ppo_lightning.jobs.run import train

    runs = {}
    for name, chunk in (("plain", "null"), ("lean", "13")):
        out = tmp_path / name
        cfg = compose_cfg(
            [
                f"ppo.lm_head_chunk_size={chunk}",
                "ppo.ent_coef=0.01",
                "trainer.max_steps=3",
                "callbacks=none",
                "logger=csv",
                "export_dir=null",
                "trainer.enable_progress_bar=false",
                "trainer.enable_model_summary=false",
            ],
            out,
            cache_dir,
        )
        train(cfg)
        runs[name] = read_metrics(out / "metrics.csv")
        assert (len(chunk_calls) > 0) == (name == "lean")
    helpers.assert_same_metrics(runs["plain"], runs["lean"])
    assert runs["lean"][0]["policy/approxkl_avg"] == pytest.approx(runs["plain"][0]["policy/approxkl_avg"], abs=1e-7)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_the_lean_head_computes_the_real_response_tokens_only(arch, chunk_calls):
    """Responses that end at 7, 3 and 1 tokens (right padding after): the lean head's chunks
    cover the 11 real positions, not 3 x 7, and logprobs, entropies and every gradient of a loss
    on the real positions equal the plain head's there; the padded positions read 0."""
    ids, am, pos, P = _batch()
    am[1, P + 3 :], am[2, P + 1 :] = 0, 0
    real = am[:, P:].bool()
    results = []
    for chunk in (None, 4):
        policy = PolicyWithValueHead(_lm(arch), value_head=True)
        nn.init.normal_(policy.v_head.weight, std=0.1)
        logp, ent, values = policy.score_responses(ids, am, pos, P, 0.7, chunk)
        w = torch.linspace(-1, 1, logp.numel()).view_as(logp)
        ((w * real * logp).sum() + (w.flip(0) * real * ent).sum() + (w * real * values).sum()).backward()
        grads = {n: p.grad.clone() for n, p in policy.named_parameters() if p.grad is not None}
        results.append((logp.detach(), ent.detach(), grads))
    assert sorted(chunk_calls) == [3, 3, 4, 4, 4, 4]  # 11 positions: 4 + 4 + 3, forward and recomputed
    (lp0, e0, g0), (lp1, e1, g1) = results
    torch.testing.assert_close(lp1[real], lp0[real], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(e1[real], e0[real], rtol=1e-5, atol=1e-6)
    assert not lp1[~real].any() and not e1[~real].any()
    for name in g0:
        torch.testing.assert_close(g1[name], g0[name], rtol=1e-4, atol=1e-6, msg=name)
