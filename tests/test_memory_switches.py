"""Memory switches keep the update unchanged: gradient checkpointing recomputes the decoder blocks
in the backward pass (really: the blocks run twice) and gives the same gradients and the same run.
What it saves: ``python -m benchmarks.memory``."""

from __future__ import annotations

import pytest
import torch

from ppo_lightning.models.policy import PolicyWithValueHead, load_causal_lm, load_tokenizer, position_ids_from_mask
from ppo_lightning.jobs.run import train
from tests.conftest import compose_cfg, read_metrics
from tests.helpers import assert_same_metrics

QUIET = [
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "trainer.enable_checkpointing=false",
    "logger=csv",
]


def _policy_and_batch(tiny_lm_dir):
    tok = load_tokenizer(str(tiny_lm_dir))
    policy = PolicyWithValueHead(load_causal_lm(str(tiny_lm_dir), tok))
    torch.nn.init.normal_(policy.v_head.weight, std=0.1)
    enc = tok(["hello there, friend", "a", "the cat sat"], return_tensors="pt", padding=True)
    ids = torch.cat([enc.input_ids, torch.randint(0, 256, (3, 6), generator=torch.Generator().manual_seed(0))], 1)
    am = torch.cat([enc.attention_mask, torch.ones(3, 6, dtype=torch.long)], 1)
    return policy, ids, am, enc.input_ids.shape[1]


def _grads_and_block_calls(policy, ids, am, P):
    calls = []
    mlp = policy.lm.transformer.h[0].mlp  # inside a block: its forward runs again in a recompute
    mlp.forward = lambda *a, _f=type(mlp).forward.__get__(mlp), **k: calls.append(1) or _f(*a, **k)
    policy.zero_grad()
    logits, values = policy(ids, am, position_ids_from_mask(am), P)
    (torch.log_softmax(logits.float(), -1).mean() + values.pow(2).mean()).backward()
    del mlp.forward
    return {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}, len(calls)


def test_gradient_checkpointing_recomputes_the_blocks_and_gives_the_same_gradients(tiny_lm_dir):
    policy, ids, am, P = _policy_and_batch(tiny_lm_dir)
    policy.train()  # what Lightning does at fit start
    assert not policy.lm.training  # no checkpointing: the LM keeps eval mode
    plain, plain_calls = _grads_and_block_calls(policy, ids, am, P)
    policy.enable_gradient_checkpointing()
    policy.train()
    assert policy.lm.training  # Hugging Face checkpoints only in train mode
    ckpt, ckpt_calls = _grads_and_block_calls(policy, ids, am, P)
    assert (plain_calls, ckpt_calls) == (1, 2)  # the block ran again in the backward pass
    assert plain.keys() == ckpt.keys() and len(plain) > 10
    for k in plain:
        torch.testing.assert_close(ckpt[k], plain[k], rtol=1e-5, atol=1e-7, msg=k)


def test_a_checkpointing_policy_still_samples_with_the_kv_cache(tiny_lm_dir):
    from ppo_lightning.generation.hf import generate

    policy, ids, am, P = _policy_and_batch(tiny_lm_dir)
    kw = dict(max_new_tokens=8, eos_token_id=256, pad_token_id=257, greedy=True)
    plain = generate(policy.lm, ids[:, :P], am[:, :P], **kw)
    policy.enable_gradient_checkpointing()
    ckpt = generate(policy.lm, ids[:, :P], am[:, :P], **kw)
    assert torch.equal(plain[0], ckpt[0]) and policy.lm.training  # train mode restored after sampling


@pytest.mark.parametrize("minibatch", [8, 16])  # two minibatches, and one (the fused forward)
def test_gradient_checkpointing_leaves_the_run_unchanged(tmp_path, cache_dir, minibatch):
    runs, weights = {}, {}
    for ckpt in (False, True):
        out = tmp_path / str(ckpt)
        cfg = compose_cfg(
            [
                *QUIET,
                "trainer.max_steps=3",
                "sampling.max_new_tokens=12",
                f"ppo.minibatch_size={minibatch}",
                f"model.gradient_checkpointing={ckpt}",
                f"export_dir={out / 'policy'}",
            ],
            out,
            cache_dir,
        )
        train(cfg)
        runs[ckpt] = read_metrics(out / "metrics.csv")
        from safetensors.torch import load_file

        weights[ckpt] = load_file(str(out / "policy" / "model.safetensors"))
    for a, b in zip(runs[False], runs[True]):
        for k in a:
            if not k.startswith("perf/"):
                assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (a["step"], k)
    for k in weights[False]:
        torch.testing.assert_close(weights[True][k], weights[False][k], rtol=1e-4, atol=1e-6, msg=k)
    assert runs[True][-1]["policy/approxkl_avg"] > 0  # the weights moved


def run_two_iterations(tmp_path, cache_dir, name, overrides):
    """Two iterations of the default tiny run with ``overrides``: its metrics rows and exported weights."""
    from safetensors.torch import load_file

    out = tmp_path / name
    cfg = compose_cfg(
        [*QUIET, "trainer.max_steps=2", "sampling.max_new_tokens=12", f"export_dir={out / 'policy'}", *overrides],
        out,
        cache_dir,
    )
    train(cfg)
    return read_metrics(out / "metrics.csv"), load_file(str(out / "policy" / "model.safetensors"))


_BASELINES: dict[tuple[str, ...], tuple] = {}


def baseline(tmp_path, cache_dir, overrides: list[str]) -> tuple:
    """``run_two_iterations`` of a reference run, run once in this process for the tests that
    compare against the same one (its metrics rows and weights are only read)."""
    key = tuple(overrides)
    if key not in _BASELINES:
        _BASELINES[key] = run_two_iterations(tmp_path, cache_dir, "whole", overrides)
    return _BASELINES[key]


def assert_same_run(base: tuple, other: tuple) -> None:
    """Two ``run_two_iterations`` results: the same weights within fp32 tolerance, the same metrics
    (the same samples, since the weights agree), and weights that moved."""
    (base_rows, base_w), (rows, w) = base, other
    for k in base_w:
        torch.testing.assert_close(w[k], base_w[k], rtol=1e-5, atol=1e-6, msg=k)
    assert_same_metrics(base_rows, rows, abs=1e-6)
    assert rows[-1]["policy/approxkl_avg"] > 0


@pytest.mark.parametrize("minibatch, micro", [(8, 4), (8, 2), (16, 4)])
def test_micro_batches_give_the_whole_minibatch_update(tmp_path, cache_dir, minibatch, micro):
    """Gradient accumulation over micro-batches, each loss its share of the minibatch's token mean:
    the weights after two iterations equal the unsplit run's within fp32 tolerance, and so do the
    metrics (the same samples, since the weights agree). (16, 4): one minibatch, so the unsplit run
    fuses its first forward and the split one cannot."""
    base = baseline(tmp_path, cache_dir, [f"ppo.minibatch_size={minibatch}"])  # shared by (8, 4) and (8, 2)
    micro_run = [f"ppo.minibatch_size={minibatch}", f"ppo.micro_batch_size={micro}"]
    assert_same_run(base, run_two_iterations(tmp_path, cache_dir, "micro", micro_run))


def test_micro_batch_size_must_divide_the_minibatch(tmp_path, cache_dir):
    from ppo_lightning.config import validate
    from ppo_lightning.config.errors import ConfigError

    cfg = compose_cfg(["ppo.minibatch_size=8", "ppo.micro_batch_size=3"], tmp_path, cache_dir)
    with pytest.raises(ConfigError, match=r"^ppo.micro_batch_size=3: must divide ppo.minibatch_size=8.*=2"):
        validate(cfg)


def test_chunked_rollout_forwards_leave_the_run_unchanged_and_generation_is_chunked(tmp_path, cache_dir, monkeypatch):
    """ppo.rollout_forward_batch_size: the reference and old-policy forwards in chunks of 5 rows (of
    16, two minibatches so the old-policy forward is not fused) give the same run. And
    sampling.chunk_size reaches the sampler: 16 prompts sampled 6, 6 and 4 at a time."""
    from ppo_lightning.generation import hf

    common = ["ppo.minibatch_size=8"]
    base_rows, base_w = baseline(tmp_path, cache_dir, common)  # the micro-batch tests' (8, *) run
    rows, w = run_two_iterations(tmp_path, cache_dir, "chunked", [*common, "ppo.rollout_forward_batch_size=5"])
    for k in base_w:
        torch.testing.assert_close(w[k], base_w[k], rtol=1e-5, atol=1e-6, msg=k)
    assert_same_metrics(base_rows, rows, abs=1e-6)  # chunks have their own padding windows: roundings

    sampled_rows = []
    loop = hf._sample_loop
    monkeypatch.setattr(hf, "_sample_loop", lambda lm, ids, *a: sampled_rows.append(len(ids)) or loop(lm, ids, *a))
    run_two_iterations(
        tmp_path, cache_dir, "chunked_generation", [*common, "sampling.chunk_size=6", "reward.normalize=false"]
    )
    assert sampled_rows == [6, 6, 4] * 2  # two iterations


def test_lora_with_checkpointing_and_micro_batches_gives_the_same_adapters(tmp_path, cache_dir):
    """The memory switches compose with LoRA: gradient checkpointing and micro-batches leave the
    trained adapters and the value head (the merged export) equal to plain LoRA's."""
    common = ["model.lora.r=4", "ppo.minibatch_size=8"]
    base = run_two_iterations(tmp_path, cache_dir, "lora", common)
    switches = [*common, "model.gradient_checkpointing=true", "ppo.micro_batch_size=4"]
    assert_same_run(base, run_two_iterations(tmp_path, cache_dir, "lora_switches", switches))


def test_the_hf_samplers_own_logprobs_leave_the_run_unchanged_and_match_the_training_forward(tmp_path, cache_dir):
    """``generation.logprobs=true``: the same run (the same samples; the engine correction's
    weights are 1 to float32 rounding), and ``rollout/engine_*`` compare the sampler's logprobs
    with the training forward's: the fast decode step's numbers are the forward's, so the
    difference and the KL are ~0, the effective sample size 1 and nothing capped."""
    common = ["ppo.minibatch_size=8"]
    base = baseline(tmp_path, cache_dir, common)  # the micro-batch tests' (8, *) run
    rows, w = run_two_iterations(tmp_path, cache_dir, "sampler_logprobs", [*common, "generation.logprobs=true"])
    assert_same_run(base, (rows, w))
    for row in rows:
        assert 0 <= row["rollout/engine_logprob_diff"] < 1e-5 and abs(row["rollout/engine_kl"]) < 1e-5
        assert row["rollout/engine_ess"] == pytest.approx(1.0, abs=1e-6) and row["rollout/engine_capped_frac"] == 0
    assert "rollout/engine_logprob_diff" not in base[0][0]  # without it: no engine view
