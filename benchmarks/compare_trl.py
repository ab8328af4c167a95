"""ppo_lightning vs TRL's PPOTrainer on one workload, side by side in one run.

    python benchmarks/compare_trl.py --workload tiny --rounds 3
    python benchmarks/compare_trl.py --workload medium --rounds 1   # ~10 min a round on 2 cores

Runs ``throughput.py`` and ``trl_baseline.py`` alternately in fresh subprocesses (same models,
same prompts, same thread count; the models are built once, before the first round),
``--rounds`` times each, and prints one JSON line with the median episodes/s of each and their
ratio. Alternating spreads machine noise over both. Needs the
``bench`` extra (``pip install -e ".[bench]"``, trl==1.12.0).
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


def run(script: str, workload: str, model_dir: str, threads: int | None) -> dict:
    cmd = [sys.executable, str(HERE / script), "--workload", workload, "--model-dir", model_dir]
    if threads:
        cmd += ["--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if p.returncode:
        sys.exit(f"{script} failed:\n{p.stderr[-4000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workload", default="tiny")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int)
    args = ap.parse_args()
    from workloads import WORKLOADS, build_models

    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as model_dir:
        build_models(WORKLOADS[args.workload], model_dir)
        results = {"ppo_lightning": [], "trl": []}
        for _ in range(args.rounds):
            results["ppo_lightning"].append(run("throughput.py", args.workload, model_dir, args.threads))
            results["trl"].append(run("trl_baseline.py", args.workload, model_dir, args.threads))
    med = {k: statistics.median(r["episodes_per_s"] for r in v) for k, v in results.items()}
    print(
        json.dumps(
            {
                "workload": args.workload,
                "rounds": args.rounds,
                "episodes_per_s_ppo_lightning": med["ppo_lightning"],
                "episodes_per_s_trl": med["trl"],
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
                "wall_s": round(time.perf_counter() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
