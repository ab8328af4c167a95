"""GSM8K-style RL from verifiable rewards on chat prompts, offline: ``python train.py experiment=math_chat``.

The tutorial's GSM8K run in miniature (``ppo_lightning/recipes/math_chat/data.py``): multi-step word
problems as chat messages, a system prompt asking for ``<answer>`` tags, each prompt's own gold
``answer`` and its ``data_source`` as record columns, held-out problems (``eval.split_fraction``)
evaluated greedily during training, and the tutorial's two weighted rewards (``reward=math``:
correctness 1.0, format 0.2) reading the ``answer`` column.

The SFT warm start learns from worked answers with two flaws: 70% of the three-step answers stop
after two steps, and 20% of all answers leave out the tags. It therefore answers most three-step
problems wrongly, greedily too, and often without tags when sampling. RL has to find, from the
rewards alone, that finishing the last step is right and that the tags pay.

Built once under ``${recipe_dir:math_chat}``::

    tokenizer/  base/  sft/  problems.jsonl  DONE

``problems.jsonl`` holds the RL prompt records (the eval split is taken from it); the SFT
corpus is generated apart, leaving out every problem of that file.
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

from ppo_lightning.recipes.common import eval_report, fit_stage, save_base_model

from . import data as math_word

log = logging.getLogger(__name__)

BASE = dict(n_layer=2, n_head=4, n_embd=128, n_positions=96)
N_PROBLEMS = 2000  # RL prompts, the eval split included
SFT_EXAMPLES = 20000
SFT_STEPS = 700

ROWS = {
    "accuracy (greedy)": "eval/rewards/correct/mean@1",
    "  two-step problems": "eval/two_step/rewards/correct/mean@1",
    "  three-step problems": "eval/three_step/rewards/correct/mean@1",
    "format (greedy)": "eval/rewards/format/mean@1",
    "response length (tokens)": "eval/response_length",
    "KL to reference (nats)": "eval/kl",
}
"""The before/after table: labels and the run's own ``eval/*`` metrics (``reward=math``'s terms)."""
CURVE = {"accuracy": "eval/rewards/correct/mean@1", "format": "eval/rewards/format/mean@1"}


def build(cfg, tmp: Path) -> None:
    """The tokenizer, the problems and the SFT policy, into ``tmp``."""
    log.info("math_chat recipe, first run: building the tokenizer, problems and SFT policy under %s", tmp)
    rng = random.Random(cfg.seed)
    tokenizer = math_word.build_tokenizer()
    tokenizer.save_pretrained(tmp / "tokenizer")
    save_base_model(tmp / "base", tokenizer, seed=cfg.seed, **BASE)
    problems = math_word.prompt_records(rng, N_PROBLEMS)
    with (tmp / "problems.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in problems)
    log.info(
        "[1/1] SFT policy on %d worked answers (flawed: see ppo_lightning/recipes/math_chat/recipe.py)", SFT_EXAMPLES
    )
    questions = {r["prompt"][-1]["content"] for r in problems}
    sft = fit_stage(
        "sft",
        tmp / "base",
        tmp / "sft",
        math_word.sft_corpus(rng, SFT_EXAMPLES, exclude=questions),
        steps=SFT_STEPS,
        batch_size=64,
        lr=3e-3,
        max_length=BASE["n_positions"],
        seed=cfg.seed,
        extra={"max_prompt_length": 64},
    )
    log.info("SFT: val/loss %.3f", sft.get("val/loss", float("nan")))


def evaluate(cfg, module, out_dir: Path | None) -> str:
    """The run's first and last greedy evaluations of the held-out problems, and its curve."""
    return eval_report(module.eval_history, ROWS, out_dir, CURVE)
