"""The critic-free estimators against naive references on hand-made groups (plain Python loops
over the formulas of each paper; ``ppo_lightning/algo/advantages.py`` cites them)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from ppo_lightning.algo import advantages as E
from ppo_lightning.config import PPOConfig

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
        group = REWARDS[s : s + G]
        m, sd = sum(group) / G, _naive_std(group)
        want += [(r - m) / (sd + 1e-4) for r in group]
    got = E.grpo_advantages(torch.tensor(REWARDS), G)
    assert got.tolist() == pytest.approx(want, rel=1e-6, abs=1e-7)
    assert got[3:].tolist() == [0.0, 0.0, 0.0]  # equal rewards: no signal


def test_dr_grpo_only_subtracts_the_group_mean():
    """Liu et al. 2025 (Dr. GRPO): without the std division, A_i = r_i - mean(r_group)."""
    want = []
    for s in range(0, len(REWARDS), G):
        group = REWARDS[s : s + G]
        want += [r - sum(group) / G for r in group]
    got = E.grpo_advantages(torch.tensor(REWARDS), G, scale_by_std=False)
    assert got.tolist() == pytest.approx(want, abs=1e-7)


def test_rloo_baseline_is_the_mean_of_the_other_samples():
    """Ahmadian et al. 2024 (RLOO), eq. for the leave-one-out baseline:
    A_i = r_i - 1/(k-1) * sum_{j != i} r_j."""
    want = []
    for s in range(0, len(REWARDS), G):
        group = REWARDS[s : s + G]
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
            want = (returns[b][t] - m) / math.sqrt(sd**2 + 1e-8) if mask[b, t] else 0.0
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


# ----------------------------------------------------------------------------- with the KL penalty
def _samples(scores: list[float], lengths: list[int], R: int = 6, P: int = 2, seed: int = 0):
    """``Played`` episodes (``tests.helpers.samples``) of ``len(scores)`` rows whose responses have ``lengths`` tokens, with
    reference logprobs around -1 (what ``finish_rollout`` reads; the token ids are placeholders)."""
    from tests.helpers import samples

    B = len(scores)
    mask = torch.tensor([[1.0] * n + [0.0] * (R - n) for n in lengths])
    ref = -1.0 - torch.rand(B, R, generator=torch.Generator().manual_seed(seed))
    ids = torch.zeros(B, P + R, dtype=torch.long)
    am = torch.cat([torch.ones(B, P, dtype=torch.long), mask.long()], 1)
    return samples(
        query_responses=ids,
        attention_mask=am,
        position_ids=am.cumsum(1) - 1,
        response_mask=mask,
        ref_logprobs=ref,
        scores=torch.tensor(scores),
        raw_scores=torch.tensor(scores),
        contains_eos=torch.ones(B, dtype=torch.bool),
        context_length=P,
    )


@pytest.mark.parametrize("advantage", ["grpo", "rloo"])
def test_group_estimators_compare_scores_and_add_the_kl_penalty_per_token(advantage):
    """The audit's case: policy close to the reference (logprob noise 0.05), group 0 all correct,
    group 1 mixed, beta = 0.05, the KL in the reward. Comparing ``score - beta * sum KL`` within
    a group would turn group 0's KL noise into GRPO advantages of about +-1 (the std division
    scales any spread up to 1, whatever beta). Here the scores are compared and each token adds
    its return-to-go of the KL penalty (OpenRLHF): group 0's advantages are of size beta * KL,
    group 1's are its score advantages plus that. A naive loop over the formula checks each."""
    from tests.helpers import finish

    scores, lengths, beta = [1.0, 1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 1.0], [3, 6, 2, 5, 4, 6, 1, 3], 0.05
    s = _samples(scores, lengths)
    logprobs = s.ref_logprobs + 0.05 * torch.randn(s.ref_logprobs.shape, generator=torch.Generator().manual_seed(1))
    r = finish(
        s, logprobs, None, kl_coef=beta, kl_estimator="k1", cfg=PPOConfig(advantage=advantage, num_generations=4)
    )
    for g in range(2):
        group = scores[4 * g : 4 * g + 4]
        for i, score in enumerate(group):
            b = 4 * g + i
            if advantage == "grpo":
                m = sum(group) / 4
                sd = math.sqrt(sum((x - m) ** 2 for x in group) / 3)
                score_adv = (score - m) / (sd + 1e-4)
            else:
                score_adv = score - sum(group[j] for j in range(4) if j != i) / 3
            for t in range(6):
                kl_to_go = sum(logprobs[b, u].item() - s.ref_logprobs[b, u].item() for u in range(t, lengths[b]))
                want = score_adv - beta * kl_to_go if t < lengths[b] else 0.0
                assert r.advantages[b, t].item() == pytest.approx(want, abs=1e-5), (b, t)
    assert r.advantages[:4].abs().max() < 0.05  # the tied group: KL-sized, not +-1
    real = r.response_mask[4:] > 0
    assert r.advantages[4:][real].abs().min() > 0.6  # the mixed group: its scores' signal (RLOO 2/3, GRPO 0.87)


def test_frac_zero_std_groups_counts_groups_whose_scores_tie():
    """With the KL in the reward, no two episode rewards are equal once the policy has moved;
    the metric looks at the scores, which are what the group estimators compare."""
    stats = E.group_reward_stats(torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5]), 3)
    assert stats["frac_zero_std"].item() == pytest.approx(0.5)


@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp"])
def test_reward_whitening_is_refused_without_a_critic(advantage):
    """Whitening per-token rewards while keeping their mean adds a term proportional to each
    response's length: with equal scores within each group and lengths 2 and 6, GRPO's
    advantages would be about +-0.87 (short answers rewarded for being short) instead of 0."""
    from tests.helpers import finish

    s = _samples([1.0, 1.0, 0.0, 0.0], [2, 6, 3, 6])
    cfg = PPOConfig(advantage=advantage, num_generations=2)
    r = finish(s, s.ref_logprobs.clone(), None, kl_coef=0.0, kl_estimator="k1", cfg=cfg)
    if advantage != "reinforce_pp":
        assert r.advantages.abs().max() == 0  # no signal in equal scores
    with pytest.raises(ValueError, match="length bias"):
        finish(
            s,
            s.ref_logprobs.clone(),
            None,
            kl_coef=0.0,
            kl_estimator="k1",
            cfg=dataclasses.replace(cfg, whiten_rewards=True),
        )


# ----------------------------------------------------------------------------- in training
RUN = [
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "optimizer.lr=1e-3",
    "ppo.kl_coef=0.01",
    "data.batch_size=4",
    "ppo.num_generations=4",
    "ppo.minibatch_size=8",
    "sampling.max_new_tokens=16",
]


@pytest.mark.slow  # 25 iterations each
@pytest.mark.parametrize("advantage", ["grpo", "rloo", "reinforce_pp"])
def test_critic_free_estimators_raise_reward_without_any_value_head(tmp_path, cache_dir, advantage):
    """Each critic-free estimator learns the tiny problem (4 prompts x 4 samples per iteration), and
    no value head exists anywhere: not in the policy, the optimizer, the checkpoint, the metrics
    or the export. (The mean score rises by 1.0 to 4.2 over 25 iterations here; the test asks
    for 0.1.)"""
    from ppo_lightning.jobs.factory import build
    from ppo_lightning.jobs.run import train
    from tests.conftest import compose_cfg, read_metrics

    steps = 25
    overrides = [
        *RUN,
        f"ppo.advantage={advantage}",
        f"trainer.max_steps={steps}",
        f"callbacks.model_checkpoint.every_n_train_steps={steps}",
    ]
    module, _, _ = build(compose_cfg(overrides, tmp_path / "built", cache_dir))
    assert module.policy.v_head is None
    n_lm_params = len(list(module.policy.lm.parameters()))  # a tied weight once

    train(compose_cfg(overrides, tmp_path, cache_dir))
    rows = read_metrics(tmp_path / "metrics.csv")
    scores = [r["objective/scores"] for r in rows]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > first + 0.1, f"{advantage}: mean reward did not rise clearly: {first:.3f} -> {last:.3f}"
    assert rows[-1]["episode"] == steps * 16  # every sample of every prompt is an episode
    assert not any(k.startswith(("value/", "loss/value", "val/clipfrac")) for r in rows for k in r)
    assert 0 <= rows[0]["objective/frac_zero_std_groups"] <= 1 and rows[0]["objective/group_reward_std"] > 0
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert not any("v_head" in k for k in state["state_dict"])
    (group,) = state["optimizer_states"][0]["param_groups"]
    assert len(group["params"]) == n_lm_params  # the LM's weights, nothing else
    assert not (tmp_path / "policy" / "value_head.safetensors").exists()
    assert (tmp_path / "policy" / "model.safetensors").exists()


class CaptureRollout:
    """A Lightning callback that keeps the first rollout."""

    def __new__(cls):
        import lightning as L

        class _Capture(L.Callback):
            rollout = None

            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
                if self.rollout is None:
                    self.rollout = pl_module.rollout

        return _Capture()


@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_each_prompts_samples_are_one_group_on_consecutive_rows(tmp_path, cache_dir, advantage):
    """``ppo.num_generations=3``: the rollout holds each prompt three times in a row (valid for
    GAE too); GRPO's advantages are constant along a response and sum to 0 within each group."""
    from ppo_lightning.jobs.factory import build
    from tests.conftest import compose_cfg

    cfg = compose_cfg(
        [
            *RUN,
            "ppo.num_generations=3",
            "ppo.minibatch_size=6",
            f"ppo.advantage={advantage}",
            "trainer.max_steps=1",
            "callbacks=none",
            "export_dir=null",
        ],
        tmp_path,
        cache_dir,
    )
    module, datamodule, trainer = build(cfg)
    capture = CaptureRollout()
    trainer.callbacks.append(capture)
    trainer.fit(module, datamodule=datamodule)
    r = capture.rollout
    prompts = r.query_responses[:, : r.context_length].view(4, 3, -1)
    assert r.batch_size == 12 and (prompts == prompts[:, :1]).all()  # three copies of each prompt
    assert len({tuple(p[0].tolist()) for p in prompts}) == 4  # four different prompts
    if advantage == "grpo":
        mask = r.response_mask
        per_response = (r.advantages * mask).sum(1) / mask.sum(1)
        assert torch.allclose(r.advantages, per_response[:, None] * mask, atol=1e-6)
        assert torch.allclose(per_response.view(4, 3).sum(1), torch.zeros(4), atol=1e-5)


def test_bad_estimator_settings_name_the_key(tmp_path, cache_dir):
    from ppo_lightning.config import validate
    from ppo_lightning.config.errors import ConfigError
    from tests.conftest import compose_cfg

    for overrides, match in (
        (["ppo.advantage=grpo"], r"^ppo.advantage=grpo: compares the responses to one prompt; set ppo.num_generations"),
        (["ppo.advantage=rloo", "ppo.num_generations=1"], r"^ppo.advantage=rloo"),
        (
            ["ppo.advantage=reinforce_pp", "model.value_head_init=reward_model", "reward=model"],
            r"^model.value_head_init='reward_model' with ppo.advantage=reinforce_pp",
        ),
        (
            ["ppo.num_generations=3", "data.batch_size=4", "ppo.minibatch_size=8"],
            r"^ppo.minibatch_size=8: must divide the rollout's 12 rows",
        ),
        (["ppo.advantage=vtrace"], r"ppo.advantage"),
        (
            ["ppo.advantage=grpo", "ppo.num_generations=2", "ppo.whiten_rewards=true"],
            r"^ppo.whiten_rewards=true with ppo.advantage=grpo: reward whitening is GAE's",
        ),
        (
            ["ppo.advantage=reinforce_pp", "ppo.whiten_rewards=true"],
            r"^ppo.whiten_rewards=true with ppo.advantage=reinforce_pp",
        ),
        (
            ["ppo.advantage=grpo", "ppo.num_generations=2", "ppo.gamma=0.9"],
            r"^ppo.gamma=0.9 with ppo.advantage=grpo: grpo judges each response by its score as a whole",
        ),
        (["ppo.advantage=rloo", "ppo.num_generations=2", "ppo.gamma=0.99"], r"^ppo.gamma=0.99 with ppo.advantage=rloo"),
        (
            ["ppo.advantage=rloo", "ppo.num_generations=2", "ppo.scale_by_group_std=false"],
            r"^ppo.scale_by_group_std=false with ppo.advantage=rloo: only grpo divides",
        ),
        (["ppo.scale_by_group_std=false"], r"^ppo.scale_by_group_std=false with ppo.advantage=gae"),
        (
            ["ppo.advantage=reinforce_pp", "ppo.scale_by_group_std=false"],
            r"^ppo.scale_by_group_std=false with ppo.advantage=reinforce_pp",
        ),
        (["ppo.kl_in=loss", "ppo.kl_estimator=k1"], r"^ppo.kl_estimator=k1 with ppo.kl_in=loss: as a loss term"),
        (
            ["trainer=ddp_cpu", "trainer.devices=4", "reward.normalize_samples=3"],
            r"^reward.normalize_samples=3 with 4 processes",
        ),
    ):
        with pytest.raises(ConfigError, match=match):
            validate(compose_cfg(overrides, tmp_path, cache_dir))


def test_estimator_options_that_are_valid_pass(tmp_path, cache_dir):
    from ppo_lightning.config import validate
    from tests.conftest import compose_cfg

    for overrides in (
        ["ppo.advantage=reinforce_pp", "ppo.gamma=0.9"],
        ["ppo.gamma=0.99", "ppo.whiten_rewards=true"],
        ["ppo.advantage=grpo", "ppo.num_generations=2", "ppo.scale_by_group_std=false"],
        ["ppo.kl_in=loss", "ppo.kl_estimator=k2"],
        ["ppo.kl_estimator=k1"],
        ["trainer=ddp_cpu", "reward.normalize_samples=2"],
    ):
        validate(compose_cfg(overrides, tmp_path, cache_dir))


def test_tied_groups_are_counted_while_the_kl_penalty_moves_the_policy(tmp_path, cache_dir):
    """A reward that scores every response alike, GRPO with the KL in the reward (the default),
    and an entropy bonus that moves the policy off the reference: every group ties on every
    iteration, though after the first update the KL penalty differs from response to response.
    The metric counts the ties (with score + KL penalty it read 0 from iteration 1 on)."""
    from ppo_lightning.jobs.run import train
    from tests.conftest import compose_cfg, read_metrics

    train(
        compose_cfg(
            [
                *RUN,
                "ppo.advantage=grpo",
                "ppo.kl_coef=0.5",
                "ppo.ent_coef=0.5",
                "optimizer.lr=1e-2",
                "trainer.max_steps=3",
                "callbacks=none",
                "export_dir=null",
                "logger=csv",
                "reward.fn=tests.helpers.constant_reward",
            ],
            tmp_path,
            cache_dir,
        )
    )
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [r["objective/frac_zero_std_groups"] for r in rows] == [1.0, 1.0, 1.0]
    assert rows[-1]["objective/kl"] != 0.0  # the penalty's rewards differ between responses
