"""Peak memory of PPO iterations with each memory switch: one JSON line on stdout.

    python benchmarks/memory.py --workload small
    python benchmarks/memory.py --workload small --variants full,gradient_checkpointing --repeats 3

Each variant runs in a fresh process (the real config, models and Trainer of
``benchmarks/throughput.py``). A thread samples the process's RSS every 2 ms during
``trainer.fit`` (``--iterations`` PPO iterations: rollout and updates); the figure is the peak
above the RSS the loaded models hold just before fit, so what a switch saves in activations shows
undiluted by the weights. On a GPU it would be ``torch.cuda.max_memory_allocated``. Variants
alternate over ``--repeats`` rounds, medians reported, ratios against ``full`` measured in this run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

VARIANTS = {
    "full": [],
    "gradient_checkpointing": ["model.gradient_checkpointing=true"],
    "micro_batches_4": ["ppo.micro_batch_size=4"],
    "checkpointing_and_micro_batches_4": ["model.gradient_checkpointing=true", "ppo.micro_batch_size=4"],
}


def child(workload: str, variant: str, iterations: int, model_root: Path) -> dict:
    import psutil

    from throughput import compose
    from workloads import WORKLOADS, build_models, make_prompts

    from ppo_lightning.factory import build

    w = WORKLOADS[workload]
    policy_dir, reward_dir = build_models(w, model_root)
    with tempfile.TemporaryDirectory() as out:
        out = Path(out)
        prompts = out / "prompts.txt"
        prompts.write_text("\n".join(make_prompts(w)) + "\n")
        cfg = compose(w, policy_dir, reward_dir, prompts, out,
                      extra=(f"trainer.max_steps={iterations}", *VARIANTS[variant]))
        module, datamodule, trainer = build(cfg)
        proc = psutil.Process()
        gc.collect()
        base = proc.memory_info().rss
        peak = [base]
        done = threading.Event()

        def sample():
            while not done.is_set():
                peak[0] = max(peak[0], proc.memory_info().rss)
                time.sleep(0.002)

        t = threading.Thread(target=sample, daemon=True)
        t.start()
        t0 = time.perf_counter()
        trainer.fit(module, datamodule=datamodule)
        fit_s = time.perf_counter() - t0
        done.set()
        t.join()
        return {"peak_above_models_mb": (peak[0] - base) / 2**20, "models_mb": base / 2**20, "fit_s": fit_s}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", default="small")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--model-root", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.workload, args.child, args.iterations, Path(args.model_root))))
        return
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    results: dict[str, list[dict]] = {v: [] for v in variants}
    with tempfile.TemporaryDirectory() as model_root:
        for _ in range(args.repeats):
            for v in variants:  # alternate, so machine noise hits every variant
                p = subprocess.run([sys.executable, __file__, "--workload", args.workload, "--child", v,
                                    "--iterations", str(args.iterations), "--model-root", model_root],
                                   capture_output=True, text=True, check=True)
                results[v].append(json.loads(p.stdout.strip().splitlines()[-1]))
    from workloads import WORKLOADS

    w = WORKLOADS[args.workload]
    out = {"benchmark": "memory", "workload": w.name, "layers": w.n_layer, "width": w.n_embd,
           "rollout_batch": w.rollout_batch, "minibatch": w.minibatch_size,
           "tokens_per_row": w.prompt_tokens + w.response_tokens, "iterations": args.iterations,
           "repeats": args.repeats, "device": "cpu", "measure": "peak RSS above the loaded models, MB"}
    full = statistics.median(r["peak_above_models_mb"] for r in results["full"]) if "full" in results else None
    for v, rs in results.items():
        peak = statistics.median(r["peak_above_models_mb"] for r in rs)
        out[v] = {"peak_above_models_mb": round(peak, 1),
                  "fit_s": round(statistics.median(r["fit_s"] for r in rs), 2),
                  **({"ratio_to_full": round(peak / full, 3)} if full else {})}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
