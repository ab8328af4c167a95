"""One precision for the whole iteration: the rollout (sampling, reference, reward, old logprobs and
values) runs in the precision context the update runs in, so the first update's ratio is exactly 1
in every precision; the value head, logprobs and losses are float32 in every one. CPU autocast runs
bf16, so all of this is tested here."""

from __future__ import annotations

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from ppo_lightning.config import validate
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.models.policy import PolicyWithValueHead, load_causal_lm, load_tokenizer
from ppo_lightning.jobs.run import train
from tests.conftest import compose_cfg, read_metrics

QUIET = [
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "export_dir=null",
    "trainer.enable_checkpointing=false",
    "logger=csv",
]


class RolloutDtypes(L.Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        r = pl_module.rollout
        self.dtypes = {
            k: getattr(r, k).dtype for k in ("logprobs", "ref_logprobs", "values", "advantages", "returns", "scores")
        }


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed", "bf16-true"])
def test_the_first_update_sees_exactly_the_rollout_numerics(tmp_path, cache_dir, precision, fused):
    """One epoch, one minibatch, the default fused AdamW and gradient clipping. The update's forward
    reproduces the old logprobs (fused: it is the rollout's forward; unfused: a new one in the same
    precision context), and the reference agrees with the untrained policy (KL 0)."""
    cfg = compose_cfg(
        [
            *QUIET,
            f"trainer.precision={precision}",
            "trainer.max_steps=1",
            "ppo.ppo_epochs=1",
            "data.batch_size=8",
            "ppo.minibatch_size=8",
            "sampling.max_new_tokens=12",
            f"ppo.fuse_rollout_forward={fused}",
        ],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    (row,) = read_metrics(tmp_path / "metrics.csv")
    assert (row["val/ratio"], row["val/ratio_var"], row["policy/approxkl_avg"]) == (1.0, 0.0, 0.0)
    assert row["policy/clipfrac_avg"] == 0.0 and row["objective/kl"] == 0.0
    assert row["health/skipped_updates"] == 0.0


def test_rollout_tensors_are_float32_in_bf16_true(tmp_path, cache_dir):
    from ppo_lightning.jobs.factory import build

    cfg = compose_cfg(
        [
            *QUIET,
            "trainer.precision=bf16-true",
            "trainer.max_steps=1",
            "ppo.ppo_epochs=1",
            "data.batch_size=8",
            "ppo.minibatch_size=4",
            "sampling.max_new_tokens=8",
        ],
        tmp_path,
        cache_dir,
    )
    module, datamodule, trainer = build(cfg)
    cb = RolloutDtypes()
    trainer.callbacks.append(cb)
    trainer.fit(module, datamodule=datamodule)
    assert next(module.policy.lm.parameters()).dtype == torch.bfloat16  # the LM really is bf16
    assert set(cb.dtypes.values()) == {torch.float32}, cb.dtypes


def test_the_value_head_computes_in_float32_under_autocast(tiny_lm_dir):
    tok = load_tokenizer(str(tiny_lm_dir))
    policy = PolicyWithValueHead(load_causal_lm(str(tiny_lm_dir), tok))
    torch.nn.init.normal_(policy.v_head.weight, std=0.5)  # a head that is not zero
    enc = tok(["hello there", "a b"], return_tensors="pt", padding=True)
    ids = torch.cat([enc.input_ids, torch.tensor([[104, 105], [106, 256]])], 1)
    am = torch.cat([enc.attention_mask, torch.ones(2, 2, dtype=torch.long)], 1)
    pos = (am.cumsum(-1) - 1).clamp(min=0)
    P = enc.input_ids.shape[1]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits, values = policy(ids, am, pos, P)
        hidden = policy.lm(input_ids=ids, attention_mask=am, position_ids=pos, output_hidden_states=True).hidden_states[
            -1
        ][:, P - 1 : -1]
        naive_autocast = policy.v_head(hidden.float()).squeeze(-1)  # what autocast does to nn.Linear
    assert logits.dtype == torch.bfloat16 and values.dtype == torch.float32
    expected = F.linear(hidden.float(), policy.v_head.weight, policy.v_head.bias).squeeze(-1)  # fp32
    torch.testing.assert_close(values, expected, rtol=0, atol=0)
    assert naive_autocast.dtype == torch.bfloat16 and not torch.equal(naive_autocast.float(), expected)


@pytest.mark.parametrize("precision", ["16-mixed", "16-true"])
def test_float16_is_refused_with_a_pointer_to_bf16(tmp_path, cache_dir, precision):
    cfg = compose_cfg([f"trainer.precision={precision}"], tmp_path, cache_dir)
    with pytest.raises(ConfigError, match=rf"^trainer.precision={precision}: float16 is not supported.*bf16-mixed"):
        validate(cfg)


def test_cpu_bf16_probe_reads_what_proc_cpuinfo_lists():
    """``cpu_has_bf16_matmul`` against the kernel's own list of the CPU's flags (x86 Linux)."""
    import platform
    from pathlib import Path

    from ppo_lightning.jobs.trainer import cpu_has_bf16_matmul

    info = Path("/proc/cpuinfo")
    if platform.machine() != "x86_64" or not info.exists():
        assert cpu_has_bf16_matmul() in (None, True, False)
        return
    flags = next(line for line in info.read_text().splitlines() if line.startswith("flags")).split()
    assert cpu_has_bf16_matmul() == bool({"avx512_bf16", "amx_tile"} & set(flags))


@pytest.mark.parametrize(
    "precision, native, warns",
    [("bf16-mixed", False, True), ("bf16-true", False, True), ("bf16-mixed", True, False), ("32-true", False, False)],
)
def test_bf16_on_a_cpu_without_bf16_matmuls_is_warned_of_before_the_run(
    tmp_path, cache_dir, monkeypatch, caplog, precision, native, warns
):
    """Without AVX512-BF16 or AMX torch runs bf16 matmuls on a slow path (here ~60x float32's
    time): ``check_inputs`` names the key and the fix before any model loads. The probe is set
    both ways, since one machine has one CPU; its reading of the hardware is tested above."""
    import logging

    from ppo_lightning.jobs import factory, trainer

    monkeypatch.setattr(trainer, "cpu_has_bf16_matmul", lambda: native)
    cfg = compose_cfg(["trainer=cpu", f"trainer.precision={precision}"], tmp_path, cache_dir)
    with caplog.at_level(logging.WARNING, logger=trainer.log.name):
        factory.check_inputs(cfg)
    warned = [r.getMessage() for r in caplog.records if "bf16 matmul" in r.getMessage()]
    assert bool(warned) == warns, warned
    if warns:
        assert warned[0].startswith(f"trainer.precision={precision} on a CPU without bf16 matmul instructions")
        assert "Use trainer.precision=32-true" in warned[0]


def test_bf16_mixed_training_raises_the_reward(tmp_path, cache_dir):
    cfg = compose_cfg(
        [*QUIET, "trainer.precision=bf16-mixed", "trainer.max_steps=30", "sampling.max_new_tokens=16"],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    scores = [r["objective/raw_scores"] for r in read_metrics(tmp_path / "metrics.csv")]
    assert sum(scores[-5:]) / 5 > sum(scores[:5]) / 5 + 0.1, scores
