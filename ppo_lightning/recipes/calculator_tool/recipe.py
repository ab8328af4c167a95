"""Tool calling, offline: ``python train.py experiment=calculator_tool``.

Three-digit arithmetic (``ppo_lightning/recipes/calculator_tool/data.py``) that a 2-layer model cannot do
in its head, with the safe calculator (``ppo_lightning.envs.calculator``) as a tool
(``env=tools``). The SFT warm start learns from transcripts of both ways of answering, mostly the
wrong one: 30% call the calculator and copy its result, 70% state the answer at once. So greedy
decoding starts by answering in its head, and is almost never right. GRPO with a correctness
reward on the final answer (``data.final_answer``) then has to find, from its own
sampled episodes, that calling the tool pays; the tool's result is in each episode's sequence but
never in its loss.

Built once under ``${recipe_dir:calculator_tool}``::

    tokenizer/  base/  sft/  problems.jsonl  DONE

After the run the table shows the greedy accuracy on held-out problems before and after RL with
the tool (the run's own evaluations) and without it (the same prompts answered in one turn, no
tool to answer a call: the model's own arithmetic).
"""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch

from ppo_lightning.recipes.common import eval_report, fit_stage, save_base_model

from . import data as calculator

log = logging.getLogger(__name__)

BASE = dict(n_layer=2, n_head=4, n_embd=128, n_positions=96)
N_PROBLEMS = 1200  # RL prompts, the eval split included
SFT_PROBLEMS = 6000
SFT_STEPS = 1000

ROWS = {
    "accuracy with the tool (greedy)": "eval/reward/mean@1",
    "  products": "eval/product/reward/mean@1",
    "  sums of three": "eval/sum/reward/mean@1",
    "  product plus a term": "eval/mixed/reward/mean@1",
    "tool calls per episode": "eval/env/tool_calls_mean",
    "policy turns per episode": "eval/env/turns_mean",
    "KL to reference (nats)": "eval/kl",
}
"""The before/after table: labels and the run's own ``eval/*`` metrics."""
CURVE = {"accuracy": "eval/reward/mean@1", "tool calls": "eval/env/tool_calls_mean"}
WITHOUT_TOOL = "accuracy without the tool (greedy)"
"""The table's last row: the SFT policy (before) and the trained one (after) answering in one
turn, with no calculator to call."""


def build(cfg, tmp: Path) -> None:
    """The tokenizer, the problems and the SFT policy, into ``tmp``."""
    from ppo_lightning.envs import ToolEnvironment

    log.info("calculator_tool recipe, first run: building the tokenizer, problems and SFT policy under %s", tmp)
    rng = random.Random(cfg.seed)
    tokenizer = calculator.build_tokenizer(calculator.tokenizer_corpus(rng))
    tokenizer.save_pretrained(tmp / "tokenizer")
    save_base_model(tmp / "base", tokenizer, seed=cfg.seed, **BASE)
    problems = calculator.prompt_records(rng, N_PROBLEMS)
    with (tmp / "problems.jsonl").open("w") as f:
        f.writelines(json.dumps(r) + "\n" for r in problems)
    tools = ToolEnvironment(tools=[calculator_path()]).tools
    exclude = {r["prompt"][0]["content"][len("What is ") : -1] for r in problems}
    records = calculator.sft_records(rng, SFT_PROBLEMS, tokenizer, tools, tool_share=0.3, exclude=exclude)
    log.info(
        "[1/1] SFT policy on %d turns of %d problems (30%% of first turns call the tool)", len(records), SFT_PROBLEMS
    )
    sft = fit_stage(
        "sft",
        tmp / "base",
        tmp / "sft",
        records,
        steps=SFT_STEPS,
        batch_size=32,
        lr=3e-3,
        max_length=BASE["n_positions"],
        seed=cfg.seed,
        extra={"max_prompt_length": 64},
    )
    log.info("SFT: val/loss %.3f", sft.get("val/loss", float("nan")))


def calculator_path() -> str:
    return "ppo_lightning.envs.calculator.calculator"


def evaluate(cfg, module, out_dir: Path | None) -> str:
    """The run's first and last greedy evaluations with the tool, its curve, and the accuracy
    without the tool of the SFT policy (the reference) and of the trained policy."""
    before, after = (without_tool(module, lm) for lm in (module.ref_lm, module.policy.lm))
    table = eval_report(module.eval_history, ROWS, out_dir, CURVE, extra_rows={WITHOUT_TOOL: (before, after)})
    if out_dir is not None:
        path = out_dir / "eval.json"
        data = json.loads(path.read_text()) if path.exists() else {}
        data["without_tool"] = {"before": before, "after": after}
        path.write_text(json.dumps(data, indent=2))
    return table


@torch.no_grad()
def without_tool(module, lm) -> float:
    """Greedy accuracy of ``lm`` on the eval prompts in one turn: no environment answers a tool
    call, so only an answer the model works out itself can score."""
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.rollouts import Prompts

    dm = module.trainer.datamodule
    params = module.sampling.replace(greedy=True, stop_strings=(calculator.TOOL_CLOSE,))
    worker = module.worker.replace(backend=HFBackend(lm, module.tokenizer), params=params, runner=None)
    right = total = 0.0
    with module.runtime.rollout_context(lm):
        for batch, weight in dm.eval_batches():
            raw = worker.play(Prompts.of(batch, module.device)).raw_scores
            right += float((raw.cpu() * weight).sum())
            total += float(weight.sum())
    right, total = module.runtime.reduce_sum(torch.tensor([right, total], device=module.device)).tolist()
    return right / max(total, 1.0)
