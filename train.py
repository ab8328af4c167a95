"""Entry point: ``python train.py [group=choice ...] [key=value ...]``.

Hydra composes ``conf/train.yaml`` with the chosen groups and overrides, validates them against
the schemas in ``ppo_lightning/config.py`` and calls ``ppo_lightning.train.train``. Returns the
``optimized_metric`` for Hydra sweepers. Bad input prints one short message and exits 1
(``HYDRA_FULL_ERROR=1`` shows the full traceback).
"""

from __future__ import annotations

import logging
import os
import sys

import hydra
from omegaconf import DictConfig

import ppo_lightning.config  # noqa: F401  (registers the schemas before Hydra composes)
from ppo_lightning.errors import ConfigError
from ppo_lightning.module import NonFiniteError
from ppo_lightning.rewards import RewardError

log = logging.getLogger("ppo_lightning")


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    from ppo_lightning.train import export, train

    try:
        if cfg.task.name == "export":
            export(cfg)
            return None
        metrics = train(cfg)
    except (ConfigError, RewardError, NonFiniteError) as e:
        if os.environ.get("HYDRA_FULL_ERROR") == "1":
            raise
        log.error("%s", e)
        print(f"error: {e}", file=sys.stderr)
        sys.exit(1)
    return metrics.get(cfg.optimized_metric)


if __name__ == "__main__":
    main()
