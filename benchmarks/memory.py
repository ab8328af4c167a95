"""Peak memory of PPO iterations with each memory switch, and of TRL's PPOTrainer: one JSON line.

    python -m benchmarks.memory --workload small
    python -m benchmarks.memory --workload small --variants full,gradient_checkpointing --repeats 3
    python -m benchmarks.memory --workload medium          # all variants and TRL, ~20 min on 2 cores

Each variant runs in a fresh process (``python -m benchmarks.memory --child <variant>``: the real
config, models and Trainer of ``benchmarks.throughput``, ``benchmarks.lib.ours.compose``), and so
does TRL 1.12's ``PPOTrainer`` on the same workload, models, prompts and thread count
(``benchmarks.lib.trl_ppo.build_trainer`` / ``train``), for the same number of PPO
iterations (``--iterations``). A thread samples the process's RSS every 2 ms during
``trainer.fit`` (TRL: ``trainer.train()``): rollouts and updates. Per variant, in MB:

* ``total_peak_mb``: the process's peak RSS during training, everything included (libraries,
  the loaded models, optimizer state, activations). The comparison with TRL is about this: TRL
  keeps four models (policy, reference, reward, value), ppo_lightning three (policy and value
  head on one backbone, reference, reward), or two with LoRA (the reference is the policy with
  its adapters off). ``total_peak_ratio_to_trl`` divides it by TRL's.
* its breakdown: ``imports_mb`` (RSS with the libraries imported, before any model loads),
  ``loaded_mb`` (RSS with the models loaded, the trainer built and every weight read once:
  ``from_pretrained`` maps the weights lazily, see ``benchmarks.lib.measure.read_weights``), so ``models_mb`` =
  ``loaded_mb - imports_mb``, and ``peak_above_loaded_mb`` = ``total_peak_mb - loaded_mb``.
* ``peak_above_models_mb``: the peak above the RSS just before fit with the weights as
  ``from_pretrained`` left them (the measure the ``small`` table of docs/scaling.md uses; the weights not
  read while loading count in it). ``ratio_to_full`` is a switch's over full fine-tuning's,
  measured in this run, so that what a switch saves in activations shows undiluted by the weights.
* from the tensors rather than the RSS: ``weights_mb`` (every parameter held, shared ones once),
  ``trainable_params_m`` and ``grads_and_adam_mb`` (4 + 8 bytes per trainable float32 parameter:
  the gradient and AdamW's two moments), and ``activations_mb`` = ``peak_above_loaded_mb`` minus
  that estimate (activations, logits, rollout tensors and allocator slack at the peak).
* ``kernel_peak_mb``: the kernel's high-water mark over training (``VmHWM`` after resetting it
  through ``/proc/self/clear_refs``), a check on the 2 ms sampler; null where the kernel refuses.

A variant whose overrides the config does not accept (a key it does not have yet) is reported as
``{"skipped": reason}`` and the others still run. Variants alternate over ``--repeats`` rounds,
medians reported; the default is 3 rounds, 1 for ``medium`` (each of its runs takes minutes).
On a GPU the measure would be ``torch.cuda.max_memory_allocated`` (``benchmarks.gpu_check``).
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import cli
from benchmarks.lib.measure import MB, PeakRSS, read_weights, rss, tensor_bytes
from benchmarks.lib.runner import absolute, alternate, module_cmd, run_json
from benchmarks.lib.workloads import WORKLOADS, build_models, write_prompts

VARIANTS = {
    "full": [],
    "gradient_checkpointing": ["model.gradient_checkpointing=true"],
    "micro_batches_4": ["ppo.micro_batch_size=4"],
    "checkpointing_and_micro_batches_4": ["model.gradient_checkpointing=true", "ppo.micro_batch_size=4"],
    "lora": ["model.lora.r=16"],
    "lora_and_checkpointing": ["model.lora.r=16", "model.gradient_checkpointing=true"],
    "lean_head": ["ppo.lm_head_chunk_size=256"],  # the default since; "full" runs it too
    "plain_head": ["ppo.lm_head_chunk_size=null"],  # [batch, response, vocab] logits at once
}
TRL = "trl"  # TRL's PPOTrainer on the same workload: not a switch of ours, measured alongside


def tensor_sizes(models, trainable) -> dict:
    """Weights held by ``models`` (each parameter once, however often it is shared or tied) and the
    gradient + AdamW estimate for ``trainable`` parameters (float32: 4 + 2 x 4 bytes each)."""
    weights = tensor_bytes(p for m in models for p in m.parameters())
    n_train = sum(p.numel() for p in trainable)
    grads_and_adam = sum(p.numel() * p.element_size() * 3 for p in trainable)
    return {"weights_mb": weights / MB, "trainable_params_m": n_train / 1e6, "grads_and_adam_mb": grads_and_adam / MB}


def measured(imports: int, unread: int, loaded: int, peak: PeakRSS, sizes: dict, train_s: float) -> dict:
    return {
        "total_peak_mb": peak.peak / MB,
        "imports_mb": imports / MB,
        "loaded_mb": loaded / MB,
        "models_mb": (loaded - imports) / MB,
        "peak_above_loaded_mb": (peak.peak - loaded) / MB,
        "peak_above_models_mb": (peak.peak - unread) / MB,
        "kernel_peak_mb": None if peak.kernel_peak is None else peak.kernel_peak / MB,
        **sizes,
        "fit_s": train_s,
    }


def child_ours(workload: str, variant: str, iterations: int, model_root: Path, threads: int | None) -> dict:
    import torch
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    from benchmarks.lib.ours import compose
    from ppo_lightning.config.errors import ConfigError
    from ppo_lightning.jobs.factory import build

    cli.set_threads(threads)
    w = WORKLOADS[workload]
    gc.collect()
    imports = rss()
    policy_dir, reward_dir = build_models(w, model_root)
    with tempfile.TemporaryDirectory() as out:
        out = Path(out)
        prompts = write_prompts(w, out)
        try:
            cfg = compose(
                w, policy_dir, reward_dir, prompts, out, extra=(f"trainer.max_steps={iterations}", *VARIANTS[variant])
            )
            module, datamodule, trainer = build(cfg)
        except (HydraException, OmegaConfBaseException, ConfigError) as e:  # the config lacks a key
            return {"skipped": f"{type(e).__name__}: {str(e).strip().splitlines()[0]}"}
        sizes = tensor_sizes([module], [p for p in module.policy.parameters() if p.requires_grad])
        gc.collect()
        unread = rss()
        read_weights([module])
        loaded = rss()
        with PeakRSS() as peak:
            t0 = time.perf_counter()
            trainer.fit(module, datamodule=datamodule)
            fit_s = time.perf_counter() - t0
    return {**measured(imports, unread, loaded, peak, sizes, fit_s), "threads": torch.get_num_threads()}


def child_trl(workload: str, iterations: int, model_root: Path, threads: int | None) -> dict:
    import datasets  # noqa: F401  imported before the baseline RSS, as ours are
    import torch
    import trl.experimental.ppo  # noqa: F401

    from benchmarks.lib.trl_ppo import build_trainer, train

    w = WORKLOADS[workload]
    gc.collect()
    imports = rss()
    run = build_trainer(w, model_root, episodes=iterations * w.rollout_batch, threads=threads)
    t = run.trainer
    # t.model wraps the policy and the value model, the two that train
    models = [t.model, t.ref_model, t.reward_model]
    sizes = tensor_sizes(models, [p for p in t.model.parameters() if p.requires_grad])
    gc.collect()
    unread = rss()
    read_weights(models)
    loaded = rss()
    with PeakRSS() as peak:
        train_s = train(run)["total_s"]
    run.tmp.cleanup()
    return {**measured(imports, unread, loaded, peak, sizes, train_s), "threads": torch.get_num_threads()}


def summarize(runs: list[dict]) -> dict:
    """Medians over the repeats of every measure; the breakdown's estimate derived from them."""
    if any("skipped" in r for r in runs):
        return {"skipped": next(r["skipped"] for r in runs if "skipped" in r)}
    keys = (
        "total_peak_mb",
        "imports_mb",
        "loaded_mb",
        "models_mb",
        "peak_above_loaded_mb",
        "peak_above_models_mb",
        "kernel_peak_mb",
        "weights_mb",
        "trainable_params_m",
        "grads_and_adam_mb",
        "fit_s",
    )
    out = {}
    for k in keys:
        vals = [r[k] for r in runs if r[k] is not None]
        out[k] = round(statistics.median(vals), 3 if k == "trainable_params_m" else 1) if vals else None
    out["activations_mb"] = round(out["peak_above_loaded_mb"] - out["grads_and_adam_mb"], 1)
    return out


def main() -> None:
    ap = cli.parser(__doc__)
    cli.add_workload(ap, default="small")
    ap.add_argument(
        "--variants",
        default=",".join([*VARIANTS, TRL]),
        help=f"comma-separated, from {[*VARIANTS, TRL]} (default: all)",
    )
    ap.add_argument("--repeats", type=int, help="rounds over the variants (default 3; 1 for medium)")
    ap.add_argument("--iterations", type=int, default=2, help="PPO iterations per run, both sides")
    cli.add_threads(ap, help="torch.set_num_threads in every run (default: torch's)")
    cli.add_model_dir(ap)
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        model_root = Path(args.model_dir)
        if args.child == TRL:
            from benchmarks.lib.trl_side import stdout_for_one_line, write_line

            result_out = stdout_for_one_line()  # TRL prints to stdout
            write_line(result_out, child_trl(args.workload, args.iterations, model_root, args.threads))
        else:
            print(json.dumps(child_ours(args.workload, args.child, args.iterations, model_root, args.threads)))
        return

    w = WORKLOADS[args.workload]
    variants = args.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS and v != TRL]
    if unknown:
        sys.exit(f"--variants: unknown {unknown}; choose from {[*VARIANTS, TRL]}")
    repeats = args.repeats or (1 if w.name == "medium" else 3)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        model_root = absolute(args.model_dir or tmp)
        build_models(w, model_root)  # once, before any child measures

        def child(v: str):  # a fresh process per run
            cmd = ["--workload", w.name, "--child", v, "--iterations", str(args.iterations), "--model-dir", model_root]
            if args.threads:
                cmd += ["--threads", str(args.threads)]
            return lambda r: run_json(module_cmd("memory", *cmd), f"variant {v}")

        # alternate, so machine noise hits every variant; a variant the config refuses runs once
        runs = alternate({v: child(v) for v in variants}, repeats, done=lambda r: "skipped" in r)
    threads = {r["threads"] for rs in runs.values() for r in rs if "threads" in r}
    assert len(threads) <= 1, f"runs used different thread counts: {threads}"
    out = {
        "benchmark": "memory",
        "workload": w.name,
        "layers": w.n_layer,
        "width": w.n_embd,
        "vocab": w.vocab_size or 258,
        "rollout_batch": w.rollout_batch,
        "minibatch": w.minibatch_size,
        "tokens_per_row": w.prompt_tokens + w.response_tokens,
        "ppo_epochs": w.ppo_epochs,
        "iterations": args.iterations,
        "repeats": repeats,
        "threads": threads.pop() if threads else None,
        "device": "cpu",
        "measure": "RSS in MB: total peak during training = imports + models + peak above "
        "loaded; peak above models as in the small table of docs/scaling.md; medians over repeats",
    }
    results = {v: summarize(rs) for v, rs in runs.items()}
    full = results.get("full", {}).get("peak_above_models_mb")
    trl_total = results.get(TRL, {}).get("total_peak_mb")
    for v, r in results.items():
        if "skipped" not in r and v != TRL:
            if full:
                r["ratio_to_full"] = round(r["peak_above_models_mb"] / full, 3)
            if trl_total:
                r["total_peak_ratio_to_trl"] = round(r["total_peak_mb"] / trl_total, 3)
        out[v] = r
    out["wall_s"] = round(time.perf_counter() - t0, 1)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
