"""``generation=vllm`` on two processes (``test_vllm.py`` holds the one-process tests; this file
runs in a pytest worker of its own beside it, ``make test-vllm``): under FSDP, each rank's
engine samples from the gathered policy, as under DDP."""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics
from tests.test_vllm import RUN

vllm = pytest.importorskip("vllm", reason="generation=vllm needs vllm (make test-vllm)")


@pytest.mark.slow  # two runs of two processes
def test_under_fsdp_each_rank_samples_from_the_gathered_policy_as_under_ddp(tmp_path, cache_dir):
    """Two processes, an engine in each (vLLM's ``external_launcher``, on the trainer's process
    group): the FSDP run gathers its shards for every sync and matches the DDP run, whose ranks
    hold whole weights, metric for metric; the engines' logprobs stay the training forward's, so
    each engine follows the updates. Both runs export the policy after the engines have shut down,
    a collective under FSDP: the trainer's process group outlives them."""
    from tests.helpers import assert_same_metrics, run_ranks

    rows = {}
    for strategy in ("ddp_cpu", "fsdp_cpu"):
        run_dir = tmp_path / strategy
        args = [*RUN, f"trainer={strategy}", "experiment=tiny_char", "trainer.max_steps=3", "logger=csv"]
        args += ["sampling.max_new_tokens=8", "data.batch_size=8", "ppo.minibatch_size=4", "ppo.ppo_epochs=1"]
        args += ["optimizer.lr=1e-3", "callbacks=none", f"hydra.run.dir={run_dir}"]
        p = run_ranks(args, cache_dir, timeout=600)
        assert p.returncode == 0, p.stderr[-4000:]
        assert (run_dir / "policy" / "model.safetensors").exists()
        rows[strategy] = [r for r in read_metrics(run_dir / "metrics.csv") if "lr" in r]
    assert_same_metrics(rows["ddp_cpu"], rows["fsdp_cpu"])
    for r in rows["fsdp_cpu"]:
        assert r["perf/time_weight_sync_s"] > 0 and r["rollout/engine_logprob_diff"] < 1e-6
