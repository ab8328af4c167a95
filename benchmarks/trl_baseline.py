"""TRL baseline: time TRL's ``PPOTrainer`` (``trl.experimental.ppo``, trl==1.12.0) on a named workload.

This is the reference point ppo_lightning is compared against. It runs stock TRL PPO, fp32 on CPU (``--bf16``: under
bf16 autocast, TRL's ``bf16=True``),
on exactly the workload defined in ``benchmarks/lib/workloads.py``:

* policy: the workload's saved GPT-2 causal LM; reference: a second ``from_pretrained`` of the
  same dir; tokenizer: the one saved with it (byte-level, or ``medium``'s 50257-entry word
  vocabulary), the very files ppo_lightning loads;
* reward model and value model: two separate loads of the saved random
  ``GPT2ForSequenceClassification`` dir (TRL's reward-model path; TRL needs a value model too, and
  initialising it from the reward model is what TRL users do);
* prompts: ``make_prompts(w)`` through that tokenizer (a chat workload's through its chat
  template: ``render_prompts``), each exactly its ``prompt_lengths`` tokens;
* responses: exactly ``w.response_tokens`` sampled tokens, no stop token (``stop_token=None``,
  ``stop_token_id=None``, which makes TRL clear ``generation_config.eos_token_id``, so ``generate``
  never stops at EOS; the script checks every rollout is full length); for a workload whose
  completions stop at EOS (``gsm8k_like``), ``stop_token="eos"``: ``generate`` stops when every row
  of its chunk has, and TRL truncates each response after its first EOS;
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

    python -m benchmarks.trl_baseline --workload tiny [--model-dir DIR] [--threads N] [--bf16]

prints exactly one JSON line on stdout; all other output (TRL's logs, progress bar, and this
script's per-iteration rollout/update/RSS trace) goes to stderr. ``peak_rss_mb`` is the process's
``ru_maxrss`` (so it includes model loading).

The run is ``benchmarks.lib.trl_ppo``'s two halves, ``build_trainer`` and ``train``;
``benchmarks.memory`` calls them in a child process to sample TRL's memory between them. Its
``TrainingArguments`` are ``benchmarks.lib.trl_side.cpu_fp32_config``'s, as TRL's GRPO side's.
"""

from __future__ import annotations

# first: its import sets the environment (offline, TRL's Accelerator on CPU)
from benchmarks.lib.trl_side import stdout_for_one_line, write_line

import tempfile
from pathlib import Path

from benchmarks.lib import cli
from benchmarks.lib.measure import peak_rss_mb
from benchmarks.lib.trl_ppo import build_trainer, train
from benchmarks.lib.workloads import WORKLOADS


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_workload(p)
    cli.add_model_dir(p)
    cli.add_threads(p)
    p.add_argument(
        "--iterations", type=int, help="PPO iterations of the workload's rollout batch (default: the workload's)"
    )
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on the fp32 weights (TRL's bf16=True)")
    return p.parse_args(argv)


def main(argv=None) -> None:
    result_out = stdout_for_one_line()
    args = parse_args(argv)
    w = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory(prefix="trl-models-") as tmp:
        model_root = Path(args.model_dir) if args.model_dir else Path(tmp)
        episodes = args.iterations * w.rollout_batch if args.iterations else None
        run = build_trainer(w, model_root, episodes=episodes, threads=args.threads, bf16=args.bf16)
        result = train(run)
        run.tmp.cleanup()
    result["peak_rss_mb"] = peak_rss_mb()
    write_line(result_out, result)


if __name__ == "__main__":
    main()
