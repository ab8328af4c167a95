"""TRL 1.16's ``GRPOTrainer`` (``use_vllm=False``, or its colocated vLLM engine) on a workload with
the GRPO shape of ``grpo_workload``, fp32 on CPU: ``build_trainer`` (the trainer constructed, with
a ``PhaseTimer``) and ``train`` (``trainer.train()``, timed). ``benchmarks/trl_grpo_baseline.py``
says what is run and measured; ``benchmarks.profile_iteration`` profiles one iteration."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from benchmarks.lib.grpo_workload import ADAM_EPS, BETA, LR, char_fraction_reward
from benchmarks.lib.runner import free_port
from benchmarks.lib.trl_side import check_tokens, cpu_fp32_config
from benchmarks.lib.workloads import Workload, build_models, make_prompts, render_prompts, tokenizer_source

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
        os.environ["MASTER_PORT"] = str(free_port())
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(kv_cache_gib))


class PhaseTimer:
    """Times the trainer's rollout (``_generate_and_score_completions``) and ``generate`` calls,
    and checks that every completion is full length (``response_tokens``; None: completions stop
    at EOS, and their tokens are counted)."""

    def __init__(self, response_tokens: int | None):
        self.response_tokens = response_tokens
        self.rollout_s = 0.0
        self.generate_s = 0.0
        self.rollouts = 0
        self.completions = 0
        self.completion_tokens = 0
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
            if self.response_tokens is not None and lengths != {self.response_tokens}:
                raise RuntimeError(f"completion lengths {sorted(lengths)}, expected all {self.response_tokens}")
            self.completions += len(completion_ids)
            self.completion_tokens += sum(len(ids) for ids in completion_ids)
            return completion_ids, logprobs

        # instance attributes: the trainer calls both through self
        trainer._generate_and_score_completions = generate_and_score
        trainer._generate_single_turn = generate_single_turn


def build_trainer(
    w: Workload,
    model_root: Path,
    prompts: int,
    generations: int,
    iterations: int,
    out_dir: Path,
    use_vllm=False,
    bf16=False,
):
    """TRL's ``GRPOTrainer`` on the workload, ready for ``train()``, with its ``PhaseTimer``;
    ``bf16``: under bf16 autocast (``bf16=True``)."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    policy_dir, _ = build_models(w, model_root)
    tok_dir = tokenizer_source(policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, padding_side="left")
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    texts = make_prompts(w)  # chats: TRL renders them through the tokenizer's template, as here
    check_tokens(w, tokenizer, tokenizer(render_prompts(w, tokenizer, texts))["input_ids"])  # as TRL tokenises
    rows = prompts * generations
    # one generation batch of P x G rows is one optimizer step: one micro-batch, or where the
    # workload's logits would not fit (Qwen2's vocabulary), micro-batches of one group each
    micro = generations if w.stops_at_eos else rows
    config = cpu_fp32_config(
        GRPOConfig,
        out_dir / "trl-output",
        bf16,
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=rows // micro,
        steps_per_generation=rows // micro,
        num_iterations=1,  # one pass over it
        num_generations=generations,
        max_steps=iterations,
        max_completion_length=w.response_tokens,
        # full-length completions, EOS never sampled (vLLM's SamplingParams calls it min_tokens),
        # unless the workload's completions stop at EOS
        generation_kwargs={} if w.stops_at_eos else {"min_tokens" if use_vllm else "min_new_tokens": w.response_tokens},
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
        log_completions=False,
    )
    trainer = GRPOTrainer(
        model=policy,
        reward_funcs=char_fraction_reward,
        args=config,
        train_dataset=Dataset.from_dict({"prompt": texts}),
        processing_class=tokenizer,
    )
    assert config.generation_batch_size == rows and config.steps_per_generation == rows // micro
    assert trainer.ref_model is not None and trainer.beta == BETA
    timer = PhaseTimer(None if w.stops_at_eos else w.response_tokens)
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
        "generated_tokens_per_s": timer.completion_tokens / total_s,
        "rollout_s": timer.rollout_s,
        "update_s": total_s - timer.rollout_s,
        "generate_s": timer.generate_s,
        "total_s": total_s,
    }
