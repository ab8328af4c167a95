"""Stopping on more than EOS (``sampling.stop_token_ids``, ``sampling.stop_strings``): the mask ends at
the first stop, sampling ends the row there, both decode paths agree, and a stop string stops the
response at the token that completes it however the tokenizer split the text (a BPE tokenizer,
where the splits differ: the byte tokenizer cannot show this)."""

from __future__ import annotations

import pytest
import torch

from ppo_lightning.generation import SamplingParams, StopChecker, stopped_rows
from ppo_lightning.generation.hf import generate
from tests.multiturn import build_bpe_tokenizer, save_bpe_lm


def _naive_mask(responses, stop_ids):
    out = torch.zeros(responses.shape)
    for b, row in enumerate(responses.tolist()):
        for t in range(len(row)):
            out[b, t] = 1.0
            if row[t] in stop_ids:
                break
    return out


def test_the_mask_ends_at_the_first_eos_or_stop_token():
    torch.manual_seed(0)
    responses = torch.randint(0, 6, (64, 12))
    assert torch.equal(StopChecker(0, (4, 5)).mask(responses), _naive_mask(responses, {0, 4, 5}))
    assert torch.equal(StopChecker(0).mask(responses), _naive_mask(responses, {0}))


@pytest.fixture(scope="module")
def bpe_lm(tmp_path_factory):
    from ppo_lightning.models.policy import load_causal_lm, load_tokenizer

    path = save_bpe_lm(tmp_path_factory.mktemp("bpe") / "lm")
    tok = load_tokenizer(str(path))
    return load_causal_lm(str(path), tok), tok


@pytest.mark.parametrize("fast_decode", [True, False])
def test_sampling_stops_each_row_at_its_first_stop_token(tiny_lm_dir, fast_decode):
    """Greedy decoding without stops, then with a stop token taken from what row 0 wrote: row 0
    now ends at its first occurrence, with the same tokens up to it and pad after."""
    from ppo_lightning.models.policy import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_lm_dir))
    lm = load_causal_lm(str(tiny_lm_dir), tok)
    enc = tok(["hello there", "the cat sat on", "xyz"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=10, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True)
    free, _ = generate(lm, enc.input_ids, enc.attention_mask, fast_decode=fast_decode, **kw)
    row = free[0].tolist()
    got, mask = generate(lm, enc.input_ids, enc.attention_mask, fast_decode=fast_decode, stop_token_ids=(row[4],), **kw)
    want_mask = _naive_mask(free, {tok.eos_token_id, row[4]})
    n = int(want_mask[0].sum())
    assert n <= 5 and int(mask[0].sum()) == n
    assert got[0, :n].tolist() == row[:n] and (got[0, n:] == tok.pad_token_id).all()
    assert torch.equal(mask, want_mask[:, : mask.shape[1]])


@pytest.mark.parametrize("fast_decode", [True, False])
def test_a_stop_string_stops_at_the_token_that_completes_it_however_it_was_split(bpe_lm, fast_decode):
    """The stop string is a piece of the model's free output that starts inside one token and
    ends inside the next: tokenised alone it is other ids (so matching ids never fires), yet
    sampling stops at the token that completes it, that token kept whole."""
    lm, tok = bpe_lm
    enc = tok(["<|user|>What is 3 * 4?\n<|assistant|>", "so the sum"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=24, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True)
    free, free_mask = generate(lm, enc.input_ids, enc.attention_mask, fast_decode=fast_decode, **kw)
    row = free[0].tolist()
    pieces = [tok.decode([t]) for t in row]
    k = next(i for i in range(2, len(row) - 1) if len(pieces[i]) >= 2 and len(pieces[i + 1]) >= 2)
    stop = pieces[k][1:] + pieces[k + 1][:1]  # from inside token k to inside token k + 1
    assert tuple(tok.encode(stop, add_special_tokens=False)) != tuple(row[k : k + 2])  # other ids alone
    assert stop not in tok.decode(row[: k + 1])  # first completed by token k + 1
    got, mask = generate(
        lm, enc.input_ids, enc.attention_mask, fast_decode=fast_decode, stop_strings=(stop,), tokenizer=tok, **kw
    )
    assert int(mask[0].sum()) == k + 2 and got[0, : k + 2].tolist() == row[: k + 2]
    assert (got[0, k + 2 :] == tok.pad_token_id).all()
    params = SamplingParams(max_new_tokens=24, stop_strings=(stop,))
    assert (
        stopped_rows(got, mask, params, tok)[0]
        and not stopped_rows(free, free_mask, params.replace(stop_strings=()), tok)[0]
    )


def test_the_audits_split_stops_where_matching_ids_would_not():
    """``</answer>`` alone is one token here; a model that writes ``.</answer>`` as one other
    token (or as ``is 12`` then ``</answer>``) completes it all the same."""
    tok = build_bpe_tokenizer()
    stops = StopChecker(tok.eos_token_id, (), ("</answer>",), tok)
    alone = tok.encode("</answer>", add_special_tokens=False)
    merged = tok.encode("so 12.</answer>", add_special_tokens=False)
    assert not set(alone) & set(merged[-1:])  # the last token is not the string's own
    assert stops.ends_at(merged) and not stops.ends_at(merged[:-1])
    assert stops.first_stops(torch.tensor([merged + [5, 6]])).tolist() == [len(merged) - 1]
    text = tok.encode("the </answ", add_special_tokens=False) + tok.encode("er> and", add_special_tokens=False)
    first = stops.first_stops(torch.tensor([text]))
    assert tok.decode(text[: int(first) + 1]).find("</answer>") >= 0 and "</answer>" not in tok.decode(
        text[: int(first)]
    )


def test_stop_settings_reach_the_sampler_and_bad_ones_name_the_key(tmp_path, cache_dir):
    from ppo_lightning.config.errors import ConfigError
    from ppo_lightning.jobs.factory import build_module
    from tests.conftest import compose_cfg

    module, _ = build_module(
        compose_cfg(["sampling.stop_strings=['ab',' c']", "sampling.stop_token_ids=[5]"], tmp_path, cache_dir)
    )
    assert module.sampling.stop_token_ids == (5,) and module.sampling.stop_strings == ("ab", " c")
    with pytest.raises(ConfigError, match=r"^sampling.stop_token_ids: \[99999\] outside"):
        build_module(compose_cfg(["sampling.stop_token_ids=[99999]"], tmp_path, cache_dir))
    with pytest.raises(ConfigError, match=r"^sampling.stop_strings: an empty string would stop"):
        build_module(compose_cfg(["sampling.stop_strings=['']"], tmp_path, cache_dir))


def test_each_row_stops_at_its_own_limit_and_its_positions_stay_within_it(tiny_lm_dir):
    """``row_max_new_tokens``: a row ends at its own limit (its mask ends there, pad after), the
    other rows sample exactly as without it, and an ended row's positions stop growing: a model
    with 24 positions samples a 20-token prompt for 12 new tokens on the rows allowed 4."""
    from ppo_lightning.models.policy import load_causal_lm, load_tokenizer
    from ppo_lightning.models.tiny import gpt2_config, save_random_model

    tok = load_tokenizer(str(tiny_lm_dir))
    lm = load_causal_lm(str(tiny_lm_dir), tok)
    enc = tok(["hello there", "the cat sat on the mat", "xyz"], return_tensors="pt", padding=True)
    kw = dict(max_new_tokens=10, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, greedy=True)
    free, free_mask = generate(lm, enc.input_ids, enc.attention_mask, **kw)
    got, mask = generate(lm, enc.input_ids, enc.attention_mask, row_max_new_tokens=(3, 10, 6), **kw)
    assert mask.sum(1).tolist() == [min(3, free_mask[0].sum()), free_mask[1].sum(), min(6, free_mask[2].sum())]
    assert torch.equal(got[1], free[1]) and got[0, :3].tolist() == free[0, :3].tolist()
    short = save_random_model(tiny_lm_dir.parent / "short-ctx", gpt2_config(n_positions=24), tok)
    small = load_causal_lm(str(short), tok)
    ids = tok(["a" * 20, "b" * 8], return_tensors="pt", padding=True)
    alone = tok(["b" * 8], return_tensors="pt")
    for fast in (True, False):
        out, m = generate(
            small,
            ids.input_ids,
            ids.attention_mask,
            row_max_new_tokens=(4, 12),
            fast_decode=fast,
            **{**kw, "max_new_tokens": 12},
        )
        # the long row samples what it samples alone, to its own limit (or its EOS), after the
        # short row has stopped at 4 (its positions would have passed 24 otherwise)
        want, want_mask = generate(
            small, alone.input_ids, alone.attention_mask, fast_decode=fast, **{**kw, "max_new_tokens": 12}
        )
        n = int(want_mask.sum())
        assert m[0].sum() <= 4 and int(m[1].sum()) == n > 4, (m.sum(1), n)
        assert out[1, :n].tolist() == want[0, :n].tolist()


@pytest.mark.parametrize("top_k, top_p, min_p", [(0, 1.0, 0.1), (20, 1.0, 0.05), (0, 0.9, 0.2), (30, 0.8, 0.1)])
def test_min_p_keeps_the_tokens_hugging_faces_processors_keep(top_k, top_p, min_p):
    """``sampling.min_p`` after temperature, top-k and top-p: the distribution drawn from equals
    the one Hugging Face's own logits processors give, in their order, renormalised."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    from ppo_lightning.generation.hf import sampling_probs

    logits = torch.randn(16, 300, generator=torch.Generator().manual_seed(3)) * 3
    chain = [TemperatureLogitsWarper(0.7)]
    chain += [TopKLogitsWarper(top_k)] if top_k else []
    chain += [TopPLogitsWarper(top_p)] if top_p < 1 else []
    chain += [MinPLogitsWarper(min_p)]
    want = torch.softmax(LogitsProcessorList(chain)(None, logits.clone()), -1)
    got = sampling_probs(logits, 0.7, top_k, top_p, min_p)
    got = got / got.sum(-1, keepdim=True)
    assert torch.equal(got > 0, want > 0)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
