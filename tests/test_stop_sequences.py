"""Stopping on more than EOS (``sampling.stop_token_ids``, ``sampling.stop_strings``): the mask ends at the
first stop, sampling ends the row there, and both decode paths agree."""

from __future__ import annotations

import pytest
import torch

from ppo_lightning.generation.hf import _mask_after_stop, generate, stop_hits


def _naive_mask(responses, eos, seqs):
    out = torch.zeros(responses.shape)
    for b, row in enumerate(responses.tolist()):
        for t in range(len(row)):
            out[b, t] = 1.0
            if row[t] == eos or any(len(s) <= t + 1 and tuple(row[t + 1 - len(s) : t + 1]) == s for s in seqs):
                break
    return out


def test_the_mask_ends_at_the_first_eos_or_stop_sequence():
    torch.manual_seed(0)
    responses = torch.randint(0, 6, (64, 12))
    seqs = ((4,), (2, 3), (1, 1, 5))
    assert torch.equal(_mask_after_stop(responses, 0, seqs), _naive_mask(responses, 0, seqs))
    assert torch.equal(_mask_after_stop(responses, 0, ()), _naive_mask(responses, 0, ()))
    hits = stop_hits(torch.tensor([[7, 2, 3, 9]]), 0, ((2, 3),))
    assert hits.tolist() == [[False, False, True, False]]  # at the sequence's last token


@pytest.mark.parametrize("fast_decode", [True, False])
def test_sampling_stops_each_row_at_its_first_stop(tiny_lm_dir, fast_decode):
    """Greedy decoding without stops, then with a stop token and a 2-token stop sequence taken
    from what row 0 wrote: row 0 now ends at their first occurrence, with the same tokens up to
    it and pad after, whichever decode path samples."""
    from ppo_lightning.policy import load_causal_lm, load_tokenizer

    tok = load_tokenizer(str(tiny_lm_dir))
    lm = load_causal_lm(str(tiny_lm_dir), tok)
    enc = tok(["hello there", "the cat sat on", "xyz"], return_tensors="pt", padding=True)
    kw = dict(
        max_new_tokens=10,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        greedy=True,
        fast_decode=fast_decode,
    )
    free, free_mask = generate(lm, enc.input_ids, enc.attention_mask, **kw)
    row = free[0].tolist()
    for seqs in (((row[4],),), ((row[3], row[4]),)):
        got, mask = generate(lm, enc.input_ids, enc.attention_mask, stop_sequences=seqs, **kw)
        want_mask = _naive_mask(free, tok.eos_token_id, seqs)
        n = int(want_mask[0].sum())
        assert n <= 5 and int(mask[0].sum()) == n
        assert got[0, :n].tolist() == row[:n] and (got[0, n:] == tok.pad_token_id).all()
        assert torch.equal(mask, want_mask[:, : mask.shape[1]])


def test_stop_strings_become_token_sequences_and_bad_ones_name_the_key(tmp_path, cache_dir):
    from ppo_lightning.errors import ConfigError
    from ppo_lightning.factory import build_module
    from tests.conftest import compose_cfg

    module, _ = build_module(
        compose_cfg(["sampling.stop_strings=['ab',' c']", "sampling.stop_token_ids=[5]"], tmp_path, cache_dir)
    )
    tok = module.tokenizer
    assert module.sampling.stop_sequences == (
        (5,),
        tuple(tok.encode("ab", add_special_tokens=False)),
        tuple(tok.encode(" c", add_special_tokens=False)),
    )
    with pytest.raises(ConfigError, match=r"^sampling.stop_token_ids: \[99999\] outside"):
        build_module(compose_cfg(["sampling.stop_token_ids=[99999]"], tmp_path, cache_dir))
    with pytest.raises(ConfigError, match=r"^sampling.stop_strings: '' is no token"):
        build_module(compose_cfg(["sampling.stop_strings=['']"], tmp_path, cache_dir))
