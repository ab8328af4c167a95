"""The benchmarks' own contracts: the workloads they share, and gpu_check's report (on CPU)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch

from benchmarks.lib.workloads import WORKLOADS, build_tokenizer, make_prompts, render_prompts
from tests.helpers import run_module

ROOT = Path(__file__).resolve().parents[1]


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


def test_chat_workload_prompts_render_alike_on_both_sides_at_their_lengths(tmp_path):
    """``gsm8k_like``'s chats (a smaller vocabulary): TRL's side renders them with the tokenizer's
    chat template (``render_prompts``), ours reads ``write_prompts``'s JSONL and renders it through
    ``data``'s pipeline with the saved tokenizer's template. Both give the same token ids, each
    prompt exactly its ``prompt_lengths``, every id a real entry (no unknown word), opening the
    assistant's turn; the EOS is ``<|im_end|>``, as Qwen2-Instruct's."""
    import dataclasses

    from transformers import AutoTokenizer

    from benchmarks.lib.workloads import CHAT_TEMPLATE, prompt_lengths, write_prompts
    from ppo_lightning.data.prompts import render_prompts as render_records
    from ppo_lightning.data.records import read_prompt_records

    w = dataclasses.replace(WORKLOADS["gsm8k_like"], vocab_size=2000, num_prompts=16)
    assert w.chat
    build_tokenizer(w).save_pretrained(tmp_path / "tok")
    tok = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(tok) == 2000 and tok.chat_template == CHAT_TEMPLATE
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 1999 and tok.pad_token_id not in (None, 1999)
    theirs = tok(render_prompts(w, tok), add_special_tokens=False)["input_ids"]
    ours = tok(render_records(read_prompt_records(write_prompts(w, tmp_path)), tok), add_special_tokens=False)[
        "input_ids"
    ]
    assert ours == theirs
    assert [len(x) for x in ours] == prompt_lengths(w)
    assert tok.unk_token_id not in {i for x in ours for i in x}
    assert {tuple(tok.convert_ids_to_tokens(x[-2:])) for x in ours} == {("<|im_start|>", "assistant")}
    assert len({tuple(x[:20]) for x in ours}) == 1  # the one system message opens every prompt


@pytest.mark.slow
def test_a_workload_that_stops_at_eos_spreads_its_lengths_around_the_baked_in_mean(tmp_path):
    """``bake_eos_rate`` on a small Qwen2-shaped word model (as ``gsm8k_like``'s, narrower): every
    prompt has its own length, and 256 completions sampled by the ``hf`` backend stop at EOS with
    a mean length within 20% of ``eos_mean_tokens``, spread from a few tokens to the maximum."""
    import dataclasses

    from benchmarks.lib.workloads import build_models, prompt_lengths, tokenizer_dir
    from ppo_lightning.generation import SamplingParams
    from ppo_lightning.generation.hf import generate
    from ppo_lightning.models.policy import load_causal_lm, load_tokenizer

    w = dataclasses.replace(
        WORKLOADS["gsm8k_like"], name="eos", n_layer=1, n_embd=32, vocab_size=2000, eos_mean_tokens=12
    )
    w = dataclasses.replace(w, prompt_tokens=40, prompt_tokens_min=30, response_tokens=64)
    policy_dir, _ = build_models(w, tmp_path)
    tok = load_tokenizer(str(tokenizer_dir(policy_dir)))
    texts = render_prompts(w, tok)  # gsm8k_like's chats, through the saved chat template
    assert [len(x) for x in tok(texts)["input_ids"]] == prompt_lengths(w)
    assert len(set(prompt_lengths(w))) > 8 and min(prompt_lengths(w)) >= 30 and max(prompt_lengths(w)) <= 40
    assert tok.eos_token == "<|im_end|>"
    enc = tok(texts[:4], return_tensors="pt", padding=True)
    params = SamplingParams(max_new_tokens=w.response_tokens, temperature=1.0)
    _, mask = generate(
        load_causal_lm(str(policy_dir), tok),
        enc.input_ids.repeat_interleave(64, 0),
        enc.attention_mask.repeat_interleave(64, 0),
        params,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        generator=torch.Generator().manual_seed(0),
    )
    lengths = mask.sum(1).float()
    assert abs(lengths.mean().item() - 12) < 12 * 0.2, lengths.mean()
    assert lengths.min() <= 3 and lengths.max() >= 40


def test_gpu_check_smoke_on_cpu():
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    args = ["--device", "cpu", "--workload", "tiny", "--iterations", "1", "--repeats", "1"]
    p = run_module("benchmarks.gpu_check", args, env)
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
    """``benchmarks.sharding``'s per-rank bytes (``benchmarks.lib.measure``): parameters, a tied
    weight once, AdamW's state. (A DTensor's local part needs a process group: the benchmark's own
    runs check that, 0.5x.)"""
    import torch

    from benchmarks.lib.measure import optimizer_tensors, tensor_bytes

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
    """``benchmarks.compare_estimators``'s overrides compose and validate on both recipes'
    jobs, and every estimator gets the recipe's 32 episodes per iteration."""
    from benchmarks.compare_estimators import RECIPES, estimator_overrides
    from ppo_lightning.config import validate
    from tests.conftest import compose_cfg

    for job, batch, _ in RECIPES.values():
        cfg = compose_cfg([*job, *estimator_overrides(estimator, batch, 4)], tmp_path, cache_dir, experiment=None)
        validate(cfg)
        assert cfg.ppo.advantage == estimator
        assert cfg.data.batch_size * cfg.ppo.num_generations == batch == 32


def test_scripts_are_thin_clis_over_the_library():
    """No benchmark script imports another script (what they share is in ``benchmarks.lib``) and
    none edits ``sys.path``: they run as modules from the repository root."""
    import ast

    bench = ROOT / "benchmarks"
    scripts = {p.stem for p in bench.glob("*.py")} - {"__init__"}
    assert {"throughput", "trl_baseline", "memory"} <= scripts
    for path in [*bench.glob("*.py"), *(bench / "lib").glob("*.py")]:
        text = path.read_text()
        assert "sys.path" not in text, path
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                assert parts[0] not in scripts, (path, name)  # the old sys.path imports
                assert not (parts[0] == "benchmarks" and parts[1:2] and parts[1] in scripts), (path, name)


def test_alternate_runs_the_sides_in_turn_and_ratios_pair_by_pair():
    from benchmarks.lib.runner import alternate, ratios

    calls = []

    def side(name, value):
        return lambda r: calls.append((name, r)) or value * (r + 1)

    out = alternate({"a": side("a", 2.0), "b": side("b", 1.0)}, 3, abba=True)
    assert calls == [("a", 0), ("b", 0), ("b", 1), ("a", 1), ("a", 2), ("b", 2)]
    assert out == {"a": [2.0, 4.0, 6.0], "b": [1.0, 2.0, 3.0]}
    assert ratios(out["a"], out["b"]) == [2.0, 2.0, 2.0]
    assert ratios([{"x": 3.0}], [{"x": 1.5}], "x") == [2.0]
    refused = alternate(
        {"ok": lambda r: {"r": r}, "no": lambda r: {"skipped": "why"}}, 3, done=lambda x: "skipped" in x
    )
    assert refused == {"ok": [{"r": 0}, {"r": 1}, {"r": 2}], "no": [{"skipped": "why"}]}


def test_trl_sides_share_one_cpu_fp32_configuration(tmp_path, monkeypatch):
    """``trl_ppo`` and ``trl_grpo`` configure TRL through one builder: fp32 on CPU (or bf16
    autocast, ``--bf16``), nothing saved or reported; a trainer cannot set those keys its own way."""
    pytest.importorskip("trl")
    monkeypatch.setattr(os, "environ", dict(os.environ))  # importing trl_side sets ACCELERATE_USE_CPU
    from trl import GRPOConfig

    from benchmarks.lib.trl_side import CPU_FP32, cpu_fp32_config

    config = cpu_fp32_config(GRPOConfig, tmp_path / "out", per_device_train_batch_size=8, num_generations=4)
    assert config.output_dir == str(tmp_path / "out") and config.per_device_train_batch_size == 8
    assert config.use_cpu and not config.bf16 and not config.fp16 and not config.gradient_checkpointing
    assert config.save_strategy == "no" and config.report_to == [] and config.seed == 0
    with pytest.raises(ValueError, match="fp16"):
        cpu_fp32_config(GRPOConfig, tmp_path / "out", fp16=True)
    bf16 = cpu_fp32_config(GRPOConfig, tmp_path / "out", True)  # --bf16: autocast, the rest as fp32's
    assert bf16.bf16 and bf16.use_cpu and not bf16.fp16 and bf16.save_strategy == "no"
    for side in ("trl_ppo", "trl_grpo"):
        assert "cpu_fp32_config(" in (ROOT / "benchmarks" / "lib" / f"{side}.py").read_text()
    assert set(CPU_FP32) >= {"use_cpu", "bf16", "fp16", "gradient_checkpointing"}


def test_the_gemm_peak_counts_flops_as_the_profiler_does_and_each_mfu_divides_by_it(monkeypatch):
    """The MFU rows of ``benchmarks.profile_iteration``: the profiler counts a matmul as 2 n^3
    FLOPs, the peak is that count over the best time of the same matmul, and the two MFUs divide
    the iteration's matmul rate and its whole-iteration rate by the peak."""
    from benchmarks.lib import measure
    from benchmarks.profile_iteration import FLOP_OPS, mfu

    n = 192
    a = torch.randn(n, n)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_flops=True) as prof:
        torch.mm(a, a)
    assert [e.flops for e in prof.events() if e.name in FLOP_OPS] == [2 * n**3]
    assert measure.gemm_peak_gflops(n=n, repeats=2) > 0
    times = iter([0.004, 0.002, 0.003])  # the repeats' times: the best is 2 ms
    monkeypatch.setattr(measure, "timed", lambda fn: (fn(), next(times)))
    assert measure.gemm_peak_gflops(n=n, repeats=3) == pytest.approx(2 * n**3 / 0.002 / 1e9)
    v = {"gemm_peak_gflops": 80.0, "profiled": {"gflop": 60.0, "flop_op_s": 1.5}, "timed": {"wall_s": 3.0}}
    assert mfu(v) == pytest.approx((0.5, 0.25))
    assert mfu({**v, "gemm_peak_gflops": None}) is None  # a result from before the peak was measured


def test_trls_ppo_timer_counts_each_rows_tokens_up_to_its_first_eos():
    """On a workload whose completions stop at EOS, TRL's ``generate`` pads a row after its EOS and
    stops the chunk with its longest row: the timer counts each row's tokens up to and including its
    first EOS (a naive loop's count), and pad tokens the policy sampled only before it. On a
    full-length workload it refuses a generation that stopped early."""
    import types

    from benchmarks.lib.trl_ppo import PhaseTimer

    pad, eos = 0, 9
    queries = torch.tensor([[5, 6], [5, 7], [6, 6]])
    responses = torch.tensor([[1, 9, 0, 0], [2, 0, 3, 9], [4, 4, 4, 4]])  # EOS at 2, at 4, none

    def batch_generation(model, q, *args, **kwargs):
        return torch.cat([q, responses], 1), torch.zeros(q.shape[0], responses.shape[1], 3)

    module = types.SimpleNamespace(batch_generation=batch_generation, forward=lambda *a: None)
    timer = PhaseTimer(None, pad, eos)
    timer.install(module)
    module.batch_generation(None, queries)
    naive = 0
    for row in responses.tolist():
        naive += row.index(eos) + 1 if eos in row else len(row)
    assert timer.sampled_tokens == naive == 2 + 4 + 4
    assert timer.sampled_pad_tokens == 1  # row 1's sampled pad, before its EOS; row 0's padding is not counted

    strict = types.SimpleNamespace(batch_generation=batch_generation, forward=lambda *a: None)
    PhaseTimer(8, pad, eos).install(strict)
    with pytest.raises(RuntimeError, match="generation stopped early: 4 new tokens, expected 8"):
        strict.batch_generation(None, queries)


def test_scaling_on_paper_counts_one_unpadded_row_alike_on_both_sides_but_the_lean_heads_recompute():
    """``benchmarks.scaling.paper_gflop`` against a naive count: with one prompt and one completion
    there is no padding and no repeated prompt, so the two sides' FLOPs differ only by ours
    recomputing the head on the completion once more (the lean head); a doubled workload doubles
    its prompts or its completions, and the drawn lengths follow the baked EOS rate."""
    import random
    import statistics

    from benchmarks.lib.workloads import doubled, prompt_lengths
    from benchmarks.scaling import QWEN2_5_1_5B, Shape, completion_lengths, forward, layer_flops, paper_gflop

    w = WORKLOADS["gsm8k_like"]
    assert WORKLOADS["gsm8k_like_prompts_x2"] == doubled(w, "prompts")
    assert (doubled(w, "prompts").prompt_tokens_min, doubled(w, "prompts").prompt_tokens) == (200, 400)
    assert (doubled(w, "completions").eos_mean_tokens, doubled(w, "completions").response_tokens) == (192, 512)
    lengths = completion_lengths(w, random.Random(0), 4000)
    assert max(lengths) == 256 and min(lengths) >= 1
    expected = 96 * (1 - (1 - 1 / 96) ** 256)  # a geometric mean, capped at 256
    assert math.isclose(w.expected_response_tokens, expected) and w.expected_prompt_tokens == 150
    assert abs(statistics.mean(lengths) - expected) < 0.05 * expected
    assert 1.30e9 < QWEN2_5_1_5B.layer_weights * QWEN2_5_1_5B.n_layer < 1.32e9  # Qwen2.5-1.5B's 1.31 B
    # one token through a forward: 2 FLOPs a weight, the layers' and the head's (attention aside)
    for shape, weights in ((QWEN2_5_1_5B, 1.31e9 + 1536 * 151936), (Shape.of(w), 4 * 10 * 256**2 + 256 * 151936)):
        assert math.isclose(forward(shape, 0, 1, 1), 2 * weights + 0.5 * layer_flops(shape)[1], rel_tol=0.01)
    for shape in (Shape.of(w), QWEN2_5_1_5B):
        gflop = paper_gflop(w, 1, 1, shape, draws=50)
        rng = random.Random(0)  # the same draws, counted naively: 5 forwards of p + c, the head on c
        f, att, h = layer_flops(shape)
        trl = head = 0.0
        for _ in range(50):
            p = rng.sample(prompt_lengths(w), 1)[0]
            c = completion_lengths(w, rng, 1)[0]
            trl += 5 * ((p + c) * f + att * (p + c) ** 2 / 2 + c * h)
            head += c * h
        assert math.isclose(gflop["trl"], trl / 50 / 1e9, rel_tol=1e-9)
        assert math.isclose(gflop["ppo_lightning"], (trl + head) / 50 / 1e9, rel_tol=1e-9)


def test_ppo_scaling_on_paper_counts_one_row_as_its_passes_do():
    """``benchmarks.scaling.paper_gflop_ppo`` against a naive count of one row (prompt p,
    completion c, n = p + c positions, no padding): ours samples it, then runs six passes of its
    layers (reference, rollout, reward model, the update's forward and backward at 3x) and seven
    of the head on c (the lean head's recomputation); TRL samples it, runs the head on all n in
    four passes (reference, update) and its layers in nine more (value model x4, reward model).
    ``doubled(w, "batch")`` doubles the rollout batch and keeps the iterations."""
    import dataclasses
    import random

    from benchmarks.lib.workloads import doubled, prompt_lengths
    from benchmarks.scaling import QWEN2_5_1_5B, Shape, completion_lengths, layer_flops, paper_gflop_ppo

    w = WORKLOADS["gsm8k_like"]
    assert WORKLOADS["gsm8k_like_batch_x2"] == doubled(w, "batch")
    assert (doubled(w, "batch").rollout_batch, doubled(w, "batch").iterations) == (16, w.iterations)
    one = dataclasses.replace(w, rollout_batch=1)
    for shape in (Shape.of(w), QWEN2_5_1_5B):
        gflop = paper_gflop_ppo(one, shape, draws=50)
        rng, (f, att, h) = random.Random(0), layer_flops(shape)
        ours = trl = 0.0
        for _ in range(50):
            p = rng.sample(prompt_lengths(w), 1)[0]
            c = completion_lengths(w, rng, 1)[0]
            layers = (p + c) * f + att * (p + c) ** 2 / 2
            ours += 7 * layers + 7 * c * h
            trl += 10 * layers + c * h + 4 * (p + c) * h
        assert math.isclose(gflop["ppo_lightning"], ours / 50 / 1e9, rel_tol=1e-9)
        assert math.isclose(gflop["trl"], trl / 50 / 1e9, rel_tol=1e-9)


def test_the_scaling_table_gives_each_points_growth_and_both_speed_ups():
    """``benchmarks.scaling.table`` from its JSON rows: growth over x1 per side, the speed-up at
    the mean length and raw with each side's drawn mean, and the FLOP ratios."""
    from benchmarks.scaling import POINTS, table

    rows = []
    for i, (label, _, _) in enumerate(POINTS["ppo"]):
        for side, s, tokens, gflop in (("ppo_lightning", 1.0, 80.0, 50.0), ("trl", 4.0, 120.0, 150.0)):
            k = 1 + i  # each point costs (1 + i)x x1 on both sides
            rows.append(
                {
                    "point": label,
                    "side": side,
                    "s_per_completion": [k * s, k * s],
                    "mean_tokens": [tokens, tokens],
                    "s_per_completion_at_mean": k * s * (0.5 if side == "trl" else 1.0),
                    "paper_gflop": k * gflop,
                    "paper_gflop_floor": 40.0,
                    "paper_gflop_qwen2_5_1_5b": k * gflop * (2.0 if side == "trl" else 1.0),
                }
            )
    lines = table(rows, POINTS["ppo"]).splitlines()
    assert len(lines) == 2 + len(POINTS["ppo"])
    cells = [c.strip() for c in lines[3].split("|")[1:-1]]  # prompts x2: every figure twice x1's
    assert cells == [
        "prompts x2", "2.00 (2.00x)", "4.00 (2.00x)", "100.0 (2.00x)", "300.0 (2.00x)", "40.0",
        "2.00x", "4.00x (80.0 / 120.0)", "3.00x", "6.00x",
    ]  # fmt: skip


def test_each_engine_correction_modes_weights_match_their_definition_and_are_1_without_a_mismatch():
    """``benchmarks.engine_correction.mode_stats`` over kept rollouts: with the engine equal to the
    trainer every mode changes and drops nothing (ESS 1); with a mismatch, ``token_mask`` drops
    exactly the tokens whose ratio passes the cap, and a sequence mode weighs each token of a
    completion by the completion's product of ratios."""
    from benchmarks.engine_correction import MODES, mismatch, mode_stats

    g = torch.Generator().manual_seed(0)
    old = torch.randn(6, 9, generator=g) - 2
    mask = (torch.arange(9) < torch.tensor([2, 3, 4, 7, 8, 9])[:, None]).float()
    for mode in MODES:
        s = mode_stats([(old, old.clone(), mask)], mode, 2.0)
        assert s["changed"] == 0 and s["dropped"] == 0 and abs(s["ess"] - 1) < 1e-6, (mode, s)
    engine = old - 0.5 * torch.randn(6, 9, generator=g)
    kept, log_rho = [(old, engine, mask)], old - engine
    dropped = (log_rho.exp() > 2)[mask.bool()].float().mean().item()
    assert math.isclose(mode_stats(kept, "token_mask", 2.0)["dropped"], dropped, rel_tol=1e-6)
    # the longest third: rows 4 and 5 (8 and 9 tokens), each token weighed by its row's capped product
    w4, w5 = (log_rho[4, :8].sum().exp().clamp(max=2.0).item(), log_rho[5].sum().exp().clamp(max=2.0).item())
    assert math.isclose(mode_stats(kept, "sequence_truncate", 2.0)["w_long"], (8 * w4 + 9 * w5) / 17, rel_tol=1e-5)
    m = mismatch(kept + kept[:1], 2.0)  # pooled over two rollouts: the same figures
    assert m["tokens"] == 2 * int(mask.sum())
    assert math.isclose(m["engine_kl"], (engine - old)[mask.bool()].mean().item(), rel_tol=1e-5)
    assert math.isclose(m["engine_logprob_diff"], log_rho[mask.bool()].abs().mean().item(), rel_tol=1e-5)
    assert math.isclose(m["engine_capped_frac"], dropped, rel_tol=1e-5)  # what token_mask drops
    assert math.isclose(m["max_abs_log_rho"], log_rho[mask.bool()].abs().max().item(), rel_tol=1e-6)


def test_packed_micro_batches_give_the_trimmed_ones_logprobs(tmp_path):
    """``benchmarks.padding --packing``: each micro-batch's rows end to end in one row, positions
    restarting per sequence, give the log-probabilities of the rows on their window (Hugging Face's
    block-diagonal mask from the position ids), so its timing compares the same work."""
    from benchmarks import padding

    r = padding.build_rollout()[0]
    r = r.index(torch.arange(padding.MINIBATCH))  # one minibatch
    policy = padding.build_policy(tmp_path)
    trimmed, packed = (padding.packing_epoch(policy, r, p, seed=0) for p in (False, True))
    assert packed["tokens_computed"] < trimmed["tokens_computed"]
    assert math.isclose(packed["logp_sum"], trimmed["logp_sum"], rel_tol=1e-4), (packed, trimmed)
