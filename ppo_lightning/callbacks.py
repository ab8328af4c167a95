"""Callbacks for PPO runs."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import WandbLogger

from ppo_lightning.rollout import decode_prompts_and_responses


class SampleTable(L.Callback):
    """Every ``every_n_steps`` PPO iterations, record prompts, responses and scores.

    Rows go to ``<dirpath>/samples.jsonl`` (one JSON object per sample, with the iteration) and,
    when a W&B logger is attached, to a W&B table ``samples`` at that step. Seeing what the policy
    writes is the first check against reward hacking.
    """

    def __init__(self, dirpath: str, every_n_steps: int = 10, n_samples: int = 4):
        self.path = Path(dirpath) / "samples.jsonl"
        self.every_n_steps, self.n_samples = every_n_steps, n_samples

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        step = trainer.global_step - 1  # the iteration that just finished
        r = pl_module.rollout
        if r is None or step % self.every_n_steps != 0 or not trainer.is_global_zero:
            return
        n = min(self.n_samples, r.batch_size)
        prompts, responses = decode_prompts_and_responses(
            pl_module.tokenizer, r.query_responses[:n, : r.context_length], r.responses[:n], r.response_mask[:n]
        )
        scores = r.scores[:n].tolist()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for p, resp, s in zip(prompts, responses, scores):
                f.write(json.dumps({"step": step, "prompt": p, "response": resp, "score": s}) + "\n")
        for lg in trainer.loggers:
            if isinstance(lg, WandbLogger):
                lg.log_table(
                    key="samples",
                    columns=["step", "prompt", "response", "score"],
                    data=[[step, p, resp, s] for p, resp, s in zip(prompts, responses, scores)],
                    step=step,
                )
