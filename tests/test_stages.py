"""The stages before PPO: SFT and the reward model, on the tiny offline models with a real Trainer.

Learning tests use problems a 2-layer byte-level GPT-2 learns in about a hundred steps: SFT maps
``"c*n="`` to ``c`` repeated n times; the reward model prefers the response with more ``a``s.
"""

from __future__ import annotations

import json
import math
import random
import sys

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from ppo_lightning.config import ModelConfig, OptimizerConfig
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.rewards import RewardModel
from ppo_lightning.stages import (
    IGNORE_INDEX,
    STAGES,
    PairCollator,
    RewardModelConfig,
    SFTCollator,
    SFTConfig,
    SFTDataModule,
    bradley_terry_loss,
    build_reward_model,
    build_sft,
    prepare_reward_tokenizer,
    save_reward_model,
    save_sft,
    tokenize_pairs,
    tokenize_sft,
)
from ppo_lightning.models.tiny import build_byte_tokenizer

EOS, PAD = 256, 257


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: these models are tiny, and on a shared 2-core machine two threads
    contend with other jobs (100 SFT steps: ~2 s on one thread, 30+ s on two under load)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tok():
    return build_byte_tokenizer()


def trainer(max_steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=max_steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        check_val_every_n_epoch=10_000,
    )


def repeat_records(letters: str = "abcdefghij", counts=range(1, 9)) -> list[dict[str, str]]:
    """``"c*n="`` -> ``c * n``: the response is a deterministic function of the prompt."""
    return [{"prompt": f"{c}*{n}=", "response": c * n} for c in letters for n in counts]


def preference_records(n: int, seed: int) -> list[dict[str, str]]:
    """Random prompts; the chosen response has at least 2 more 'a's than the rejected one."""
    rng = random.Random(seed)

    def response(n_a: int, length: int = 8) -> str:
        chars = ["a"] * n_a + [rng.choice("bcde") for _ in range(length - n_a)]
        rng.shuffle(chars)
        return "".join(chars)

    out = []
    for _ in range(n):
        prompt = "".join(rng.choice("xyz ") for _ in range(rng.randint(2, 6))) + ":"
        lo = rng.randint(0, 5)
        hi = rng.randint(lo + 2, 8)
        out.append({"prompt": prompt, "chosen": response(hi), "rejected": response(lo)})
    return out


def write_jsonl(path, rows) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return str(path)


# ---------------------------------------------------------------------------------------------
# SFT: examples, labels, padding


def naive_sft_row(tok, prompt: str, response: str) -> tuple[list[int], list[int]]:
    p = list(prompt.encode("utf-8"))  # the byte tokenizer: token id = byte value
    r = list(response.encode("utf-8")) + [EOS]
    return p + r, [IGNORE_INDEX] * len(p) + r


def test_sft_collated_labels_match_naive_construction(tok):
    records = [
        {"prompt": "Q: 2+2?\nA:", "response": " 4"},
        {"prompt": "hi", "response": "hello there é"},
        {"prompt": "x", "response": ""},
    ]
    examples = tokenize_sft(records, tok, max_length=64, max_prompt_length=32)
    batch = SFTCollator(PAD)(examples)
    T = max(len(naive_sft_row(tok, r["prompt"], r["response"])[0]) for r in records)
    assert batch["input_ids"].shape == batch["labels"].shape == batch["attention_mask"].shape == (3, T)
    for i, r in enumerate(records):
        ids, labels = naive_sft_row(tok, r["prompt"], r["response"])
        n_pad = T - len(ids)
        assert batch["input_ids"][i].tolist() == ids + [PAD] * n_pad
        assert batch["labels"][i].tolist() == labels + [IGNORE_INDEX] * n_pad
        assert batch["attention_mask"][i].tolist() == [1] * len(ids) + [0] * n_pad
    # -100 exactly on prompt and pad positions; every response token (EOS included) is a label
    n_prompt = sum(len(r["prompt"].encode()) for r in records)
    assert int((batch["labels"] == IGNORE_INDEX).sum()) == n_prompt + int((batch["attention_mask"] == 0).sum())
    assert int((batch["labels"] == EOS).sum()) == 3

    left = SFTCollator(PAD, padding_side="left")(examples)
    ids, labels = naive_sft_row(tok, records[2]["prompt"], records[2]["response"])
    assert left["input_ids"][2].tolist() == [PAD] * (T - len(ids)) + ids
    assert left["labels"][2].tolist() == [IGNORE_INDEX] * (T - len(ids)) + labels


def test_sft_truncation_rule(tok, caplog):
    records = [{"prompt": "0123456789", "response": "abcdefghij"}, {"prompt": "ok", "response": "y"}]
    ex = tokenize_sft(records, tok, max_length=8, max_prompt_length=3)
    # prompt: its last 3 tokens; response: its first 8 - 3 tokens, so no EOS (not taught to stop)
    assert ex[0]["input_ids"] == list(b"789abcde")
    assert ex[0]["labels"] == [IGNORE_INDEX] * 3 + list(b"abcde")
    assert ex[1]["input_ids"] == list(b"oky") + [EOS]  # within limits: untouched
    assert "1 of 2 SFT examples" in caplog.text

    dropped = tokenize_sft(records, tok, max_length=8, max_prompt_length=3, truncation="drop")
    assert [e["input_ids"] for e in dropped] == [list(b"oky") + [EOS]]
    with pytest.raises(ConfigError, match=r"record 0 has 10 prompt \+ 11 response tokens.*task.max_length=8"):
        tokenize_sft(records, tok, max_length=8, max_prompt_length=3, truncation="error")
    with pytest.raises(ConfigError, match="record 1 has a prompt that tokenises to nothing"):
        tokenize_sft([{"prompt": "a", "response": "b"}, {"prompt": "", "response": "b"}], tok, 8, 3)


def test_sft_loss_is_padding_invariant_and_token_averaged(tiny_lm_dir, tok):
    """Left and right padding give the same loss (position ids from the mask), equal to the
    per-example unpadded loss summed over response tokens."""
    module, dm = build_sft(
        ModelConfig(name_or_path=str(tiny_lm_dir)),
        OptimizerConfig(),
        SFTConfig(val_fraction=0.0, max_length=64, max_prompt_length=32),
        records=[{"prompt": "a" * k, "response": "bc" * k} for k in (1, 4, 9)],
    )
    module.eval()
    ex = dm.train_examples
    with torch.no_grad():
        right = module.loss_sums(SFTCollator(PAD, "right")(ex))
        left = module.loss_sums(SFTCollator(PAD, "left")(ex))
        naive_sum, naive_n = 0.0, 0
        for e in ex:
            ids = torch.tensor([e["input_ids"]])
            logits = module.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1]
            target = torch.tensor(e["labels"][1:])
            keep = target != IGNORE_INDEX
            naive_sum += F.cross_entropy(logits[keep], target[keep], reduction="sum").item()
            naive_n += int(keep.sum())
    assert int(right[1]) == int(left[1]) == naive_n == sum(2 * k + 1 for k in (1, 4, 9))  # 2k + EOS each
    assert right[0].item() == pytest.approx(naive_sum, rel=1e-5)
    assert left[0].item() == pytest.approx(naive_sum, rel=1e-5)


def test_split_is_deterministic_disjoint_and_optional(tok):
    records = repeat_records()
    cfg = dict(val_fraction=0.25, seed=3, max_length=32, max_prompt_length=8)

    def split(**kw):
        dm = SFTDataModule(SFTConfig(**{**cfg, **kw}, batch_size=4), tok, records=records)
        dm.load()
        return ([tuple(e["input_ids"]) for e in dm.train_examples], [tuple(e["input_ids"]) for e in dm.val_examples])

    train, val = split()
    assert len(val) == 20 and len(train) == 60 and not set(train) & set(val)
    assert split() == (train, val)
    assert split(seed=4)[1] != val
    train0, val0 = split(val_fraction=0.0)
    assert val0 == [] and len(train0) == 80
    dm = SFTDataModule(SFTConfig(**{**cfg, "val_fraction": 0.0}), tok, records=records)
    dm.load()
    assert dm.val_dataloader() == []


def test_sft_learns_and_saves_a_policy(tiny_lm_dir, tmp_path):
    """Val loss falls by far; the saved directory loads with plain transformers, greedy-generates
    the learned responses, and loads as the PPO policy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ppo_lightning.models.policy import PolicyWithValueHead, load_causal_lm, load_tokenizer

    records = repeat_records()
    path = write_jsonl(tmp_path / "sft.jsonl", records)
    L.seed_everything(0, verbose=False)
    module, dm = build_sft(
        ModelConfig(name_or_path=str(tiny_lm_dir)),
        OptimizerConfig(lr=3e-3, scheduler="linear", warmup_steps=10),
        SFTConfig(path=path, val_fraction=0.2, max_length=32, max_prompt_length=8, batch_size=16),
    )
    t = trainer(max_steps=100)
    before = t.validate(module, datamodule=dm, verbose=False)[0]
    t.fit(module, datamodule=dm)
    assert module.last_metrics["train/loss"] < 0.5
    after = t.validate(module, datamodule=dm, verbose=False)[0]
    print(f"SFT val/loss {before['val/loss']:.3f} -> {after['val/loss']:.4f}")
    assert before["val/loss"] > 3.0  # random init over 258 tokens
    assert after["val/loss"] < 0.1 * before["val/loss"] and after["val/loss"] < 0.5
    assert after["val/perplexity"] == pytest.approx(math.exp(after["val/loss"]), rel=1e-4)

    out = save_sft(module, tmp_path / "sft-model")
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    tk = AutoTokenizer.from_pretrained(out)
    assert model.generation_config.eos_token_id == EOS and model.generation_config.pad_token_id == PAD
    train_prompts = {tk.decode(e["input_ids"][: e["labels"].count(IGNORE_INDEX)]) for e in dm.train_examples}
    train_records = [r for r in records if r["prompt"] in train_prompts]
    enc = tk([r["prompt"] for r in train_records], return_tensors="pt", padding=True, add_special_tokens=False)
    assert tk.padding_side == "left"
    gen = model.generate(**enc, max_new_tokens=10, do_sample=False)
    texts = tk.batch_decode(gen[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    exact = sum(t == r["response"] for t, r in zip(texts, train_records)) / len(train_records)
    print(f"SFT greedy exact match on training prompts: {exact:.2f}")
    assert exact >= 0.9
    assert (gen[:, enc["input_ids"].shape[1] :] == EOS).any(1).float().mean() >= 0.9  # it learned to stop

    # usable as model.name_or_path for PPO: same tokenizer, no resize, value head on top
    ptok = load_tokenizer(str(out))
    lm = load_causal_lm(str(out), ptok)
    assert ptok.pad_token_id == PAD and len(ptok) == lm.get_input_embeddings().num_embeddings
    PolicyWithValueHead(lm)


def padded_tokens(batches, lengths) -> int:
    """What a batch padded to its longest record computes: rows × the longest, summed."""
    return sum(len(b) * max(lengths[i] for i in b) for b in batches)


@pytest.mark.parametrize("world", [1, 2])
def test_length_grouped_batches_hold_every_record_once_an_epoch_and_pad_less(world):
    """``task.group_by_length``: each epoch every record is drawn once over the ranks (as the
    shuffled ``DistributedSampler`` draws them, wrap-around included), every rank gets as many
    batches, a DataLoader of ``batch_size`` cuts exactly the sampler's batches, and they pad to
    within a few percent of the real tokens where random batches pad 30% more. The order is fixed
    by the seed and the epoch."""
    from torch.utils.data import DataLoader, DistributedSampler

    from ppo_lightning.stages.common import LengthGroupedSampler

    rng = random.Random(0)
    lengths = [rng.randint(8, 96) for _ in range(2003)]
    bs, real = 16, sum(lengths)

    def sampler(rank, **kw):
        return LengthGroupedSampler(lengths, bs, num_replicas=world, rank=rank, seed=3, **kw)

    for epoch in (0, 1):
        drawn, plain, counts = [], [], set()
        for rank in range(world):
            s = sampler(rank)
            s.set_epoch(epoch)
            batches = s.batches()
            assert all(len(b) == bs for b in batches[:-1]) and 0 < len(batches[-1]) <= bs
            loader = DataLoader(range(len(lengths)), batch_size=bs, sampler=s)
            assert [x.tolist() for x in loader] == batches
            assert len(s) == sum(map(len, batches))
            counts.add(len(batches))
            drawn += [i for b in batches for i in b]
            d = DistributedSampler(range(len(lengths)), num_replicas=world, rank=rank, shuffle=True, seed=3)
            d.set_epoch(epoch)
            share = list(d)
            plain += [share[k : k + bs] for k in range(0, len(share), bs)]
        assert len(counts) == 1  # every rank steps as often
        assert sorted(drawn) == sorted(i for b in plain for i in b)  # the same records, once each
        assert set(drawn) == set(range(len(lengths)))
        grouped = padded_tokens([b for r in range(world) for b in sampler(r).batches()], lengths)
        assert grouped < 1.05 * real < 1.05 / 1.3 * padded_tokens(plain, lengths)
    one, again, later = sampler(0), sampler(0), sampler(0)
    later.set_epoch(1)
    assert one.batches() == again.batches() != later.batches()
    in_order = sampler(0, shuffle=False).batches()  # no shuffle: mega-batches in the records' order
    assert sorted(i for b in in_order[:50] for i in b) == list(range(0, len(lengths), world))[: bs * 50]


def test_sft_with_length_grouped_batches_learns_and_draws_each_record_once_an_epoch(tiny_lm_dir, tmp_path):
    """``task.group_by_length=true`` under a real Trainer: Lightning keeps the sampler and moves
    its epoch, each epoch's batches hold every training example once, they are narrower than
    random batches, and the loss falls as without grouping."""
    from ppo_lightning.stages.common import LengthGroupedSampler

    records = [{"prompt": f"{c}*{n}=", "response": c * n} for c in "abcdefghij" for n in range(1, 25)]
    path = write_jsonl(tmp_path / "sft.jsonl", records)
    widths = {}
    for group in (False, True):
        L.seed_everything(0, verbose=False)
        module, dm = build_sft(
            ModelConfig(name_or_path=str(tiny_lm_dir)),
            OptimizerConfig(lr=3e-3, scheduler="linear", warmup_steps=10),
            SFTConfig(
                path=path, val_fraction=0.1, max_length=40, max_prompt_length=8, batch_size=8, group_by_length=group
            ),
        )
        t = trainer(max_steps=120)  # epochs 0-4, of 27 batches
        before = t.validate(module, datamodule=dm, verbose=False)[0]["val/loss"]
        t.fit(module, datamodule=dm)
        loader = t.train_dataloader
        if group:  # the sampler Lightning drew from, at the epoch it was on
            assert isinstance(loader.sampler, LengthGroupedSampler) and loader.sampler.epoch == 120 // len(loader) == 4
        after = t.validate(module, datamodule=dm, verbose=False)[0]["val/loss"]
        print(f"group_by_length={group}: val/loss {before:.3f} -> {after:.3f}")
        assert after < 0.15 * before, group
        rows = [tuple(r[r != PAD].tolist()) for b in loader for r in b["input_ids"]]
        assert sorted(rows) == sorted(tuple(e["input_ids"]) for e in dm.train_examples)
        widths[group] = sum(b["input_ids"].numel() for b in loader)
    assert widths[True] < 0.8 * widths[False]


# ---------------------------------------------------------------------------------------------
# Reward model


def test_bradley_terry_loss_matches_naive():
    rc = torch.tensor([0.0, 1.0, -2.0, 50.0, -50.0])
    rr = torch.tensor([0.0, -1.0, 1.0, -50.0, 50.0])
    loss = bradley_terry_loss(rc, rr)
    naive = torch.tensor([-math.log(1 / (1 + math.exp(-(c - r)))) for c, r in zip([0, 1, -2], [0, -1, 1])])
    torch.testing.assert_close(loss[:3], naive.float())
    assert loss[3].item() == pytest.approx(0.0, abs=1e-12) and loss[4].item() == pytest.approx(100.0)
    assert torch.isfinite(loss).all()


def test_pair_tokenization_matches_the_ppo_reward_path(tiny_rm_dir):
    """The ids trained on are the ids RewardModel scores: prompt + response strings, left-truncated."""
    rm = RewardModel(str(tiny_rm_dir), max_length=6)
    tk = prepare_reward_tokenizer(rm.tokenizer)
    records = [
        {"prompt": "long prompt:", "chosen": "yes", "rejected": "no"},
        {"prompt": "q", "chosen": "a", "rejected": "bb"},
    ]
    pairs = tokenize_pairs(records, tk, max_length=6)
    for r, p in zip(records, pairs):
        for side in ("chosen", "rejected"):
            assert p[side] == rm.tokenizer(r["prompt"] + r[side], truncation=True, max_length=6)["input_ids"]
    assert bytes(pairs[0]["chosen"]) == b"pt:yes"  # the end (the response) is kept
    batch = PairCollator(PAD)(pairs)
    assert batch["input_ids"].shape == (4, 6)
    assert batch["input_ids"][3].tolist() == list(b"qbb") + [PAD] * 3  # rejected rows after chosen
    assert batch["attention_mask"][3].tolist() == [1, 1, 1, 0, 0, 0]


def test_reward_tokenizer_gets_a_pad_distinct_from_eos(tiny_rm_dir, tok):
    """A tokenizer whose pad is EOS gets its own pad token (here the byte vocabulary's <|pad|>)."""
    import copy

    t = copy.deepcopy(tok)
    t.pad_token = t.eos_token
    module, _ = build_reward_model(
        ModelConfig(name_or_path=str(tiny_rm_dir)),
        None,
        {"val_fraction": 0.0, "max_length": 16},
        tokenizer=t,
        records=preference_records(4, seed=0),
    )
    assert t.pad_token_id == EOS and t.padding_side == "left"  # the caller's tokenizer is untouched
    tk = module.tokenizer
    assert tk.pad_token_id == PAD and tk.padding_side == "right" and tk.truncation_side == "left"
    assert module.model.get_input_embeddings().num_embeddings == len(tk)
    assert module.model.config.pad_token_id == PAD and module.model.config.num_labels == 1


def test_reward_model_learns_and_saves(tiny_lm_dir, tmp_path):
    """From the tiny causal LM (new score head): >= 90% val accuracy; the saved directory loads in
    RewardModel, ranks chosen above rejected on new pairs and scores exactly as in training."""
    L.seed_everything(0, verbose=False)
    module, dm = build_reward_model(
        ModelConfig(name_or_path=str(tiny_lm_dir)),
        OptimizerConfig(lr=1e-3),
        RewardModelConfig(val_fraction=0.2, max_length=32, batch_size=16),
        records=preference_records(300, seed=0),
    )
    assert len(dm.val_examples) == 60
    t = trainer(max_steps=100)
    before = t.validate(module, datamodule=dm, verbose=False)[0]
    t.fit(module, datamodule=dm)
    after = t.validate(module, datamodule=dm, verbose=False)[0]
    print(
        f"RM val/accuracy {before['val/accuracy']:.2f} -> {after['val/accuracy']:.2f}, "
        f"val/loss {before['val/loss']:.3f} -> {after['val/loss']:.3f}, margin {after['val/margin']:.2f}"
    )
    assert after["val/accuracy"] >= 0.9
    assert after["val/loss"] < 0.5 * before["val/loss"] and after["val/margin"] > 1.0

    out = save_reward_model(module, tmp_path / "rm")
    rm = RewardModel(str(out), max_length=32)
    held_out = preference_records(100, seed=123)
    prompts = [r["prompt"] for r in held_out]
    chosen = rm(prompts, [r["chosen"] for r in held_out])
    rejected = rm(prompts, [r["rejected"] for r in held_out])
    acc = (chosen > rejected).float().mean().item()
    print(f"RM held-out accuracy through RewardModel: {acc:.2f}")
    assert acc >= 0.9
    module.eval()
    batch = PairCollator(module.tokenizer.pad_token_id)(tokenize_pairs(held_out, module.tokenizer, 32))
    with torch.no_grad():
        trained_chosen, _ = module.pair_rewards(batch)  # the training path's tokens and forward
    torch.testing.assert_close(trained_chosen, chosen, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------
# Validation metrics (torchmetrics): weighted over all examples, not averaged over batches


def no_compute_warnings(record) -> bool:
    return not any("compute" in str(w.message) for w in record)


def test_sft_val_loss_is_token_weighted_over_unequal_batches(tiny_lm_dir, recwarn):
    """val/loss over batches of 5, 5 and 4 examples of unequal token counts is the mean over all
    response tokens (computed here example by example, unpadded) and equals the old hand sums of
    the same batches; the mean of batch means differs."""
    module, dm = build_sft(
        ModelConfig(name_or_path=str(tiny_lm_dir)),
        OptimizerConfig(),
        SFTConfig(val_fraction=0.25, val_batch_size=5, max_length=32, max_prompt_length=8, batch_size=4),
        records=repeat_records("abcdefg"),
    )
    assert len(dm.val_examples) == 14
    out = trainer(max_steps=1).validate(module, datamodule=dm, verbose=False)[0]
    assert set(out) == {"val/loss", "val/perplexity"}

    module.eval()
    with torch.no_grad():
        naive_sum, naive_n = 0.0, 0
        for e in dm.val_examples:
            ids = torch.tensor([e["input_ids"]])
            logits = module.model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[0, :-1]
            target = torch.tensor(e["labels"][1:])
            keep = target != IGNORE_INDEX
            naive_sum += F.cross_entropy(logits[keep].double(), target[keep], reduction="sum").item()
            naive_n += int(keep.sum())
        sums, batch_means, sizes = torch.zeros(2, dtype=torch.float64), [], []
        for batch in dm.val_dataloader():
            loss_sum, n = module.loss_sums(batch)
            sums += torch.stack([loss_sum.double(), n.double()])
            batch_means.append((loss_sum / n).item())
            sizes.append(len(batch["input_ids"]))
    assert sizes == [5, 5, 4]
    naive = naive_sum / naive_n
    hand = (sums[0] / sums[1]).item()
    assert out["val/loss"] == pytest.approx(hand, rel=1e-6)
    assert out["val/loss"] == pytest.approx(naive, rel=1e-5)  # other padding: float noise only
    assert abs(sum(batch_means) / len(batch_means) - naive) > 1e-4 * naive  # the test can tell
    assert out["val/perplexity"] == pytest.approx(math.exp(out["val/loss"]), rel=1e-6)

    # the metric states are reset after each run, are not saved, and an empty run logs nothing
    assert module.val_tokens.update_count == 0
    assert not [k for k in module.state_dict() if not k.startswith("model.")]
    assert module.compute_val_metrics() == {}
    assert no_compute_warnings(recwarn)


@pytest.mark.filterwarnings("ignore:Total length of `list` across ranks is zero")
def test_validation_without_a_split_logs_nothing(tiny_lm_dir, tiny_rm_dir):
    for stage, model_dir, records in [
        ("sft", tiny_lm_dir, repeat_records("ab")),
        ("reward_model", tiny_rm_dir, preference_records(6, seed=0)),
    ]:
        cfg_cls, build, _ = STAGES[stage]
        module, dm = build(ModelConfig(name_or_path=str(model_dir)), None, cfg_cls(val_fraction=0.0), records=records)
        t = trainer(max_steps=1)
        assert t.validate(module, datamodule=dm, verbose=False) == []
        assert not [k for k in t.callback_metrics if k.startswith("val/")]
        assert module.compute_val_metrics() == {}


def test_reward_model_val_metrics_are_per_pair_over_unequal_batches(tiny_lm_dir, recwarn):
    """val/loss, val/accuracy, val/margin over batches of 4, 4 and 1 pairs are the means over all
    pairs (each pair scored alone here), equal to the old hand sums of the same batches."""
    module, dm = build_reward_model(
        ModelConfig(name_or_path=str(tiny_lm_dir)),
        OptimizerConfig(),
        RewardModelConfig(val_fraction=0.4, val_batch_size=4, max_length=32, batch_size=4),
        records=preference_records(23, seed=1),
    )
    assert len(dm.val_examples) == 9
    out = trainer(max_steps=1).validate(module, datamodule=dm, verbose=False)[0]
    assert set(out) == {"val/loss", "val/accuracy", "val/margin"}

    module.eval()
    with torch.no_grad():
        diffs = []
        for p in dm.val_examples:
            rc, rr = (
                module(torch.tensor([p[s]]), torch.ones(1, len(p[s]), dtype=torch.long)) for s in ("chosen", "rejected")
            )
            diffs.append((rc - rr).item())
        batched = torch.cat([torch.stack(module.pair_rewards(b)) for b in dm.val_dataloader()], dim=1)
    d = torch.tensor(diffs, dtype=torch.float64)
    naive = {"val/loss": -F.logsigmoid(d).mean().item(), "val/margin": d.mean().item()}
    for k, v in naive.items():
        assert out[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k
    rc, rr = batched.double()
    hand = {
        "val/loss": bradley_terry_loss(batched[0], batched[1]).double().mean().item(),
        "val/accuracy": (rc > rr).double().mean().item(),
        "val/margin": (rc - rr).mean().item(),
    }
    for k, v in hand.items():
        assert out[k] == pytest.approx(v, rel=1e-6, abs=1e-9), k
    assert out["val/accuracy"] * 9 == pytest.approx(round(out["val/accuracy"] * 9))

    # the update path directly: a tie counts as wrong, a tiny positive difference as right, and
    # differences inside [0, 1] are not thresholded at 0.5 (as BinaryAccuracy on them would be)
    module.on_validation_epoch_start()
    rc = torch.tensor([0.3, 0.5, 0.7, 1e-8, -0.2])
    rr = torch.tensor([0.0, 0.5, 0.0, 0.0, 0.0])
    module.update_val_metrics(rc[:2], rr[:2])
    module.update_val_metrics(rc[2:], rr[2:])
    got = module.compute_val_metrics()
    diff = (rc - rr).double()
    assert got["val/accuracy"] == pytest.approx(3 / 5)
    assert got["val/margin"] == pytest.approx(diff.mean().item(), rel=1e-12)
    assert got["val/loss"] == pytest.approx(-F.logsigmoid(diff).mean().item(), rel=1e-6)
    module.on_validation_epoch_start()
    assert module.compute_val_metrics() == {}
    assert no_compute_warnings(recwarn)


def test_val_metric_states_stay_float64_under_a_true_half_precision_cast():
    """A "bf16-true" trainer calls module.to(torch.bfloat16), which casts torchmetrics states."""
    from torchmetrics.aggregation import SumMetric

    from ppo_lightning.stages.common import reset_val_metrics

    holder = torch.nn.Module()
    holder.m = SumMetric(nan_strategy="disable")
    holder.to(torch.bfloat16)
    assert holder.m.sum_value.dtype == torch.bfloat16
    reset_val_metrics(holder.m)
    holder.m.update(torch.tensor(1.0 + 2**-20))
    holder.m.update(torch.tensor(256, dtype=torch.long))
    assert holder.m.sum_value.dtype == torch.float64 and holder.m.compute().item() == 257 + 2**-20


# ---------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize("stage", ["sft", "reward_model"])
def test_malformed_jsonl_names_the_line(tmp_path, tiny_lm_dir, stage):
    cfg_cls, build, _ = STAGES[stage]
    good = {"prompt": "p", "response": "r", "chosen": "c", "rejected": "x"}
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps(good) + "\n\n" + json.dumps(good) + "\n" + '{"prompt": "p", \n')
    with pytest.raises(ConfigError) as e:
        build(ModelConfig(name_or_path=str(tiny_lm_dir)), None, cfg_cls(path=str(f)))
    msg = str(e.value)
    assert "bad.jsonl" in msg and "line 4" in msg and "not valid JSON" in msg and "task.path" in msg


@pytest.mark.parametrize(
    "stage, row, missing",
    [
        ("sft", {"prompt": "p"}, ["'response' (task.response_field='response')"]),
        ("reward_model", {"prompt": "p", "chosen": "c"}, ["'rejected' (task.rejected_field='rejected')"]),
        (
            "reward_model",
            {"question": "p", "chosen": "c"},
            ["'prompt'", "'rejected'", "task.prompt_field='prompt'", "task.rejected_field='rejected'"],
        ),
    ],
)
def test_missing_fields_are_named(tmp_path, tiny_lm_dir, stage, row, missing):
    cfg_cls, build, _ = STAGES[stage]
    full = {"prompt": "p", "response": "r", "chosen": "c", "rejected": "x"}
    f = write_jsonl(tmp_path / "m.jsonl", [full, full, row])
    with pytest.raises(ConfigError) as e:
        build(ModelConfig(name_or_path=str(tiny_lm_dir)), None, cfg_cls(path=f))
    msg = str(e.value)
    assert "line 3" in msg and "missing field" in msg and all(m in msg for m in missing), msg
    # the same check on an in-memory list names the record
    with pytest.raises(ConfigError, match=r"records\[2\]: missing field"):
        build(ModelConfig(name_or_path=str(tiny_lm_dir)), None, cfg_cls(), records=[full, full, row])


def test_the_stages_read_json_and_hf_datasets_as_they_read_jsonl(tmp_path, tok, monkeypatch):
    """The stages read through PPO's reader (``data.read_records``): a ``.json`` list and a HF
    dataset give the examples a ``.jsonl`` gives, extra columns ignored; ``.txt`` is refused."""
    from tests.test_data import fake_datasets

    rows = [{**r, "id": i} for i, r in enumerate(repeat_records("ab"))]
    jsonl = write_jsonl(tmp_path / "r.jsonl", rows)
    (tmp_path / "r.json").write_text(json.dumps(rows))
    fake_datasets(monkeypatch, rows)
    examples = []
    for source in [dict(path=jsonl), dict(path=str(tmp_path / "r.json")), dict(hf_dataset="org/sft")]:
        dm = SFTDataModule(SFTConfig(**source, val_fraction=0.25), tok)
        dm.load()
        examples.append((dm.train_examples, dm.val_examples))
    assert examples[0] == examples[1] == examples[2] and len(examples[0][1]) == 4
    (tmp_path / "r.txt").write_text("a*1=\n")
    with pytest.raises(ConfigError, match=r"task.path='.*r.txt': unsupported extension '.txt'; use .jsonl"):
        SFTDataModule(SFTConfig(path=str(tmp_path / "r.txt")), tok).load()
    fake_datasets(monkeypatch, [{"question": "q"}])
    with pytest.raises(
        ConfigError,
        match=r"task.hf_dataset='org/sft' row 0: missing field\(s\) 'prompt', "
        r"'response' .*; it has \['question'\]",
    ):
        SFTDataModule(SFTConfig(hf_dataset="org/sft"), tok).load()


@pytest.mark.parametrize("stage", ["sft", "reward_model"])
def test_the_stages_batch_by_their_own_task_keys(tmp_path, cache_dir, tiny_lm_dir, stage):
    """``task.batch_size`` / ``task.shuffle`` / ``task.num_workers`` (the defaults ``data.*`` has;
    ``data.num_workers`` is gone) make a stage's training loader; ``data.*`` is PPO's and no longer
    reaches a stage."""
    from omegaconf import OmegaConf

    from ppo_lightning.config import DataConfig
    from tests.conftest import compose_cfg

    cfg_cls, build, _ = STAGES[stage]
    d, c = DataConfig(), cfg_cls()
    assert (c.batch_size, c.shuffle, c.num_workers) == (d.batch_size, d.shuffle, 0)
    cfg = compose_cfg(
        [f"task={stage}", "task.batch_size=3", "task.shuffle=false", "data.batch_size=5"], tmp_path, cache_dir
    )
    keys = {k: v for k, v in OmegaConf.to_container(cfg.task).items() if k not in ("name", "save_dir")}
    assert (keys["batch_size"], keys["shuffle"], keys["num_workers"]) == (3, False, 0)
    records = repeat_records("ab") if stage == "sft" else preference_records(16, seed=0)
    _, dm = build(
        ModelConfig(name_or_path=str(tiny_lm_dir)), None, {**keys, "val_fraction": 0, "path": None}, records=records
    )
    loader = dm.train_dataloader()
    assert loader.batch_size == 3 and type(loader.sampler).__name__ == "SequentialSampler"
    rows = [len(b["input_ids"]) for b in loader]  # a reward-model batch holds 2 rows a pair
    assert rows == [3 * (1 if stage == "sft" else 2)] * 5 + [1 * (1 if stage == "sft" else 2)]
    _, dm = build(ModelConfig(name_or_path=str(tiny_lm_dir)), None, {"val_fraction": 0}, records=records)
    assert dm.train_dataloader().batch_size == 16 and type(dm.train_dataloader().sampler).__name__ == "RandomSampler"


@pytest.mark.slow  # train.py in a subprocess
def test_data_batch_keys_for_a_stage_are_named_as_doing_nothing(tmp_path, cache_dir):
    """``data.batch_size`` (and ``shuffle``, ``num_workers``) once set the stages' batches; given
    to ``task=sft`` on the command line now, a warning says so and names ``task.batch_size``
    (before any data or model loads: here the missing file then stops the job)."""
    from tests.helpers import run_train

    p = run_train(
        [
            "experiment=tiny_char",
            "task=sft",
            f"task.path={tmp_path / 'none.jsonl'}",
            "data.batch_size=8",
            "task.batch_size=4",
            f"hydra.run.dir={tmp_path / 'run'}",
            f"paths.cache_dir={cache_dir}",
        ],
        cache_dir,
    )
    out = p.stdout + p.stderr
    assert p.returncode == 1 and "none.jsonl': no such file" in out, out[-2000:]
    assert (
        "data.batch_size is PPO's prompt loader's and does nothing for task=sft, which batches by "
        "task.batch_size (4 here)"
    ) in out, out[-2000:]


def test_custom_field_names_and_type_errors(tmp_path, tok):
    f = write_jsonl(tmp_path / "q.jsonl", [{"q": "in", "a": "out"}, {"q": "in", "a": 5}])
    dm = SFTDataModule(SFTConfig(path=f, prompt_field="q", response_field="a", val_fraction=0), tok)
    with pytest.raises(ConfigError, match=r"line 2: field 'a' \(task.response_field\) must be a string, got int"):
        dm.load()
    dm = SFTDataModule(
        {
            "path": write_jsonl(tmp_path / "r.jsonl", [{"q": "in", "a": "out"}]),
            "prompt_field": "q",
            "response_field": "a",
            "val_fraction": 0,
        },
        tok,
        key_prefix="sft",
    )
    dm.load()
    assert dm.train_examples[0]["input_ids"] == list(b"inout") + [EOS]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(), r"task.path and task.hf_dataset are both null"),
        (dict(path="nope.jsonl"), r"task.path='nope.jsonl': no such file"),
        (dict(path="{tmp}/p.txt"), r"unsupported extension '.txt'"),
        (dict(path="{tmp}/empty.jsonl"), r"holds no records"),
        (dict(path="{tmp}/p.txt", hf_dataset="x"), r"both set"),
        (dict(max_prompt_length=64, max_length=64), r"task.max_prompt_length=64: must be >= 1 and < task.max_length"),
        (dict(val_fraction=1.0), r"task.val_fraction=1.0"),
        (dict(truncation="left"), r"task.truncation=.left.: choose one of truncate \| drop \| error"),
    ],
)
def test_sft_config_and_source_errors(tmp_path, tiny_lm_dir, kwargs, match):
    (tmp_path / "p.txt").write_text("hello\n")
    (tmp_path / "empty.jsonl").write_text("\n\n")
    kwargs = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in kwargs.items()}
    with pytest.raises(ConfigError, match=match):
        build_sft(ModelConfig(name_or_path=str(tiny_lm_dir)), None, SFTConfig(**kwargs))


def test_other_build_errors(tiny_lm_dir, monkeypatch):
    model = ModelConfig(name_or_path=str(tiny_lm_dir))
    with pytest.raises(ConfigError, match=r"task.max_lenght: unknown key"):
        build_sft(model, None, {"max_lenght": 5})
    with pytest.raises(ConfigError, match=r"optimizer.scheduler='step'"):
        build_sft(model, OptimizerConfig(scheduler="step"), SFTConfig(), records=repeat_records())
    with pytest.raises(ConfigError, match=r"task.max_length=1000 exceeds the model's context of 256"):
        build_reward_model(model, None, RewardModelConfig(max_length=1000), records=preference_records(10, seed=0))
    with pytest.raises(ConfigError, match=r"too few for task.val_fraction"):
        build_sft(model, None, SFTConfig(val_fraction=0.5), records=repeat_records("a", [1]))
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    with pytest.raises(ConfigError, match=r"task.hf_dataset='org/prefs' needs the 'datasets' package"):
        build_reward_model(model, None, RewardModelConfig(hf_dataset="org/prefs"))


def _files(directory) -> dict[str, bytes]:
    return {
        str(f.relative_to(directory)): f.read_bytes() if f.is_file() else b"<dir>" for f in sorted(directory.rglob("*"))
    }


@pytest.mark.parametrize("stage", ["sft", "reward_model"])
def test_model_tiny_never_writes_into_a_users_model_directory(tmp_path, cache_dir, tiny_lm_dir, stage):
    """``task=<stage> model=tiny model.name_or_path=<a model directory of the user's, outside
    paths.cache_dir>``: the job loads that model, trains and saves to ``task.save_dir``; the
    user's directory (and the one around it, where a build would put its temporary copy) keeps
    every file, byte for byte, and gains none."""
    import shutil

    from ppo_lightning.jobs.run import run_task
    from tests.conftest import compose_cfg

    user = tmp_path / "home" / "my_model"
    shutil.copytree(tiny_lm_dir, user)
    assert not user.resolve().is_relative_to(cache_dir.resolve())
    before = _files(user.parent)
    data = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "a", "response": "b", "chosen": "c", "rejected": "d"}] * 8)
    cfg = compose_cfg(
        [
            f"task={stage}",
            "model=tiny",
            f"model.name_or_path={user}",
            f"task.path={data}",
            "task.val_fraction=0",
            "trainer.max_steps=2",
            "trainer.limit_val_batches=0",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "callbacks=none",
            "logger=none",
        ],
        tmp_path / "out",
        cache_dir,
    )
    assert cfg.model.build_tiny is not None  # model=tiny: it would build, were the directory in the cache
    run_task(cfg)
    assert _files(user.parent) == before
    assert (tmp_path / "out" / ("sft_model" if stage == "sft" else "reward_model") / "config.json").is_file()


def test_builds_the_tiny_model_seeds_the_score_head_and_fits_max_length(tmp_path):
    """``model.build_tiny`` builds the offline model first; the new score head's init follows
    ``seed`` and leaves the global RNG alone."""
    from ppo_lightning.config import TinyModelConfig

    model_cfg = ModelConfig(name_or_path=str(tmp_path / "tiny"), build_tiny=TinyModelConfig())
    records = preference_records(6, seed=0)
    a, dm = build_reward_model(model_cfg, None, RewardModelConfig(seed=5), records=records, cache_dir=tmp_path)
    state = torch.random.get_rng_state()
    b, _ = build_reward_model(model_cfg, None, RewardModelConfig(seed=5), records=records, cache_dir=tmp_path)
    assert torch.equal(torch.random.get_rng_state(), state)
    c, _ = build_reward_model(model_cfg, None, RewardModelConfig(seed=6), records=records, cache_dir=tmp_path)
    assert (tmp_path / "tiny" / "config.json").is_file()
    wa, wb, wc = (m.model.score.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)
    # max_length null: the model's context (256 here), at most 512
    assert dm.cfg.max_length == 256
    _, dm = build_sft(model_cfg, None, SFTConfig(), records=repeat_records())
    assert dm.cfg.max_length == 256 and dm.cfg.max_prompt_length == 128
