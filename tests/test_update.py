"""One whole PPO iteration's updates against a naive reference written here: after one
``training_step`` on a tiny model, the policy's weights equal those of hand-written steps on the
same rollout (plain torch forward, the clipped policy and value losses, backward, gradient-norm
clip, AdamW)."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from ppo_lightning.jobs.factory import build
from tests.conftest import compose_cfg

CLIP, VF_CLIP, VF_COEF, MAX_NORM, LR = 0.01, 0.2, 0.1, 0.5, 1e-3  # a small clip: active in step 2
BETAS, EPS = (0.9, 0.999), 1e-5


class Capture(L.Callback):
    """The weights before the iteration's update, and the rollout it learned from."""

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):  # runs before the rollout
        self.before = copy.deepcopy(pl_module.policy.state_dict())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rollout = pl_module.rollout
        self.after = copy.deepcopy(pl_module.policy.state_dict())


def naive_update(policy, state: dict, r, temperature: float, steps: int) -> tuple[dict, float]:
    """``steps`` updates on the whole rollout, written out: a copy of the policy with the old
    weights, its LM called plainly (final hidden state from ``output_hidden_states``, value head
    applied by hand), AdamW's moments kept here. Returns the weights and the clipped fraction of
    the last step's tokens."""
    policy = copy.deepcopy(policy)
    policy.load_state_dict(state)
    lm, v_head = policy.lm, policy.v_head
    P, m = r.context_length, r.response_mask
    n = m.sum()
    moments = {}
    for step in range(1, steps + 1):
        policy.zero_grad()
        out = lm(
            input_ids=r.query_responses,
            attention_mask=r.attention_mask,
            position_ids=r.position_ids,
            output_hidden_states=True,
            use_cache=False,
        )
        logits = out.logits[:, P - 1 : -1].float() / temperature  # position t predicts token t + 1
        new_logp = torch.gather(F.log_softmax(logits, -1), 2, r.responses.unsqueeze(-1)).squeeze(-1)
        new_values = v_head(out.hidden_states[-1][:, P - 1 : -1].float()).squeeze(-1)

        ratio = torch.exp(new_logp - r.logprobs)
        unclipped, clipped = -r.advantages * ratio, -r.advantages * ratio.clamp(1 - CLIP, 1 + CLIP)
        pg_loss = (torch.maximum(unclipped, clipped) * m).sum() / n
        clip_frac = float(((clipped > unclipped).float() * m).sum() / n)
        v_clipped = r.values + (new_values - r.values).clamp(-VF_CLIP, VF_CLIP)
        vf = torch.maximum((new_values - r.returns) ** 2, (v_clipped - r.returns) ** 2)
        vf_loss = 0.5 * (vf * m).sum() / n
        (pg_loss + VF_COEF * vf_loss).backward()

        params = [p for p in policy.parameters() if p.grad is not None]
        norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in params))
        assert step > 1 or norm > MAX_NORM, "the norm clip must act in step 1 for this test to check it"
        scale = min(1.0, MAX_NORM / (float(norm) + 1e-6))
        with torch.no_grad():
            for p in params:  # AdamW without weight decay: bias-corrected moments
                g = p.grad * scale
                m1, m2 = moments.get(p, (torch.zeros_like(p), torch.zeros_like(p)))
                m1, m2 = BETAS[0] * m1 + (1 - BETAS[0]) * g, BETAS[1] * m2 + (1 - BETAS[1]) * g * g
                moments[p] = (m1, m2)
                m_hat, v_hat = m1 / (1 - BETAS[0] ** step), m2 / (1 - BETAS[1] ** step)
                p -= LR * m_hat / (v_hat.sqrt() + EPS)
    return policy.state_dict(), clip_frac


@pytest.mark.parametrize("fused", [True, False])
def test_one_training_step_equals_a_hand_written_update(tmp_path, cache_dir, fused):
    """Two epochs of one minibatch: two optimizer steps, the second with ratios away from 1 and
    clipping active. With ``fuse_rollout_forward`` the first update reuses the rollout's forward;
    without, it runs its own: both must be the hand-written steps."""
    cfg = compose_cfg(
        [
            "trainer.max_steps=1",
            "ppo.ppo_epochs=2",
            "data.batch_size=8",
            "ppo.minibatch_size=8",
            "sampling.max_new_tokens=12",
            f"ppo.clip={CLIP}",
            f"ppo.vf_clip={VF_CLIP}",
            f"ppo.vf_coef={VF_COEF}",
            f"ppo.max_grad_norm={MAX_NORM}",
            f"optimizer.lr={LR}",
            "sampling.temperature=0.9",
            f"ppo.fuse_rollout_forward={fused}",
            "callbacks=none",
            "logger=none",
            "export_dir=null",
            "trainer.enable_checkpointing=false",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
        ],
        tmp_path,
        cache_dir,
    )
    module, datamodule, trainer = build(cfg)
    cap = Capture()
    trainer.callbacks.append(cap)
    trainer.fit(module, datamodule=datamodule)

    expected, clip_frac = naive_update(module.policy, cap.before, cap.rollout, temperature=0.9, steps=2)
    assert clip_frac > 0.05, "the policy clip must act in the second step for this test to check it"
    moved = 0
    for k, w in cap.after.items():
        torch.testing.assert_close(w, expected[k], rtol=1e-5, atol=1e-7, msg=k)
        moved += not torch.equal(w, cap.before[k])
    assert moved > 10  # the step really changed the weights
