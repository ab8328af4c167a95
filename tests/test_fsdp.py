"""FSDP2 (``trainer=fsdp_cpu``: ``fully_shard`` over two gloo processes): each rank holds half of
every weight, and three PPO iterations equal ``trainer=ddp_cpu``'s from the same seed (metrics
and final weights, within fp32 tolerance), whether the rollout gathers the weights once or per
token; the export, at the end or from the sharded run's checkpoint, gathers the full weights; the
first update's ratio is exactly 1 under bf16 too."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import read_metrics
from tests.helpers import assert_same_metrics, run_ranks
from tests.test_cli import TINY_RUN
from tests.test_ddp import ddp_run

pytestmark = pytest.mark.slow  # two processes per run


def test_fsdp_cpu_shards_and_matches_ddp_cpu(cache_dir, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    steps = ["trainer.max_steps=3"]
    ddp = ddp_run(tmp_path, cache_dir, "ddp", steps)
    run_dir, layout_dir = tmp_path / "run_fsdp", tmp_path / "layout"
    p = run_ranks(
        [
            "trainer=fsdp_cpu",
            *TINY_RUN,
            "optimizer.lr=1e-3",
            *steps,
            f"hydra.run.dir={run_dir}",
            "+callbacks.layout._target_=tests.helpers.SaveShardLayout",
            f"+callbacks.layout.dir={layout_dir}",
            "ppo.micro_batch_tokens=56",  # rows grouped by length: as many groups on every rank
            "+callbacks.groups._target_=tests.helpers.RecordMicroBatchGroups",
            f"+callbacks.groups.dir={layout_dir}",
        ],
        cache_dir,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]

    # sharded: each rank holds its half of every decoder-block weight, and of the policy in all
    layouts = [json.loads((layout_dir / f"rank{r}.json").read_text()) for r in (0, 1)]
    block = "lm.transformer.h.0.attn.c_attn.weight"
    assert [lay[block][0] for lay in layouts] == [layouts[0][block][1] // 2] * 2
    for lay in layouts:
        held, total = sum(v[0] for v in lay.values()), sum(v[1] for v in lay.values())
        assert 0.45 * total <= held <= 0.55 * total

    # dynamic micro-batches: the ranks' rows made different numbers of groups, and every rank
    # ran the larger number (FSDP gathers the weights in each forward, a collective)
    groups = [json.loads((layout_dir / f"rank{r}.groups.json").read_text()) for r in (0, 1)]
    assert len(groups[0]) == len(groups[1]) == 3 * 2  # iterations x minibatches
    assert any(a[0] != b[0] for a, b in zip(*groups))
    assert all(a[1] == b[1] == max(a[0], b[0]) for a, b in zip(*groups))

    # the same run as DDP's (which runs whole minibatches): metrics and final weights
    assert_same_metrics(ddp["rows"], read_metrics(run_dir / "metrics.csv"))
    exported = load_file(str(run_dir / "policy" / "model.safetensors"))
    value_head = load_file(str(run_dir / "policy" / "value_head.safetensors"))
    for k, v in ddp["weights"].items():
        got = value_head[k.removeprefix("v_head.")] if k.startswith("v_head.") else exported.get(k.removeprefix("lm."))
        if got is None:  # a tied weight, written once (GPT-2's lm_head is the token embedding)
            continue
        torch.testing.assert_close(got, v, rtol=1e-5, atol=1e-6, msg=k)
    assert "lm_head.weight" not in exported
    AutoModelForCausalLM.from_pretrained(run_dir / "policy")  # loads in plain transformers

    # the sharded checkpoint: one full-state file with DDP's entries (the tied LM head under its
    # first name only, not gathered as a second copy), the same size within 1%
    ckpts = {name: tmp_path / f"run_{name}" / "checkpoints" / "last.ckpt" for name in ("ddp", "fsdp")}
    states = {name: torch.load(path, weights_only=True)["state_dict"] for name, path in ckpts.items()}
    assert set(states["fsdp"]) == set(states["ddp"]) and "policy.lm.transformer.wte.weight" in states["fsdp"]
    assert "policy.lm.lm_head.weight" not in states["fsdp"]
    assert ckpts["fsdp"].stat().st_size == pytest.approx(ckpts["ddp"].stat().st_size, rel=0.01)
    for k, v in states["ddp"].items():  # and the same values: the gathered state is DDP's
        torch.testing.assert_close(states["fsdp"][k], v, rtol=1e-5, atol=1e-6, msg=k)

    # the rollout kept sharded (weights all-gathered for every token): the same run
    per_token = tmp_path / "run_fsdp_per_token"
    p = run_ranks(
        [
            "trainer=fsdp_cpu",
            *TINY_RUN,
            "optimizer.lr=1e-3",
            *steps,
            f"hydra.run.dir={per_token}",
            "ppo.micro_batch_tokens=56",  # the updates micro-batched as above: only the rollout differs
            "+trainer.strategy.gather_for_rollout=false",
            "export_dir=null",
        ],
        cache_dir,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    for a, b in zip(read_metrics(run_dir / "metrics.csv"), read_metrics(per_token / "metrics.csv"), strict=True):
        assert {k: v for k, v in a.items() if not k.startswith("perf/")} == pytest.approx(
            {k: v for k, v in b.items() if not k.startswith("perf/")}, rel=1e-6, abs=1e-7
        )

    # task=export from the sharded run's checkpoint (one process): the same files as its own export
    exported_again = tmp_path / "exported_again"
    p = run_ranks(
        [
            "task=export",
            *TINY_RUN,
            f"ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}",
            f"export_dir={exported_again}",
            f"hydra.run.dir={tmp_path / 'export_run'}",
        ],
        cache_dir,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    for name in ("model.safetensors", "value_head.safetensors"):
        a, b = load_file(str(run_dir / "policy" / name)), load_file(str(exported_again / name))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name


def test_fsdp_cpu_bf16_mixed_first_update_ratio_is_exactly_one(cache_dir, tmp_path):
    """bf16 autocast with sharded weights: the rollout's forwards and the update's agree exactly
    (one minibatch, a fresh forward in the update), gradients of DTensors are clipped with the
    default fused AdamW, and training goes on with finite updates."""
    run_dir = tmp_path / "run"
    p = run_ranks(
        [
            "trainer=fsdp_cpu",
            *TINY_RUN,
            "trainer.precision=bf16-mixed",
            "ppo.fuse_rollout_forward=false",
            "data.batch_size=8",
            "ppo.minibatch_size=8",
            "ppo.ppo_epochs=1",
            "export_dir=null",
            f"hydra.run.dir={run_dir}",
        ],
        cache_dir,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-4000:]
    first, second = read_metrics(run_dir / "metrics.csv")
    for row in (first, second):  # one step per iteration: every update starts at the rollout's policy
        assert (row["val/ratio"], row["val/ratio_var"], row["policy/approxkl_avg"]) == (1.0, 0.0, 0.0)
        assert row["health/skipped_updates"] == 0.0
    assert first["objective/kl"] == 0.0 and second["objective/kl"] != 0.0  # then the policy moved


def test_lora_under_fsdp_cpu_matches_lora_under_ddp_cpu(cache_dir, tmp_path):
    """LoRA with sharded blocks (frozen base and trainable adapters in one FSDP group; the
    reference is the sharded policy with adapters off): three iterations give DDP's metrics, and
    the gathered export (merged model, adapters, value head) equals DDP's."""
    from safetensors.torch import load_file

    runs = {}
    for trainer in ("ddp_cpu", "fsdp_cpu"):
        runs[trainer] = run_dir = tmp_path / trainer
        p = run_ranks(
            [
                f"trainer={trainer}",
                *TINY_RUN,
                "model.lora.r=4",
                "optimizer.lr=1e-3",
                "trainer.max_steps=3",
                f"hydra.run.dir={run_dir}",
            ],
            cache_dir,
            timeout=600,
        )
        assert p.returncode == 0, p.stderr[-4000:]
    assert_same_metrics(read_metrics(runs["ddp_cpu"] / "metrics.csv"), read_metrics(runs["fsdp_cpu"] / "metrics.csv"))
    for name in ("model.safetensors", "value_head.safetensors", "adapter/adapter_model.safetensors"):
        a, b = (load_file(str(runs[t] / "policy" / name)) for t in ("ddp_cpu", "fsdp_cpu"))
        assert a.keys() == b.keys(), name
        for k in a:
            torch.testing.assert_close(b[k], a[k], rtol=1e-5, atol=1e-6, msg=f"{name}: {k}")


def test_grpo_keeps_groups_on_their_rank_and_fsdp_matches_ddp(cache_dir, tmp_path):
    """GRPO (no value head) over two processes: each rank samples ``num_generations`` answers for
    its own prompts, so a group never spans ranks and its statistics need no communication; the
    update's gradients are reduced as PPO's. Under DDP the ranks end identical (``ddp_run``), and
    the sharded policy root without a value head gives DDP's run."""
    grpo = ["trainer.max_steps=2", "ppo.advantage=grpo", "ppo.num_generations=2"]
    ddp = ddp_run(tmp_path, cache_dir, "grpo", grpo)
    assert [r["episode"] for r in ddp["rows"]] == [32.0, 64.0]  # 8 prompts x 2 answers x 2 ranks per iteration
    assert not any(k.startswith("value/") for k in ddp["rows"][0])
    assert all(0 <= r["objective/frac_zero_std_groups"] <= 1 for r in ddp["rows"])
    run_dir = tmp_path / "run_fsdp_grpo"
    p = run_ranks(
        ["trainer=fsdp_cpu", *TINY_RUN, "optimizer.lr=1e-3", *grpo, f"hydra.run.dir={run_dir}"], cache_dir, timeout=600
    )
    assert p.returncode == 0, p.stderr[-4000:]
    assert_same_metrics(ddp["rows"], read_metrics(run_dir / "metrics.csv"))
