"""The sampler's lean GPT-2 decode step: the same logits as the model's forward, and a fallback
to that forward for every model it does not cover."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from transformers import DynamicCache, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from ppo_lightning.fast_decode import GPT2Decoder, supports_fast_decode
from ppo_lightning.lora import DisabledAdapters
from ppo_lightning.policy import load_causal_lm, load_tokenizer, model_class, position_ids_from_mask, underlying
from ppo_lightning.generation.hf import generate
from tests.helpers import greedy_by_full_forward

PROMPTS = ["hello there, friend", "a", "xyz abc", "the cat sat on"]  # left-padded: rows differ in length


@pytest.fixture(scope="module")
def lm_and_tok(tiny_lm_dir):
    tok = load_tokenizer(str(tiny_lm_dir))
    return load_causal_lm(str(tiny_lm_dir), tok), tok


def test_decode_step_logits_equal_the_model_forward(lm_and_tok):
    """Token by token under left padding, the lean step's logits are the HF forward's, bitwise."""
    lm, tok = lm_and_tok
    assert supports_fast_decode(lm)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    ids, am = enc.input_ids, enc.attention_mask
    assert (am == 0).any()
    B, P = ids.shape
    steps = 10
    tokens = torch.randint(0, 256, (B, steps), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        caches = [DynamicCache(config=lm.config), DynamicCache(config=lm.config)]
        pos = position_ids_from_mask(am)
        for cache in caches:
            lm(input_ids=ids, attention_mask=am, position_ids=pos, use_cache=True, cache=cache)
        decoder = GPT2Decoder(lm, caches[1], am, steps)
        mask = torch.cat([am, torch.ones(B, steps, dtype=am.dtype)], 1)
        next_pos = pos[:, -1] + 1
        for t in range(steps):
            want = lm(
                input_ids=tokens[:, t : t + 1],
                attention_mask=mask[:, : P + t + 1],
                position_ids=next_pos[:, None],
                use_cache=True,
                cache=caches[0],
            ).logits[:, -1]
            got = decoder.step(tokens[:, t], next_pos)
            assert torch.equal(got, want), (t, (got - want).abs().max().item())
            next_pos = next_pos + 1


@pytest.mark.parametrize("greedy", [True, False])
def test_generate_draws_the_same_tokens_with_and_without_the_fast_path(lm_and_tok, greedy):
    lm, tok = lm_and_tok
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


def test_models_the_lean_step_does_not_cover_decode_through_their_forward(lm_and_tok):
    lm, tok = lm_and_tok
    upcast = copy.deepcopy(lm)
    upcast.config.reorder_and_upcast_attn = True  # eager attention in fp32: another computation
    assert not supports_fast_decode(upcast)

    class Custom(GPT2LMHeadModel):  # a subclass may change the forward
        pass

    custom = Custom(lm.config)
    assert not supports_fast_decode(custom)

    dropout = copy.deepcopy(lm).train()
    dropout.transformer.drop.p = 0.1
    assert not supports_fast_decode(dropout)
    assert supports_fast_decode(dropout.eval())  # dropout is off in eval mode

    torch.manual_seed(0)
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=64,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
        )
    ).eval()
    assert not supports_fast_decode(llama)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    resp, mask = generate(
        llama,
        enc.input_ids,
        enc.attention_mask,
        max_new_tokens=6,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        stop_at_eos=False,
        greedy=True,
    )
    # the fallback is the model's own cached forward: greedy tokens match re-running it whole
    assert torch.equal(greedy_by_full_forward(llama, enc.input_ids, enc.attention_mask, 6), resp)


def test_fsdp_sharded_weights_decline_the_lean_step_and_gathered_ones_take_it(lm_and_tok, monkeypatch):
    """Under FSDP2 (one gloo process here) a sharded LM holds DTensor weights that only its own
    forward gathers: the lean step declines it. Gathered for the rollout
    (``sharding.unsharded_for_rollout``) its weights are whole again, and the lean step samples
    the tokens the unsharded model samples."""
    import socket

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ppo_lightning.sharding import is_sharded, shard_lm, unsharded_for_rollout

    lm, tok = lm_and_tok
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
        assert type(sharded) is not GPT2LMHeadModel and model_class(sharded) is GPT2LMHeadModel
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
    """``policy.underlying`` / ``model_class`` see through ``DisabledAdapters`` (the reference under
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
