"""The real ``train(cfg)`` on a tiny offline model: reward rises, checkpoint and export written."""

from __future__ import annotations

import re

import pytest
import torch
from omegaconf import OmegaConf

from ppo_lightning.jobs.run import train
from tests.conftest import compose_cfg, read_metrics

FAST = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false", "sampling.max_new_tokens=16"]


def test_ratio_is_exactly_one_on_first_minibatch(tmp_path, cache_dir):
    """One epoch, one minibatch, old logprobs from the rollout's own no-grad forward: the update's
    forward must reproduce them, so ratio = 1 on every token (mean 1, variance 0) and nothing is
    clipped."""
    cfg = compose_cfg(
        [
            *FAST,
            "trainer.max_steps=1",
            "ppo.ppo_epochs=1",
            "data.batch_size=8",
            "ppo.minibatch_size=8",
            "ppo.fuse_rollout_forward=false",
            "callbacks=none",
            "export_dir=null",
        ],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    (row,) = read_metrics(tmp_path / "metrics.csv")
    assert row["val/ratio"] == 1.0
    assert row["val/ratio_var"] == 0.0
    assert row["policy/approxkl_avg"] == 0.0
    assert row["policy/clipfrac_avg"] == 0.0
    assert row["objective/kl"] == 0.0  # policy == reference before any update


def test_fused_rollout_forward_gives_the_same_run(tmp_path, cache_dir):
    """Old logprobs and values from the first update's forward (the default with one minibatch)
    or from a separate rollout forward: every logged metric of a 4-iteration run agrees."""
    runs = {}
    for fused in (True, False):
        out = tmp_path / str(fused)
        cfg = compose_cfg(
            [
                *FAST,
                "trainer.max_steps=4",
                "data.batch_size=8",
                "ppo.minibatch_size=8",
                "optimizer.lr=1e-3",
                f"ppo.fuse_rollout_forward={fused}",
                "callbacks=none",
                "export_dir=null",
            ],
            out,
            cache_dir,
        )
        train(cfg)
        runs[fused] = read_metrics(out / "metrics.csv")
    assert len(runs[True]) == len(runs[False]) == 4
    for a, b in zip(runs[True], runs[False]):
        for k in a:
            if k.startswith("perf/"):
                continue
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6), (a["step"], k)
    assert runs[True][-1]["policy/approxkl_avg"] > 0  # the weights moved: the runs are not trivial


def test_ppo_raises_reward_and_writes_checkpoint(tmp_path, cache_dir):
    """24 iterations (the mean score rises by 3.3 here; the test asks for 0.1), a numbered
    checkpoint halfway and ``last.ckpt`` at the end, and the export."""
    steps = 24
    cfg = compose_cfg(
        [
            *FAST,
            f"trainer.max_steps={steps}",
            "optimizer.lr=1e-3",
            "ppo.kl_coef=0.01",
            f"callbacks.model_checkpoint.every_n_train_steps={steps // 2}",
        ],
        tmp_path,
        cache_dir,
    )
    metrics = train(cfg)
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [int(r["step"]) for r in rows] == list(range(steps))  # one logged row per PPO iteration
    scores = [r["objective/scores"] for r in rows]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > first + 0.1, f"mean reward did not rise clearly: {first:.3f} -> {last:.3f}"
    assert metrics["objective/scores"] == scores[-1]
    assert rows[-1]["episode"] == steps * 16
    assert rows[-1]["objective/kl"] > 0  # the policy moved away from the reference

    ckpt = tmp_path / "checkpoints" / "last.ckpt"
    assert ckpt.exists() and (tmp_path / "checkpoints" / f"step_{steps // 2:06d}.ckpt").exists()
    state = torch.load(ckpt, map_location="cpu", weights_only=False)
    assert state["global_step"] == steps
    assert any(k.startswith("policy.v_head") for k in state["state_dict"])
    assert not any(k.startswith("ref_lm.") for k in state["state_dict"])
    assert state["ppo_state"]["episode"] == steps * 16

    from transformers import AutoModelForCausalLM

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "policy")
    assert (tmp_path / "policy" / "value_head.safetensors").exists()
    w = exported.state_dict()["transformer.h.0.attn.c_attn.weight"]
    assert torch.equal(w, state["state_dict"]["policy.lm.transformer.h.0.attn.c_attn.weight"])


def test_any_metric_can_be_a_checkpoint_monitor(tmp_path, cache_dir):
    """Only what callbacks read goes through `self.log`: a monitor on any metric, and the metric
    in the best checkpoint's filename template, still reach trainer.callback_metrics."""
    cfg = compose_cfg(
        [
            *FAST,
            "trainer.max_steps=4",
            "callbacks.best_checkpoint.monitor=loss/value_avg",
            "callbacks.best_checkpoint.mode=min",
            "callbacks.best_checkpoint.every_n_train_steps=2",
            "callbacks.model_checkpoint.every_n_train_steps=2",
            "export_dir=null",
        ],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    rows = read_metrics(tmp_path / "metrics.csv")
    best = sorted((tmp_path / "checkpoints" / "best").glob("*.ckpt"))
    assert len(best) == 2
    # the filename carries the real rlhf_reward of that step (formatted from callback_metrics)
    rewards = {f"{r['objective/rlhf_reward']:.4f}" for r in rows}
    assert all(p.stem.rsplit("_reward_", 1)[1] in rewards for p in best), [p.name for p in best]
    state = torch.load(best[0], map_location="cpu", weights_only=False)
    cb_state = next(v for k, v in state["callbacks"].items() if "loss/value_avg" in k)
    assert cb_state["monitor"] == "loss/value_avg"


def _tensorboard_scalars(directory, tag: str) -> dict[int, float]:
    """``tag``'s scalars by step from the TensorBoard event files under ``directory`` (TFRecords of
    ``Event`` protos: length, its CRC, the record, its CRC), read with tensorboardX's protos."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    scalars = {}
    for path in directory.rglob("events.out.tfevents.*"):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (n,) = struct.unpack("<Q", data[at : at + 8])
            event = Event.FromString(data[at + 12 : at + 12 + n])
            at += 12 + n + 4
            for v in event.summary.value:
                if v.tag == tag:
                    scalars[event.step] = v.simple_value
    return scalars


def _wandb_history(path, key: str, timeout: float = 120) -> dict[int, float]:
    """``key``'s values by step from an offline W&B run's ``run-*.wandb`` file, once the run's
    ``exit`` record is in it. W&B's service process writes the file, and ``wandb.finish`` can
    return before its last records land (seen on a loaded machine: the file then ended at the
    run's config, with no history): the file is read again until the ``exit`` record, which the
    service writes after the run's history, is there, for up to ``timeout`` seconds."""
    import time

    deadline = time.monotonic() + timeout
    history, exited = _wandb_records(path, key)
    while not exited and time.monotonic() < deadline:
        time.sleep(0.2)
        history, exited = _wandb_records(path, key)
    return history


def _wandb_records(path, key: str) -> tuple[dict[int, float], bool]:
    """``key``'s values by step in the ``run-*.wandb`` file as it is now, and whether the run's
    ``exit`` record is among its records. The file is a LevelDB-style log (after a 7-byte ``:W&B``
    header, 32 KiB blocks of records, each with a 7-byte header: CRC, length, type 1 full / 2 first
    / 3 middle / 4 last piece) of ``Record`` protos."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2

    data, block, at, parts, history, exited = path.read_bytes(), 32768, 7, b"", {}, False
    assert data[:4] == b":W&B"
    while at + 7 <= len(data):
        if block - at % block < 7:  # a block's last bytes are padding
            at += block - at % block
            continue
        _, n, kind = struct.unpack("<IHB", data[at : at + 7])
        if at + 7 + n > len(data):  # a last record still being written (W&B's service writes it)
            break
        parts, at = parts + data[at + 7 : at + 7 + n], at + 7 + n
        if kind in (1, 4):
            record = wandb_internal_pb2.Record.FromString(parts)
            parts = b""
            exited = exited or record.WhichOneof("record_type") == "exit"
            items = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            if record.WhichOneof("record_type") == "history" and key in items:
                history[items["trainer/global_step"]] = items[key]
    return history, exited


@pytest.mark.parametrize("logger", ["csv", "tensorboard", "wandb"])
def test_each_logger_works_alone_and_holds_the_runs_metrics(tmp_path, cache_dir, monkeypatch, logger):
    """Each logger alone writes its files, and the ``objective/scores`` read back from each are
    the run's, one per iteration."""
    if logger == "wandb":
        monkeypatch.setenv("WANDB_MODE", "offline")
    cfg = compose_cfg(
        [*FAST, "trainer.max_steps=2", f"logger={logger}", "callbacks=none", "export_dir=null"], tmp_path, cache_dir
    )
    last = train(cfg)["objective/scores"]
    if logger == "csv":
        scores = [r["objective/scores"] for r in read_metrics(tmp_path / "metrics.csv")]
        assert len(scores) == 2 and scores[-1] == pytest.approx(last, rel=1e-6)
    if logger == "tensorboard":
        scores = _tensorboard_scalars(tmp_path / "tensorboard", "objective/scores")
        assert sorted(scores) == [0, 1] and scores[1] == pytest.approx(last, rel=1e-6)
    if logger == "wandb":
        runs = list((tmp_path / "wandb").glob("offline-run-*"))
        files = list(runs[0].glob("run-*.wandb")) if len(runs) == 1 else []
        assert len(files) == 1, runs
        scores = _wandb_history(files[0], "objective/scores")
        assert sorted(scores) == [0, 1] and scores[1] == pytest.approx(last, rel=1e-6)
        assert not (tmp_path / "metrics.csv").exists()


def _wrap_check(module, v0):
    """After normalisation the copied value head is on the normalised scale: gain * raw head."""
    fit = module._fit_reward_normalization

    def wrapped():
        fit()
        gain, _ = module.reward_norm
        torch.testing.assert_close(module.policy.v_head.weight, v0 * gain)

    return wrapped


def test_reward_normalisation_and_value_head_from_reward_model(tmp_path, cache_dir, tiny_rm_dir):
    from ppo_lightning.jobs.factory import build

    cfg = compose_cfg(
        [
            *FAST,
            "trainer.max_steps=1",
            "reward=model",
            f"reward.name_or_path={tiny_rm_dir}",
            "reward.normalize=true",
            "reward.normalize_samples=32",
            "model.value_head_init=reward_model",
            "data.batch_size=8",
            "ppo.minibatch_size=8",
            "ppo.ppo_epochs=1",
            "callbacks=none",
            "logger=csv",
            "export_dir=null",
        ],
        tmp_path,
        cache_dir,
    )
    module, datamodule, trainer = build(cfg)
    head = module.reward_fn.score_head().weight.detach().clone()
    assert torch.equal(module.policy.v_head.weight, head)  # before normalisation: gain 1, bias 0
    module.ppo_cfg.ppo_epochs = 1
    v0 = module.policy.v_head.weight.detach().clone()
    module._fit_reward_normalization = _wrap_check(module, v0)
    trainer.fit(module, datamodule=datamodule)
    gain, bias = module.reward_norm
    assert gain > 0
    # the fitted map sends the raw scores of reference samples to mean 0 / std 1
    g = torch.Generator().manual_seed(0)
    from ppo_lightning.generation.hf import generate

    batch = next(iter(datamodule.normalization_batches(32)))
    resp, mask = generate(
        module.ref_lm,
        batch["input_ids"],
        batch["attention_mask"],
        max_new_tokens=16,
        eos_token_id=module.tokenizer.eos_token_id,
        pad_token_id=module.tokenizer.pad_token_id,
        generator=g,
    )
    from ppo_lightning.rewards.base import decode_prompts_and_responses

    p, r = decode_prompts_and_responses(module.tokenizer, batch["input_ids"], resp, mask)
    scores = module.score(p, r)  # the raw scores through the fitted gain and bias
    torch.testing.assert_close(scores, module.reward_fn(p, r) * gain + bias)
    assert abs(float(scores.mean())) < 1.0 and 0.3 < float(scores.std()) < 3.0


def test_direct_clipping_matches_lightning_clip_gradients(tmp_path, cache_dir, monkeypatch):
    """On one fp32 device the module clips with ``clip_grad_norm_`` itself (one pass: clip and
    the finiteness check); the weights must equal those of Lightning's ``self.clip_gradients``."""
    from safetensors.torch import load_file

    from ppo_lightning.train.module import PPOModule

    orig = PPOModule.on_fit_start
    weights = {}
    for plain in (True, False):

        def on_fit_start(self, plain=plain):
            orig(self)
            assert self.runtime.plain_clipping  # what a CPU fp32 run gets
            self.runtime.plain_clipping = plain

        monkeypatch.setattr(PPOModule, "on_fit_start", on_fit_start)
        out = tmp_path / str(plain)
        cfg = compose_cfg(
            [
                *FAST,
                "trainer.max_steps=2",
                "ppo.max_grad_norm=0.01",
                "callbacks=none",
                "logger=none",
                f"export_dir={out / 'policy'}",
            ],
            out,
            cache_dir,
        )
        train(cfg)
        weights[plain] = load_file(str(out / "policy" / "model.safetensors"))
        # callbacks=none leaves Lightning's default checkpoint on: it lands in the run dir
        assert list((out / "checkpoints").glob("*.ckpt"))
    assert weights[True].keys() == weights[False].keys()
    for k in weights[True]:
        torch.testing.assert_close(weights[True][k], weights[False][k], atol=1e-6, rtol=0)


@pytest.mark.slow  # 35 iterations
def test_a_small_sparse_reward_learns_under_the_defaults(tmp_path, cache_dir):
    """A reward of small scale (the fraction of response characters from a rare set, ~0.01 on the
    initial policy) with every PPO key at its default: reward normalisation puts it on the scale
    the KL coefficient assumes, and it rises clearly (to ~0.7 in 35 iterations here). (Without
    normalisation it stays at ~0.01: the KL penalty is several times the score.)"""
    from ppo_lightning.config import ASSETS, PPOConfig

    cfg = compose_cfg(
        [
            "model=tiny",
            "data=file",
            f"data.path={ASSETS / 'toy_prompts.txt'}",
            "reward=function",
            "reward.fn=ppo_lightning.rewards.rules.char_fraction",
            "+reward.kwargs.chars=xyz",
            "trainer.max_steps=35",
            "logger=csv",
            "callbacks=none",
            "export_dir=null",
            "trainer.enable_checkpointing=false",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
        ],
        tmp_path,
        cache_dir,
        experiment=None,
    )
    assert OmegaConf.to_object(cfg.ppo) == PPOConfig() and cfg.reward.normalize
    train(cfg)
    raw = [r["objective/raw_scores"] for r in read_metrics(tmp_path / "metrics.csv")]
    first, last = sum(raw[:5]) / 5, sum(raw[-5:]) / 5
    assert first < 0.03, f"the reward should start small, at ~0.01: {first:.4f}"
    assert last >= first + 0.05 and last >= 1.5 * first, f"{first:.4f} -> {last:.4f}"


def test_a_batch_of_four_trains_with_the_default_minibatch_size(tmp_path, cache_dir):
    """``data.batch_size=4`` and no ``ppo.minibatch_size``: the update gets the resolved size (the
    whole rollout of 4 rows, one minibatch per epoch), and the run trains."""
    from ppo_lightning.jobs.factory import build_module

    cfg = compose_cfg(
        [*FAST, "trainer.max_steps=1", "data.batch_size=4", "callbacks=none", "export_dir=null"], tmp_path, cache_dir
    )
    assert cfg.ppo.minibatch_size is None
    module, _ = build_module(cfg)
    assert module.ppo_cfg.minibatch_size == module.algo.cfg.minibatch_size == 4
    m = train(cfg)
    assert m["policy/epochs"] == cfg.ppo.ppo_epochs and m["val/ratio"] > 0


def test_the_progress_bar_counts_iterations_out_of_max_steps_with_reward_and_kl(tmp_path, cache_dir, capfd):
    """One bar for the whole run, ``iteration 3/3``, with the last iteration's
    ``objective/scores`` and ``objective/kl``, across an epoch boundary (324 toy prompts make 2
    batches of 128): not Lightning's per-epoch bar, whose rich version reads ``Epoch 1/-2``."""
    cfg = compose_cfg(
        [
            "trainer.enable_model_summary=false",
            "sampling.max_new_tokens=4",
            "trainer.max_steps=3",
            "data.batch_size=128",
            "ppo.minibatch_size=64",
            "ppo.ppo_epochs=1",
            "callbacks=none",
            "logger=csv",
            "export_dir=null",
        ],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    out = capfd.readouterr().out
    states = [line.strip() for line in out.replace("\r", "\n").splitlines() if line.strip().startswith("iteration ")]
    assert states[0].startswith("iteration 0/3 |"), states
    final = states[-1]
    assert final.startswith("iteration 3/3 |") and "Epoch" not in out, states
    assert all(state.split()[1] in ("0/3", "1/3", "2/3", "3/3") for state in states), states  # one bar
    shown = dict(re.findall(r"(objective/\w+)=([-+.\de]+)", final))  # tqdm's 3 significant digits
    m = read_metrics(tmp_path / "metrics.csv")[-1]
    assert list(shown) == ["objective/scores", "objective/kl"] and "v_num" not in final, final
    for k, v in shown.items():
        assert float(v) == pytest.approx(m[k], rel=1e-2, abs=1e-3), (k, final)


def test_a_ppo_run_gets_the_iteration_bar_unless_it_brings_a_bar_or_shows_none(tmp_path, cache_dir):
    """``callbacks=none`` keeps the bar (it is the run's, not a callback group's); a progress
    bar of the user's own replaces it; ``trainer.enable_progress_bar=false`` shows none."""
    from lightning.pytorch.callbacks import TQDMProgressBar

    from ppo_lightning.jobs.trainer import build_trainer
    from ppo_lightning.train.callbacks import IterationProgressBar

    def bar(*overrides):
        cfg = compose_cfg(["logger=none", *overrides], tmp_path, cache_dir)
        return build_trainer(cfg, progress_bar=IterationProgressBar).progress_bar_callback

    assert type(bar()) is IterationProgressBar
    assert type(bar("callbacks=none")) is IterationProgressBar
    own = "+callbacks.bar._target_=lightning.pytorch.callbacks.TQDMProgressBar"
    assert type(bar("callbacks=none", own)) is TQDMProgressBar
    assert bar("trainer.enable_progress_bar=false") is None
