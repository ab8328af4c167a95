"""GPU check: bf16-mixed PPO on one CUDA device, what it costs and whether its numerics hold.

    python -m benchmarks.gpu_check                                        # medium, 3 iterations
    python -m benchmarks.gpu_check --device cpu --workload tiny --iterations 1   # smoke test

Needs no network: the workload's models are built from code (``benchmarks/lib/workloads.py``) and
the run goes through ``train.py``'s Hydra config (``benchmarks.lib.ours.compose``, as ``throughput``) with
``trainer.accelerator=gpu trainer.devices=1 trainer.precision=bf16-mixed`` (``cpu`` with
``--device cpu``: CPU autocast runs bf16 too, but a CPU without native bf16 (no AVX512-BF16 or
AMX) runs its matmuls ~100x slower than float32, so the smoke test uses ``tiny``). Prints one
JSON line:

* sampling: tokens/s of our sampler (``ppo_lightning.generation.hf.generate``) and of Hugging Face's
  ``model.generate(use_cache=True)`` on one rollout batch, both under bf16 autocast, alternated
  ``--repeats`` times (``benchmarks.lib.ours.compare_generate``);
* the update's model FLOPs utilisation, per iteration::

      mfu = 6 * N * rows * (prompt + response) * ppo_epochs / update_s / peak

  ``N`` the policy's parameters (shared ones once, value head included), ``rows`` the rollout
  batch, ``update_s`` the module's update timer (``perf/time_update_s``, the device synchronised
  at its end) and ``peak`` the device's dense bf16 FLOP/s (``PEAK_BF16_FLOPS`` by device name, or
  ``--peak-flops``); summed over the iterations after the first (the first pays for kernel
  selection and allocation), or the one iteration there is. Two things make it read high: with
  one minibatch the first epoch's forward runs in the rollout (``ppo.fuse_rollout_forward``), one
  of the ``3 * ppo_epochs`` passes; and the LM head runs on response positions only. Null on CPU;
* memory: ``torch.cuda.memory_allocated`` with the models on the device before fit, and
  ``torch.cuda.max_memory_allocated`` during fit (null on CPU, where ``peak_rss_mb`` is the
  process's peak RSS);
* numerics: ``val/ratio`` and ``policy/approxkl_avg`` of the first update of a one-iteration run
  with ``ppo.ppo_epochs=1`` and one minibatch (so the iteration's metrics are that update's), and
  the first rollout's ``objective/kl`` against the reference. With the rollout and the update in
  one precision they are exactly 1, 0 and 0. ``first_update`` runs the default fused forward (the
  rollout's old logprobs are the update's own forward); ``first_update_unfused`` sets
  ``ppo.fuse_rollout_forward=false``, so the old logprobs come from the rollout's no-grad forward
  and the update's from a new one with grad: the check that the two forwards agree.
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import json
import re
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.lib import cli
from benchmarks.lib.measure import MB, peak_rss_mb
from benchmarks.lib.ours import PerfTotals, compare_generate, compose
from benchmarks.lib.workloads import WORKLOADS, Workload, build_models, write_prompts

PEAK_BF16_FLOPS = (  # dense bf16 tensor-core FLOP/s by device-name pattern; the first match wins
    (r"H100.*PCIe", 756e12),
    (r"H100|H200", 989e12),  # SXM (and GH200): 989 TFLOP/s dense
    (r"A100", 312e12),
    (r"L40S", 362e12),
    (r"\bL4\b", 121e12),
)
PRECISION = "bf16-mixed"
FIRST_UPDATE_METRICS = ("val/ratio", "policy/approxkl_avg", "objective/kl")


def peak_flops(device_name: str) -> float | None:
    for pattern, flops in PEAK_BF16_FLOPS:
        if re.search(pattern, device_name):
            return flops
    return None


def cpu_name() -> str:
    import platform

    try:
        info = Path("/proc/cpuinfo").read_text()
        return re.search(r"model name\s*:\s*(.+)", info).group(1).strip()
    except (OSError, AttributeError):
        return platform.processor() or platform.machine()


def fit(w: Workload, policy_dir: Path, reward_dir: Path, device: torch.device, extra: tuple[str, ...]) -> dict:
    """One ``trainer.fit`` of the workload in ``PRECISION`` on ``device``: its per-iteration
    metrics, wall time, the policy's size and the device memory of the models and of the run."""
    from ppo_lightning.jobs.factory import build

    with tempfile.TemporaryDirectory() as out:
        out = Path(out)
        prompts = write_prompts(w, out)
        accelerator = "gpu" if device.type == "cuda" else "cpu"
        cfg = compose(
            w,
            policy_dir,
            reward_dir,
            prompts,
            out,
            extra=(f"trainer.accelerator={accelerator}", "trainer.devices=1", f"trainer.precision={PRECISION}", *extra),
        )
        module, datamodule, trainer = build(cfg)
        totals = PerfTotals(w.response_tokens)
        trainer.callbacks.append(totals)
        policy_params = sum(p.numel() for p in {p.data_ptr(): p for p in module.policy.parameters()}.values())
        models_mb = peak_mb = None
        if device.type == "cuda":
            module.to(device)  # Lightning would move it at fit start; here, to weigh the models first
            torch.cuda.synchronize(device)
            models_mb = torch.cuda.memory_allocated(device) / MB
            torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        trainer.fit(module, datamodule=datamodule)
        fit_s = time.perf_counter() - t0
        if device.type == "cuda":
            peak_mb = torch.cuda.max_memory_allocated(device) / MB
    return {
        "per_iteration": totals.per_iteration,
        "fit_s": fit_s,
        "policy_params": policy_params,
        "models_mb": models_mb,
        "peak_mb": peak_mb,
    }


def first_update(w: Workload, policy_dir: Path, reward_dir: Path, device: torch.device, fused: bool) -> dict:
    """``val/ratio``, ``policy/approxkl_avg`` and ``objective/kl`` of a one-iteration run with one
    epoch of one minibatch: the first update's own values."""
    run = fit(
        w,
        policy_dir,
        reward_dir,
        device,
        (
            "trainer.max_steps=1",
            "ppo.ppo_epochs=1",
            f"ppo.minibatch_size={w.rollout_batch}",
            f"ppo.fuse_rollout_forward={str(fused).lower()}",
        ),
    )
    m = run["per_iteration"][0]
    return {k: m[k] for k in FIRST_UPDATE_METRICS}


def main() -> None:
    ap = cli.parser(__doc__)
    cli.add_workload(ap, default="medium")
    ap.add_argument("--iterations", type=int, default=3, help="PPO iterations of the measured run")
    ap.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu (a smoke test)")
    ap.add_argument("--peak-flops", type=float, help="the device's dense bf16 FLOP/s (default: by name)")
    ap.add_argument("--repeats", type=int, default=5, help="alternations of the sampling comparison")
    cli.add_model_dir(ap)
    args = ap.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("--device cuda: torch sees no CUDA device; use --device cpu for the smoke test")
    w = WORKLOADS[args.workload]
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_root = Path(args.model_dir or tmp)
        policy_dir, reward_dir = build_models(w, model_root)

        t0 = time.perf_counter()
        sampling = compare_generate(w, model_root, args.repeats, device=str(device), bf16=True)
        sampling_s = time.perf_counter() - t0

        run = fit(w, policy_dir, reward_dir, device, (f"trainer.max_steps={args.iterations}",))
        t0 = time.perf_counter()
        numerics = {
            "first_update": first_update(w, policy_dir, reward_dir, device, fused=True),
            "first_update_unfused": first_update(w, policy_dir, reward_dir, device, fused=False),
        }
        numerics_s = time.perf_counter() - t0

    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = args.peak_flops or peak_flops(name)
    else:
        name, peak = cpu_name(), None
    update_s = [m["perf/time_update_s"] for m in run["per_iteration"]]
    steady = update_s[1:] or update_s
    tokens = w.rollout_batch * (w.prompt_tokens + w.response_tokens) * w.ppo_epochs  # per iteration
    achieved = 6 * run["policy_params"] * tokens * len(steady) / sum(steady)
    episodes = w.rollout_batch * len(update_s)
    print(
        json.dumps(
            {
                "benchmark": "gpu_check",
                "device": device.type,
                "device_name": name,
                "torch": torch.__version__,
                "precision": PRECISION,
                "workload": w.name,
                "iterations": len(update_s),
                **sampling,
                "policy_params_m": run["policy_params"] / 1e6,
                "update_tokens_per_iteration": tokens,
                "update_s_per_iteration": update_s,
                "rollout_s_per_iteration": [m["perf/time_rollout_s"] for m in run["per_iteration"]],
                "update_flops_per_s": achieved,
                "peak_flops": peak,
                "mfu": achieved / peak if peak else None,
                "models_gpu_mb": run["models_mb"],
                "peak_gpu_mb": run["peak_mb"],
                "peak_rss_mb": peak_rss_mb(),
                **numerics,
                "episodes_per_s": episodes / run["fit_s"],
                "fit_s": run["fit_s"],
                "sampling_s": sampling_s,
                "numerics_s": numerics_s,
                "wall_s": time.perf_counter() - t_start,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
