"""Prompt data: reading files, tokenising with truncation, left padding, the datamodule."""

from __future__ import annotations

import json
import logging
import sys
import types

import pytest
import torch

from ppo_lightning.config import DataConfig
from ppo_lightning.data.prompts import PadCollator, PromptDataModule, tokenize_prompts
from ppo_lightning.data.records import read_prompt_records, read_prompts, read_records
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.models.tiny import build_byte_tokenizer

PAD = 257


@pytest.fixture(scope="module")
def tok():
    t = build_byte_tokenizer()
    assert t.pad_token_id == PAD
    return t


# ---------------------------------------------------------------------------------------------
# read_prompts


def _hf_prompts(field: str) -> list:
    """The prompts of the (faked) dataset ``org/x``, as PPO reads them."""
    return [r.prompt for r in read_prompt_records(None, field, hf_dataset="org/x", hf_split="train")]


def test_read_txt_skips_blank_lines(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first prompt\n\n   \nsecond one \n\t\nthird\n", encoding="utf-8")
    assert read_prompts(f) == ["first prompt", "second one ", "third"]


def test_read_jsonl_custom_field(tmp_path):
    f = tmp_path / "p.jsonl"
    rows = [{"text": "alpha", "prompt": "ignored"}, {"text": "beta é"}, {"text": "gamma"}]
    f.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n" + json.dumps(rows[2]) + "\n", encoding="utf-8")
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


@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("blank.txt", "\n  \n\n"), ("empty.jsonl", "\n")])
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


def fake_datasets(monkeypatch, rows: list[dict], fail: bool = False) -> list:
    """``import datasets`` gives a module whose ``load_dataset`` returns ``rows`` (a dataset
    iterates its rows as dicts); returns the list of ``(name, split)`` it was called with."""
    calls = []

    def load_dataset(name, split):
        calls.append((name, split))
        if fail:
            raise FileNotFoundError(f"no dataset {name}")
        return [dict(r) for r in rows]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    return calls


def test_one_reader_keeps_every_field_in_order_from_each_source(tmp_path, monkeypatch):
    """``read_records``: ``.jsonl``, ``.json`` and a HF dataset give the same dicts, every field
    kept (metadata travels with the prompt); ``.txt`` gives one ``{"prompt": line}`` a line."""
    rows = [
        {"prompt": "a", "id": 1, "meta": {"tags": ["x"]}},
        {"prompt": "b é", "id": 2},
        {"prompt": "c", "answer": "3"},
    ]
    (tmp_path / "r.jsonl").write_text(json.dumps(rows[0]) + "\n\n" + "".join(json.dumps(r) + "\n" for r in rows[1:]))
    (tmp_path / "r.json").write_text(json.dumps(rows, indent=1))
    (tmp_path / "r.txt").write_text("a\n\n b é \nc\n")
    hub = tmp_path / "org_x"  # a dataset repository as the hub gives it: a data file a split
    hub.mkdir()
    (hub / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    jsonl = list(read_records("data", path=tmp_path / "r.jsonl"))
    assert [w for w, _ in jsonl] == [f"data.path='{tmp_path / 'r.jsonl'}' line {i}" for i in (1, 3, 4)]
    assert [r for _, r in jsonl] == rows
    assert [r for _, r in read_records("task", path=str(tmp_path / "r.json"))] == rows
    hf = list(read_records("task", hf_dataset=str(hub), hf_split="test"))  # the real datasets library, offline
    # a dataset's rows share one schema: a field a row lacks comes back as None
    columns = {k: None for r in rows for k in r}
    assert [r for _, r in hf] == [{**columns, **r} for r in rows] and hf[2][0] == f"task.hf_dataset='{hub}' row 2"
    txt = list(read_records("data", path=tmp_path / "r.txt"))
    assert [r for _, r in txt] == [{"prompt": "a"}, {"prompt": " b é "}, {"prompt": "c"}]
    assert txt[1][0].endswith("line 3")
    assert [r for _, r in read_records("data", path=tmp_path / "r.txt", text_field="q")][0] == {"q": "a"}
    # PPO's prompts through it: the .json file, the dataset's column (values as strings)
    assert read_prompts(tmp_path / "r.json") == ["a", "b é", "c"]
    fake_datasets(monkeypatch, [{"text": "alpha", "n": 1}, {"text": 5, "n": 2}])  # mixed types: only a fake has them
    assert _hf_prompts("text") == ["alpha", "5"]
    with pytest.raises(
        ConfigError,
        match=r"^data.hf_dataset='org/x' row 0: no 'prompt' field \(data.prompt_field='prompt'\); its fields are "
        r"\['n', 'text'\]",
    ):
        _hf_prompts("prompt")


def test_one_reader_names_the_file_and_line_of_a_bad_record(tmp_path, monkeypatch):
    f = tmp_path / "lists.jsonl"
    f.write_text('{"prompt": "a"}\n["a"]\n')
    with pytest.raises(ConfigError, match=r"lists.jsonl' line 2: expected a JSON object, got list"):
        read_prompts(f)
    f = tmp_path / "bad.json"
    for text, match in [
        ('[{"prompt": "a"},\n {"prompt": }]', r"bad.json' line 2: not valid JSON"),
        ('{"prompt": "a"}', r"bad.json': expected a JSON list of objects, got a dict"),
        ('[{"prompt": "a"}, 5]', r"bad.json' record 1: expected a JSON object, got int"),
        (
            '[{"prompt": "a"}, {"prompt": 5}]',
            r"bad.json' record 1: expected an object with a "
            r"string 'prompt' field",
        ),
    ]:
        f.write_text(text)
        with pytest.raises(ConfigError, match=match):
            read_prompts(f)
    f = tmp_path / "p.csv"
    f.write_text("a\n")
    with pytest.raises(
        ConfigError,
        match=r"task.path='.*p.csv': unsupported extension '.csv'; use "
        r"\.jsonl \(one JSON object a line\) or \.json",
    ):
        list(read_records("task", path=f, suffixes=(".jsonl", ".json")))
    fake_datasets(monkeypatch, [], fail=True)
    with pytest.raises(
        ConfigError,
        match=r"data.hf_dataset='org/x' \(split 'train'\) could not be loaded: "
        r"no dataset org/x. For offline use give a local file with data.path",
    ):
        _hf_prompts("prompt")
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ConfigError, match=r"data.hf_dataset='org/x' needs the 'datasets' package"):
        _hf_prompts("prompt")


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
        tokenize_prompts(["ok", "this is too long"], tok, max_length=4, truncation="error", source="data.path='x.txt'")
    msg = str(e.value)
    assert "data.max_prompt_length" in msg and "prompt 1" in msg and "x.txt" in msg


# ---------------------------------------------------------------------------------------------
# PadCollator


def test_left_pad_collator():
    batch = [[1, 2, 3], [4], [5, 6, 7, 8, 9], [10, 11]]
    out = PadCollator(PAD)(batch)
    ids, mask = out["input_ids"], out["attention_mask"]
    assert ids.dtype == torch.long and mask.dtype == torch.long
    assert ids.shape == mask.shape == (4, 5)
    assert ids.tolist() == [[PAD, PAD, 1, 2, 3], [PAD, PAD, PAD, PAD, 4], [5, 6, 7, 8, 9], [PAD, PAD, PAD, 10, 11]]
    assert mask.tolist() == [[0, 0, 1, 1, 1], [0, 0, 0, 0, 1], [1, 1, 1, 1, 1], [0, 0, 0, 1, 1]]
    # the mask is 0 exactly on the pads (no real token here equals the pad id)
    assert torch.equal(mask == 0, ids == PAD)
    # every row ends at the same column
    assert bool(mask[:, -1].all())
    right = PadCollator(PAD, "right")(batch)  # the stages' side: every row starts at column 0
    assert torch.equal(right["attention_mask"], mask.flip(1)) and right["input_ids"][1].tolist() == [4] + [PAD] * 4
    with pytest.raises(ValueError, match="padding_side='middle'"):
        PadCollator(PAD, "middle")


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
    prompts = [
        "Once",
        "upon a time",
        "x",
        "the quick brown fox",
        "hello",
        "a b c",
        "é!",
        "zz",
        "last one dropped?",
        "10",
    ]
    f = _write_txt(tmp_path, prompts)
    torch.manual_seed(0)
    dm = PromptDataModule(DataConfig(path=str(f), batch_size=3, max_prompt_length=64, shuffle=shuffle), tok)
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
