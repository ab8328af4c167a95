"""Rollouts: KV-cache sampling under left padding, and logprobs that a fresh forward reproduces."""

from __future__ import annotations

import pytest
import torch

from ppo_lightning.models.policy import PolicyWithValueHead, load_causal_lm, load_tokenizer, make_reference
from ppo_lightning.rewards.rules import char_fraction
from ppo_lightning.generation.hf import generate
from tests.helpers import greedy_by_full_forward, make_rollout

PROMPTS = ["hello there, friend", "a", "xyz abc", "the cat sat on"]
GEN = dict(max_new_tokens=12, temperature=0.7, top_k=50, top_p=0.95, stop_at_eos=True)


def _setup(tiny_lm_dir):
    tok = load_tokenizer(str(tiny_lm_dir))
    lm = load_causal_lm(str(tiny_lm_dir), tok)
    return tok, lm, PolicyWithValueHead(lm), make_reference(lm)


def _rollout(tok, policy, ref, eos_bias: float = 0.0, seed: int = 0):
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    if eos_bias:  # make EOS likely so some rows stop early and get padded
        policy.lm.lm_head.weight.data[tok.eos_token_id] += eos_bias
    g = torch.Generator().manual_seed(seed)
    return enc, make_rollout(
        policy=policy,
        ref_lm=ref,
        reward_fn=char_fraction,
        tokenizer=tok,
        input_ids=enc.input_ids,
        attention_mask=enc.attention_mask,
        kl_coef=0.05,
        gen=GEN,
        gamma=1.0,
        lam=0.95,
        generator=g,
    )


def test_rollout_logprobs_equal_unpadded_fresh_forward(tiny_lm_dir):
    """Each row alone, with no padding at all, gives the logprobs the padded batch gave."""
    tok, lm, policy, ref = _setup(tiny_lm_dir)
    enc, r = _rollout(tok, policy, ref, eos_bias=0.05)
    assert (enc.attention_mask == 0).any(), "prompts must be left-padded for this test"
    for i in range(len(PROMPTS)):
        ids = r.query_responses[i][r.attention_mask[i].bool()][None]  # drop left pads and after-EOS
        P = int(enc.attention_mask[i].sum())
        with torch.no_grad():
            logits = lm(ids).logits[0, P - 1 : -1] / GEN["temperature"]
        fresh = torch.log_softmax(logits, -1).gather(1, ids[0, P:, None]).squeeze(1)
        got = r.logprobs[i][r.response_mask[i].bool()]
        torch.testing.assert_close(got, fresh, atol=1e-5, rtol=1e-5)
        ref_logits = ref(ids).logits[0, P - 1 : -1] / GEN["temperature"]
        ref_fresh = torch.log_softmax(ref_logits, -1).gather(1, ids[0, P:, None]).squeeze(1)
        torch.testing.assert_close(r.ref_logprobs[i][r.response_mask[i].bool()], ref_fresh, atol=1e-5, rtol=1e-5)


def test_kv_cache_generation_matches_full_forward_greedy(tiny_lm_dir):
    """Greedy decoding with the cache equals re-running the whole padded sequence each step."""
    tok, lm, _, _ = _setup(tiny_lm_dir)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    resp, mask = generate(
        lm,
        enc.input_ids,
        enc.attention_mask,
        max_new_tokens=10,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        greedy=True,
        stop_at_eos=False,
    )
    assert torch.equal(greedy_by_full_forward(lm, enc.input_ids, enc.attention_mask, 10), resp)
    assert mask.shape == resp.shape and bool(mask.all())


def test_chunked_generation_gives_the_whole_batch_tokens(tiny_lm_dir):
    """``chunk_size`` rows at a time (sampling.chunk_size): greedy tokens and masks
    equal the whole batch's, chunks that stop early padded to the longest, on the fast decode path
    and the model's forward."""
    tok, lm, _, _ = _setup(tiny_lm_dir)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=12, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True)
    eos_row = lm.lm_head.weight.data[tok.eos_token_id].clone()
    for scale in range(1, 13):  # make EOS likely enough that rows stop at different steps
        lm.lm_head.weight.data[tok.eos_token_id] = eos_row * scale
        whole, whole_mask = generate(lm, enc.input_ids, enc.attention_mask, **kw)
        if len(set(whole_mask.sum(1).tolist())) > 2:
            break
    assert len(set(whole_mask.sum(1).tolist())) > 2, "need rows of different lengths"
    for fast in (True, False):
        for chunk in (1, 3):
            resp, mask = generate(lm, enc.input_ids, enc.attention_mask, chunk_size=chunk, fast_decode=fast, **kw)
            assert torch.equal(resp, whole) and torch.equal(mask, whole_mask), (fast, chunk)
            assert not resp.is_inference() and mask.dtype == whole_mask.dtype


def test_everything_after_eos_is_masked_and_scored_at_last_token(tiny_lm_dir):
    tok, _, policy, ref = _setup(tiny_lm_dir)
    _, r = _rollout(tok, policy, ref, eos_bias=0.08)
    for seed in range(1, 20):  # a batch where some rows stop at EOS and some run to the limit
        if r.contains_eos.any() and (~r.contains_eos).any():
            break
        _, r = _rollout(tok, policy, ref, seed=seed)
    assert r.contains_eos.any() and (~r.contains_eos).any()
    eos = tok.eos_token_id
    for i in range(r.batch_size):
        row, m = r.responses[i], r.response_mask[i]
        n = int(m.sum())
        if r.contains_eos[i]:
            assert row[n - 1] == eos and not (row[: n - 1] == eos).any()
            assert (row[n:] == tok.pad_token_id).all()
        for t in (r.logprobs, r.values, r.rewards, r.advantages, r.returns, r.kl):
            assert (t[i][n:] == 0).all()
        # reward = -beta * KL_t everywhere, plus the score at the last real token
        expected = -0.05 * r.kl[i]
        expected[n - 1] += r.scores[i]
        torch.testing.assert_close(r.rewards[i], expected)
    # advantages are whitened over response tokens only
    m = r.response_mask.bool()
    assert abs(float(r.advantages[m].mean())) < 1e-5
    assert abs(float(r.advantages[m].std()) - 1) < 1e-3


def test_missing_eos_penalty(tiny_lm_dir):
    tok, lm, policy, ref = _setup(tiny_lm_dir)
    enc = tok(PROMPTS, return_tensors="pt", padding=True)
    common = dict(
        policy=policy,
        ref_lm=ref,
        reward_fn=char_fraction,
        tokenizer=tok,
        input_ids=enc.input_ids,
        attention_mask=enc.attention_mask,
        kl_coef=0.0,
        gen=GEN,
        gamma=1.0,
        lam=0.95,
    )
    a = make_rollout(**common, generator=torch.Generator().manual_seed(3))
    b = make_rollout(**common, generator=torch.Generator().manual_seed(3), missing_eos_penalty=1.0)
    assert torch.equal(a.responses, b.responses)
    torch.testing.assert_close(b.scores, a.scores - (~a.contains_eos).float())


def test_value_head_starts_at_zero(tiny_lm_dir):
    tok, _, policy, ref = _setup(tiny_lm_dir)
    _, r = _rollout(tok, policy, ref)
    assert (r.values == 0).all()


def test_fused_gelu_matches_gelu_new_and_export_keeps_the_config(tiny_lm_dir, tmp_path):
    """``load_causal_lm`` runs GPT-2's ``gelu_new`` as one fused kernel: same outputs, same config."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.activations import NewGELUActivation

    from ppo_lightning.models.policy import fuse_activations

    tok = load_tokenizer(str(tiny_lm_dir))
    fused = load_causal_lm(str(tiny_lm_dir), tok).eval()
    plain = AutoModelForCausalLM.from_pretrained(str(tiny_lm_dir)).eval()
    plain.resize_token_embeddings(len(tok))
    assert plain.config.activation_function == "gelu_new"
    assert any(isinstance(m, NewGELUActivation) for m in plain.modules())
    assert not any(isinstance(m, NewGELUActivation) for m in fused.modules())
    ids = torch.randint(0, 256, (3, 12))
    with torch.no_grad():
        torch.testing.assert_close(fused(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-5, rtol=0)
    assert fuse_activations(fused) == 0  # idempotent
    fused.save_pretrained(tmp_path / "out")
    assert AutoConfig.from_pretrained(tmp_path / "out").activation_function == "gelu_new"


def test_values_read_the_final_hidden_state_and_the_reference_has_no_hook(tiny_lm_dir):
    """The value head reads the LM head's input (a pre-hook): the same states as
    ``output_hidden_states[-1]`` at the positions before each response token."""
    from ppo_lightning.models.policy import make_reference, position_ids_from_mask

    tok = load_tokenizer(str(tiny_lm_dir))
    policy = PolicyWithValueHead(load_causal_lm(str(tiny_lm_dir), tok))
    torch.nn.init.normal_(policy.v_head.weight)
    ids = torch.randint(0, 256, (3, 10))
    am = torch.ones_like(ids)
    am[0, :3] = 0  # left padding on one row
    pos = position_ids_from_mask(am)
    P = 4
    with torch.no_grad():
        logits, values = policy(ids, am, pos, P)
        out = policy.lm(input_ids=ids, attention_mask=am, position_ids=pos, output_hidden_states=True)
    expected = policy.v_head(out.hidden_states[-1][:, P - 1 : -1]).squeeze(-1)
    torch.testing.assert_close(values, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(logits, out.logits[:, P - 1 : -1], atol=1e-5, rtol=0)
    assert policy.lm.get_output_embeddings().head_input is None  # nothing held between calls
    with torch.no_grad():
        policy.lm(input_ids=ids)  # a plain LM call (sampling, say) keeps nothing either
    assert policy.lm.get_output_embeddings().head_input is None
    ref = make_reference(policy.lm)
    assert not ref.get_output_embeddings()._forward_pre_hooks
    assert not any(isinstance(m, PolicyWithValueHead) for m in ref.modules())


def _naive_kept(z: list[float], top_k: int, top_p: float, min_p: float, min_p_first: bool) -> dict[int, float]:
    """The distribution a truncating sampler draws from, token by token in plain Python: tempered
    logits ``z``, the ``top_k`` largest, then the smallest prefix (by probability) whose mass
    before its last token is under ``top_p``, then the tokens at least ``min_p`` x the likeliest
    (``min_p_first``: that cut first, as vLLM makes it); renormalised at every cut."""
    import math

    order = sorted(range(len(z)), key=lambda i: -z[i])
    if min_p_first and min_p > 0.0:
        order = [i for i in order if math.exp(z[i] - z[order[0]]) >= min_p]
        min_p = 0.0
    kept = order[:top_k] if top_k else order
    norm = sum(math.exp(z[i]) for i in kept)
    probs = {i: math.exp(z[i]) / norm for i in kept}
    if top_p < 1.0:
        mass, nucleus = 0.0, []
        for i in kept:  # descending
            if mass >= top_p:
                break
            nucleus.append(i)
            mass += probs[i]
        probs = {i: probs[i] / mass for i in nucleus}
    if min_p > 0.0:
        top = max(probs.values())
        probs = {i: p for i, p in probs.items() if p >= min_p * top}
        norm = sum(probs.values())
        probs = {i: p / norm for i, p in probs.items()}
    return probs


@pytest.mark.parametrize(
    "top_k, top_p, min_p, min_p_first",
    [(0, 1.0, 0.0, False), (5, 1.0, 0.0, False), (0, 0.7, 0.0, False), (8, 0.9, 0.1, False), (0, 0.8, 0.2, True)],
    ids=["none", "k", "p", "kpm", "m_first_p"],
)
def test_truncated_logprobs_match_a_naive_truncation(tiny_lm_dir, top_k, top_p, min_p, min_p_first):
    """``algo.rollout.truncated_logprobs`` (what an engine's logprobs are compared with under
    top-k / top-p / min-p) against responses drawn and scored one token at a time in plain Python
    from each row's own unpadded forward: left-padded prompts and right-padded responses of
    several lengths, chunks of rows and padding removal, and a token outside the truncation
    (the floor); in Hugging Face's order and in vLLM's (min-p first). With no truncation they are
    ``forward_logprobs``."""
    import math
    import random

    from ppo_lightning.rollouts.engine import TRUNCATED_LOGPROB_FLOOR, truncated_logprobs
    from ppo_lightning.rollouts.forward import forward_logprobs
    from ppo_lightning.generation import SamplingParams
    from ppo_lightning.models.policy import position_ids_from_mask

    tok = load_tokenizer(str(tiny_lm_dir))
    lm = load_causal_lm(str(tiny_lm_dir), tok).eval()
    T, rng = 0.7, random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (3, 6, 2, 5, 4)]
    lengths = (6, 2, 5, 4, 6)
    rows, want = [], []
    for p, n in zip(prompts, lengths):
        seq, lps = list(p), []
        for _ in range(n):
            with torch.no_grad():
                z = (lm(torch.tensor([seq])).logits[0, -1] / T).tolist()
            probs = _naive_kept(z, top_k, top_p, min_p, min_p_first)
            ids, weights = zip(*probs.items())
            t = rng.choices(ids, weights)[0]
            seq.append(t)
            lps.append(math.log(probs[t]))
        rows.append((p, seq[len(p) :]))
        want.append(lps)
    if top_k:  # the last row's last token: one the truncation leaves out
        with torch.no_grad():
            z = (lm(torch.tensor([rows[-1][0] + rows[-1][1][:-1]])).logits[0, -1] / T).tolist()
        outside = min(range(len(z)), key=lambda i: z[i])
        rows[-1][1][-1], want[-1][-1] = outside, TRUNCATED_LOGPROB_FLOOR
    P, R = max(len(p) for p, _ in rows), max(lengths)
    qr = torch.full((len(rows), P + R), tok.pad_token_id)
    mask = torch.zeros_like(qr)
    for b, (p, r) in enumerate(rows):
        qr[b, P - len(p) : P], qr[b, P : P + len(r)] = torch.tensor(p), torch.tensor(r)
        mask[b, P - len(p) : P + len(r)] = 1
    pos = position_ids_from_mask(mask)
    params = SamplingParams(max_new_tokens=R, temperature=T, top_k=top_k, top_p=top_p, min_p=min_p)
    assert params.truncates == (top_k > 0 or top_p < 1.0 or min_p > 0.0)
    got = truncated_logprobs(lm, qr, mask, pos, P, params, chunk_size=2, remove_padding=True, min_p_first=min_p_first)
    assert got.shape == (len(rows), R)
    for b, lps in enumerate(want):
        torch.testing.assert_close(got[b, : len(lps)], torch.tensor(lps), rtol=0, atol=2e-5)
    if not params.truncates:
        full, _ = forward_logprobs(None, lm, qr, mask, pos, P, T)
        response = mask[:, P:].bool()
        torch.testing.assert_close(got[response], full[response], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fast", [True, False])
def test_the_hf_samplers_own_logprobs_are_the_forwards_of_the_distribution_it_drew_from(tiny_lm_dir, fast):
    """``generation.logprobs``: the sampler returns each token's logprob under its truncated
    distribution (temperature, top-k, top-p), equal to ``truncated_logprobs`` of the training
    forward on the finished sequences, 0 after each stop; the same tokens as without it, whole
    or in chunks, on the fast decode step and on the model's forward."""
    from ppo_lightning.generation import SamplingParams
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.models.policy import position_ids_from_mask
    from ppo_lightning.rollouts.engine import truncated_logprobs

    tok, lm, _, _ = _setup(tiny_lm_dir)
    enc = tok(PROMPTS * 2, return_tensors="pt", padding=True)
    params = SamplingParams(max_new_tokens=12, temperature=0.7, top_k=50, top_p=0.95)

    def play(backend, chunk=None):
        seeded = torch.Generator().manual_seed(3)
        return backend.generate(enc.input_ids, enc.attention_mask, params.replace(chunk_size=chunk), seeded)

    eos_row = lm.lm_head.weight.data[tok.eos_token_id].clone()
    for scale in range(2, 40):  # make EOS likely enough that some rows stop early
        lm.lm_head.weight.data[tok.eos_token_id] = eos_row * scale
        if (play(HFBackend(lm, tok)).response_mask == 0).any():
            break

    plain = play(HFBackend(lm, tok, fast_decode=fast))
    asked = play(HFBackend(lm, tok, fast_decode=fast, logprobs=True))
    chunked = play(HFBackend(lm, tok, fast_decode=fast, logprobs=True), chunk=3)
    assert plain.logprobs is None
    assert torch.equal(asked.responses, plain.responses) and torch.equal(asked.response_mask, plain.response_mask)
    assert (asked.response_mask == 0).any(), "some rows must stop early"
    qr = torch.cat([enc.input_ids, asked.responses], 1)
    am = torch.cat([enc.attention_mask, asked.response_mask.long()], 1)
    P = enc.input_ids.shape[1]
    want = truncated_logprobs(lm, qr, am, position_ids_from_mask(am), P, params) * asked.response_mask
    torch.testing.assert_close(asked.logprobs, want, atol=2e-5, rtol=1e-5)
    assert bool((asked.logprobs[asked.response_mask == 0] == 0).all())
    assert bool((asked.logprobs[asked.response_mask > 0] < 0).any())
    # chunks draw their uniforms in another order: their own tokens, each with its own logprob
    qr3 = torch.cat([enc.input_ids, chunked.responses], 1)
    am3 = torch.cat([enc.attention_mask, chunked.response_mask.long()], 1)
    want3 = truncated_logprobs(lm, qr3, am3, position_ids_from_mask(am3), P, params) * chunked.response_mask
    torch.testing.assert_close(chunked.logprobs, want3, atol=2e-5, rtol=1e-5)
