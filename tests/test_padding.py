"""No compute on padding (``ppo.remove_padding``, ``ppo.micro_batch_tokens``): every forward runs on
the columns its rows use, and dynamic micro-batches group rows by length under a token budget.
Both leave logprobs, values, gradients and the run as they were, to float32 rounding."""

from __future__ import annotations

import pytest
import torch

from ppo_lightning.algo.losses import aggregate, global_token_count
from ppo_lightning.rollouts.forward import (
    pad_responses,
    padding_window,
    row_windows,
    split_to,
    token_budget_groups,
    unpadded,
)
from ppo_lightning.config.choices import LOSS_AGGREGATIONS
from ppo_lightning.models.policy import PolicyWithValueHead, load_causal_lm, load_tokenizer, position_ids_from_mask
from ppo_lightning.models.tiny import ARCHITECTURES, save_tiny_causal_lm
from tests.conftest import compose_cfg
from tests.test_memory_switches import assert_same_run, run_two_iterations

P, R = 7, 9


def _masks(prompt_lens: list[int], response_lens: list[int]) -> torch.Tensor:
    """``[B, P + R]`` attention masks: left-padded prompts, responses that end at their length."""
    rows = [[0] * (P - p) + [1] * p + [1] * r + [0] * (R - r) for p, r in zip(prompt_lens, response_lens)]
    return torch.tensor(rows)


def _naive_window(mask: torch.Tensor) -> tuple[int, int]:
    used = [any(mask[b, t] for b in range(mask.shape[0])) for t in range(mask.shape[1])]
    start = min([t for t in range(P) if used[t]] + [P - 1])
    stop = max([t + 1 for t in range(P, P + R) if used[t]] + [P + 1])
    return min(start, P - 1), stop


@pytest.mark.parametrize("seed", range(5))
def test_the_window_holds_every_used_column_and_no_other(seed):
    """Against a column-by-column scan: the batch's window, and each row's own."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(0, P + 1, (6,), generator=g).tolist()
    response_lens = torch.randint(0, R + 1, (6,), generator=g).tolist()
    mask = _masks(prompt_lens, response_lens)
    assert padding_window(mask, P) == _naive_window(mask)
    starts, stops = row_windows(mask, P)
    assert [(s, e) for s, e in zip(starts, stops)] == [_naive_window(mask[b : b + 1]) for b in range(6)]


def test_an_all_padding_batch_keeps_the_prompts_last_column_and_one_response_column():
    assert padding_window(torch.zeros(2, P + R, dtype=torch.long), P) == (P - 1, P + 1)


@pytest.mark.parametrize("budget", [1, 20, 40, 200])
def test_token_budget_groups_cover_every_row_once_within_the_budget(budget):
    """Each row in exactly one group; a group of several rows costs at most the budget (rows x
    its window's width); rows go longest first; ``split_to`` gives as many groups as asked."""
    g = torch.Generator().manual_seed(budget)
    starts = torch.randint(0, P, (12,), generator=g).tolist()
    stops = [P + 1 + int(x) for x in torch.randint(0, R, (12,), generator=g)]
    groups = token_budget_groups(starts, stops, budget)
    rows = torch.cat(groups).tolist()
    assert sorted(rows) == list(range(12))
    widths = [stops[i] - starts[i] for i in rows]
    assert widths == sorted(widths, reverse=True)
    for grp in groups:
        cost = len(grp) * (max(stops[i] for i in grp.tolist()) - min(starts[i] for i in grp.tolist()))
        assert cost <= budget or len(grp) == 1
    more = split_to(groups, 12)
    assert len(more) == 12 and sorted(torch.cat(more).tolist()) == list(range(12))


@pytest.mark.parametrize("mode", LOSS_AGGREGATIONS)
def test_losses_of_token_budget_groups_add_up_to_the_minibatchs(mode):
    """Each group's loss is its share of the minibatch's (the minibatch's token count, rows and
    length), whatever rows it holds: the shares of sorted, regrouped rows add up to the whole."""
    g = torch.Generator().manual_seed(1)
    mask = _masks([3, 7, 1, 5, 6, 2], [9, 1, 4, 0, 6, 2])[:, P:].float()
    mask[3, 0] = 1.0  # every response holds a token
    x = torch.randn(mask.shape, generator=g)
    whole = aggregate(x, mask, mode, norm_length=R)
    count = global_token_count(mask)
    starts, stops = row_windows(_masks([3, 7, 1, 5, 6, 2], [9, 1, 4, 1, 6, 2]), P)
    groups = token_budget_groups(starts, stops, 30)
    assert len(groups) > 1
    shares = sum(aggregate(x[i], mask[i], mode, token_count=count, seq_count=6, norm_length=R) for i in groups)
    assert shares.item() == pytest.approx(whole.item(), rel=1e-6)


def _policy(tmp_path, arch: str) -> tuple[PolicyWithValueHead, object]:
    path = save_tiny_causal_lm(tmp_path / arch, n_layer=2, n_head=2, n_embd=32, n_positions=64, arch=arch)
    tok = load_tokenizer(str(path))
    policy = PolicyWithValueHead(load_causal_lm(str(path), tok))
    torch.nn.init.normal_(policy.v_head.weight, std=0.1)
    return policy.float(), tok


def _scored(policy, ids, mask, context_length, remove_padding: bool):
    """Logprobs, entropies and values ``[B, R]`` as the update computes them, and the gradients
    of a loss that weighs every real response position."""
    rows = (ids, mask, position_ids_from_mask(mask))
    args = unpadded(*rows, context_length) if remove_padding else (*rows, context_length)
    policy.zero_grad()
    logp, entropy, values = policy.score_responses(*args, temperature=0.7, chunk=None)
    logp, entropy, values = (pad_responses(x, R) for x in (logp, entropy, values))
    weights = mask[:, context_length:].float() * torch.linspace(-1, 1, R)
    ((logp * weights).sum() + (values * weights).pow(2).sum() + (entropy * weights).sum()).backward()
    grads = {k: p.grad.clone() for k, p in policy.named_parameters() if p.grad is not None}
    return (logp.detach(), entropy.detach(), values.detach()), grads


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_the_unpadded_forward_gives_the_padded_ones_logprobs_values_and_gradients(tmp_path, arch):
    """On every architecture of the fast-decode list: a batch whose rows leave padding on both
    sides (the window is 11 of 16 columns) gives the same logprobs, entropies, values and
    parameter gradients, to 1e-5 in float32, at every real response position."""
    torch.manual_seed(0)
    policy, _ = _policy(tmp_path, arch)
    mask = _masks([4, 2, 5, 3], [3, 1, 6, 2])
    ids = torch.randint(0, 256, mask.shape) * mask
    start, stop = padding_window(mask, P)
    assert (start, stop) == (2, 13) and mask.shape[1] == 16
    (a, grads_a), (b, grads_b) = (_scored(policy, ids, mask, P, flag) for flag in (False, True))
    real = mask[:, P:].bool()
    for x, y in zip(a, b):
        torch.testing.assert_close(y[real], x[real], rtol=1e-5, atol=1e-5)
    assert grads_a.keys() == grads_b.keys() and len(grads_a) > 5
    for k in grads_a:
        scale = float(grads_a[k].abs().max())  # an embedding row's sum of many terms: 1e-5 of the largest
        torch.testing.assert_close(grads_b[k], grads_a[k], rtol=1e-5, atol=1e-6 * max(1.0, scale), msg=k)


@pytest.mark.parametrize(
    "name, overrides",
    [
        ("gae", []),
        (
            "grpo",
            ["ppo.advantage=grpo", "ppo.num_generations=2", "data.batch_size=4", "ppo.loss_agg=seq_mean_token_mean"],
        ),
        (
            "rloo_lora_checkpointing",
            [
                "ppo.advantage=rloo",
                "ppo.num_generations=2",
                "data.batch_size=4",
                "ppo.loss_agg=seq_mean_token_sum_norm",
                "model.lora.r=4",
                "model.gradient_checkpointing=true",
            ],
        ),
    ],
)
def test_runs_without_padding_and_with_token_budget_micro_batches_equal_the_padded_run(
    tmp_path, cache_dir, name, overrides
):
    """Two iterations, two minibatches each: the padded run (every forward on the whole width,
    whole minibatches) against the unpadded one with dynamic micro-batches of at most 60 tokens
    (several groups per minibatch, rows reordered by length). The same weights to 1e-5 and the same
    metrics, with a critic and without, and with LoRA and checkpointing. (The estimators differ in
    what the forward's outputs are used for, and ``test_losses_of_token_budget_groups_add_up_to_the
    _minibatchs`` covers every loss aggregation.)"""
    overrides = ["ppo.minibatch_size=8", *overrides]
    base = run_two_iterations(tmp_path, cache_dir, "padded", [*overrides, "ppo.remove_padding=false"])
    assert_same_run(
        base, run_two_iterations(tmp_path, cache_dir, "unpadded", [*overrides, "ppo.micro_batch_tokens=60"])
    )


def test_micro_batch_size_and_micro_batch_tokens_together_are_refused(tmp_path, cache_dir):
    from ppo_lightning.config import validate
    from ppo_lightning.config.errors import ConfigError

    cfg = compose_cfg(["ppo.micro_batch_size=4", "ppo.micro_batch_tokens=256"], tmp_path, cache_dir)
    with pytest.raises(ConfigError, match=r"^ppo.micro_batch_size=4 and ppo.micro_batch_tokens=256: choose one"):
        validate(cfg)
