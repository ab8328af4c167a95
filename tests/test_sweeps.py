"""Hydra sweeps through ``train.py``: the Optuna search config, and a sweep that outlives a failing job."""

from __future__ import annotations

import math

import lightning as L
import pytest
import yaml

from tests.conftest import ROOT, read_metrics
from tests.helpers import run_train

pytestmark = pytest.mark.slow  # Hydra sweeps in subprocesses

# Two PPO iterations on the tiny model; metrics.csv only (no W&B run, no checkpoints, no export).
# experiment=tiny_char: the default job would build the reviews recipe's models first (minutes), or
# find them built by whichever test ran before.
TINY_RUN = [
    "experiment=tiny_char",
    "trainer.max_steps=2",
    "sampling.max_new_tokens=8",
    "data.batch_size=8",
    "ppo.minibatch_size=4",
    "ppo.ppo_epochs=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "trainer.enable_checkpointing=false",
    "logger=csv",
    "export_dir=null",
]


class CrashAtStep(L.Callback):
    """Raises a plain RuntimeError (not one of train.py's user errors) when iteration ``step`` starts."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        if trainer.global_step == self.step:
            raise RuntimeError(f"injected crash at iteration {self.step}")


def test_optuna_search_runs_trials_and_writes_the_best(cache_dir, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason='needs pip install -e ".[optuna]"')
    p = run_train(
        ["hparams_search=ppo_optuna", "hydra.sweeper.n_trials=2", *TINY_RUN, f"hydra.sweep.dir={tmp_path}"], cache_dir
    )
    assert p.returncode == 0, p.stderr[-3000:]

    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    searched = yaml.safe_load((ROOT / "conf/hparams_search/ppo_optuna.yaml").read_text())["hydra"]["sweeper"]["params"]
    assert set(results["best_params"]) == set(searched)
    assert 0.1 <= results["best_params"]["ppo.clip"] <= 0.3
    assert math.isfinite(results["best_value"])

    last = []  # each trial's last objective/rlhf_reward: what train.py returned to the sweeper
    clips = []
    for trial in ("0", "1"):
        rows = read_metrics(tmp_path / trial / "metrics.csv")
        assert len(rows) == 2
        last.append(rows[-1]["objective/rlhf_reward"])
        clips.append(yaml.safe_load((tmp_path / trial / ".hydra" / "config.yaml").read_text())["ppo"]["clip"])
    assert results["best_value"] == pytest.approx(max(last), rel=1e-5)  # maximised the named metric
    assert clips[0] != clips[1]  # the sampler set the trial's parameters


def test_optuna_search_goes_on_after_a_failed_trial(cache_dir, tmp_path):
    pytest.importorskip("hydra_plugins.hydra_optuna_sweeper", reason='needs pip install -e ".[optuna]"')
    # ppo.clip=-1 fails validation (in milliseconds); with this seed the sampler draws it for
    # trials 0-2 and 0.2 for trial 3.
    p = run_train(
        [
            "hparams_search=ppo_optuna",
            "hydra.sweeper.n_trials=4",
            "hydra.sweeper.sampler.seed=1234",
            "ppo.clip=choice(0.2,-1)",
            *TINY_RUN,
            f"hydra.sweep.dir={tmp_path}",
        ],
        cache_dir,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    clips = [
        yaml.safe_load((tmp_path / str(t) / ".hydra" / "config.yaml").read_text())["ppo"]["clip"] for t in range(4)
    ]
    assert -1 in clips and 0.2 in clips, clips
    for t, clip in enumerate(clips):
        if clip == -1:
            assert "ppo.clip=-1.0: must be > 0" in (tmp_path / str(t) / "train.log").read_text()
    results = yaml.safe_load((tmp_path / "optimization_results.yaml").read_text())
    assert results["best_params"]["ppo.clip"] == 0.2 and math.isfinite(results["best_value"])


def test_sweep_goes_on_after_failing_jobs(cache_dir, tmp_path):
    # 4 jobs, in this order: (clip=-1, step=1) and (clip=-1, step=100) fail validation with a
    # ConfigError; (clip=0.2, step=1) crashes with a RuntimeError in the middle of Trainer.fit;
    # (clip=0.2, step=100) never meets the crash and must train normally in the same process.
    p = run_train(
        [
            "-m",
            "ppo.clip=-1,0.2",
            "+callbacks.crash._target_=tests.test_sweeps.CrashAtStep",
            "+callbacks.crash.step=1,100",
            *TINY_RUN,
            f"hydra.sweep.dir={tmp_path}",
        ],
        cache_dir,
    )
    assert p.returncode == 0, p.stderr[-3000:]

    for job in ("0", "1"):
        log = (tmp_path / job / "train.log").read_text()
        assert "ppo.clip=-1.0: must be > 0" in log, log
        assert not (tmp_path / job / "metrics.csv").exists()  # stopped before any model loaded
    log = (tmp_path / "2" / "train.log").read_text()
    assert "job 2 failed; the sweep goes on" in log and "injected crash at iteration 1" in log, log
    assert "Traceback" in log  # an unexpected error keeps its traceback in the job's log

    rows = [r for r in read_metrics(tmp_path / "3" / "metrics.csv") if "lr" in r]  # iterations, not evals
    assert len(rows) == 2 and math.isfinite(rows[-1]["objective/scores"])
    assert "failed" not in (tmp_path / "3" / "train.log").read_text()
