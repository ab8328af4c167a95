"""FSDP2 (``trainer=fsdp_cpu``: ``fully_shard`` over two gloo processes): each rank holds half of
every weight, and three PPO iterations equal ``trainer=ddp_cpu``'s from the same seed (metrics
and final weights, within fp32 tolerance); the export gathers the full weights."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import read_metrics
from tests.helpers import run_train
from tests.test_cli import TINY_RUN
from tests.test_ddp import ddp_run

pytestmark = pytest.mark.slow  # two processes per run


def test_fsdp_cpu_shards_and_matches_ddp_cpu(cache_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    steps = ["trainer.max_steps=3"]
    ddp = ddp_run(tmp_path, cache_dir, "ddp", steps)
    run_dir, layout_dir = tmp_path / "run_fsdp", tmp_path / "layout"
    p = run_train(["trainer=fsdp_cpu", *TINY_RUN, "optimizer.lr=1e-3", *steps, f"hydra.run.dir={run_dir}",
                   "+callbacks.layout._target_=tests.helpers.SaveShardLayout", f"+callbacks.layout.dir={layout_dir}"],
                  cache_dir, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]

    # sharded: each rank holds its half of every decoder-block weight, and of the policy in all
    layouts = [json.loads((layout_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    block = "lm.transformer.h.0.attn.c_attn.weight"
    assert [lay[block][0] for lay in layouts] == [layouts[0][block][1] // 2] * 2
    for lay in layouts:
        held, total = sum(v[0] for v in lay.values()), sum(v[1] for v in lay.values())
        assert 0.45 * total <= held <= 0.55 * total

    # the same run as DDP's: metrics and final weights
    for a, b in zip(ddp["rows"], read_metrics(run_dir / "metrics.csv"), strict=True):
        for k in a:
            if k.startswith("perf/"):
                continue
            tol = dict(abs=0.02) if k.endswith("clipfrac_avg") else dict(rel=1e-4, abs=1e-5)
            assert b[k] == pytest.approx(a[k], **tol), (a["step"], k)
    exported = load_file(str(run_dir / "policy" / "model.safetensors"))
    value_head = load_file(str(run_dir / "policy" / "value_head.safetensors"))
    for k, v in ddp["weights"].items():
        got = value_head[k.removeprefix("v_head.")] if k.startswith("v_head.") else exported.get(k.removeprefix("lm."))
        if got is None:  # a tied weight, written once (GPT-2's lm_head is the token embedding)
            continue
        torch.testing.assert_close(got, v, rtol=1e-5, atol=1e-6, msg=k)
    assert "lm_head.weight" not in exported
    AutoModelForCausalLM.from_pretrained(run_dir / "policy")  # loads in plain transformers
