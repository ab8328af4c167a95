"""What TRL's side of the comparisons shares, ``PPOTrainer`` (trl 1.12, ``trl_ppo``) and
``GRPOTrainer`` (trl 1.16, ``trl_grpo``) alike: the environment (importing this module sets it:
offline, and TRL's own ``Accelerator`` on CPU), the CPU / fp32 ``TrainingArguments`` both trainers
are configured with, the checks on the workload's tokenizer and prompts, and stdout kept for one
JSON line. Nothing here imports trl: each venv brings its own version."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.lib import offline  # noqa: F401

if TYPE_CHECKING:
    from benchmarks.lib.workloads import Workload

os.environ["ACCELERATE_USE_CPU"] = "true"  # TRL builds its own Accelerator(); keep it on CPU

# fp32 on CPU: PPOConfig and GRPOConfig default to bf16=True and gradient_checkpointing=True, both
# off; no eval, no checkpoints, no reporting integrations (TRL's default metric logging stays).
CPU_FP32 = {
    "use_cpu": True,
    "bf16": False,
    "fp16": False,
    "gradient_checkpointing": False,
    "eval_strategy": "no",
    "save_strategy": "no",
    "report_to": "none",
    "dataloader_num_workers": 0,
    "seed": 0,
}


def cpu_fp32_config(config_cls, output_dir: Path, bf16: bool = False, **kwargs):
    """``config_cls`` (a TRL config: ``PPOConfig``, ``GRPOConfig``, both ``TrainingArguments``)
    with ``CPU_FP32`` and the trainer's own ``kwargs``. ``output_dir``: TRL insists on one;
    nothing is saved there. ``bf16``: bf16 autocast on the fp32 weights instead (TRL's
    ``bf16=True``; ours: ``trainer.precision=bf16-mixed``)."""
    clash = sorted(CPU_FP32.keys() & kwargs.keys())
    if clash:
        raise ValueError(f"{clash} are CPU_FP32's: the same on both sides")
    return config_cls(output_dir=str(output_dir), **kwargs, **{**CPU_FP32, "bf16": bf16})


def check_tokens(w: Workload, tokenizer, prompt_ids: list[list[int]]) -> None:
    """The workload's tokenizer has a pad distinct from EOS, and every prompt has its
    ``prompt_lengths`` tokens (``w.prompt_tokens`` each, so nothing is padded, unless the workload
    spreads them)."""
    from benchmarks.lib.workloads import prompt_lengths

    if tokenizer.pad_token_id is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        raise RuntimeError("the workload's tokenizer must have a pad token distinct from EOS")
    bad = [(len(ids), n) for ids, n in zip(prompt_ids, prompt_lengths(w)) if len(ids) != n]
    if bad:
        raise RuntimeError(f"prompts must have the workload's lengths; (got, wanted): {bad[:5]}")


def stdout_for_one_line():
    """Keep stdout for the one JSON line: point fd 1 (and so sys.stdout, tqdm, accelerate's
    print, TRL's log prints) at stderr for the rest of the run; return a file on the real stdout."""
    result_out = os.fdopen(os.dup(1), "w")
    sys.stdout.flush()
    os.dup2(2, 1)
    return result_out


def write_line(result_out, result: dict) -> None:
    """The run's one JSON line, on the stdout ``stdout_for_one_line`` kept."""
    result_out.write(json.dumps(result) + "\n")
    result_out.flush()
