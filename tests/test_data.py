"""Prompt data: reading files, tokenising with truncation, left padding, the datamodule."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from ppo_lightning.config import DataConfig
from ppo_lightning.data import (LeftPadCollator, PromptDataModule, read_prompts,
                                tokenize_prompts)
from ppo_lightning.errors import ConfigError
from ppo_lightning.tiny import build_byte_tokenizer

PAD = 257


@pytest.fixture(scope="module")
def tok():
    t = build_byte_tokenizer()
    assert t.pad_token_id == PAD
    return t


# ---------------------------------------------------------------------------------------------
# read_prompts


def test_read_txt_skips_blank_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n   \nsecond one \n\t\nthird\n", encoding="utf-8")
    assert read_prompts(f) == ["first prompt", "second one ", "third"]


def test_read_jsonl_custom_field(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"text": "alpha", "prompt": "ignored"}, {"text": "beta é"}, {"text": "gamma"}]
    f.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n",
                 encoding="utf-8")
    assert read_prompts(f, field="text") == ["alpha", "beta é", "gamma"]
    assert read_prompts(str(f), field="text") == ["alpha", "beta é", "gamma"]  # str path too
    with pytest.raises(ConfigError):
        read_prompts(f)  # default field "prompt" missing from rows 2 and 3


def test_read_jsonl_malformed_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"prompt": "c"\n{"prompt": "d"}\n')
    with pytest.raises(ConfigError) as e:
        read_prompts(f)
    msg = str(e.value)
    assert "bad.jsonl" in msg and "line 3" in msg and "JSON" in msg


def test_read_jsonl_missing_field(tmp_path):
    f = tmp_path / "missing.jsonl"
    f.write_text('{"question": "a"}\n{"question": "b"}\n{"q": "c"}\n')
    with pytest.raises(ConfigError) as e:
        read_prompts(f, field="question")
    msg = str(e.value)
    assert "missing.jsonl" in msg and "line 3" in msg and "'question'" in msg


def test_read_jsonl_non_string_field(tmp_path):
    f = tmp_path / "num.jsonl"
    f.write_text('{"prompt": 5}\n')
    with pytest.raises(ConfigError, match="line 1"):
        read_prompts(f)


@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("blank.txt", "\n  \n\n"),
                                           ("empty.jsonl", "\n")])
def test_read_empty_file(tmp_path, name, content):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(ConfigError) as e:
        read_prompts(f)
    assert str(f) in str(e.value) and "no prompts" in str(e.value)


def test_read_unsupported_extension_and_missing_file(tmp_path):
    f = tmp_path / "prompts.csv"
    f.write_text("prompt\nhello\n")
    with pytest.raises(ConfigError) as e:
        read_prompts(f)
    assert "'.csv'" in str(e.value) and str(f) in str(e.value)
    with pytest.raises(ConfigError, match="no such file"):
        read_prompts(tmp_path / "nope.txt")


# ---------------------------------------------------------------------------------------------
# tokenize_prompts


def test_tokenize_one_token_per_byte(tok):
    ids = tokenize_prompts(["ab", "é"], tok, max_length=10, truncation="error", source="src")
    assert ids == [[ord("a"), ord("b")], list("é".encode())]


def test_tokenize_truncation_left_keeps_last_tokens_one_warning(tok, caplog):
    prompts = ["0123456789", "short", "abcdefghijklmnop", "ABCDEFGHIJKL"]
    with caplog.at_level(logging.WARNING, logger="ppo_lightning.data"):
        ids = tokenize_prompts(prompts, tok, max_length=6, truncation="left", source="src")
    expected = [list(p.encode()[-6:]) for p in prompts]
    assert ids == expected
    assert [tok.decode(x) for x in ids] == ["456789", "short", "klmnop", "GHIJKL"]
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "3 of 4 prompts" in warnings[0].getMessage()


def test_tokenize_no_warning_when_all_fit(tok, caplog):
    with caplog.at_level(logging.WARNING, logger="ppo_lightning.data"):
        tokenize_prompts(["abc", "de"], tok, max_length=3, truncation="left", source="src")
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_tokenize_truncation_error(tok):
    with pytest.raises(ConfigError) as e:
        tokenize_prompts(["ok", "this is too long"], tok, max_length=4, truncation="error",
                         source="data.path='x.txt'")
    msg = str(e.value)
    assert "data.max_prompt_length" in msg and "prompt 1" in msg and "x.txt" in msg


# ---------------------------------------------------------------------------------------------
# LeftPadCollator


def test_left_pad_collator():
    batch = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    out = LeftPadCollator(PAD)(batch)
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.dtype == torch.long and mask.dtype == torch.long
    assert ids.shape == mask.shape == (4, 5)
    assert ids.tolist() == [[PAD, PAD, 1, 2, 3], [PAD, PAD, PAD, PAD, 4], [5, 6, 7, 8, 9],
                            [PAD, PAD, PAD, 10, 11]]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    # the mask is 0 exactly on the pads (no real token here equals the pad id)
    assert torch.equal(mask == 0, ids == PAD)
    # every row ends at the same column
    assert bool(mask[:, -1].all())


# ---------------------------------------------------------------------------------------------
# PromptDataModule


def _write_txt(tmp_path, prompts):
    f = tmp_path / "prompts.txt"
    f.write_text("\n".join(prompts) + "\n", encoding="utf-8")
    return f


def test_datamodule_fewer_prompts_than_batch(tmp_path, tok):
    f = _write_txt(tmp_path, ["a", "b", "c"])
    dm = PromptDataModule(DataConfig(path=str(f), batch_size=4), tok)
    with pytest.raises(ConfigError) as e:
        dm.setup("fit")
    msg = str(e.value)
    assert "3 prompts" in msg and "data.batch_size=4" in msg and "prompts.txt" in msg


@pytest.mark.parametrize("shuffle", [False, True])
def test_datamodule_batches(tmp_path, tok, shuffle):
    prompts = ["Once", "upon a time", "x", "the quick brown fox", "hello", "a b c", "é!",
               "zz", "last one dropped?", "10"]
    f = _write_txt(tmp_path, prompts)
    torch.manual_seed(0)
    dm = PromptDataModule(DataConfig(path=str(f), batch_size=3, max_prompt_length=64,
                                     shuffle=shuffle), tok)
    dm.setup("fit")
    batches = list(dm.train_dataloader())
    assert len(batches) == 3  # 10 // 3, the partial batch dropped
    seen = []
    for b in batches:
        ids, mask = b["input_ids"], b["attention_mask"]
        assert ids.shape[0] == 3 and mask.shape == ids.shape
        assert torch.equal(mask == 0, ids == PAD)
        assert bool(mask[:, -1].all())  # left padded: every prompt ends at the last column
        seen += [tok.decode(row[m.bool()].tolist()) for row, m in zip(ids, mask)]
    assert len(seen) == 9 and len(set(seen)) == 9
    if shuffle:
        assert set(seen) <= set(prompts)
    else:
        assert seen == prompts[:9]
