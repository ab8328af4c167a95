"""Callbacks the tests inject through Hydra (``+callbacks.<name>._target_=tests.helpers.X``)."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch


class SaveRankWeights(L.Callback):
    """At the end of fit, every rank writes its policy weights to ``<dir>/rank<k>.pt``."""

    def __init__(self, dir: str):
        self.dir = Path(dir)

    def on_train_end(self, trainer, pl_module) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().cpu().clone() for k, v in pl_module.policy.state_dict().items()}
        torch.save(state, self.dir / f"rank{trainer.global_rank}.pt")
