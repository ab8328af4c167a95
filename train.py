"""Entry point: ``python train.py [group=choice ...] [key=value ...]``.

Hydra composes ``conf/train.yaml`` with the chosen groups and overrides, validates them against
the schemas in ``ppo_lightning/config/`` (one module per group) and runs the job ``task=`` chose.
Returns the ``optimized_metric`` for Hydra sweepers. Bad input prints one short message and exits 1
(``HYDRA_FULL_ERROR=1`` shows the full traceback). In a sweep (``-m``) a failing job is logged
and returns no value (Optuna records the trial as failed), and the sweep goes on with the next.
SIGTERM (a cluster's preemption) stops the job, and a sweep, with exit status 143 and one line
naming the command that resumes (``ppo_lightning/parallel/preemption.py``).
"""

from __future__ import annotations

import logging
import math
import os
import shlex
import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

# Only the config (no torch) at the top: --help, --cfg job and an override Hydra refuses answer in
# a second or two; the training stack (torch, Lightning, transformers) loads in main.
import ppo_lightning.config  # noqa: F401  (registers the schemas before Hydra composes)
from ppo_lightning.config.rules import check_sweep_launch
from ppo_lightning.config.errors import ConfigError

log = logging.getLogger("ppo_lightning")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    in_sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    try:
        if in_sweep:
            check_sweep_launch(cfg)  # before the sweep's first job builds anything
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    from ppo_lightning.jobs.run import run_task
    from ppo_lightning.parallel.checkpoint import OutputWriteError
    from ppo_lightning.parallel.preemption import EXIT_STATUS, Preempted
    from ppo_lightning.envs import EnvError
    from ppo_lightning.rewards import RewardError
    from ppo_lightning.train.loggers import finish_wandb
    from ppo_lightning.train.module import NonFiniteError

    user_errors = (ConfigError, RewardError, EnvError, NonFiniteError, OutputWriteError)
    try:
        metrics = run_task(cfg)
    except Preempted as e:
        finish_wandb(exit_code=EXIT_STATUS)
        if _rank() == 0:  # one line per job, not per process
            print(f"{e}. {_resume_hint(e.checkpoint)}", file=sys.stderr, flush=True)
        sys.exit(EXIT_STATUS)
    except user_errors as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.error("%s", e)
        if in_sweep:
            finish_wandb(exit_code=1)
            return None
        if not isinstance(e, OutputWriteError):
            print(f"error: {e}", file=sys.stderr)
        elif _rank() == 0:  # every rank stops with it: one line per job; make space, then resume
            print(f"error: {e}. {_resume_hint(e.checkpoint, without='Run the same command again')}", file=sys.stderr)
        sys.exit(1)
    except Exception:
        if not in_sweep:
            raise
        log.exception("job %s failed; the sweep goes on", HydraConfig.get().job.num)
        finish_wandb(exit_code=1)
        return None
    value = metrics.get(cfg.optimized_metric)
    if value is None and metrics:
        log.warning("optimized_metric=%r was not logged; known: %s", cfg.optimized_metric, sorted(metrics))
    if value is not None and not math.isfinite(value):
        return None  # a sweeper cannot rank NaN; the trial counts as failed
    return value


def _resume_hint(checkpoint, without: str = "No checkpoint was written at the stop; run the same command again") -> str:
    """The command that resumes this job from ``checkpoint`` (``without`` when there is none)."""
    if checkpoint is None:
        return without
    overrides = [o for o in HydraConfig.get().overrides.task if not o.startswith("ckpt_path=")]
    args = [*overrides, f"ckpt_path={checkpoint.resolve()}"]
    return "Resume with: python train.py " + " ".join(shlex.quote(a) for a in args)


def _rank() -> int:
    from lightning.pytorch.utilities import rank_zero_only

    return rank_zero_only.rank


if __name__ == "__main__":
    main()
