"""Kill, stop and full-disk runs and their resumes, with one of ``SWITCHES`` (LoRA, DDP, FSDP,
episodes, a schedule): the checks that ``test_reliability.py`` (one process) and
``test_reliability_distributed.py`` (two) run, split in two files so that the two pytest workers
share them. The uninterrupted run of each switch is run once per worker and shared.

Runs whose stop is what ``train.py`` reports (SIGTERM: exit 143 and the resume command; a full
disk: one error line) start ``train.py`` (``run_train``); the uninterrupted, SIGKILLed and resumed
runs fork their ranks from the test process (``run_ranks``): a SIGKILL ends every rank's process
as it would a torchrun job's."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import read_metrics
from tests.helpers import run_ranks, run_train, wall_clock

FAST = [
    "experiment=tiny_char",
    "data.batch_size=8",
    "ppo.minibatch_size=4",
    "ppo.ppo_epochs=2",
    "sampling.max_new_tokens=8",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


SWITCHES = {
    "full": [],
    "ddp_cpu": ["trainer=ddp_cpu"],
    "fsdp_cpu": ["trainer=fsdp_cpu"],
    "lora_fsdp_cpu": ["model.lora.r=4", "trainer=fsdp_cpu"],
    # sharded checkpoints: each rank writes its shards (torch.distributed.checkpoint), a directory
    "dcp_fsdp_cpu": ["trainer=fsdp_cpu", "+trainer.strategy.save_distributed_checkpoint=true"],
    # the state a resume must carry besides the weights, at once: LoRA's adapters (the frozen base
    # is rebuilt from its source), the LR schedule's step and the adaptive KL controller's beta (a
    # target the run's KL misses, so beta moves every iteration), and two-turn episodes (the
    # environment answers the first turn)
    "lora_schedule_episodes": [
        "model.lora.r=4",
        "optimizer.scheduler=cosine",
        "optimizer.warmup_steps=2",
        "optimizer.min_lr_ratio=0.1",
        "ppo.adaptive_kl=true",
        "ppo.kl_target=0.01",
        "ppo.kl_horizon=100",
        "env=function",
        "env._target_=tests.multiturn.Echo",
        "+env.turns=2",
        "env.max_total_tokens=48",
    ],
    # a sampler two updates behind the policy (rollout.staleness: its copy, versions and waiting
    # snapshots are in the checkpoint), on two-turn episodes (each turn's behaviour logprobs)
    "staleness_episodes": [
        "rollout.staleness=2",
        "env=function",
        "env._target_=tests.multiturn.Echo",
        "+env.turns=2",
        "env.max_total_tokens=48",
    ],
    # tool calling under DDP (the tools' JSON schemas in the prompt; a parser that reads a call, a
    # malformed call or a failing call into the random policy's turns)
    "env_tools_ddp_cpu": [
        "env=tools",
        "env.tools=[ppo_lightning.envs.calculator.calculator]",
        "env.parser=tests.multiturn.EveryTurnCalls",
        "data.max_prompt_length=360",
        "model.name_or_path=${paths.cache_dir}/tiny-gpt2-p768",
        "model.build_tiny.n_positions=768",
        "env.max_total_tokens=48",
        "trainer=ddp_cpu",
    ],
}
SAME_TRAJECTORY = {"dcp_fsdp_cpu": "fsdp_cpu"}
"""Switches that train exactly as another (sharded checkpoints change how a checkpoint is written,
not the run): their resumes are checked against that switch's uninterrupted run."""
_UNINTERRUPTED: dict[str, dict[int, dict[str, float]]] = {}


def checkpoint_step(path) -> int:
    """The iterations a checkpoint holds: a file, or a sharded checkpoint's directory (its
    ``meta.pt`` holds what is not sharded)."""
    return torch.load(path / "meta.pt" if path.is_dir() else path, weights_only=True)["global_step"]


def interruptible(switch: str) -> list[str]:
    """An 8-iteration run that checkpoints every 3 iterations, with one of the SWITCHES."""
    return [
        *FAST,
        "trainer.max_steps=8",
        "callbacks.model_checkpoint.every_n_train_steps=3",
        "callbacks.best_checkpoint.every_n_train_steps=3",
        "export_dir=null",
        *SWITCHES[switch],
    ]


def uninterrupted(switch: str, tmp_path_factory, cache_dir) -> dict[int, dict[str, float]]:
    """Metrics by iteration of the run nothing stops (run once per switch, shared by the tests)."""
    switch = SAME_TRAJECTORY.get(switch, switch)
    if switch not in _UNINTERRUPTED:
        run_dir = tmp_path_factory.mktemp(f"uninterrupted_{switch}")
        p = run_ranks([*interruptible(switch), f"hydra.run.dir={run_dir}"], cache_dir)
        assert p.returncode == 0, p.stderr[-3000:]
        _UNINTERRUPTED[switch] = {int(r["step"]): r for r in read_metrics(run_dir / "metrics.csv")}
    return _UNINTERRUPTED[switch]


def assert_resume_replays(switch: str, last, run_dir, expected: dict, first_step: int, cache_dir) -> None:
    """Resuming from ``last`` gives the uninterrupted run's metrics from ``first_step`` on. (The
    stop happened to ``train.py`` itself; the resume is the same command with ``ckpt_path``, its
    processes forked from the test's, which never ran this job: all it knows comes from ``last``.)"""
    resumed = run_ranks([*interruptible(switch), f"hydra.run.dir={run_dir}", f"ckpt_path={last}"], cache_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    got = {int(r["step"]): r for r in read_metrics(run_dir / "metrics.csv")}
    assert sorted(got) == list(range(first_step, 8))
    for step, row in got.items():
        for k, v in row.items():
            if wall_clock(k):
                continue
            assert v == pytest.approx(expected[step][k], rel=1e-5, abs=1e-6), (step, k)


def sigkill_then_resume_replays_the_uninterrupted_trajectory(tmp_path, tmp_path_factory, cache_dir, switch):
    """With LoRA the checkpoint holds only the adapters, the value head and their optimizer state;
    the frozen base is rebuilt from its source. With two processes every rank is killed, and the
    checkpoint holds every rank's sampling stream (FSDP: the gathered full state, restored after
    the strategy's setup). The trajectory is the same in each case."""
    expected, overrides = uninterrupted(switch, tmp_path_factory, cache_dir), SWITCHES[switch]
    if "ppo.adaptive_kl=true" in overrides:  # lr and beta move every iteration, so the replay checks them
        lrs, betas = ([expected[k][key] for k in sorted(expected)] for key in ("lr", "objective/kl_coef"))
        assert len(set(lrs)) == len(lrs) and len(set(betas)) == len(betas), (lrs, betas)
    if any(o.startswith("env=") for o in overrides):  # the episodes had several turns (and called tools)
        assert all(row["env/turns_mean"] > 1 for row in expected.values())
        assert "env=tools" not in overrides or sum(row["env/tool_calls_mean"] for row in expected.values()) > 0
    if any(o.startswith("rollout.staleness=") for o in overrides):  # sampled two updates back
        assert [expected[k]["rollout/staleness_max"] for k in sorted(expected)] == [0, 1] + [2] * 6
    killed = run_ranks(
        [
            *interruptible(switch),
            f"hydra.run.dir={tmp_path / 'killed'}",
            "+callbacks.kill._target_=tests.helpers.KillAtStep",
            "+callbacks.kill.step=5",
        ],
        cache_dir,
    )
    assert killed.returncode == -9  # SIGKILL, mid-training
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 3  # the checkpoint before the kill
    assert not list(last.parent.glob("*.tmp"))  # no half-written file left behind
    assert_resume_replays(switch, last, tmp_path / "resumed", expected, 3, cache_dir)


def sigterm_checkpoints_the_iteration_exits_143_and_resumes(tmp_path, tmp_path_factory, cache_dir, switch):
    """A cluster's preemption: SIGTERM reaches rank 0 as iteration 4 starts. The iteration ends,
    every rank agrees to stop, ``last.ckpt`` is written after iteration 4 (not the periodic one
    from iteration 2), the job exits 143 with the command that resumes, and the resumed run
    replays the uninterrupted trajectory from iteration 5. (Sharded, with LoRA: the checkpoint
    holds only the adapters' and value head's gathered state, placed back into shards.)"""
    expected = uninterrupted(switch, tmp_path_factory, cache_dir)
    run_dir = tmp_path / "stopped"
    stopped = run_train(
        [
            *interruptible(switch),
            f"hydra.run.dir={run_dir}",
            "+callbacks.term._target_=tests.helpers.SigtermAtStep",
            "+callbacks.term.step=4",
        ],
        cache_dir,
    )
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    last = run_dir / "checkpoints" / "last.ckpt"
    assert checkpoint_step(last) == 5  # nothing trained is lost
    assert [int(r["step"]) for r in read_metrics(run_dir / "metrics.csv")] == [0, 1, 2, 3, 4]  # stopped there
    hint = [line for line in stopped.stderr.splitlines() if line.startswith("stopped by SIGTERM")]
    assert len(hint) == 1, stopped.stderr[-3000:]  # one line, not one per rank
    assert "after PPO iteration 4" in hint[0] and f"ckpt_path={last.resolve()}" in hint[0]
    assert not list(last.parent.glob("*.tmp"))
    assert_resume_replays(switch, last, tmp_path / "resumed", expected, 5, cache_dir)


def a_full_disk_stops_every_rank_with_one_line_and_the_run_resumes(tmp_path, tmp_path_factory, cache_dir, switch):
    """The disk fills during the checkpoint after iteration 6 (every write from iteration 4 on
    fails with ENOSPC part-way, as a full filesystem does). Every rank stops at once with exit
    status 1 and one line: what failed, the last good checkpoint (``last.ckpt`` after 3
    iterations, untouched) and the command that resumes; no traceback, no temporary file. The
    resumed run replays the uninterrupted trajectory (on one process, and from a sharded
    checkpoint; resuming under ddp_cpu and fsdp_cpu from a ``last.ckpt`` file is what the SIGKILL
    and SIGTERM tests check)."""
    run_dir = tmp_path / "full"
    p = run_train(
        [
            *interruptible(switch),
            f"hydra.run.dir={run_dir}",
            "+callbacks.full._target_=tests.helpers.DiskFullFromStep",
            "+callbacks.full.step=4",
        ],
        cache_dir,
        timeout=300,
    )
    assert p.returncode == 1, p.stderr[-3000:]
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    lines = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, p.stderr[-3000:]  # one line, not one per rank
    last = run_dir / "checkpoints" / "last.ckpt"
    assert lines[0].startswith(f"error: No space left on device writing checkpoint {run_dir / 'checkpoints'}")
    assert f"the last good checkpoint is {last} (after 3 iterations)" in lines[0]
    assert f"ckpt_path={last.resolve()}" in lines[0]
    assert checkpoint_step(last) == 3
    assert not list(last.parent.glob("*.tmp"))
    if switch in ("full", "dcp_fsdp_cpu"):  # a full-state checkpoint, and a sharded one
        assert_resume_replays(
            switch, last, tmp_path / "resumed", uninterrupted(switch, tmp_path_factory, cache_dir), 3, cache_dir
        )
