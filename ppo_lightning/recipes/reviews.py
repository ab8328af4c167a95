"""The default job: steer a small LM towards positive movie reviews, offline, in minutes.

The offline analogue of the classic RLHF demo (GPT-2 + an IMDB sentiment classifier). Everything
comes from this project (``ppo_lightning/tasks/reviews.py``): a grammar of short reviews, a
word-level tokenizer over its vocabulary, an SFT policy trained on reviews of mixed sentiment,
and a reward model trained on preference pairs (the more positive continuation wins). PPO then
raises the reward model's score; the ground-truth sentiment and the grammar check tell whether
the gain is real or reward hacking.

Built once under ``<paths.cache_dir>/reviews-v1`` (about a minute on 2 CPU cores)::

    tokenizer/  sft/  reward_model/  prompts_train.txt  prompts_eval.txt  DONE
"""

from __future__ import annotations

import logging
import random
from pathlib import Path

from ppo_lightning.recipes.common import build_cached, fit_stage, report, sample_and_score, save_base_model
from ppo_lightning.tasks import reviews

log = logging.getLogger(__name__)

NAME = "reviews-v1"  # bump when the recipe's data or models change
BASE = dict(n_layer=2, n_head=4, n_embd=128, n_positions=64)


def root(cfg) -> Path:
    return Path(cfg.paths.cache_dir) / NAME


def prepare(cfg) -> Path:
    """Build (first run) or reuse the tokenizer, SFT policy, reward model and prompt files."""
    def build(tmp: Path) -> None:
        log.info("reviews recipe, first run: building the tokenizer, data, SFT policy and reward "
                 "model under %s (cached for later runs)", root(cfg))
        rng = random.Random(cfg.seed)
        tokenizer = reviews.build_tokenizer()
        tokenizer.save_pretrained(tmp / "tokenizer")
        save_base_model(tmp / "base", tokenizer, seed=cfg.seed, **BASE)
        (tmp / "prompts_train.txt").write_text("\n".join(reviews.prompts(rng, 2000)) + "\n")
        (tmp / "prompts_eval.txt").write_text("\n".join(reviews.prompts(rng, 128)) + "\n")
        log.info("[1/2] SFT policy on 6000 generated reviews of mixed sentiment")
        sft = fit_stage("sft", tmp / "base", tmp / "sft", reviews.sft_corpus(rng, 6000), steps=600,
                        batch_size=64, lr=3e-3, max_length=32, seed=cfg.seed,
                        extra={"max_prompt_length": 8})
        log.info("SFT: val/loss %.3f", sft.get("val/loss", float("nan")))
        log.info("[2/2] reward model on 4000 generated preference pairs")
        rm = fit_stage("reward_model", tmp / "base", tmp / "reward_model", reviews.preference_pairs(rng, 4000),
                       steps=400, batch_size=32, lr=1e-3, max_length=32, seed=cfg.seed)
        log.info("reward model: val/accuracy %.3f", rm.get("val/accuracy", float("nan")))

    return build_cached(root(cfg), build)


def well_formed(prompts: list[str], responses: list[str]) -> list[float]:
    return [float(reviews.is_well_formed(reviews.join_text(p, r))) for p, r in zip(prompts, responses)]


def true_sentiment(prompts: list[str], responses: list[str]) -> list[float]:
    return [reviews.sentiment(reviews.join_text(p, r)) for p, r in zip(prompts, responses)]


def evaluate(cfg, module, out_dir: Path | None) -> str:
    """Before (the reference = the SFT policy) and after (the trained policy) on held-out prompts."""
    prompts = (root(cfg) / "prompts_eval.txt").read_text().split("\n")
    prompts = [p for p in prompts if p]
    scorers = {"reward (training reward)": module.reward_fn,
               "sentiment (ground truth)": true_sentiment,
               "well-formed fraction": well_formed}
    c = module.ppo_cfg
    gen = {"max_new_tokens": c.max_new_tokens, "temperature": c.temperature, "top_k": c.top_k,
           "top_p": c.top_p, "stop_at_eos": c.stop_at_eos}
    before = sample_and_score(module.ref_lm, module.ref_lm, module.tokenizer, prompts, scorers, gen, cfg.seed)
    after = sample_and_score(module.policy.lm, module.ref_lm, module.tokenizer, prompts, scorers, gen, cfg.seed)
    return report(before, after, out_dir / "eval.json" if out_dir else None)
