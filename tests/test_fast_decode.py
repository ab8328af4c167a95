"""The sampler's lean decode step (GPT-2, Llama, Qwen2, GPT-NeoX): the same logits as the model's
forward, and a fallback to that forward for every model it does not cover."""

from __future__ import annotations

import copy
import importlib.util
import types

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, DynamicCache, GPT2LMHeadModel, LlamaForCausalLM

from ppo_lightning.generation.fast_decode import decoder_for, head_logits, supports_fast_decode
from ppo_lightning.models.lora import DisabledAdapters
from ppo_lightning.models.policy import load_causal_lm, load_tokenizer, position_ids_from_mask
from ppo_lightning.models.signature import model_class
from ppo_lightning.models.lora import underlying
from ppo_lightning.generation.hf import generate, sample_next_token
from ppo_lightning.models.signature import cache_kwarg
from ppo_lightning.models.tiny import causal_lm_config
from tests.helpers import greedy_by_full_forward

PROMPTS = ["hello there, friend", "a", "xyz abc", "the cat sat on"]  # left-padded: rows differ in length

ROPE = {  # rotary types whose frequencies are fixed at load: the lean step takes them
    "linear": {"rope_type": "linear", "factor": 2.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 16,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16},
}

MODELS = {  # id: (architecture, config changes); Llama and Qwen2 with grouped-query attention
    "llama": ("llama", {"num_key_value_heads": 2}),
    "qwen2": ("qwen2", {"num_key_value_heads": 2}),
    "gpt_neox": ("gpt_neox", {}),  # rotary_pct 0.25, parallel residual
    "gpt_neox-sequential": ("gpt_neox", {"use_parallel_residual": False}),
    **{f"llama-rope-{k}": ("llama", {"num_key_value_heads": 2, "rope_parameters": rope}) for k, rope in ROPE.items()},
}


def tiny(arch: str, attn_implementation: str = "sdpa", **config):
    """A 2-layer, 4-head, 64-wide random causal LM of ``arch`` over the byte vocabulary, built
    offline; ``config`` changes its config (``rope_parameters`` are merged into the default)."""
    cfg = causal_lm_config(arch, 2, 4, 64, 128)
    if "rope_parameters" in config:
        config["rope_parameters"] = {**cfg.rope_parameters, **config["rope_parameters"]}
    for key, value in config.items():
        setattr(cfg, key, value)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation).eval()


@pytest.fixture(scope="module")
def lm_and_tok(tiny_lm_dir):
    tok = load_tokenizer(str(tiny_lm_dir))
    return load_causal_lm(str(tiny_lm_dir), tok), tok


@pytest.fixture(scope="module", params=["gpt2", "llama", "qwen2", "gpt_neox"])
def any_lm(request, lm_and_tok):
    """Each architecture the lean step covers: the tiny GPT-2 (loaded from disk), the others built."""
    return lm_and_tok[0] if request.param == "gpt2" else tiny(*MODELS[request.param])


@pytest.mark.parametrize("padded", [True, False], ids=["left-padded", "unpadded"])
@pytest.mark.parametrize("model", ["gpt2", *MODELS])
def test_decode_step_logits_equal_the_model_forward(lm_and_tok, model, padded):
    """Token by token, the lean step's hidden state gives the HF forward's logits bitwise under
    the model's own head (``F.linear``): under left padding (the model's mask is a boolean key
    mask) and without (no mask: grouped-query attention then takes another SDPA path). The step's
    own head (``head_logits``) gives them to float32 rounding."""
    lm = lm_and_tok[0] if model == "gpt2" else tiny(MODELS[model][0], **MODELS[model][1])
    tok = lm_and_tok[1]
    assert supports_fast_decode(lm)
    enc = tok(PROMPTS if padded else ["abcd", "efgh", "ijkl"], return_tensors="pt", padding=True)
    ids, am = enc.input_ids, enc.attention_mask
    assert (am == 0).any() == padded
    B, P = ids.shape
    steps = 10
    tokens = torch.randint(0, 256, (B, steps), generator=torch.Generator().manual_seed(0))
    cache_kw = cache_kwarg(lm)  # transformers >= 5.24: cache=; earlier: past_key_values=
    with torch.inference_mode():
        caches = [DynamicCache(config=lm.config), DynamicCache(config=lm.config)]
        pos = position_ids_from_mask(am)
        for cache in caches:
            lm(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True, **{cache_kw: cache})
        decoder = decoder_for(lm, caches[1], am, steps)
        mask = torch.cat([am, torch.ones(B, steps, dtype=am.dtype)], 1)
        next_pos = pos[:, -1] + 1
        head = lm.get_output_embeddings()
        for t in range(steps):
            want = lm(
                input_ids=tokens[:, t : t + 1],
                attention_mask=mask[:, : P + t + 1],
                position_ids=next_pos[:, None],
                use_cache=True,
                **{cache_kw: caches[0]},
            ).logits[:, -1]
            h = decoder.hidden(tokens[:, t], next_pos)
            got = F.linear(h, head.weight, head.bias)
            assert torch.equal(got, want), (t, (got - want).abs().max().item())
            torch.testing.assert_close(head_logits(h, head.weight, head.bias), want, rtol=1e-5, atol=1e-5)
            next_pos = next_pos + 1


@pytest.mark.parametrize("bias", [False, True])
def test_the_decode_head_computes_f_linear(bias):
    """``head_logits`` on 1-16 rows of a Qwen2-sized head (151,936 x 256) is ``F.linear`` to
    float32 rounding, in float32 on the CPU (where it sums in another order); in bfloat16 it is
    ``F.linear`` itself."""
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(151936, 256, generator=g) * 0.05
    b = torch.randn(151936, generator=g) if bias else None
    for rows in (1, 2, 3, 8, 16):
        h = torch.randn(rows, 256, generator=g)
        got, want = head_logits(h, weight, b), F.linear(h, weight, b)
        assert got.shape == want.shape == (rows, 151936)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    h16, w16 = h[:2].bfloat16(), weight[:4096].bfloat16()
    assert torch.equal(head_logits(h16, w16), F.linear(h16, w16))


@pytest.mark.parametrize("greedy", [True, False])
def test_generate_draws_the_same_tokens_with_and_without_the_fast_path(any_lm, lm_and_tok, greedy):
    lm, tok = any_lm, lm_and_tok[1]
    assert supports_fast_decode(lm)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    out = {}
    for fast in (True, False):
        out[fast] = generate(
            lm,
            enc.input_ids,
            enc.attention_mask,
            max_new_tokens=12,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            temperature=0.8,
            top_k=40,
            greedy=greedy,
            generator=torch.Generator().manual_seed(5),
            fast_decode=fast,
        )
    assert torch.equal(out[True][0], out[False][0])
    assert torch.equal(out[True][1], out[False][1])


def naive_sampling(lm, ids, am, n: int, stops: set[int], seed: int, pad: int, **params):
    """The sampler written plainly: the whole batch through the model's full forward (no cache)
    every step, one uniform per row a step from ``seed``'s generator, a row's tokens kept until
    its first stop; ``(tokens [B, m], mask [B, m])``, ``m`` the step where the last row stopped."""
    g = torch.Generator().manual_seed(seed)
    B = ids.shape[0]
    tokens, mask = torch.full((B, n), pad), torch.zeros(B, n)
    live = [True] * B
    for t in range(n):
        u = torch.rand(B, generator=g, dtype=torch.float64)
        logits = lm(input_ids=ids, attention_mask=am, position_ids=position_ids_from_mask(am)).logits[:, -1]
        for b in range(B):
            if live[b]:
                tokens[b, t] = sample_next_token(logits[b : b + 1], uniforms=u[b : b + 1], **params)[0]
                mask[b, t] = 1.0
                live[b] = int(tokens[b, t]) not in stops
        if not any(live):
            return tokens[:, : t + 1], mask[:, : t + 1]
        ids = torch.cat([ids, tokens[:, t : t + 1]], 1)
        am = torch.cat([am, torch.ones_like(am[:, :1])], 1)
    return tokens, mask


@pytest.mark.parametrize("fast", [True, False], ids=["lean-step", "model-forward"])
def test_rows_that_stop_leave_the_decode_batch_and_every_token_is_the_plain_loops(
    any_lm, lm_and_tok, fast, monkeypatch
):
    """A quarter of the vocabulary stops a row, so rows end at different steps and leave the
    decode batch (the step's batch shrinks); each row's tokens and mask are still the plain
    full-batch loop's, token for token, since every step draws a uniform for every row."""
    from ppo_lightning.generation import hf

    lm, tok = any_lm, lm_and_tok[1]
    enc = tok(PROMPTS * 2, return_tensors="pt", padding=True)
    stops = tuple(range(0, 256, 4))
    params = dict(temperature=0.9, top_k=60)
    batch_sizes = []
    step = hf._Decode.step
    monkeypatch.setattr(
        hf._Decode, "step", lambda self, token, *a: batch_sizes.append(len(token)) or step(self, token, *a)
    )
    with torch.inference_mode():
        want = naive_sampling(
            lm, enc.input_ids, enc.attention_mask, 16, {tok.eos_token_id, *stops}, 3, tok.pad_token_id, **params
        )
    got = generate(
        lm,
        enc.input_ids,
        enc.attention_mask,
        max_new_tokens=16,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        stop_token_ids=stops,
        generator=torch.Generator().manual_seed(3),
        fast_decode=fast,
        **params,
    )
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    lengths = want[1].sum(1)
    assert len(set(lengths.tolist())) > 2  # rows stopped at different steps
    assert batch_sizes == sorted(batch_sizes, reverse=True) and batch_sizes[-1] < len(PROMPTS) * 2
    assert batch_sizes == [int((lengths > t + 1).sum()) for t in range(len(batch_sizes))]


@pytest.mark.parametrize("fast", [True, False], ids=["lean-step", "model-forward"])
def test_a_groups_prompt_is_prefilled_once_and_its_rows_draw_the_plain_loops_tokens(any_lm, lm_and_tok, fast):
    """Rows that hold the same prompt (a group's ``num_generations`` rows, here 3 of each of 4
    prompts) share one row of the prefill: the model's forward sees each distinct prompt once, its
    cache is copied to each of the group's rows, and every row's tokens and mask are still the
    plain full-batch loop's."""
    lm, tok = any_lm, lm_and_tok[1]
    enc = tok([p for p in PROMPTS for _ in range(3)], return_tensors="pt", padding=True)
    params = dict(temperature=0.9, top_k=60)
    rows_seen = []
    hook = lm.register_forward_pre_hook(lambda m, a, kw: rows_seen.append(kw["input_ids"].shape[0]), with_kwargs=True)
    try:
        got = generate(
            lm,
            enc.input_ids,
            enc.attention_mask,
            max_new_tokens=10,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            generator=torch.Generator().manual_seed(4),
            fast_decode=fast,
            **params,
        )
    finally:
        hook.remove()
    assert rows_seen[0] == len(PROMPTS)  # the prefill
    with torch.inference_mode():
        want = naive_sampling(
            lm, enc.input_ids, enc.attention_mask, 10, {tok.eos_token_id}, 4, tok.pad_token_id, **params
        )
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    assert len({tuple(r) for r in got[0].tolist()}) > len(PROMPTS)  # a group's rows drew their own tokens


def test_gpt2_variants_the_lean_step_does_not_cover_are_declined(lm_and_tok):
    lm = lm_and_tok[0]
    upcast = copy.deepcopy(lm)
    upcast.config.reorder_and_upcast_attn = True  # eager attention in fp32: another computation
    assert not supports_fast_decode(upcast)

    class Custom(GPT2LMHeadModel):  # a subclass may change the forward
        pass

    custom = Custom(lm.config)
    assert not supports_fast_decode(custom)

    eager = copy.deepcopy(lm)
    eager.config._attn_implementation = "eager"  # matmul and softmax, not SDPA: other rounding
    assert not supports_fast_decode(eager)

    dropout = copy.deepcopy(lm).train()
    dropout.transformer.drop.p = 0.1
    assert not supports_fast_decode(dropout)
    assert supports_fast_decode(dropout.eval())  # dropout is off in eval mode


DECLINED = {  # id: (architecture, tiny() arguments): what the lean step would not compute bitwise
    "rope-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}),  # rescaled per call
    "sliding-window": ("qwen2", {"layer_types": ["sliding_attention"] * 2, "sliding_window": 4}),  # another mask
    "eager-attention": ("llama", {"attn_implementation": "eager"}),  # matmul and softmax, not SDPA
}


@pytest.mark.parametrize("case", list(DECLINED))
def test_rotary_configurations_the_lean_step_does_not_cover_decode_through_the_forward(lm_and_tok, case):
    tok = lm_and_tok[1]
    arch, kwargs = DECLINED[case]
    lm = tiny(arch, **kwargs)
    assert not supports_fast_decode(lm)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    resp, _ = generate(
        lm,
        enc.input_ids,
        enc.attention_mask,
        max_new_tokens=6,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        stop_at_eos=False,
        greedy=True,
    )
    # the fallback is the model's own cached forward: greedy tokens match re-running it whole
    assert torch.equal(greedy_by_full_forward(lm, enc.input_ids, enc.attention_mask, 6), resp)


def test_rotary_models_with_other_forwards_are_declined():
    """A subclass, attention dropout in train mode, LoRA layers injected into the projections
    (``lora.apply_lora``) and LoRA's adapters-off view each run a forward the lean step does not."""

    class Custom(LlamaForCausalLM):  # a subclass may change the forward
        pass

    llama = tiny("llama")
    assert supports_fast_decode(llama) and not supports_fast_decode(Custom(llama.config))

    dropout = tiny("llama", attention_dropout=0.1).train()
    assert not supports_fast_decode(dropout)
    assert supports_fast_decode(dropout.eval())  # dropout is off in eval mode

    peft = pytest.importorskip("peft")
    adapted = peft.get_peft_model(copy.deepcopy(llama), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    assert model_class(adapted.get_base_model()) is LlamaForCausalLM
    assert not supports_fast_decode(adapted.get_base_model())  # q_proj is a LoRA layer now
    assert not supports_fast_decode(DisabledAdapters(adapted))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt_neox"])
def test_rotary_models_loaded_from_disk_take_the_lean_step(tmp_path, lm_and_tok, arch):
    """``from_pretrained`` kernelizes a model when the ``kernels`` package is installed (it comes
    with transformers 5) and sets ``use_kernels`` even though, here, every layer keeps its own
    forward: the lean step takes such a model, and samples what the model's forward samples."""
    tok = lm_and_tok[1]
    tiny(*MODELS[arch]).save_pretrained(tmp_path)
    lm = load_causal_lm(str(tmp_path), tok)
    if importlib.util.find_spec("kernels") is not None:
        assert lm.use_kernels  # the case this test is for
    assert supports_fast_decode(lm)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, temperature=0.8)
    fast, plain = (
        generate(lm, enc.input_ids, enc.attention_mask, generator=torch.Generator().manual_seed(5), fast_decode=f, **kw)
        for f in (True, False)
    )
    assert torch.equal(fast[0], plain[0]) and torch.equal(fast[1], plain[1])


def test_models_with_a_swapped_forward_are_declined():
    """A forward set on a module instance (how ``kernels.kernelize`` installs a hub kernel, on a
    layer or on a function wrapper it routes calls through) runs in place of the code the lean
    step copies: such a model decodes through its forward."""
    lm = tiny("qwen2")
    norm = lm.model.layers[1].post_attention_layernorm
    norm.forward = types.MethodType(lambda self, x: 2 * x, norm)
    assert not supports_fast_decode(lm)
    del norm.forward
    assert supports_fast_decode(lm)
    wrappers = getattr(lm.model.layers[0].self_attn, "_kernel_funcs", {})  # with ``kernels`` installed
    for wrapper in wrappers.values():
        wrapper.forward = types.MethodType(lambda self, *args: args, wrapper)
        assert not supports_fast_decode(lm)
        del wrapper.forward


@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_fsdp_sharded_weights_decline_the_lean_step_and_gathered_ones_take_it(lm_and_tok, arch, monkeypatch):
    """Under FSDP2 (one gloo process here) a sharded LM holds DTensor weights that only its own
    forward gathers: the lean step declines it. Gathered for the rollout
    (``sharding.unsharded_for_rollout``) its weights are whole again, and the lean step samples
    the tokens the unsharded model samples (FSDP2 swapped the class of the LM and of each block:
    the check sees through both)."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ppo_lightning.parallel.sharding import shard_lm, unsharded_for_rollout

    from ppo_lightning.models.weights import is_sharded

    lm, tok = lm_and_tok if arch == "gpt2" else (tiny("llama", num_key_value_heads=2), lm_and_tok[1])
    sharded = copy.deepcopy(lm)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(
        max_new_tokens=8, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True, stop_at_eos=False
    )
    want, _ = generate(lm, enc.input_ids, enc.attention_mask, **kw)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        shard_lm(sharded, init_device_mesh("cpu", (1,)))
        # what it really is: the class FSDP2 swapped out, sharded also behind LoRA's adapters-off view
        assert type(sharded) is not type(lm) and model_class(sharded) is type(lm)
        view = DisabledAdapters(types.SimpleNamespace(get_base_model=lambda: sharded))
        assert is_sharded(sharded) and is_sharded(view) and not is_sharded(lm)
        assert not supports_fast_decode(sharded)
        with torch.no_grad():
            sharded(enc.input_ids[:, :2])  # FSDP initialises at the first forward
        with unsharded_for_rollout(sharded):
            assert supports_fast_decode(sharded)
            got, _ = generate(sharded, enc.input_ids, enc.attention_mask, **kw)
        assert not supports_fast_decode(sharded)  # resharded after the rollout
    finally:
        dist.destroy_process_group()
    assert torch.equal(got, want)


def test_lora_s_adapters_off_view_is_seen_through_but_not_fast_decoded(lm_and_tok):
    """``lora.underlying`` / ``model_class`` see through ``DisabledAdapters`` (the reference under
    LoRA): the sampler passes the LM's own keyword arguments, and declines the lean step, which
    would read the adapted layers' weights directly. The view samples what the base LM samples."""
    peft = pytest.importorskip("peft")
    lm, tok = lm_and_tok
    adapted = peft.get_peft_model(
        copy.deepcopy(lm), peft.LoraConfig(r=4, target_modules=["c_attn"], fan_in_fan_out=True)
    )
    with torch.no_grad():
        for name, w in adapted.named_parameters():
            if "lora_B" in name:  # adapters that change the output (peft starts them at zero)
                w.normal_(generator=torch.Generator().manual_seed(0))
    view = DisabledAdapters(adapted)
    assert underlying(view) is adapted.get_base_model() and underlying(lm) is lm
    assert model_class(view) is GPT2LMHeadModel and not supports_fast_decode(view)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(
        max_new_tokens=6, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True, stop_at_eos=False
    )
    base = generate(lm, enc.input_ids, enc.attention_mask, **kw)[0]
    assert torch.equal(generate(view, enc.input_ids, enc.attention_mask, **kw)[0], base)
    assert not torch.equal(generate(adapted, enc.input_ids, enc.attention_mask, **kw)[0], base)
