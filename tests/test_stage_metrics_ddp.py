"""The SFT stage's val/loss under DDP (2 CPU processes, gloo) equals the single-process value.

Each rank validates its own shard (11 and 10 examples, batches of 3, 3, 3, 2 and 3, 3, 3, 1), so
ranks differ in token count and a mean of rank means would be off; the torchmetrics sums are
synced in ``compute()``. The ranks are forked from the test process with torchrun's environment
(``tests.helpers.fork_ranks``), so Lightning's ``ddp`` strategy launches none.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _validate(model_dir: Path, devices: int, out_path: Path) -> None:
    """One rank: the SFT stage's validation on ``devices`` processes; rank 0 writes what it saw."""
    import warnings

    import lightning as L
    import torch

    from ppo_lightning.stages import build_sft

    records = [{"prompt": f"{c}*{n}=", "response": c * n} for c in "abcdefghij" for n in range(1, 9)]
    stage = {
        "val_fraction": 0.26,
        "val_batch_size": 3,
        "max_length": 32,
        "max_prompt_length": 8,
        "seed": 0,
        "batch_size": 4,
        "num_workers": 0,
    }
    module, dm = build_sft({"name_or_path": str(model_dir)}, None, stage, records=records)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy="ddp" if devices > 1 else "auto",
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = trainer.validate(module, datamodule=dm, verbose=False)[0]
    loader = dm.val_dataloader()
    shards = trainer.strategy.all_gather(torch.tensor(len(loader.sampler))).reshape(-1).tolist()
    if trainer.global_rank == 0:
        seen = {
            "metrics": out,
            "world_size": trainer.world_size,
            "val_examples": len(dm.val_examples),
            "shards": shards,
            "batch_sizes": [len(b["input_ids"]) for b in loader],
            "warnings": [str(w.message) for w in caught],
        }
        out_path.write_text(json.dumps(seen))
    if torch.distributed.is_initialized():  # an orderly end: no rank exits while gloo still talks to it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def validate(model_dir: Path, devices: int, tmp_path: Path) -> dict:
    from tests.helpers import fork_ranks

    out = tmp_path / f"devices{devices}.json"
    p = fork_ranks(lambda: _validate(model_dir, devices, out), devices, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:]
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
