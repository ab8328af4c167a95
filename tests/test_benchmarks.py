"""The benchmarks' own contracts: the workloads they share, and gpu_check's report (on CPU)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from workloads import WORKLOADS, build_tokenizer, make_prompts


def test_medium_tokenizer_has_gpt2s_vocabulary_and_prompts_are_exact(tmp_path):
    from transformers import AutoTokenizer

    w = WORKLOADS["medium"]
    built = build_tokenizer(w)
    built.save_pretrained(tmp_path)  # as build_models saves it with the models
    tok = AutoTokenizer.from_pretrained(tmp_path, padding_side="left")
    assert len(tok) == w.vocab_size == 50257
    assert tok.get_vocab() == built.get_vocab()
    assert tok.eos_token_id == 50256 and tok.pad_token_id is not None and tok.pad_token_id != tok.eos_token_id
    ids = tok(make_prompts(w), add_special_tokens=False)["input_ids"]
    assert len(ids) == w.num_prompts and {len(x) for x in ids} == {w.prompt_tokens} == {64}
    assert max(max(x) for x in ids) < tok.pad_token_id  # ordinary words, no specials or unknowns
    assert tok.decode(ids[0]) == make_prompts(w)[0]


def test_byte_workloads_keep_their_prompts():
    """The published tiny and small numbers were measured on these prompts."""
    assert make_prompts(WORKLOADS["tiny"])[:2] == ["mynbiqpm", "z jplsgq"]
    assert make_prompts(WORKLOADS["small"])[0] == "mynbiqpmz jplsgqejeydtzirwztejdx"
    assert WORKLOADS["tiny"].vocab_size is None and WORKLOADS["small"].vocab_size is None


@pytest.mark.slow
def test_gpu_check_smoke_on_cpu():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    p = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--device",
            "cpu",
            "--workload",
            "tiny",
            "--iterations",
            "1",
            "--repeats",
            "1",
        ],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["device"] == "cpu" and r["workload"] == "tiny" and r["iterations"] == 1
    assert r["precision"] == "bf16-mixed"
    for key in ("first_update", "first_update_unfused"):  # one precision per iteration
        assert r[key]["val/ratio"] == pytest.approx(1.0, abs=1e-6)
        assert r[key]["policy/approxkl_avg"] == pytest.approx(0.0, abs=1e-6)
        assert r[key]["objective/kl"] == pytest.approx(0.0, abs=1e-6)
    assert r["generate_tokens_per_s_ours"] > 0 and r["generate_tokens_per_s_hf"] > 0
    assert math.isclose(
        r["generate_ratio_ours_over_hf"], r["generate_tokens_per_s_ours"] / r["generate_tokens_per_s_hf"]
    )
    w = WORKLOADS["tiny"]
    assert r["update_tokens_per_iteration"] == w.rollout_batch * (w.prompt_tokens + w.response_tokens) * w.ppo_epochs
    assert len(r["update_s_per_iteration"]) == 1 and r["update_flops_per_s"] > 0
    assert r["mfu"] is None and r["peak_flops"] is None  # no dense bf16 peak for a CPU
    assert r["peak_gpu_mb"] is None and r["models_gpu_mb"] is None and r["peak_rss_mb"] > 0
    assert 0.1 < r["policy_params_m"] < 1  # the 2-layer, 64-wide GPT-2
    assert r["torch"] and r["device_name"] and r["wall_s"] >= r["fit_s"] > 0


def test_sharding_benchmark_counts_each_tensor_once():
    """``benchmarks/sharding.py``'s per-rank bytes: parameters, a tied weight once, AdamW's state.
    (A DTensor's local part needs a process group: the benchmark's own runs check that, 0.5x.)"""
    import torch
    from sharding import optimizer_tensors, tensor_bytes

    lin = torch.nn.Linear(3, 4)
    assert tensor_bytes(lin.parameters()) == (3 * 4 + 4) * 4
    tied = torch.nn.ModuleDict({"emb": torch.nn.Embedding(5, 3), "head": torch.nn.Linear(3, 5, bias=False)})
    tied["head"].weight = tied["emb"].weight
    assert tensor_bytes([tied["emb"].weight, tied["head"].weight, None]) == 5 * 3 * 4
    assert tensor_bytes([lin.weight.detach().double()]) == 3 * 4 * 8
    opt = torch.optim.AdamW(lin.parameters())
    lin(torch.ones(2, 3)).sum().backward()
    assert tensor_bytes(p.grad for p in lin.parameters()) == (3 * 4 + 4) * 4
    opt.step()
    # two moments per parameter, float32, plus a scalar step counter per parameter
    assert tensor_bytes(optimizer_tensors(opt)) == 2 * (3 * 4 + 4) * 4 + 2 * 4


@pytest.mark.parametrize("estimator", ["gae", "grpo", "rloo", "reinforce_pp"])
def test_compare_estimators_configures_each_estimator_on_the_same_episodes(tmp_path, cache_dir, estimator):
    """``benchmarks/compare_estimators.py``'s overrides compose and validate on both recipes'
    jobs, and every estimator gets the recipe's 32 episodes per iteration."""
    from compare_estimators import RECIPES, estimator_overrides

    from ppo_lightning.config import validate
    from tests.conftest import compose_cfg

    for job, batch, _ in RECIPES.values():
        cfg = compose_cfg([*job, *estimator_overrides(estimator, batch, 4)], tmp_path, cache_dir, experiment=None)
        validate(cfg)
        assert cfg.ppo.advantage == estimator
        assert cfg.data.batch_size * cfg.ppo.num_generations == batch == 32
