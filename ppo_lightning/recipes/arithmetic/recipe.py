"""A verifiable-reward recipe: two-operand arithmetic checked exactly (RL from verifiable rewards).

``python train.py experiment=arithmetic``. The policy is warm-started by SFT on equations whose
answers are right only ~60% of the time (the rest off by one or two), so it starts partly right;
PPO with an exact-match reward (1 if the first integer of the response is the answer, else 0)
then raises the accuracy. No reward model: the reward cannot be hacked through style.

Built once under ``${recipe_dir:arithmetic}``: ``tokenizer/ sft/ prompts_train.txt
prompts_eval.txt DONE`` (digit-level tokenizer, see ``data.py``).

The template for a recipe of your own (docs/usage.md, "A recipe of your own"): copy this folder and
``conf/experiment/arithmetic.yaml``. The folder imports its own modules relatively, so a copy runs
under its new name unchanged.
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

from ppo_lightning.recipes.common import eval_report, fit_stage, save_base_model

from . import data as arithmetic

log = logging.getLogger(__name__)

MAX_OPERAND = 9  # single digits: a 2-layer model learns the format and most sums in a minute
BASE = dict(n_layer=2, n_head=4, n_embd=128, n_positions=32)


def build(cfg, tmp: Path) -> None:
    """The digit tokenizer, the train and eval prompts, and the SFT policy, into ``tmp``."""
    log.info("arithmetic recipe, first run: building the tokenizer, data and SFT policy under %s", tmp)
    rng = random.Random(cfg.seed)
    tokenizer = arithmetic.build_tokenizer()
    tokenizer.save_pretrained(tmp / "tokenizer")
    save_base_model(tmp / "base", tokenizer, seed=cfg.seed, **BASE)
    (tmp / "prompts_train.txt").write_text("\n".join(arithmetic.prompts(rng, 2000, max_operand=MAX_OPERAND)) + "\n")
    (tmp / "prompts_eval.txt").write_text("\n".join(arithmetic.prompts(rng, 200, max_operand=MAX_OPERAND)) + "\n")
    log.info("[1/1] SFT policy on 6000 equations, 60%% of them right")
    sft = fit_stage(
        "sft",
        tmp / "base",
        tmp / "sft",
        arithmetic.sft_corpus(rng, 6000, accuracy=0.6, max_operand=MAX_OPERAND),
        steps=600,
        batch_size=64,
        lr=3e-3,
        max_length=16,
        seed=cfg.seed,
        extra={"max_prompt_length": 8},
    )
    log.info("SFT: val/loss %.3f", sft.get("val/loss", float("nan")))


ROWS = {"accuracy": "eval/reward/mean@1", "KL to reference (nats)": "eval/kl"}
"""The before/after table: labels and the run's own ``eval/*`` metrics (sampled as the rollout
samples; conf/experiment/arithmetic.yaml)."""


def evaluate(cfg, module, out_dir: Path | None) -> str:
    """The run's evaluations of the held-out prompts before training (the SFT policy) and after."""
    return eval_report(module.eval_history, ROWS, out_dir)
