"""What the benchmark scripts share; a script imports from here, never from another script.

* ``offline``: the environment every benchmark runs in (no hub, no W&B), set on import: a
  script's first import;
* ``workloads``: the named workloads (models, vocabulary, prompts, PPO shape) and their models;
* ``grpo_workload``: the GRPO shape on top of a workload and the reward function both sides call
  (free of heavy imports: TRL's venv imports it too);
* ``measure``: peak RSS (the process's, a sampler, the kernel's high-water mark), tensor bytes,
  timing, medians;
* ``runner``: the repository root, the alternating runner (each side once per round, ratios round
  by round), a benchmark script as a subprocess (``python -m benchmarks.<name>``) and its JSON line;
* ``cli``: the options the scripts have in common (``--workload``, ``--model-dir``, ``--threads``);
* ``ours``: ppo_lightning's side: a workload as a real run (``train.py``'s config, a Lightning
  Trainer), PPO or GRPO, and our sampler against ``model.generate``;
* ``trl_side``: what TRL's side shares (its environment, the CPU / fp32 ``TrainingArguments``, one
  JSON line on stdout); ``trl_ppo``: TRL 1.12's ``PPOTrainer`` on a workload; ``trl_grpo``: TRL
  1.16's ``GRPOTrainer``.
"""
