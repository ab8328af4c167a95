"""A verifiable-reward recipe: two-operand arithmetic checked exactly (RL from verifiable rewards).

``python train.py experiment=arithmetic``. The policy is warm-started by SFT on equations whose
answers are right only ~60% of the time (the rest off by one or two), so it starts partly right;
PPO with an exact-match reward (1 if the first integer of the response is the answer, else 0)
then raises the accuracy. No reward model: the reward cannot be hacked through style.

Built once under ``recipe_root(paths.cache_dir, "arithmetic")``: ``tokenizer/ sft/ prompts_train.txt
prompts_eval.txt DONE`` (digit-level tokenizer, see ``ppo_lightning/examples/arithmetic.py``).
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

from ppo_lightning.recipes import recipe_root
from ppo_lightning.recipes.common import build_cached, evaluate_before_after, fit_stage, report, save_base_model
from ppo_lightning.examples import arithmetic

log = logging.getLogger(__name__)

MAX_OPERAND = 9  # single digits: a 2-layer model learns the format and most sums in a minute
BASE = dict(n_layer=2, n_head=4, n_embd=128, n_positions=32)


def root(cfg) -> Path:
    return recipe_root(cfg.paths.cache_dir, "arithmetic")


def prepare(cfg) -> Path:
    def build(tmp: Path) -> None:
        log.info("arithmetic recipe, first run: building the tokenizer, data and SFT policy under %s", root(cfg))
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

    return build_cached(root(cfg), build)


def evaluate(cfg, module, out_dir: Path | None) -> str:
    prompts = [p for p in (root(cfg) / "prompts_eval.txt").read_text().split("\n") if p]
    scorers = {"accuracy": arithmetic.reward_fn}
    before, after = evaluate_before_after(module, prompts, scorers, cfg.seed)
    scorers_g = {"accuracy (greedy)": arithmetic.reward_fn}
    greedy = evaluate_before_after(module, prompts, scorers_g, cfg.seed, module.sampling.replace(greedy=True))
    for result, extra in zip((before, after), greedy):
        result.update({k: v for k, v in extra.items() if k in scorers_g})
    return report(before, after, out_dir / "eval.json" if out_dir else None)
