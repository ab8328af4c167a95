"""TRL baseline: time TRL's ``PPOTrainer`` (``trl.experimental.ppo``, trl==1.12.0) on a named workload.

This is the reference point ppo_lightning is compared against. It runs stock TRL PPO, fp32 on CPU,
on exactly the workload defined in ``benchmarks/workloads.py``:

* policy: the workload's saved GPT-2 causal LM; reference: a second ``from_pretrained`` of the
  same dir; tokenizer: the one saved with it (byte-level, or ``medium``'s 50257-entry word
  vocabulary), the very files ppo_lightning loads;
* reward model and value model: two separate loads of the saved random
  ``GPT2ForSequenceClassification`` dir (TRL's reward-model path; TRL needs a value model too, and
  initialising it from the reward model is what TRL users do);
* prompts: ``make_prompts(w)`` through that tokenizer, each exactly ``w.prompt_tokens`` tokens
  (so the collator never pads);
* responses: exactly ``w.response_tokens`` sampled tokens, no stop token (``stop_token=None``,
  ``stop_token_id=None``, which makes TRL clear ``generation_config.eos_token_id``, so ``generate``
  never stops at EOS; the script checks every rollout is full length);
* one PPO iteration consumes ``w.rollout_batch`` prompts (generated in one ``generate`` call),
  then ``w.ppo_epochs`` epochs of ``w.num_minibatches`` minibatches, one optimizer step each;
  ``w.episodes`` prompts in all.

What is timed is the wall time of ``trainer.train()`` (model loading, dataset building and trainer
construction are excluded). TRL's per-update ``gc.collect()`` is neutralised by ``gc.freeze()``
just before training; its ``empty_cache()`` helper (``torch.cuda.empty_cache()`` on CPU, a no-op)
is left alone. TRL's default per-update metric logging stays on; eval, sample generations,
checkpointing and reporting integrations are off.

Rollout/update split: TRL's ``train()`` is one monolithic loop, so the script marks phase
boundaries by wrapping two module-level functions of ``trl.experimental.ppo.ppo_trainer``:
``batch_generation`` (its first call in an iteration opens the rollout phase) and ``forward``
(its first call with grad enabled is the first PPO minibatch forward, which closes it).
``rollout_s`` is therefore generation + logprob/ref/value/reward forwards + reward shaping, GAE and
whitening (plus TRL's post-rollout ``gc.collect()``); ``update_s = total_s - rollout_s`` is the PPO
epochs plus per-update bookkeeping (metrics, LR scheduler step, the ``next()`` on the dataloader).

Usage::

    PYTHONPATH=. python benchmarks/trl_baseline.py --workload tiny [--model-dir DIR] [--threads N]

prints exactly one JSON line on stdout; all other output (TRL's logs, progress bar, and this
script's per-iteration rollout/update/RSS trace) goes to stderr. ``peak_rss_mb`` is the process's
``ru_maxrss`` (so it includes model loading).

``build_trainer`` and ``train`` are the two halves of a run; ``benchmarks/memory.py`` calls them
in a child process to sample TRL's memory between them.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import psutil

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["ACCELERATE_USE_CPU"] = "true"  # TRL builds its own Accelerator(); keep it on CPU

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.workloads import WORKLOADS, Workload, build_models, make_prompts


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workload", required=True, choices=sorted(WORKLOADS))
    p.add_argument(
        "--model-dir", default=None, help="where to save (or reuse) the workload's models; default: a temp dir"
    )
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads(N); default: torch's default")
    return p.parse_args(argv)


class PhaseTimer:
    """Accumulates rollout time from TRL's ``batch_generation`` / ``forward`` call boundaries."""

    def __init__(self, response_tokens: int, pad_token_id: int):
        self.response_tokens = response_tokens
        self.pad_token_id = pad_token_id
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
            if n_new != self.response_tokens or logits.shape[1] != self.response_tokens:
                raise RuntimeError(f"generation stopped early: {n_new} new tokens, expected {self.response_tokens}")
            # A random policy can sample the pad token itself; TRL then treats the rest of that
            # response as padding (masks), though the tensors (and the compute) stay full length.
            self.sampled_pad_tokens += int((query_responses[:, queries.shape[1] :] == self.pad_token_id).sum())
            return query_responses, logits

        def forward(model, query_responses, pad_token_id):
            if self.in_rollout and torch.is_grad_enabled():  # first PPO training forward
                self.rollout_end = time.perf_counter()
                self.rollout_s += self.rollout_end - self.rollout_start
                self.per_iteration.append((self.rollout_end - self.rollout_start, float("nan")))
                self.rss_mb.append(psutil.Process().memory_info().rss / 2**20)
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


def build_trainer(w: Workload, model_root: Path, episodes: int | None = None, threads: int | None = None) -> TRLRun:
    """Load the workload's models four times (policy, reference, reward, value) and construct
    TRL's ``PPOTrainer`` for ``episodes`` prompts (default: the workload's)."""
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

    tokenizer = AutoTokenizer.from_pretrained(policy_dir)
    policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    ref_policy = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    reward_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1, dtype=torch.float32)
    value_model = AutoModelForSequenceClassification.from_pretrained(reward_dir, num_labels=1, dtype=torch.float32)
    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise RuntimeError("the workload's tokenizer must have a pad token distinct from EOS")

    prompt_ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in make_prompts(w)]
    bad = [len(ids) for ids in prompt_ids if len(ids) != w.prompt_tokens]
    if bad:
        raise RuntimeError(f"prompts must be {w.prompt_tokens} tokens, got lengths {bad[:5]}")
    train_dataset = Dataset.from_dict({"input_ids": prompt_ids})

    config = PPOConfig(
        output_dir=str(Path(tmp.name) / "trl-output"),  # TRL insists on creating it; nothing saved
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
        stop_token=None,  # no EOS stop, no truncation: full-length responses
        stop_token_id=None,
        missing_eos_penalty=None,
        num_sample_generations=0,  # no debugging sample generations
        # fp32 on CPU. PPOConfig defaults bf16=True and gradient_checkpointing=True; turn both off.
        use_cpu=True,
        bf16=False,
        fp16=False,
        gradient_checkpointing=False,
        # no eval, no checkpoints, no reporting integrations; TRL's default per-update logging stays
        eval_strategy="no",
        save_strategy="no",
        report_to="none",
        dataloader_num_workers=0,
        seed=0,
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
    assert policy.generation_config.eos_token_id is None and trainer.stop_token_id is None
    print(
        f"[trl_baseline] optimizer={type(trainer.optimizer.optimizer).__name__} "
        f"lr={config.learning_rate} device={trainer.accelerator.device}",
        file=sys.stderr,
    )

    timer = PhaseTimer(w.response_tokens, tokenizer.pad_token_id)
    timer.install(ppo_trainer_module)
    if threads is not None:
        torch.set_num_threads(threads)
    return TRLRun(w, episodes, trainer, timer, tmp)


def train(run: TRLRun) -> dict:
    """``trainer.train()``, timed; checks that it ran every episode at full response length."""
    import torch

    w, trainer, timer = run.workload, run.trainer, run.timer
    print(f"[trl_baseline] rss before train: {psutil.Process().memory_info().rss / 2**20:.0f} MiB", file=sys.stderr)
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
    for i, ((r, u), rss) in enumerate(zip(timer.per_iteration, timer.rss_mb)):
        print(f"[trl_baseline] iteration {i}: rollout {r:.3f}s update {u:.3f}s rss {rss:.0f} MiB", file=sys.stderr)
    return {
        "impl": "trl",
        "workload": w.name,
        "episodes": episodes,
        "episodes_per_s": episodes / total_s,
        "generated_tokens_per_s": episodes * w.response_tokens / total_s,
        "rollout_s": rollout_s,
        "update_s": total_s - rollout_s,
        "total_s": total_s,
    }


def stdout_for_one_line():
    """Keep stdout for the one JSON line: point fd 1 (and so sys.stdout, tqdm, accelerate's
    print, TRL's log prints) at stderr for the rest of the run; return a file on the real stdout."""
    result_out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    return result_out


def main(argv=None) -> None:
    result_out = stdout_for_one_line()
    args = parse_args(argv)
    w = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory(prefix="trl-models-") as tmp:
        model_root = Path(args.model_dir) if args.model_dir else Path(tmp)
        run = build_trainer(w, model_root, threads=args.threads)
        result = train(run)
        run.tmp.cleanup()
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB
    result_out.write(json.dumps(result) + "\n")
    result_out.flush()


if __name__ == "__main__":
    main()
