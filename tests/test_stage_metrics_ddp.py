"""The SFT stage's val/loss under DDP (2 CPU processes, gloo) equals the single-process value.

Each rank validates its own shard (11 and 10 examples, batches of 3, 3, 3, 2 and 3, 3, 3, 1), so
ranks differ in token count and a mean of rank means would be off; the torchmetrics sums are
synced in ``compute()``. Lightning's ``ddp`` strategy re-runs the launching script for rank 1, so
both runs are a script file started in a subprocess.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = """
import json, sys, warnings

import lightning as L
import torch

from ppo_lightning.stages import build_sft

torch.set_num_threads(1)
model_dir, devices, out_path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
records = [{"prompt": f"{c}*{n}=", "response": c * n} for c in "abcdefghij" for n in range(1, 9)]
stage = {"val_fraction": 0.26, "val_batch_size": 3, "max_length": 32, "max_prompt_length": 8, "seed": 0,
         "batch_size": 4, "num_workers": 0}
module, dm = build_sft({"name_or_path": model_dir}, None, stage, records=records)
trainer = L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                    logger=False, enable_checkpointing=False, enable_progress_bar=False,
                    enable_model_summary=False)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    out = trainer.validate(module, datamodule=dm, verbose=False)[0]
loader = dm.val_dataloader()
shard = torch.tensor(len(loader.sampler))
shards = trainer.strategy.all_gather(shard).reshape(-1).tolist()
if trainer.global_rank == 0:
    with open(out_path, "w") as f:
        json.dump({"metrics": out, "world_size": trainer.world_size, "val_examples": len(dm.val_examples),
                   "shards": shards, "batch_sizes": [len(b["input_ids"]) for b in loader],
                   "warnings": [str(w.message) for w in caught]}, f)
if torch.distributed.is_initialized():  # an orderly end: no rank exits while gloo still talks to it
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
"""


def validate(model_dir: Path, devices: int, tmp_path: Path) -> dict:
    script = tmp_path / "validate_sft.py"
    script.write_text(SCRIPT)
    out = tmp_path / f"devices{devices}.json"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    for k in ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK", "LOCAL_RANK", "NODE_RANK"):
        env.pop(k, None)  # Lightning sets them up (a free port) for the ranks it launches
    p = subprocess.run(
        [sys.executable, str(script), str(model_dir), str(devices), str(out)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_sft_val_loss_under_ddp_equals_single_process(tiny_lm_dir, tmp_path):
    single = validate(tiny_lm_dir, 1, tmp_path)
    ddp = validate(tiny_lm_dir, 2, tmp_path)
    assert single["world_size"] == 1 and single["shards"] == [21]
    assert ddp["world_size"] == 2 and ddp["val_examples"] == 21
    assert ddp["shards"] == [11, 10] and ddp["batch_sizes"] == [3, 3, 3, 2]
    for run in (single, ddp):  # no torchmetrics "compute before update" warning
        assert not [w for w in run["warnings"] if "``compute``" in w], run["warnings"]
    print(f"val/loss: DDP {ddp['metrics']['val/loss']!r}, single process {single['metrics']['val/loss']!r}")
    assert ddp["metrics"]["val/loss"] == pytest.approx(single["metrics"]["val/loss"], rel=1e-6)
    assert ddp["metrics"]["val/perplexity"] == pytest.approx(single["metrics"]["val/perplexity"], rel=1e-5)
