"""The default job: steer a small LM towards positive movie reviews, offline, in minutes.

The offline analogue of the classic RLHF demo (GPT-2 + an IMDB sentiment classifier). Everything
comes from this project (``grammar.py`` and ``data.py`` beside this file): a grammar of short
reviews, a word-level tokenizer over its vocabulary, an SFT policy trained on reviews of mixed
sentiment, and a reward model trained on preference pairs (the more positive continuation wins), then
hardened by ``RED_TEAM_ROUNDS`` rounds of online preference collection (``red_team_pairs``). PPO
then raises the reward model's score; the ground-truth sentiment and the grammar check tell
whether the gain is real or reward hacking.

Built once under ``${recipe_dir:reviews}`` (about two minutes on 2 CPU cores)::

    tokenizer/  sft/  reward_model/  prompts_train.txt  prompts_eval.txt  DONE
"""

from __future__ import annotations

import logging
import os
import random
import shutil
from pathlib import Path

from ppo_lightning.recipes.common import eval_report, fit_stage, save_base_model

from . import data as reviews
from . import grammar

log = logging.getLogger(__name__)

BASE = dict(n_layer=2, n_head=4, n_embd=128, n_positions=64)
GROUPED = {"group_by_length": True}
"""The stages batch reviews of similar length: 15-25% less compute, the same table (docs/usage.md)."""
N_PROMPTS = 2000  # RL prompts (prompts_train.txt)
N_EVAL_PROMPTS = 512  # held-out prompts (prompts_eval.txt)
SFT_REVIEWS = 6000
SFT_STEPS = 600
RM_PAIRS = 5000  # generated preference pairs of the first reward model
DRIFT_PROMPTS = 6000  # SFT samples drawn hot for pairs against its own broken text
RM_STEPS = 1000
RED_TEAM_ROUNDS = 2  # rounds of online preference collection after the first reward model
RED_TEAM_ITERATIONS = 40  # PPO iterations against the current reward model, per round
RED_TEAM_SAMPLES = 4096  # that policy's responses labelled by the grammar, per round
RED_TEAM_STEPS = 300  # reward-model steps on a round's pairs


def build(cfg, tmp: Path) -> None:
    """The tokenizer, the prompt files, the SFT policy and the red-teamed reward model, into ``tmp``."""
    log.info(
        "reviews recipe, first run: building the tokenizer, data, SFT policy and reward model under %s "
        "(cached for later runs)",
        tmp,
    )
    rng = random.Random(cfg.seed)
    tokenizer = reviews.build_tokenizer()
    tokenizer.save_pretrained(tmp / "tokenizer")
    save_base_model(tmp / "base", tokenizer, seed=cfg.seed, **BASE)
    (tmp / "prompts_train.txt").write_text("\n".join(reviews.prompts(rng, N_PROMPTS)) + "\n")
    (tmp / "prompts_eval.txt").write_text("\n".join(reviews.prompts(rng, N_EVAL_PROMPTS)) + "\n")
    build_sft(tmp, rng, cfg.seed)
    pairs = build_reward_model(tmp, rng, cfg.seed)
    current = red_team(tmp, tmp / "reward_model_r1", pairs, rng, cfg.seed)
    os.replace(current, tmp / "reward_model")


def build_sft(tmp: Path, rng: random.Random, seed: int) -> None:
    """[1/3] The SFT policy (``tmp/sft``) on generated reviews of mixed sentiment."""
    log.info("[1/3] SFT policy on %d generated reviews of mixed sentiment", SFT_REVIEWS)
    sft = fit_stage(
        "sft",
        tmp / "base",
        tmp / "sft",
        reviews.sft_corpus(rng, SFT_REVIEWS),
        steps=SFT_STEPS,
        batch_size=64,
        lr=3e-3,
        max_length=32,
        seed=seed,
        extra={**GROUPED, "max_prompt_length": 8},
    )
    log.info("SFT: val/loss %.3f", sft.get("val/loss", float("nan")))


def build_reward_model(tmp: Path, rng: random.Random, seed: int) -> list[dict]:
    """[2/3] The first reward model (``tmp/reward_model_r1``) on generated preference pairs and
    pairs against the SFT policy's own broken text; returns the pairs."""
    pairs = reviews.preference_pairs(rng, RM_PAIRS, ill_formed_fraction=0.3)
    pairs += drift_pairs(tmp / "sft", rng, DRIFT_PROMPTS, temperature=2.0)
    rng.shuffle(pairs)
    log.info(
        "[2/3] reward model on %d generated preference pairs (%d against the SFT policy's own broken text)",
        len(pairs),
        len(pairs) - RM_PAIRS,
    )
    rm = fit_stage(
        "reward_model",
        tmp / "base",
        tmp / "reward_model_r1",
        pairs,
        steps=RM_STEPS,
        batch_size=32,
        lr=1e-3,
        max_length=32,
        seed=seed,
        extra=GROUPED,
    )
    log.info("reward model, round 1: val/accuracy %.3f", rm.get("val/accuracy", float("nan")))
    return pairs


def red_team(tmp: Path, current: Path, pairs: list[dict], rng: random.Random, seed: int) -> Path:
    """[3/3] ``RED_TEAM_ROUNDS`` rounds: a short PPO run against the current reward model, whose
    broken outputs become new pairs, and the reward model trained further on them. Returns the
    last round's reward model (the earlier ones are removed)."""
    for r in range(2, RED_TEAM_ROUNDS + 2):
        log.info(
            "[3/3] red team %d/%d: a short PPO run against the reward model; its broken outputs become new pairs",
            r - 1,
            RED_TEAM_ROUNDS,
        )
        found = red_team_pairs(tmp, current, rng, seed=seed + r)
        if len(found) < 20:  # nothing left worth another round
            break
        # the new pairs plus twice as many old ones, so a round does not forget the last
        mixed = found + rng.sample(pairs, min(len(pairs), 2 * len(found)))
        pairs += found
        rng.shuffle(mixed)
        rm = fit_stage(
            "reward_model",
            current,
            tmp / f"reward_model_r{r}",
            mixed,
            steps=RED_TEAM_STEPS,
            batch_size=32,
            lr=3e-4,
            max_length=32,
            seed=seed,
            extra=GROUPED,
        )
        shutil.rmtree(current)
        current = tmp / f"reward_model_r{r}"
        log.info(
            "reward model, round %d (%d new pairs): val/accuracy %.3f",
            r,
            len(found),
            rm.get("val/accuracy", float("nan")),
        )
    return current


def drift_pairs(sft_dir: Path, rng: random.Random, n_prompts: int, temperature: float = 1.5) -> list[dict]:
    """Preference pairs against the SFT policy's own mistakes.

    Sampled hot, the SFT policy breaks the grammar the way a drifting PPO policy does (number
    agreement, a missing connective, a dangling intensifier). A reward model that never saw such
    text scores it arbitrarily, and PPO finds and exploits that within tens of iterations. Each
    broken sample is paired with a well-formed, positive continuation of the same prompt.
    """
    from ppo_lightning.models.policy import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(sft_dir))
    lm = load_causal_lm(str(sft_dir), tok).eval()
    return pairs_against_broken_samples(lm, tok, rng, n_prompts, temperature, batch_size=256)


def pairs_against_broken_samples(
    lm, tok, rng: random.Random, n_prompts: int, temperature: float = 1.0, batch_size: int = 256
) -> list[dict]:
    """Sample one response per fresh prompt from ``lm``; label it with the grammar; pair each
    ill-formed one (rejected) with a well-formed, positive continuation of its prompt (chosen).

    Part of the recipe's build, which is cached once for every later run: it samples with the
    recipe's own fixed settings (20 new tokens at ``temperature``, nothing truncated), never
    with a run's, so the cached data does not depend on which run built it."""
    import torch

    from ppo_lightning.data.prompts import PadCollator
    from ppo_lightning.generation import SamplingParams
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.rewards.base import decode_prompts_and_responses

    ps = reviews.prompts(rng, n_prompts)
    g = torch.Generator().manual_seed(rng.randrange(2**31))
    collate = PadCollator(tok.pad_token_id)
    sampler, params = HFBackend(lm, tok), SamplingParams(max_new_tokens=20, temperature=temperature)
    pairs = []
    for s in range(0, len(ps), batch_size):
        batch = collate(tok(ps[s : s + batch_size], add_special_tokens=False)["input_ids"])
        resp, mask, _ = sampler.generate(batch["input_ids"], batch["attention_mask"], params, g)
        for p, r in zip(*decode_prompts_and_responses(tok, batch["input_ids"], resp, mask)):
            if not grammar.is_well_formed(grammar.join_text(p, r)):
                pairs.append(
                    {
                        "prompt": p,
                        "chosen": grammar.complete(rng, p, 0.5 + 0.5 * rng.random()),
                        "rejected": " " + r.strip(),
                    }
                )
    return pairs


def red_team_pairs(tmp: Path, reward_dir: Path, rng: random.Random, seed: int) -> list[dict]:
    """One round of online preference collection, as iterated RLHF does it.

    PPO on a loose leash (β = 0.02) runs ``RED_TEAM_ITERATIONS`` steps from the SFT policy against the
    round-1 reward model, which finds that model's blind spots far faster than any corruption
    list can guess them (a repeated "the", a "." before the clause ends: whatever this seed's
    model happens to miss). ``RED_TEAM_SAMPLES`` responses of that policy are then labelled by the
    grammar, the offline stand-in for a human labeller: each ill-formed one becomes a pair
    that loses to a well-formed, positive continuation of the same prompt.
    """
    from ppo_lightning.jobs.factory import build, compose_config

    cfg = compose_config(
        [
            "logger=none",
            "callbacks=none",
            "export_dir=null",
            f"seed={seed}",
            "model=reviews",
            f"model.name_or_path={tmp / 'sft'}",
            "reward=model",
            f"reward.name_or_path={reward_dir}",
            "reward.max_length=32",
            "reward.normalize=true",
            "data=file",
            f"data.path={tmp / 'prompts_train.txt'}",
            "data.batch_size=32",
            "data.max_prompt_length=8",
            "sampling.max_new_tokens=20",
            "ppo.kl_coef=0.02",
            f"trainer.max_steps={RED_TEAM_ITERATIONS}",
            "trainer.enable_checkpointing=false",
            "trainer.enable_model_summary=false",
            f"paths.output_dir={tmp / 'red_team'}",
            f"paths.cache_dir={tmp}",
        ]
    )
    module, datamodule, trainer = build(cfg)
    trainer.fit(module, datamodule=datamodule)

    n_samples = RED_TEAM_SAMPLES
    pairs = pairs_against_broken_samples(module.policy.lm.eval(), module.tokenizer, rng, n_samples, batch_size=512)
    shutil.rmtree(tmp / "red_team", ignore_errors=True)
    log.info(
        "red team: %d of %d samples ill-formed after %d PPO iterations", len(pairs), n_samples, RED_TEAM_ITERATIONS
    )
    return pairs


ROWS = {
    "reward (reward model, raw)": "eval/reward/mean@1",
    "sentiment (ground truth)": "eval/metrics/sentiment/mean@1",
    "well-formed fraction": "eval/metrics/well_formed/mean@1",
    "KL to reference (nats)": "eval/kl",
}
"""The before/after table: labels and the run's own ``eval/*`` metrics (``eval.metrics`` holds the
ground truths; conf/experiment/preset/reviews-reviews.yaml)."""


def evaluate(cfg, module, out_dir: Path | None) -> str:
    """The run's evaluations of the held-out prompts before training (the SFT policy) and after."""
    return eval_report(module.eval_history, ROWS, out_dir)
