"""Nothing lost: exact resume after SIGKILL, export, non-finite guard, and bad input caught early."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.conftest import compose_cfg, read_metrics
from tests.helpers import cpu_seconds, cpu_seconds_of_children, run_train
from tests.resume import (
    a_full_disk_stops_every_rank_with_one_line_and_the_run_resumes,
    FAST,
    sigkill_then_resume_replays_the_uninterrupted_trajectory,
    sigterm_checkpoints_the_iteration_exits_143_and_resumes,
)


@pytest.mark.slow  # runs in subprocesses, one of them killed
@pytest.mark.parametrize("switch", ["full", "lora_schedule_episodes", "staleness_episodes"])
def test_sigkill_then_resume_replays_the_uninterrupted_trajectory(tmp_path, tmp_path_factory, cache_dir, switch):
    sigkill_then_resume_replays_the_uninterrupted_trajectory(tmp_path, tmp_path_factory, cache_dir, switch)


@pytest.mark.slow  # runs in subprocesses
@pytest.mark.parametrize("switch", ["full"])
def test_sigterm_checkpoints_the_iteration_exits_143_and_resumes(tmp_path, tmp_path_factory, cache_dir, switch):
    sigterm_checkpoints_the_iteration_exits_143_and_resumes(tmp_path, tmp_path_factory, cache_dir, switch)


@pytest.mark.slow  # runs in subprocesses
@pytest.mark.parametrize("switch", ["full"])
def test_a_full_disk_stops_every_rank_with_one_line_and_the_run_resumes(tmp_path, tmp_path_factory, cache_dir, switch):
    a_full_disk_stops_every_rank_with_one_line_and_the_run_resumes(tmp_path, tmp_path_factory, cache_dir, switch)


def _one_error_line_naming_the_checkpoint(p, run_dir, iterations: int) -> str:
    """The run stopped with exit status 1 and one ``error:`` line, no traceback; the line names
    ``last.ckpt`` (after ``iterations``, which it holds) and the command that resumes from it."""
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, p.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert f"the last good checkpoint is {last} (after {iterations} iterations)" in lines[0]
    assert f"ckpt_path={last.resolve()}" in lines[0]
    assert torch.load(last, weights_only=True)["global_step"] == iterations
    return lines[0]


@pytest.mark.slow  # a subprocess that must exit 1
def test_a_full_disk_under_metrics_csv_stops_with_one_line_and_keeps_the_checkpoint(tmp_path, cache_dir):
    """Not only checkpoints: when the CSV logger's write of ``metrics.csv`` fails for a full disk
    (its flush after iteration 10; the checkpoint after 9 was written), the run stops with exit
    status 1 and one line, the cause, where, the last good checkpoint and the command that resumes
    (``parallel.checkpoint.full_disk_error``), and no traceback."""
    run_dir = tmp_path / "run"
    p = run_train(
        [
            *FAST,
            "trainer.max_steps=12",
            "callbacks.model_checkpoint.every_n_train_steps=3",
            "export_dir=null",
            f"hydra.run.dir={run_dir}",
            "+callbacks.full._target_=tests.helpers.MetricsDiskFullFromStep",
            "+callbacks.full.step=5",
        ],
        cache_dir,
    )
    line = _one_error_line_naming_the_checkpoint(p, run_dir, iterations=9)
    assert line.startswith(f"error: No space left on device writing the run's outputs under {run_dir}")


@pytest.fixture
def small_disk(tmp_path):
    """A 16 MiB tmpfs mounted at a fresh directory (unmounted after the test): a real file system
    that fills up. Mounting needs root (CAP_SYS_ADMIN); elsewhere the test is skipped."""
    import subprocess

    mnt = tmp_path / "small_disk"
    mnt.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m", "tmpfs", str(mnt)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {p.stderr.strip()}")
    yield mnt
    subprocess.run(["umount", "-l", str(mnt)], check=True)


@pytest.mark.slow  # a subprocess that must exit 1
def test_a_full_disk_under_wandb_stops_with_one_line_and_keeps_the_checkpoint(tmp_path, cache_dir, small_disk):
    """W&B's own process writes its run files and drops, in silence, each record a full disk
    refuses. With W&B's directory on a small real file system that fills up before iteration 5,
    the run stops at that iteration's log with exit status 1 and one line: the cause, W&B's
    directory, the last good checkpoint (after 3 iterations, on another disk) and the command
    that resumes (``loggers.FreeSpaceCheckedWandbLogger``)."""
    run_dir = tmp_path / "run"
    p = run_train(
        [
            *FAST,
            "trainer.max_steps=8",
            "callbacks.model_checkpoint.every_n_train_steps=3",
            "export_dir=null",
            f"hydra.run.dir={run_dir}",
            "logger=default",
            "logger.wandb.mode=offline",
            f"logger.wandb.save_dir={small_disk}",
            "+callbacks.full._target_=tests.helpers.FillDiskFromStep",
            f"+callbacks.full.path={small_disk}",
            "+callbacks.full.step=4",
        ],
        cache_dir,
    )
    line = _one_error_line_naming_the_checkpoint(p, run_dir, iterations=3)
    assert line.startswith("error: No space left on device (")
    assert f"writing W&B's run files under {small_disk}/wandb/offline-run-" in line


def test_a_failed_checkpoint_write_names_the_file_and_keeps_the_previous_one(tmp_path):
    """``AtomicCheckpointIO``: a write that runs out of space part-way raises
    ``CheckpointWriteError`` with the operating system's reason (torch's own error, a zip-writer
    ``RuntimeError``, only carries it in its context), the file already at the path is intact
    and no temporary file is left. An error that is no ``OSError`` passes through as it is."""
    from ppo_lightning.parallel.checkpoint import AtomicCheckpointIO, CheckpointWriteError
    from tests.helpers import FullDisk

    io, path = AtomicCheckpointIO(), tmp_path / "last.ckpt"
    io.save_checkpoint({"global_step": 3, "w": torch.ones(10)}, path)
    write = io._write
    io._write = lambda checkpoint, f: write(checkpoint, FullDisk(f, room=1000))
    with pytest.raises(CheckpointWriteError, match=f"^No space left on device writing checkpoint {path}") as e:
        io.save_checkpoint({"global_step": 6, "w": torch.zeros(100000)}, path)
    assert isinstance(e.value.__cause__, RuntimeError)  # what torch raised
    assert torch.load(path, weights_only=True)["global_step"] == 3
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]
    io._write = lambda checkpoint, f: (_ for _ in ()).throw(TypeError("not a checkpoint"))
    with pytest.raises(TypeError, match="not a checkpoint"):
        io.save_checkpoint({}, path)


@pytest.mark.slow
def test_sigterm_from_outside_stops_a_long_run_at_the_iteration_it_is_in(tmp_path, cache_dir):
    """The measured failure: ``experiment=tiny_char trainer.max_steps=2000``, SIGTERM from outside
    mid-PPO. The run stops at the end of the iteration it is in, exits non-zero, and its
    checkpoint holds every iteration it logged (before, ``last.ckpt`` was the periodic one and the
    exit status 0). "Stops promptly" is counted in iterations, not seconds, so that it holds on a
    loaded machine: a few past those logged when the signal went, not the remaining ~1990."""
    import signal
    import time

    from tests.helpers import start_train

    proc = start_train([*FAST, "trainer.max_steps=2000", "export_dir=null", f"hydra.run.dir={tmp_path}"], cache_dir)
    metrics = tmp_path / "metrics.csv"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) > 12):  # header + 12 iterations
        assert proc.poll() is None and time.monotonic() < deadline, "the run ended before it could be stopped"
        time.sleep(0.2)
    seen = len(read_metrics(metrics))
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=600)  # a generous bound: only the iteration count is strict
    assert proc.returncode == 143, stderr[-3000:]
    logged = len(read_metrics(metrics))
    # the CSV logger writes every 10 iterations: up to 9 done but unwritten when the signal went,
    # then the one it stopped in, and one more where the signal landed between two iterations
    assert seen <= logged <= seen + 11, (seen, logged)
    assert torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["global_step"] == logged


@pytest.mark.slow
def test_sigterm_during_the_recipe_build_leaves_no_temporary_directory(tmp_path):
    """The measured failure: SIGTERM while the default job builds its recipe left
    ``reviews-<key>.tmp-*`` in the cache. Now the build's ``finally`` removes it, and the job exits
    143 at once, saying that no checkpoint was written. "At once" is the CPU time the job spends
    after the signal, which a loaded machine does not stretch as it stretches seconds: unwinding
    and removing the directory, not finishing the build step (SFT alone is tens of CPU seconds)."""
    import signal
    import time

    from tests.helpers import start_train

    cache = tmp_path / "cache"
    before = cpu_seconds_of_children()
    proc = start_train([f"paths.cache_dir={cache}", f"hydra.run.dir={tmp_path / 'run'}"], None)
    deadline = time.monotonic() + 600
    while not list(cache.glob("*.tmp-*")):
        assert proc.poll() is None and time.monotonic() < deadline, "the build never started"
        time.sleep(0.1)
    time.sleep(3)  # inside a build step
    at_signal = cpu_seconds(proc.pid)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=600)  # a generous bound: the CPU time below is the check
    assert proc.returncode == 143, stderr[-3000:]
    after_signal = cpu_seconds_of_children() - before - at_signal
    assert after_signal < 10, f"{after_signal:.1f} CPU seconds after SIGTERM"
    assert list(cache.iterdir()) == [], list(cache.iterdir())
    assert "stopped by SIGTERM. No checkpoint was written at the stop" in stderr


def test_sigterm_outside_training_raises_where_the_program_is_and_cleans_up(tmp_path):
    """Outside PPO training SIGTERM raises ``Preempted`` at once: a recipe build's ``finally``
    removes its temporary directory, and no cache entry claims to be done."""
    import signal
    import time

    from omegaconf import OmegaConf

    from ppo_lightning.jobs.recipe import prepare
    from ppo_lightning.parallel.preemption import Preempted, handle_sigterm

    class Interrupted:  # a recipe whose build a SIGTERM stops
        finished_step = False

        def build(self, cfg, tmp):
            (tmp / "half_written.bin").write_bytes(b"0" * 1024)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)  # a long build step, interrupted
            Interrupted.finished_step = True  # reached only when the signal waited for the step

    cfg = OmegaConf.create({"paths": {"cache_dir": str(tmp_path)}, "recipe": "arithmetic", "seed": 0})
    before = signal.getsignal(signal.SIGTERM)
    with handle_sigterm(), pytest.raises(Preempted):
        prepare(Interrupted(), cfg)
    assert not Interrupted.finished_step  # raised inside the step, not after it: an order, not seconds
    assert list(tmp_path.iterdir()) == []  # neither the temporary directory nor a half cache
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is the job's only


def test_export_loads_in_plain_transformers_and_generates_the_same_tokens(tmp_path, cache_dir):
    from ppo_lightning.generation.hf import generate
    from ppo_lightning.jobs.factory import build
    from ppo_lightning.jobs.run import export, train
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = compose_cfg(
        [*FAST, "trainer.max_steps=4", "callbacks.model_checkpoint.every_n_train_steps=4"], tmp_path, cache_dir
    )
    train(cfg)
    # on demand, from the checkpoint, into a second directory
    cfg2 = compose_cfg(
        [
            *FAST,
            "task=export",
            f"ckpt_path={tmp_path / 'checkpoints' / 'last.ckpt'}",
            f"export_dir={tmp_path / 'exported2'}",
        ],
        tmp_path / "export_run",
        cache_dir,
    )
    export(cfg2)
    for d in ("policy", "exported2"):
        directory = tmp_path / d
        assert (directory / "model.safetensors").exists() and (directory / "generation_config.json").exists()
        hf = AutoModelForCausalLM.from_pretrained(directory)  # no project code involved
        tok = AutoTokenizer.from_pretrained(directory)
        enc = tok(["the cat walks", "a dog"], return_tensors="pt", padding=True)
        out = hf.generate(**enc, do_sample=False, max_new_tokens=12, min_new_tokens=12, pad_token_id=tok.pad_token_id)
        # the trained weights, loaded back through the project's own path
        module, _, _ = build(
            compose_cfg(
                [
                    *FAST,
                    f"model.name_or_path={directory}",
                    "model.build_tiny=null",
                    f"model.value_head_path={directory}",
                ],
                tmp_path / "reload",
                cache_dir,
            )
        )
        ours, _ = generate(
            module.policy.lm,
            enc.input_ids,
            enc.attention_mask,
            max_new_tokens=12,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            greedy=True,
            stop_at_eos=False,
        )
        assert torch.equal(out[:, enc.input_ids.shape[1] :], ours)
    # the value head reloads into a new run
    ckpt = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert torch.equal(module.policy.v_head.weight, ckpt["policy.v_head.weight"])
    assert module.policy.v_head.weight.abs().sum() > 0  # trained, not the zero init


def test_nan_rewards_skip_those_steps_and_count_them(tmp_path, cache_dir):
    from ppo_lightning.jobs.run import train

    cfg = compose_cfg(
        [*FAST, "trainer.max_steps=6", "reward=function", "reward.fn=tests.helpers.nan_on_odd_calls", "callbacks=none"],
        tmp_path,
        cache_dir,
    )
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
    p = run_train(
        [
            *FAST,
            "trainer.max_steps=8",
            "reward=function",
            "reward.fn=tests.helpers.always_nan",
            "reward.normalize=false",
            "callbacks.model_checkpoint.every_n_train_steps=1",
            f"hydra.run.dir={tmp_path}",
        ],
        cache_dir,
    )
    assert p.returncode == 1
    assert "3 PPO iterations in a row had non-finite values" in p.stderr
    assert "reward nan for prompt" in p.stderr and "ppo.max_nonfinite_iterations" in p.stderr
    assert "Traceback" not in p.stderr
    state = torch.load(tmp_path / "checkpoints" / "last.ckpt", weights_only=True)
    assert all(torch.isfinite(v).all() for v in state["state_dict"].values())
