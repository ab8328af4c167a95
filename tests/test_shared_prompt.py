"""Each prompt once per group (``ppo.shared_prompt_forward``): the distinct prompts run once and
their responses attend to the cached keys and values. Logprobs, entropies, values and every
parameter's gradient equal the one-pass forward's, on each architecture it covers, with padding
removal and the lean head; a run with it equals the run without; ``auto`` turns it on only where
it applies, and ``true`` is refused where it cannot."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from ppo_lightning.algo.algorithm import minibatch_rows
from ppo_lightning.rollouts.forward import layout_for, policy_forward
from ppo_lightning.rollouts.forward import ForwardLayout, forward_logprobs
from ppo_lightning.config import PPOConfig
from ppo_lightning.models.policy import PolicyWithValueHead, position_ids_from_mask
from ppo_lightning.models.shared_prompt import AUTO_MIN_PROMPT_TOKENS, prompt_groups, shared_prompt_forward
from ppo_lightning.models.tiny import ARCHITECTURES, causal_lm_config
from tests.conftest import compose_cfg
from tests.test_memory_switches import assert_same_run, run_two_iterations

G, N, P, R = 3, 4, 6, 8  # groups, generations, prompt and response widths


def _lm(arch: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(causal_lm_config(arch, 2, 2, 16, 64)).eval()


def _grouped_batch():
    """``G`` prompts, each on ``N`` consecutive rows with its own responses: left padding of
    different widths (one prompt is padded on every row of its group, so padding removal cuts
    a column) and responses that end early (every row's response is right-padded somewhere)."""
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(0, 256, (G, P), generator=g)
    prompt_mask = torch.ones_like(prompts)
    prompt_mask[0, :3], prompt_mask[1, :1], prompt_mask[2, :1] = 0, 0, 0
    ids = torch.cat([prompts.repeat_interleave(N, 0), torch.randint(0, 256, (G * N, R), generator=g)], 1)
    mask = torch.cat([prompt_mask.repeat_interleave(N, 0), torch.ones(G * N, R, dtype=torch.long)], 1)
    for row, length in enumerate(torch.randint(1, R, (G * N,), generator=g).tolist()):
        mask[row, P + length :] = 0  # no row uses the last column: padding removal cuts it too
    return ids * mask, mask


def _scored(policy, layout: ForwardLayout, chunk: int | None):
    ids, mask = _grouped_batch()
    mb = SimpleNamespace(
        query_responses=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), context_length=P
    )
    mb.responses = ids[:, P:]
    policy.zero_grad()
    entropy, values, logp = policy_forward(policy, mb, 0.7, chunk, True, layout)
    real = mask[:, P:].float()
    w = real * torch.linspace(-1, 1, R)
    loss = (w * logp).sum() + (w.flip(0) * entropy).sum()
    if values is not None:
        loss = loss + (w * values).pow(2).sum()
    loss.backward()
    grads = {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}
    outs = [x.detach() * real for x in (logp, entropy, values) if x is not None]
    return outs, grads


@pytest.mark.parametrize("arch", ARCHITECTURES)
@pytest.mark.parametrize("value_head, chunk", [(True, None), (False, None), (True, 5)])
def test_each_prompt_once_gives_the_repeated_prompts_logprobs_values_and_gradients(
    arch, value_head, chunk, monkeypatch
):
    """With padding removal on both sides, the plain head and the lean one (chunks of 5), with a
    value head and without: the same logprobs, entropies and values to 1e-5 and every parameter's
    gradient to 1e-5 of its largest entry, and the shared path ran (the LM saw the ``G``
    distinct prompts, then the ``G x N`` responses)."""
    results, calls = [], []
    for shared in (False, True):
        policy = PolicyWithValueHead(_lm(arch), value_head=value_head)
        if value_head:
            torch.nn.init.normal_(policy.v_head.weight, std=0.1)  # a zero head would hide a wrong hidden state
        policy.lm.register_forward_pre_hook(lambda m, a, k: calls.append(tuple(k["input_ids"].shape)), with_kwargs=True)
        results.append(_scored(policy, ForwardLayout(remove_padding=True, shared_prompt=shared), chunk))
    assert calls == [(G * N, P - 1 + R - 1), (G, P - 1), (G * N, R - 1)]  # the window cuts a column each side
    (a, grads_a), (b, grads_b) = results
    for x, y in zip(a, b):
        torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    for k in grads_a:
        scale = float(grads_a[k].abs().max())
        torch.testing.assert_close(grads_b[k], grads_a[k], rtol=1e-5, atol=1e-5 * max(1.0, scale), msg=k)


@pytest.mark.parametrize("arch", ["gpt2", "qwen2"])
def test_the_reference_and_the_old_policy_score_each_prompt_once_too(arch):
    """``forward_logprobs`` (the rollout's no-grad forwards) in row chunks of 5, which cut groups
    apart: the same logprobs (and values) as with every row encoding its prompt."""
    ids, mask = _grouped_batch()
    pos = position_ids_from_mask(mask)
    lm = _lm(arch)
    plain, _ = forward_logprobs(None, lm, ids, mask, pos, P, 1.3, chunk_size=5)
    shared, _ = forward_logprobs(None, lm, ids, mask, pos, P, 1.3, 5, layout=ForwardLayout(True, True))
    torch.testing.assert_close(shared * mask[:, P:], plain * mask[:, P:], rtol=1e-5, atol=1e-5)
    policy = PolicyWithValueHead(lm, value_head=True)
    torch.nn.init.normal_(policy.v_head.weight, std=0.1)
    lp0, v0 = forward_logprobs(policy, None, ids, mask, pos, P, 1.3, 5, head_chunk=4)
    lp1, v1 = forward_logprobs(policy, None, ids, mask, pos, P, 1.3, 5, 4, ForwardLayout(True, True))
    torch.testing.assert_close(lp1 * mask[:, P:], lp0 * mask[:, P:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(v1 * mask[:, P:], v0 * mask[:, P:], rtol=1e-5, atol=1e-5)


def test_prompt_groups_find_each_distinct_prompt_and_its_first_row():
    ids, mask = _grouped_batch()
    first, inverse = prompt_groups(ids, mask, P)
    assert sorted(first.tolist()) == [0, N, 2 * N]
    assert torch.equal(first[inverse], torch.arange(G).repeat_interleave(N) * N)
    padded_apart = mask.clone()
    padded_apart[1, P - 1] = 0  # the same tokens, another mask: another prompt
    assert len(prompt_groups(ids, padded_apart, P)[0]) == G + 1
    assert prompt_groups(ids[::N], mask[::N], P) is None  # no prompt repeats


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("grpo", ["ppo.advantage=grpo", "ppo.loss_agg=seq_mean_token_mean"]),
        ("rloo_lean", ["ppo.advantage=rloo", "ppo.lm_head_chunk_size=5", "ppo.micro_batch_size=8"]),
        ("gae_lora", ["ppo.advantage=gae", "model.lora.r=4", "ppo.micro_batch_size=8"]),
        ("grpo_token_budget", ["ppo.advantage=grpo", "ppo.micro_batch_tokens=100"]),
    ],
)
def test_a_run_that_encodes_each_prompt_once_equals_the_run_that_repeats_them(
    tmp_path, cache_dir, name, overrides, monkeypatch
):
    """Two iterations of 4 prompts x 4 generations in one minibatch (so both runs take the same
    rows), in micro-batches of two whole groups or under a token budget: ``true`` against
    ``false``, with a critic and without, the lean head, LoRA. The same weights to 1e-5 and the
    same metrics."""
    from ppo_lightning.models import shared_prompt

    common = ["data.batch_size=4", "ppo.num_generations=4", "ppo.minibatch_size=16", *overrides]
    calls = []

    def counted(*args, **kwargs):
        calls.append(args[1].shape[0])  # its rows
        return shared_prompt_forward(*args, **kwargs)

    # the policy's forwards and the bare reference's, through their one dispatch (response_outputs)
    monkeypatch.setattr(shared_prompt, "shared_prompt_forward", counted)
    base = run_two_iterations(tmp_path, cache_dir, "repeated", [*common, "ppo.shared_prompt_forward=false"])
    assert not calls
    shared = run_two_iterations(tmp_path, cache_dir, "shared", [*common, "ppo.shared_prompt_forward=true"])
    assert_same_run(base, shared)
    # per iteration: the reference's scoring forward (LoRA: the policy with its adapters off), the
    # old policy's (or the first update's, fused), the update's micro-batches
    assert len(calls) >= 2 * 2 and max(calls) <= 16, calls


def test_minibatches_hold_whole_groups_when_prompts_are_shared():
    """16 rows in groups of 4, minibatches of 8: each minibatch two whole groups, every row once
    an epoch; without sharing, shuffled rows."""
    cfg = PPOConfig(num_generations=4, minibatch_size=8)
    for shared in (True, False):
        mbs = minibatch_rows(16, cfg, shared, torch.Generator().manual_seed(0))
        assert sorted(torch.cat(mbs).tolist()) == list(range(16)) and [len(mb) for mb in mbs] == [8, 8]
        whole = [sorted(set((mb // 4).tolist())) for mb in mbs]
        assert all(len(g) == 2 for g in whole) == shared, whole


def test_auto_turns_it_on_only_where_it_applies(caplog):
    """Groups, whole-group minibatches, no checkpointing and a covered architecture: on, for
    prompts of at least ``AUTO_MIN_PROMPT_TOKENS`` (``true``: any); one of them missing: off, and
    an architecture it does not cover says so."""
    from transformers import OPTConfig, OPTForCausalLM

    def shares(cfg, policy, P=AUTO_MIN_PROMPT_TOKENS):
        return layout_for(cfg, policy).shares(P)

    policy = PolicyWithValueHead(_lm("llama"), value_head=False)
    assert shares(PPOConfig(num_generations=4, minibatch_size=8), policy)
    assert not shares(PPOConfig(num_generations=4, minibatch_size=8), policy, P=AUTO_MIN_PROMPT_TOKENS - 1)
    assert layout_for(PPOConfig(num_generations=4, minibatch_size=8), policy).shared_prompt  # whole groups still
    assert shares(PPOConfig(num_generations=4, minibatch_size=8, shared_prompt_forward=True), policy, P=1)
    assert not shares(PPOConfig(num_generations=1, minibatch_size=8), policy)
    assert not shares(PPOConfig(num_generations=4, minibatch_size=6), policy)
    assert not shares(PPOConfig(num_generations=4, minibatch_size=8, shared_prompt_forward=False), policy)
    assert not shares(PPOConfig(num_generations=4, minibatch_size=8), None)
    checkpointed = PolicyWithValueHead(_lm("llama"), value_head=False)
    checkpointed.enable_gradient_checkpointing()
    assert checkpointed.checkpointing and not shares(PPOConfig(num_generations=4, minibatch_size=8), checkpointed)
    opt = OPTForCausalLM(
        OPTConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, ffn_dim=32, num_attention_heads=2)
    )
    with caplog.at_level(logging.WARNING):
        assert not shares(PPOConfig(num_generations=4, minibatch_size=8), PolicyWithValueHead(opt))
    assert "ppo.shared_prompt_forward: OPTForCausalLM (model_type 'opt') is not one of" in caplog.text


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["ppo.num_generations=1"], r"^ppo.shared_prompt_forward=true: ppo.num_generations=1 repeats no prompt"),
        (
            ["ppo.num_generations=4", "ppo.minibatch_size=6", "data.batch_size=3"],
            r"^ppo.shared_prompt_forward=true: ppo.minibatch_size=6 must hold whole groups of ppo.num_generations=4",
        ),
        (
            ["ppo.num_generations=4", "model.gradient_checkpointing=true"],
            r"^ppo.shared_prompt_forward=true: model.gradient_checkpointing=true gives no KV cache",
        ),
    ],
)
def test_true_where_it_cannot_apply_is_refused_naming_the_keys(tmp_path, cache_dir, overrides, message):
    from ppo_lightning.config import validate
    from ppo_lightning.config.errors import ConfigError

    cfg = compose_cfg(["ppo.shared_prompt_forward=true", *overrides], tmp_path, cache_dir)
    with pytest.raises(ConfigError, match=message):
        validate(cfg)


@pytest.mark.parametrize("budget", [20, 60, 200])
def test_token_budget_groups_of_shared_prompts_cover_every_row_once_within_the_budget(budget):
    """With each row's prompt: every row in one group, rows by response length (longest first),
    and a group of several rows costs at most the budget counting each distinct prompt once."""
    from ppo_lightning.rollouts.forward import token_budget_groups

    g = torch.Generator().manual_seed(budget)
    prompts = torch.arange(4).repeat_interleave(4).tolist()
    starts = [s for s in torch.randint(0, P, (4,), generator=g).tolist() for _ in range(4)]
    stops = [P + 1 + int(x) for x in torch.randint(0, R, (16,), generator=g)]
    groups = token_budget_groups(starts, stops, budget, prompts, P)
    rows = torch.cat(groups).tolist()
    assert sorted(rows) == list(range(16))
    assert [stops[i] for i in rows] == sorted(stops, reverse=True)
    for grp in groups:
        grp = grp.tolist()
        lo, hi = min(starts[i] for i in grp), max(stops[i] for i in grp)
        cost = len({prompts[i] for i in grp}) * (P - lo) + len(grp) * (hi - P)
        assert cost <= budget or len(grp) == 1
