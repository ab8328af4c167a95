"""TRL 1.12's ``PPOTrainer`` (``trl.experimental.ppo``) on a workload, fp32 on CPU, in two halves:
``build_trainer`` (the models loaded, the trainer constructed) and ``train`` (``trainer.train()``,
timed, split into rollout and update by ``PhaseTimer``). ``benchmarks/trl_baseline.py`` says what
is run and measured; ``benchmarks.memory`` samples TRL's memory between the two halves and
``benchmarks.profile_iteration`` profiles one iteration."""

from __future__ import annotations

import dataclasses
import gc
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib.measure import MB, rss
from benchmarks.lib.trl_side import check_tokens, cpu_fp32_config
from benchmarks.lib.workloads import Workload, build_models, render_prompts, tokenizer_source


class PhaseTimer:
    """Accumulates rollout time from TRL's ``batch_generation`` / ``forward`` call boundaries, and
    the response tokens sampled: ``response_tokens`` each (checked), or for a workload whose
    completions stop at EOS (``response_tokens=None``) each row's tokens up to its first EOS."""

    def __init__(self, response_tokens: int | None, pad_token_id: int, eos_token_id: int | None = None):
        self.response_tokens = response_tokens
        self.pad_token_id = pad_token_id
        self.eos_token_id = eos_token_id
        self.sampled_tokens = 0
        self.in_rollout = False
        self.rollout_start = 0.0
        self.rollout_s = 0.0
        self.generate_s = 0.0
        self.iterations = 0
        self.sampled_pad_tokens = 0
        self.rollout_end = None
        self.per_iteration: list[tuple[float, float]] = []  # (rollout_s, update_s)
        self.rss_mb: list[float] = []  # process RSS at the end of each rollout phase

    def install(self, ppo_trainer_module) -> None:
        import torch

        orig_batch_generation = ppo_trainer_module.batch_generation
        orig_forward = ppo_trainer_module.forward

        def batch_generation(model, queries, *args, **kwargs):
            if not self.in_rollout:
                self.in_rollout = True
                self.rollout_start = time.perf_counter()
                if self.rollout_end is not None:  # close the previous iteration's update phase
                    prev = self.per_iteration[-1]
                    self.per_iteration[-1] = (prev[0], self.rollout_start - self.rollout_end)
            t0 = time.perf_counter()
            query_responses, logits = orig_batch_generation(model, queries, *args, **kwargs)
            self.generate_s += time.perf_counter() - t0
            n_new = query_responses.shape[1] - queries.shape[1]
            if self.response_tokens is not None and (
                n_new != self.response_tokens or logits.shape[1] != self.response_tokens
            ):
                raise RuntimeError(f"generation stopped early: {n_new} new tokens, expected {self.response_tokens}")
            responses = query_responses[:, queries.shape[1] :]
            real = torch.ones_like(responses, dtype=torch.bool)
            if self.response_tokens is None:  # after a row's EOS, generate pads
                eos = (responses == self.eos_token_id).int()
                real = (eos.cumsum(1) - eos) == 0  # up to and including the first EOS
            self.sampled_tokens += int(real.sum())
            # A random policy can sample the pad token itself; TRL then treats the rest of that
            # response as padding (masks), though the tensors (and the compute) stay full length.
            self.sampled_pad_tokens += int(((responses == self.pad_token_id) & real).sum())
            return query_responses, logits

        def forward(model, query_responses, pad_token_id):
            if self.in_rollout and torch.is_grad_enabled():  # first PPO training forward
                self.rollout_end = time.perf_counter()
                self.rollout_s += self.rollout_end - self.rollout_start
                self.per_iteration.append((self.rollout_end - self.rollout_start, float("nan")))
                self.rss_mb.append(rss() / MB)
                self.in_rollout = False
                self.iterations += 1
            return orig_forward(model, query_responses, pad_token_id)

        ppo_trainer_module.batch_generation = batch_generation
        ppo_trainer_module.forward = forward


@dataclasses.dataclass
class TRLRun:
    """A constructed TRL ``PPOTrainer`` on a workload, ready for ``train``."""

    workload: Workload
    episodes: int
    trainer: object
    timer: PhaseTimer
    tmp: tempfile.TemporaryDirectory


def build_trainer(
    w: Workload, model_root: Path, episodes: int | None = None, threads: int | None = None, bf16: bool = False
) -> TRLRun:
    """Load the workload's models four times (policy, reference, reward, value) and construct
    TRL's ``PPOTrainer`` for ``episodes`` prompts (default: the workload's); ``bf16``: under bf16
    autocast (``bf16=True``)."""
    import torch
    import trl.experimental.ppo.ppo_trainer as ppo_trainer_module
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer
    from trl.experimental.ppo import PPOConfig, PPOTrainer

    episodes = w.episodes if episodes is None else episodes
    if episodes % w.rollout_batch or w.rollout_batch % w.num_minibatches:
        raise ValueError(f"workload {w.name}: rollout_batch must divide episodes and be divisible by num_minibatches")
    if threads is not None:
        torch.set_num_threads(threads)
    tmp = tempfile.TemporaryDirectory(prefix="trl-baseline-")
    policy_dir, reward_dir = build_models(w, model_root)

    tok_dir = tokenizer_source(policy_dir)
    tokenizer = AutoTokenizer.from_pretrained(tok_dir, padding_side="left")  # prompts of spread lengths
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    ref_policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1, dtype=torch.float32)
    value_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1, dtype=torch.float32)
    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in render_prompts(w, tokenizer)]
    check_tokens(w, tokenizer, prompt_ids)
    train_dataset = Dataset.from_dict({"input_ids": prompt_ids})

    config = cpu_fp32_config(
        PPOConfig,
        Path(tmp.name) / "trl-output",
        bf16,
        # One PPO iteration = per_device_train_batch_size * gradient_accumulation_steps prompts
        # (x world_size = 1), generated/scored in chunks of local_rollout_forward_batch_size. Each
        # minibatch (rollout_batch / num_mini_batches) is then a single micro-batch, so with
        # gradient_accumulation_steps=1 there is one optimizer step per minibatch.
        per_device_train_batch_size=w.rollout_batch,
        gradient_accumulation_steps=1,
        local_rollout_forward_batch_size=w.rollout_batch,
        num_mini_batches=w.num_minibatches,
        num_ppo_epochs=w.ppo_epochs,
        total_episodes=episodes,
        response_length=w.response_tokens,
        temperature=1.0,  # ours samples at 1.0 (PPOConfig's default is 0.7): gsm8k_like's lengths are baked for it
        # full-length responses (no EOS stop, no truncation), or for gsm8k_like's completions
        # that stop at EOS, TRL's EOS stop: generate stops a chunk when its last row has stopped,
        # and the response is truncated after its first EOS
        stop_token="eos" if w.stops_at_eos else None,
        stop_token_id=None,
        missing_eos_penalty=None,
        num_sample_generations=0,  # no debugging sample generations
    )
    trainer = PPOTrainer(
        args=config,
        processing_class=tokenizer,
        model=policy,
        ref_model=ref_policy,
        reward_model=reward_model,
        train_dataset=train_dataset,
        value_model=value_model,
    )
    assert config.batch_size == w.rollout_batch and config.num_total_batches == episodes // w.rollout_batch
    assert config.local_mini_batch_size == w.minibatch_size
    # stop_token=None made TRL clear the policy's eos_token_id: generate() never stops at EOS.
    eos = tokenizer.eos_token_id if w.stops_at_eos else None
    assert policy.generation_config.eos_token_id == eos and trainer.stop_token_id == eos
    print(
        f"[trl_baseline] optimizer={type(trainer.optimizer.optimizer).__name__} "
        f"lr={config.learning_rate} device={trainer.accelerator.device}",
        file=sys.stderr,
    )

    timer = PhaseTimer(None if w.stops_at_eos else w.response_tokens, tokenizer.pad_token_id, tokenizer.eos_token_id)
    timer.install(ppo_trainer_module)
    if threads is not None:
        torch.set_num_threads(threads)
    return TRLRun(w, episodes, trainer, timer, tmp)


def train(run: TRLRun) -> dict:
    """``trainer.train()``, timed; checks that it ran every episode at full response length."""
    import torch

    w, trainer, timer = run.workload, run.trainer, run.timer
    print(f"[trl_baseline] rss before train: {rss() / MB:.0f} MiB", file=sys.stderr)
    gc.collect()
    gc.freeze()  # TRL's per-update gc.collect() then only scans objects created during training
    t0 = time.perf_counter()
    trainer.train()
    t_end = time.perf_counter()
    total_s = t_end - t0
    gc.unfreeze()
    if timer.per_iteration:  # the last update phase ends when train() returns
        timer.per_iteration[-1] = (timer.per_iteration[-1][0], t_end - timer.rollout_end)

    episodes = trainer.state.episode
    iterations = run.episodes // w.rollout_batch
    if episodes != run.episodes or timer.iterations != iterations:
        raise RuntimeError(
            f"ran {episodes} episodes / {timer.iterations} iterations, expected {run.episodes} / {iterations}"
        )
    rollout_s = timer.rollout_s
    print(
        f"[trl_baseline] threads={torch.get_num_threads()} generate_s={timer.generate_s:.3f} "
        f"sampled_pad_tokens={timer.sampled_pad_tokens}",
        file=sys.stderr,
    )
    for i, ((r, u), mib) in enumerate(zip(timer.per_iteration, timer.rss_mb)):
        print(f"[trl_baseline] iteration {i}: rollout {r:.3f}s update {u:.3f}s rss {mib:.0f} MiB", file=sys.stderr)
    return {
        "impl": "trl",
        "workload": w.name,
        "episodes": episodes,
        "episodes_per_s": episodes / total_s,
        "generated_tokens_per_s": timer.sampled_tokens / total_s,
        "mean_response_tokens": timer.sampled_tokens / episodes,
        "rollout_s": rollout_s,
        "update_s": total_s - rollout_s,
        "total_s": total_s,
    }
