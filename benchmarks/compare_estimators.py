"""PPO (GAE) against the critic-free estimators on the recipes: one table, one JSON line per run.

    python -m benchmarks.compare_estimators                                   # both recipes, 3 seeds
    python -m benchmarks.compare_estimators --recipes arithmetic --seeds 42,1,2
    python -m benchmarks.compare_estimators --estimators gae,grpo --iterations 30

Each run is a real ``python train.py`` job in its own process (the recipe is built once, cached,
and reused), so what it measures is what a user gets: the recipe's before/after table on its
held-out prompts (``eval.json``), the KL to the reference at the end, the wall time of the whole
job and the process's peak RSS (``wait4``'s ``ru_maxrss``: the critic-free runs hold no value
head, gradients or AdamW state for it).

The estimators see the same episodes per iteration: GRPO and RLOO sample ``--generations``
answers for ``batch / generations`` prompts, GAE and REINFORCE++ one answer for ``batch``
prompts. Each is configured as its experiment says (``conf/experiment/arithmetic_<name>.yaml``:
GRPO with the KL as a loss term and DeepSeekMath's per-response loss mean); on the reviews job the same overrides are applied to the
default job. Every other key is the recipe's own.
"""

from __future__ import annotations

import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import cli
from benchmarks.lib.runner import ROOT

# grpo_kl_reward: GRPO with the generic keys alone (docs/usage.md: ppo.advantage=grpo ppo.num_generations=4),
# the KL in the reward (added per token after the group comparison of the scores), token-mean loss
ESTIMATORS = ("gae", "grpo", "grpo_kl_reward", "rloo", "reinforce_pp")
RECIPES = {  # recipe -> (the job's experiment overrides, its rollout batch, the table's headline row)
    "arithmetic": (["experiment=arithmetic"], 32, "accuracy"),
    "reviews": ([], 32, "sentiment (ground truth)"),
}


def estimator_overrides(name: str, batch: int, generations: int) -> list[str]:
    """What turns a recipe's job into ``name``'s (as ``conf/experiment/arithmetic_<name>.yaml``)."""
    if name == "gae":
        return []
    grouped = [f"ppo.num_generations={generations}", f"data.batch_size={batch // generations}"]
    return {
        "grpo": ["ppo.advantage=grpo", "ppo.kl_in=loss", "ppo.loss_agg=seq_mean_token_mean", *grouped],
        "grpo_kl_reward": ["ppo.advantage=grpo", *grouped],
        "rloo": ["ppo.advantage=rloo", *grouped],
        "reinforce_pp": ["ppo.advantage=reinforce_pp"],
    }[name]


def run(recipe: str, estimator: str, seed: int, args, out_root: Path) -> dict:
    job, batch, _ = RECIPES[recipe]
    run_dir = out_root / f"{recipe}_{estimator}_{seed}"
    overrides = [
        *job,
        *estimator_overrides(estimator, batch, args.generations),
        f"seed={seed}",
        "trainer.enable_progress_bar=false",
        "trainer.enable_model_summary=false",
        "logger=csv",
        "callbacks=none",
        "export_dir=null",
        f"hydra.run.dir={run_dir}",
    ]
    if args.iterations:
        overrides.append(f"trainer.max_steps={args.iterations}")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        [sys.executable, "train.py", *overrides],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    result = {
        "recipe": recipe,
        "estimator": estimator,
        "seed": seed,
        "wall_s": round(wall, 1),
        "peak_rss_mb": round(usage.ru_maxrss / 1024, 1),
    }
    if os.waitstatus_to_exitcode(status) != 0:
        return {**result, "failed": stderr[-2000:]}
    table = json.loads((run_dir / "eval.json").read_text())
    with open(run_dir / "metrics.csv") as f:  # the iterations' rows: an evaluation logs rows of its own
        rows = [r for r in csv.DictReader(f) if r.get("objective/kl")]
    result.update(
        {
            "before": {k: v for k, v in table["before"].items() if k != "samples"},
            "after": {k: v for k, v in table["after"].items() if k != "samples"},
            "kl": float(rows[-1]["objective/kl"]) if rows else None,
            "iterations": len(rows),
        }
    )
    return result


def summarise(results: list[dict]) -> str:
    """A markdown table: per recipe and estimator, the headline metric before and after, the
    change (mean and range over seeds), KL, wall time and peak RSS (means)."""
    lines = [
        "| recipe | estimator | metric | before | after | change (min..max) | KL | wall s | peak RSS MB |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for recipe, (_, _, headline) in RECIPES.items():
        for est in ESTIMATORS:
            rs = [r for r in results if r["recipe"] == recipe and r["estimator"] == est and "failed" not in r]
            if not rs:
                continue
            before = [r["before"][headline] for r in rs]
            after = [r["after"][headline] for r in rs]
            change = [a - b for a, b in zip(after, before)]
            mean = statistics.fmean
            lines.append(
                f"| {recipe} | {est} | {headline} | {mean(before):.3f} | {mean(after):.3f} | "
                f"{mean(change):+.3f} ({min(change):+.3f}..{max(change):+.3f}) | "
                f"{mean(r['kl'] for r in rs):.2f} | {mean(r['wall_s'] for r in rs):.0f} | "
                f"{mean(r['peak_rss_mb'] for r in rs):.0f} |"
            )
    return "\n".join(lines)


def main() -> None:
    ap = cli.parser(__doc__)
    ap.add_argument("--recipes", default=",".join(RECIPES), help=f"comma-separated, from {list(RECIPES)}")
    ap.add_argument("--estimators", default=",".join(ESTIMATORS), help=f"comma-separated, from {list(ESTIMATORS)}")
    ap.add_argument("--seeds", default="42,1,2")
    ap.add_argument("--generations", type=int, default=4, help="samples per prompt for GRPO and RLOO")
    ap.add_argument("--iterations", type=int, default=None, help="trainer.max_steps (default: the recipe's)")
    args = ap.parse_args()
    recipes, estimators = args.recipes.split(","), args.estimators.split(",")
    unknown = [r for r in recipes if r not in RECIPES] + [e for e in estimators if e not in ESTIMATORS]
    if unknown:
        sys.exit(f"unknown {unknown}: recipes are {list(RECIPES)}, estimators {list(ESTIMATORS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    results = []
    with tempfile.TemporaryDirectory(prefix="compare_estimators_") as tmp:
        for recipe in recipes:
            for seed in seeds:  # estimators alternate within a seed: drift on the machine hits all alike
                for est in estimators:
                    r = run(recipe, est, seed, args, Path(tmp))
                    print(json.dumps(r), flush=True)
                    results.append(r)
    print(summarise(results))


if __name__ == "__main__":
    main()
