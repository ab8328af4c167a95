"""Per-rank memory and time of DDP against FSDP2 on two CPU processes: one JSON line.

    python -m benchmarks.sharding                        # small workload, 3 iterations, all variants
    python -m benchmarks.sharding --variants ddp,fsdp --iterations 4

Three variants of the same run (``train.py`` with ``benchmarks.throughput``'s overrides for the
workload, ``benchmarks.lib.ours.workload_overrides``, ``logger=csv``, a ``last.ckpt`` at the end),
each as a real ``python train.py`` subprocess, because a 2-process strategy needs it (Lightning's
launcher re-runs the command line for rank 1):

* ``ddp``: ``trainer=ddp_cpu``, two gloo processes, each holding the whole model, its gradients
  and AdamW's two moments;
* ``fsdp``: ``trainer=fsdp_cpu``, FSDP2 ``fully_shard`` (``ppo_lightning/parallel/sharding.py``): each rank
  holds half of every policy and reference weight, gradient and AdamW moment. The rollout gathers
  the policy and reference once and samples with full weights (``gather_for_rollout``, default);
* ``fsdp_sharded_rollout``: the same with ``+trainer.strategy.gather_for_rollout=false``: the
  rollout stays sharded, each block's weights all-gathered again for every sampled token.

A callback injected through Hydra (``+callbacks.measure._target_=benchmarks.sharding.MeasureRank``)
measures every rank in its own process and writes ``rank<k>.json``. Per rank, in MB:

* from the tensors, exact: ``policy_mb`` (the policy's parameters this rank holds: a DTensor's
  local shard, each tensor once), ``ref_mb`` (the frozen reference), ``reward_mb`` (the reward
  model, replicated under both strategies), ``grads_mb`` and ``optimizer_mb`` (``optimizer.state``
  tensors, local parts: AdamW's moments and step counters), each the largest seen (gradients
  just before an optimizer step, the rest at the end of an iteration); ``model_state_mb`` = policy + grads + optimizer: what sharding divides by the world
  size (expect ~0.5 of DDP's; not exactly, for the shards' rounding and the replicated scalars);
* from the RSS: ``loaded_rss_mb`` at fit start (the ``setup`` hook: the models built, every
  weight read once as ``benchmarks.memory`` does, ``measure.read_weights``, before FSDP shards them),
  ``train_start_rss_mb`` (after sharding and wrapping), ``peak_rss_mb`` over the whole fit (the
  kernel's high-water mark ``VmHWM``, reset through ``/proc/self/clear_refs`` at fit start, or the
  2 ms sampler of ``benchmarks.lib.measure.PeakRSS`` where it saw more; both beside it) and
  ``peak_above_loaded_mb``. The kernel's mark is also read and reset at each phase boundary:
  ``setup_peak_rss_mb`` (sharding), ``rollout_peak_rss_mb`` (FSDP's gather, sampling, scoring, the
  old logprobs), ``update_peak_rss_mb`` (the PPO epochs), ``checkpoint_peak_rss_mb`` (writing
  ``last.ckpt``: FSDP gathers the full state into rank 0's CPU memory to write one file). The RSS
  includes what sharding does not touch: libraries, the replicated reward model, activations,
  logits and the rollout's tensors, and the allocator's free-but-kept memory.
* times: each iteration's ``perf/time_rollout_s`` and ``perf/time_update_s`` as the module logs
  them; the variant's ``rollout_s`` / ``update_s`` are the medians over iterations after the first
  (which pays for warm-up) of rank 0's ``metrics.csv``.

Per variant also ``checkpoint_mb``: the size of ``last.ckpt``, and what it holds (the policy's
weights and the optimizer state; frozen weights are left out, ``PPOModule.checkpointed``).
Sharded runs gather the full state to rank 0 and write one file, so it should equal DDP's (a
gathered state dict holds GPT-2's tied token embedding and LM head as two tensors; the strategy
writes it once, ``models.weights.drop_tied_aliases``, as ``torch.save`` does DDP's shared storage).
Top level: ratios fsdp / ddp of per-rank model state and peak RSS (the rank with the most), the
checkpoint sizes, and the rollout time gathering once over gathering per token.

The runs set ``MALLOC_MMAP_THRESHOLD_=65536`` (unless the environment sets it): glibc then maps
every allocation of 64 KiB or more on its own and returns it to the kernel when freed, so the RSS
follows the live tensors. With glibc's default (a threshold that grows to 32 MiB) freed memory is
kept for reuse, and the RSS shows the allocator's history instead: the rollout's gathered full
weights, freed before the update, would still count in the update's RSS, and sharding's saving
would not show (measured: a peak ratio fsdp / ddp of 1.01 with the default, 0.96 with this).

CPU timings are noisy: two processes on two cores, and whatever else runs on the machine.
``/proc/loadavg`` at start and end is in the output to judge it. A variant whose overrides the
config refuses is reported as ``{"skipped": reason}``, one whose run fails as ``{"failed": ...}``.
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import lightning as L

from benchmarks.lib import cli
from benchmarks.lib.measure import (
    MB,
    PeakRSS,
    kernel_peak,
    optimizer_tensors,
    read_weights,
    reset_kernel_peak,
    rss,
    tensor_bytes,
)
from benchmarks.lib.ours import workload_overrides
from benchmarks.lib.runner import ROOT, absolute
from benchmarks.lib.workloads import WORKLOADS, build_models, write_prompts

MMAP_THRESHOLD = 65536  # bytes; see the module docstring

VARIANTS = {
    "ddp": ["trainer=ddp_cpu"],
    "fsdp": ["trainer=fsdp_cpu"],
    "fsdp_sharded_rollout": ["trainer=fsdp_cpu", "+trainer.strategy.gather_for_rollout=false"],
}


# ----------------------------------------------------------------------------- in the run
PHASES = ("setup", "rollout", "update", "checkpoint")


class MeasureRank(L.Callback):
    """Measures this rank's memory and times over ``trainer.fit`` and writes ``<out>/rank<k>.json``
    at ``on_fit_end``: after ``on_train_end``, where ModelCheckpoint (always the last callback)
    writes ``last.ckpt``, so that the write counts in the peak.

    The kernel's peak is taken per phase (read and reset at each boundary): ``setup`` (fit start
    to the first rollout: sharding, wrapping), ``rollout`` (the module's ``on_train_batch_start``,
    this callback's hook running just before it, to ``training_step``: FSDP's gather, sampling,
    scoring, the old logprobs), ``update`` (``training_step`` to the next rollout), ``checkpoint``
    (``on_train_end`` to ``on_fit_end``). The 2 ms sampler (``measure.PeakRSS``) runs throughout."""

    def __init__(self, out: str):
        self.out = Path(out)
        self.sampler: PeakRSS | None = None
        self.phase: str | None = None
        self.phase_peaks: dict[str, int] = {}
        self.kernel = False
        self.r: dict = {
            "policy_mb": 0.0,
            "grads_mb": 0.0,
            "optimizer_mb": 0.0,
            "rollout_s_per_iteration": [],
            "update_s_per_iteration": [],
        }

    def _enter(self, phase: str | None) -> None:
        """End the current phase (its kernel peak kept, the mark reset) and start ``phase``."""
        if self.kernel and self.phase is not None:
            self.phase_peaks[self.phase] = max(self.phase_peaks.get(self.phase, 0), kernel_peak() or 0)
            self.kernel = reset_kernel_peak()
        self.phase = phase

    def setup(self, trainer, pl_module, stage: str) -> None:
        # the first callback hook inside fit, before configure_model shards anything
        read_weights([pl_module])
        self.r["loaded_rss_mb"] = rss() / MB
        self.sampler = PeakRSS().__enter__()  # resets the kernel's mark too
        self.kernel = reset_kernel_peak()
        self._enter("setup")
        step = pl_module.training_step  # the update starts here, the rollout ends

        def training_step(*args, **kwargs):
            self._enter("update")
            return step(*args, **kwargs)

        pl_module.training_step = training_step

    def on_train_start(self, trainer, pl_module) -> None:
        self.r["train_start_rss_mb"] = rss() / MB
        self.r["ref_mb"] = tensor_bytes(pl_module.ref_lm.parameters()) / MB
        reward = pl_module.reward_fn
        self.r["reward_mb"] = tensor_bytes(reward.parameters()) / MB if hasattr(reward, "parameters") else 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        self._enter("rollout")

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        # gradients are whole here (the module frees them after an iteration's last step)
        grads = tensor_bytes(p.grad for p in pl_module.policy.parameters()) / MB
        self.r["grads_mb"] = max(self.r["grads_mb"], grads)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        policy = list(pl_module.policy.parameters())
        r = self.r
        r["policy_mb"] = max(r["policy_mb"], tensor_bytes(policy) / MB)
        r["optimizer_mb"] = max(r["optimizer_mb"], tensor_bytes(optimizer_tensors(trainer.optimizers[0])) / MB)
        m = pl_module.last_metrics
        r["rollout_s_per_iteration"].append(float(m["perf/time_rollout_s"]))
        r["update_s_per_iteration"].append(float(m["perf/time_update_s"]))

    def on_train_end(self, trainer, pl_module) -> None:
        self._enter("checkpoint")

    def on_fit_end(self, trainer, pl_module) -> None:
        import torch

        self._enter(None)
        self.sampler.__exit__(None, None, None)
        r = self.r
        for phase in PHASES:
            r[f"{phase}_peak_rss_mb"] = self.phase_peaks[phase] / MB if phase in self.phase_peaks else None
        r["sampled_peak_rss_mb"] = self.sampler.peak / MB
        r["kernel_peak_rss_mb"] = max(self.phase_peaks.values()) / MB if self.phase_peaks else None
        # the kernel's counters lag by up to a few pages per thread: the larger of the two
        r["peak_rss_mb"] = max(r["kernel_peak_rss_mb"] or 0, r["sampled_peak_rss_mb"])
        r["peak_above_loaded_mb"] = r["peak_rss_mb"] - r["loaded_rss_mb"]
        r["model_state_mb"] = r["policy_mb"] + r["grads_mb"] + r["optimizer_mb"]
        r.update(
            rank=trainer.global_rank,
            world_size=trainer.world_size,
            threads=torch.get_num_threads(),
            strategy=type(trainer.strategy).__name__,
            gather_for_rollout=getattr(trainer.strategy, "gather_for_rollout", None),
        )
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"rank{trainer.global_rank}.json").write_text(json.dumps(r))


# ----------------------------------------------------------------------------- the driver
def variant_overrides(
    base: list[str], variant: list[str], iterations: int, run_dir: Path, ranks_dir: Path
) -> list[str]:
    """``base`` with ``variant`` and the measuring setup; a key given again replaces base's."""
    extra = [
        *variant,
        f"trainer.max_steps={iterations}",
        "logger=csv",
        "callbacks=none",
        "trainer.enable_checkpointing=true",
        "+callbacks.last._target_=lightning.pytorch.callbacks.ModelCheckpoint",
        f"+callbacks.last.dirpath={run_dir / 'checkpoints'}",
        "+callbacks.last.save_last=true",
        "+callbacks.last.save_top_k=0",
        "+callbacks.measure._target_=benchmarks.sharding.MeasureRank",
        f"+callbacks.measure.out={ranks_dir}",
        f"paths.output_dir={run_dir}",
        f"hydra.run.dir={run_dir}",
    ]
    keys = {o.split("=", 1)[0].lstrip("+~") for o in extra}
    return [o for o in base if o.split("=", 1)[0].lstrip("+~") not in keys] + extra


def refused(overrides: list[str]) -> str | None:
    """Why the config refuses ``overrides`` (composed and validated once, the strategy built from
    its arguments), or None."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from hydra.utils import instantiate
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    import ppo_lightning.algo.advantages  # noqa: F401  (the estimators register: validate checks ppo.advantage)
    import ppo_lightning.config  # noqa: F401  (the schemas)
    from ppo_lightning.config import validate
    from ppo_lightning.config.errors import ConfigError

    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            cfg = compose("train", overrides=overrides)
        validate(cfg)
        if OmegaConf.is_dict(cfg.trainer.strategy):  # a strategy class: does it take these arguments?
            instantiate(cfg.trainer.strategy)
    except (HydraException, OmegaConfBaseException, ConfigError, TypeError) as e:
        return f"{type(e).__name__}: {' '.join(str(e).split())[:300]}"
    return None


def median_after_first(rows: list[dict], key: str) -> float | None:
    vals = [float(r[key]) for r in rows if r.get(key) not in (None, "")]
    vals = vals[1:] if len(vals) > 1 else vals
    return round(statistics.median(vals), 4) if vals else None


def checkpoint_contents(path: Path) -> dict:
    """``last.ckpt``'s size and what its tensors take: the weights, the optimizer state."""
    import torch

    ck = torch.load(path, map_location="cpu", mmap=True, weights_only=False)

    def tensors(obj):
        if isinstance(obj, torch.Tensor):
            yield obj
        elif isinstance(obj, dict):
            for v in obj.values():
                yield from tensors(v)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                yield from tensors(v)

    def nbytes(obj) -> int:  # a tied weight (two names, one storage) once, as the file holds it
        return tensor_bytes(tensors(obj))

    return {
        "checkpoint_mb": round(path.stat().st_size / MB, 3),
        "checkpoint_weights_mb": round(nbytes(ck.get("state_dict", {})) / MB, 3),
        "checkpoint_optimizer_mb": round(nbytes(ck.get("optimizer_states", [])) / MB, 3),
    }


def run_variant(name: str, overrides: list[str], run_dir: Path, ranks_dir: Path, cache: Path, timeout: float) -> dict:
    env = {
        "MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD),
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PPO_LIGHTNING_CACHE": str(cache),
        "HYDRA_FULL_ERROR": "1",
    }
    t0 = time.perf_counter()
    p = subprocess.run(
        [sys.executable, "train.py", *overrides],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    wall = time.perf_counter() - t0
    if p.returncode:
        return {"failed": f"exit {p.returncode}: {p.stderr[-3000:]}"}
    ranks = sorted(ranks_dir.glob("rank*.json"))
    per_rank = [json.loads(f.read_text()) for f in ranks]
    with open(run_dir / "metrics.csv") as f:
        rows = [r for r in csv.DictReader(f) if r.get("perf/time_rollout_s")]
    keys = (
        "loaded_rss_mb",
        "train_start_rss_mb",
        "peak_rss_mb",
        "sampled_peak_rss_mb",
        "kernel_peak_rss_mb",
        "peak_above_loaded_mb",
        *(f"{phase}_peak_rss_mb" for phase in PHASES),
        "policy_mb",
        "ref_mb",
        "reward_mb",
        "grads_mb",
        "optimizer_mb",
        "model_state_mb",
    )
    out = {
        "ranks": [
            {
                "rank": r["rank"],
                **{k: None if r[k] is None else round(r[k], 3) for k in keys},
                "rollout_s_per_iteration": [round(x, 3) for x in r["rollout_s_per_iteration"]],
                "update_s_per_iteration": [round(x, 3) for x in r["update_s_per_iteration"]],
            }
            for r in per_rank
        ],
        "strategy": per_rank[0]["strategy"],
        "gather_for_rollout": per_rank[0]["gather_for_rollout"],
        "world_size": per_rank[0]["world_size"],
        "threads_per_rank": per_rank[0]["threads"],
        "iterations_logged": len(rows),
        "rollout_s": median_after_first(rows, "perf/time_rollout_s"),
        "update_s": median_after_first(rows, "perf/time_update_s"),
        "run_wall_s": round(wall, 1),
    }
    ckpt = run_dir / "checkpoints" / "last.ckpt"
    out.update(checkpoint_contents(ckpt) if ckpt.exists() else {"checkpoint_mb": None})
    return out


def loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


def main() -> None:
    ap = cli.parser(__doc__)
    cli.add_workload(ap, default="small")
    ap.add_argument("--iterations", type=int, default=3, help="PPO iterations per run")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, from {list(VARIANTS)}")
    cli.add_model_dir(ap)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per run")
    args = ap.parse_args()

    w = WORKLOADS[args.workload]
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {list(VARIANTS)}")
    t0 = time.perf_counter()
    out = {
        "benchmark": "sharding",
        "workload": w.name,
        "layers": w.n_layer,
        "width": w.n_embd,
        "rollout_batch_per_rank": w.rollout_batch,
        "response_tokens": w.response_tokens,
        "ppo_epochs": w.ppo_epochs,
        "iterations": args.iterations,
        "device": "cpu (2 gloo processes)",
        "loadavg_start": loadavg(),
        "malloc_mmap_threshold": os.environ.get("MALLOC_MMAP_THRESHOLD_", str(MMAP_THRESHOLD)),
        "note": "CPU timings are noisy: 2 ranks on 2 cores, other jobs may share them (see loadavg); "
        "memory from tensors is exact, RSS includes libraries, the replicated reward model "
        "and activations",
    }
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model_root = Path(absolute(args.model_dir)) if args.model_dir else tmp / "models"  # train.py runs from ROOT
        policy_dir, reward_dir = build_models(w, model_root)  # once, for every run
        prompts = write_prompts(w, tmp)
        base = workload_overrides(w, policy_dir, reward_dir, prompts, tmp / "unused")
        planned = {}
        for v in variants:  # every variant's config checked before the first run
            run_dir, ranks_dir = tmp / v / "run", tmp / v / "ranks"
            overrides = variant_overrides(base, VARIANTS[v], args.iterations, run_dir, ranks_dir)
            reason = refused([o for o in overrides if not o.startswith("hydra.")])
            if reason:
                results[v] = {"skipped": reason}
            else:
                planned[v] = (overrides, run_dir, ranks_dir)
        for v, (overrides, run_dir, ranks_dir) in planned.items():
            results[v] = run_variant(v, overrides, run_dir, ranks_dir, tmp / "cache", args.timeout)
    out.update(results)

    def ok(v):
        return v in results and "ranks" in results[v]

    def worst(v, key):  # the rank with the most
        vals = [r[key] for r in results[v]["ranks"]]
        return None if None in vals else max(vals)

    def ratio(a, b):
        return None if a is None or not b else round(a / b, 3)

    if ok("ddp") and ok("fsdp"):
        out["fsdp_over_ddp"] = {
            "model_state_per_rank": ratio(worst("fsdp", "model_state_mb"), worst("ddp", "model_state_mb")),
            "policy_per_rank": ratio(worst("fsdp", "policy_mb"), worst("ddp", "policy_mb")),
            "ref_per_rank": ratio(worst("fsdp", "ref_mb"), worst("ddp", "ref_mb")),
            "peak_rss_per_rank": ratio(worst("fsdp", "peak_rss_mb"), worst("ddp", "peak_rss_mb")),
            "rollout_peak_rss_per_rank": ratio(
                worst("fsdp", "rollout_peak_rss_mb"), worst("ddp", "rollout_peak_rss_mb")
            ),
            "update_peak_rss_per_rank": ratio(worst("fsdp", "update_peak_rss_mb"), worst("ddp", "update_peak_rss_mb")),
            "peak_above_loaded_per_rank": ratio(
                worst("fsdp", "peak_above_loaded_mb"), worst("ddp", "peak_above_loaded_mb")
            ),
            "checkpoint_size": ratio(results["fsdp"]["checkpoint_mb"], results["ddp"]["checkpoint_mb"]),
            "rollout_s": ratio(results["fsdp"]["rollout_s"], results["ddp"]["rollout_s"]),
            "update_s": ratio(results["fsdp"]["update_s"], results["ddp"]["update_s"]),
        }
    out["checkpoint_mb"] = {v: results[v].get("checkpoint_mb") for v in variants if ok(v)}
    if ok("fsdp") and ok("fsdp_sharded_rollout"):
        out["rollout_s_gather_once_over_per_token"] = ratio(
            results["fsdp"]["rollout_s"], results["fsdp_sharded_rollout"]["rollout_s"]
        )
        out["rollout_peak_rss_gather_once_over_per_token"] = ratio(
            worst("fsdp", "rollout_peak_rss_mb"), worst("fsdp_sharded_rollout", "rollout_peak_rss_mb")
        )
    out["loadavg_end"] = loadavg()
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out), flush=True)
    if any("failed" in r for r in results.values()):
        sys.exit(1)


if __name__ == "__main__":
    main()
