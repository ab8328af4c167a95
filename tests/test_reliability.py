"""Nothing lost: exact resume after SIGKILL, export, non-finite guard, and bad input caught early."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import compose_cfg, read_metrics
from tests.helpers import run_train

FAST = ["experiment=tiny_char", "data.batch_size=8", "ppo.minibatch_size=4", "ppo.ppo_epochs=2",
        "ppo.max_new_tokens=8", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]




@pytest.mark.slow  # three runs in subprocesses, one of them killed
@pytest.mark.parametrize("switch", [[], ["model.lora.r=4"], ["trainer=ddp_cpu"], ["trainer=fsdp_cpu"]],
                         ids=["full", "lora", "ddp_cpu", "fsdp_cpu"])
def test_sigkill_then_resume_replays_the_uninterrupted_trajectory(tmp_path, cache_dir, switch):
    """With LoRA the checkpoint holds only the adapters, the value head and their optimizer state;
    the frozen base is rebuilt from its source. With two processes every rank is killed, and the
    checkpoint holds every rank's sampling stream (FSDP: the gathered full state, restored after
    the strategy's setup). The trajectory is the same in each case."""
    common = [*FAST, "trainer.max_steps=8", "callbacks.model_checkpoint.every_n_train_steps=3",
              "callbacks.best_checkpoint.every_n_train_steps=3", "export_dir=null", *switch]
    full = run_train([*common, f"hydra.run.dir={tmp_path / 'full'}"], cache_dir)
    assert full.returncode == 0, full.stderr[-3000:]

    killed = run_train([*common, f"hydra.run.dir={tmp_path / 'killed'}",
                  "+callbacks.kill._target_=tests.helpers.KillAtStep", "+callbacks.kill.step=5"], cache_dir)
    assert killed.returncode == -9  # SIGKILL, mid-training
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 3  # the checkpoint before the kill
    assert not list(last.parent.glob("*.tmp"))  # no half-written file left behind

    resumed = run_train([*common, f"hydra.run.dir={tmp_path / 'resumed'}", f"ckpt_path={last}"], cache_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    expected = {int(r["step"]): r for r in read_metrics(tmp_path / "full" / "metrics.csv")}
    got = {int(r["step"]): r for r in read_metrics(tmp_path / "resumed" / "metrics.csv")}
    assert sorted(got) == [3, 4, 5, 6, 7]
    for step, row in got.items():
        for k, v in row.items():
            if k.startswith("perf/"):
                continue  # wall-clock timings
            assert v == pytest.approx(expected[step][k], rel=1e-5, abs=1e-6), (step, k)


def test_export_loads_in_plain_transformers_and_generates_the_same_tokens(tmp_path, cache_dir):
    from ppo_lightning.rollout import generate
    from ppo_lightning.factory import build
    from ppo_lightning.train import export, train
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = compose_cfg([*FAST, "trainer.max_steps=4", "callbacks.model_checkpoint.every_n_train_steps=4"],
                      tmp_path, cache_dir)
    train(cfg)
    # on demand, from the checkpoint, into a second directory
    cfg2 = compose_cfg([*FAST, "task=export", f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}",
                        f"export_dir={tmp_path / 'exported2'}"], tmp_path / "export_run", cache_dir)
    export(cfg2)
    for d in ("policy", "exported2"):
        directory = tmp_path / d
        assert (directory / "model.safetensors").exists() and (directory / "generation_config.json").exists()
        hf = AutoModelForCausalLM.from_pretrained(directory)  # no project code involved
        tok = AutoTokenizer.from_pretrained(directory)
        enc = tok(["the cat walks", "a dog"], return_tensors="pt", padding=True)
        out = hf.generate(**enc, do_sample=False, max_new_tokens=12, min_new_tokens=12,
                          pad_token_id=tok.pad_token_id)
        # the trained weights, loaded back through the project's own path
        module, _, _ = build(compose_cfg([*FAST, f"model.name_or_path={directory}", "model.build_tiny=null",
                                          f"model.value_head_path={directory}"], tmp_path / "reload", cache_dir))
        ours, _ = generate(module.policy.lm, enc.input_ids, enc.attention_mask, max_new_tokens=12,
                           eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True,
                           stop_at_eos=False)
        assert torch.equal(out[:, enc.input_ids.shape[1]:], ours)
    # the value head reloads into a new run
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert torch.equal(module.policy.v_head.weight, ckpt["policy.v_head.weight"])
    assert module.policy.v_head.weight.abs().sum() > 0  # trained, not the zero init


def test_nan_rewards_skip_those_steps_and_count_them(tmp_path, cache_dir):
    from ppo_lightning.train import train

    cfg = compose_cfg([*FAST, "trainer.max_steps=6", "reward=function",
                       "reward.fn=tests.helpers.nan_on_odd_calls", "callbacks=none"], tmp_path, cache_dir)
    metrics = train(cfg)
    rows = read_metrics(tmp_path / "metrics.csv")
    skipped = [math.isnan(r["objective/scores"]) for r in rows]
    assert skipped == [False, True] * 3
    assert metrics["health/skipped_updates"] == 3 * 2 * 2  # 3 iterations x 2 epochs x 2 minibatches
    assert all(math.isnan(r["loss/policy_avg"]) == s for r, s in zip(rows, skipped))
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert math.isfinite(metrics["objective/kl_coef"])


@pytest.mark.slow  # a subprocess that must exit 1
def test_persistent_nan_stops_the_run_and_keeps_the_checkpoint(tmp_path, cache_dir):
    # normalize=false: with it, the reference samples' all-NaN scores stop the run before training
    p = run_train([*FAST, "trainer.max_steps=8", "reward=function", "reward.fn=tests.helpers.always_nan",
             "reward.normalize=false", "callbacks.model_checkpoint.every_n_train_steps=1",
             f"hydra.run.dir={tmp_path}"], cache_dir)
    assert p.returncode == 1
    assert "3 PPO iterations in a row had non-finite values" in p.stderr
    assert "reward nan for prompt" in p.stderr and "ppo.max_nonfinite_iterations" in p.stderr
    assert "Traceback" not in p.stderr
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values())
