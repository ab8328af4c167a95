"""Callbacks for PPO runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import TQDMProgressBar
from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm
from lightning.pytorch.loggers import WandbLogger

from ppo_lightning.envs.template import conversation_text
from ppo_lightning.rewards.base import decode_prompts_and_responses
from ppo_lightning.train.metrics import PROGRESS_BAR_METRICS


class IterationProgressBar(TQDMProgressBar):
    """One bar for the whole PPO run: iterations out of ``trainer.max_steps``, with the last
    iteration's reward and KL, ``iteration 3/100 |███| [..., objective/scores=0.412, objective/kl=0.0213]``.

    Lightning's bars count batches per epoch and name the epoch, which says nothing in a PPO run:
    an epoch is a pass over the prompts, ``trainer.max_epochs`` is -1 (so its rich bar reads
    ``Epoch 1/-2``), and the run's length is ``trainer.max_steps`` iterations. Here the bar is
    made once with that total, never reset between epochs, starts at ``global_step`` on a resumed
    run (its rate then counts this run's iterations), and shows the metrics the module logs with
    ``prog_bar`` (``train.metrics.PROGRESS_BAR_METRICS``), without the logger's version number.
    ``jobs.factory.build`` adds it to every PPO run that shows a progress bar and brings none of
    its own."""

    BAR_FORMAT = "iteration {n_fmt}/{total_fmt} |{bar}| [{elapsed}<{remaining}, {rate_fmt}{postfix}]"

    def init_train_tqdm(self) -> Tqdm:
        return Tqdm(
            total=self.trainer.max_steps,
            initial=self.trainer.global_step,
            position=2 * self.process_position,
            disable=self.is_disabled,
            leave=True,
            dynamic_ncols=True,
            file=sys.stdout,
            smoothing=0,
            bar_format=self.BAR_FORMAT,
        )

    def on_train_epoch_start(self, trainer, *_) -> None:
        """Nothing: an epoch is no unit of a PPO run (Lightning's bar resets here)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar, n = self.train_progress_bar, trainer.global_step
        if not bar.disable and (n % self.refresh_rate == 0 or n == bar.total):
            bar.n = n
            bar.set_postfix(self.get_metrics(trainer, pl_module))  # refreshes

    def get_metrics(self, trainer, pl_module) -> dict:
        metrics = super().get_metrics(trainer, pl_module)
        metrics.pop("v_num", None)  # the logger's version: the same on every line
        first = {k: metrics.pop(k) for k in PROGRESS_BAR_METRICS if k in metrics}  # reward, then KL
        return {**first, **metrics}


class SampleTable(L.Callback):
    """Every ``every_n_steps`` PPO iterations, record prompts, responses and scores.

    Rows go to ``<dirpath>/samples.jsonl`` (one JSON object per sample, with the iteration, and
    with ``reward.terms`` each term's raw score as a column of its own; in a multi-turn run the
    prompt and the response are the conversation's messages, each under its role) and,
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
        if r.episodes is None:
            prompts, responses = decode_prompts_and_responses(
                pl_module.tokenizer, r.query_responses[:n, : r.context_length], r.responses[:n], r.response_mask[:n]
            )
        else:  # multi-turn: the whole conversation, each message under its role
            episodes = r.episodes.episodes[:n]
            prompts = [conversation_text(e.prompt_messages) for e in episodes]
            responses = [conversation_text(e.completion) for e in episodes]
        scores = r.scores[:n].tolist()
        terms = {name: x[:n].tolist() for name, x in r.term_scores.items()}  # reward.terms, raw
        rows = [
            {"step": step, "prompt": p, "response": resp, "score": s, **{k: v[i] for k, v in terms.items()}}
            for i, (p, resp, s) in enumerate(zip(prompts, responses, scores))
        ]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
        for lg in trainer.loggers:
            if isinstance(lg, WandbLogger):
                columns = list(rows[0])
                lg.log_table(
                    key="samples", columns=columns, data=[[row[c] for c in columns] for row in rows], step=step
                )
