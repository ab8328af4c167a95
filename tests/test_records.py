"""Prompt records: chat messages through the chat template, and each prompt's other fields (its
metadata) reaching the reward, row by row, with every one of its samples."""

from __future__ import annotations

import json

import pytest

from ppo_lightning.data.records import PromptRecord, read_prompt_records
from ppo_lightning.data.prompts import render_prompts
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.models.tiny import build_byte_tokenizer
from tests import helpers
from tests.conftest import compose_cfg, read_metrics

SYSTEM = "Answer with a number."


def _write_chat_records(path, n: int = 8):
    rows = [
        {"prompt": [{"role": "user", "content": helpers._item(q)}], "answer": str(q + 1), "qid": q} for q in range(n)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_chat_prompts_render_as_the_tokenizers_chat_template(tmp_path):
    """Messages go through ``apply_chat_template(add_generation_prompt=True)``: the tokenizer's
    template, or ``data.chat_template`` (a string or a file); ``data.system_prompt`` comes first
    where the messages have no system message; a string prompt stays as written unless a template
    is given. Every other field is the record's metadata."""
    tok = build_byte_tokenizer()
    rows = _write_chat_records(tmp_path / "chat.jsonl", 3)
    with_system = {"prompt": [{"role": "system", "content": "own"}, {"role": "user", "content": "hi"}], "k": 1}
    (tmp_path / "chat.jsonl").open("a").write(json.dumps(with_system) + "\n")
    records = read_prompt_records(tmp_path / "chat.jsonl")
    assert [r.columns for r in records] == [{"answer": str(q + 1), "qid": q} for q in range(3)] + [{"k": 1}]
    texts = render_prompts(records, tok, system_prompt=SYSTEM)
    naive = [
        tok.apply_chat_template(
            [{"role": "system", "content": SYSTEM}, *r["prompt"]], tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]
    naive.append(tok.apply_chat_template(with_system["prompt"], tokenize=False, add_generation_prompt=True))
    assert texts == naive and texts[0] == f"<|system|>{SYSTEM}\n<|user|>item 0: what is 0 + 1?\n<|assistant|>"
    template = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }} {% endfor %}=>"
    (tmp_path / "t.jinja").write_text(template)
    plain = PromptRecord("just text", {}, "here")
    from ppo_lightning.data.prompts import chat_template_of

    for given in (template, str(tmp_path / "t.jinja")):
        out = render_prompts([records[0], plain], tok, chat_template_of(given))
        assert out == ["[user] item 0: what is 0 + 1? =>", "[user] just text =>"]
    assert render_prompts([plain], tok) == ["just text"]


def test_bad_chat_records_are_named_by_file_and_line(tmp_path):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": [{"role": "user"}]}) + "\n")
    with pytest.raises(ConfigError, match=r"bad.jsonl' line 1: message 0 of 'prompt' must be an object with string"):
        read_prompt_records(f)
    f.write_text(json.dumps({"prompt": "a"}) + "\n" + json.dumps({"prompt": [{"role": "robot", "content": "x"}]}))
    records = read_prompt_records(f)
    with pytest.raises(ConfigError, match=r"bad.jsonl' line 2: the chat template rejects these messages: unknown role"):
        render_prompts(records, build_byte_tokenizer())
    tok = build_byte_tokenizer()
    tok.chat_template = None
    with pytest.raises(
        ConfigError,
        match=r"line 2: chat messages, but the tokenizer has no chat template; set "
        r"data.chat_template",
    ):
        render_prompts(records, tok)


RUN = [
    "data=file",
    "reward=function",
    "ppo.advantage=grpo",
    "ppo.num_generations=4",
    "data.batch_size=4",
    "ppo.minibatch_size=16",
    "ppo.ppo_epochs=1",
    "sampling.max_new_tokens=6",
    "trainer.max_steps=3",
    "reward.normalize=true",
    "reward.normalize_samples=8",
    f"data.system_prompt='{SYSTEM}'",
    "callbacks=none",
    "logger=csv",
    "export_dir=null",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


@pytest.mark.parametrize("fn", ["own_answer_trl", "own_answer_legacy"])
def test_every_reward_call_gets_each_prompts_own_metadata(tmp_path, cache_dir, fn):
    """A real run, 4 samples per prompt: every reward call (reward normalisation's reference
    samples included) gets each row's own columns, the same for the 4 rows of a group, under
    either signature; the rewards fail otherwise."""
    from ppo_lightning.jobs.run import train

    _write_chat_records(tmp_path / "chat.jsonl", 8)
    helpers.REWARD_CALLS.clear()
    cfg = compose_cfg(
        [*RUN, f"data.path={tmp_path / 'chat.jsonl'}", f"reward.fn=tests.helpers.{fn}"], tmp_path, cache_dir
    )
    train(cfg)
    assert len(read_metrics(tmp_path / "metrics.csv")) == 3
    rollouts = [c for c in helpers.REWARD_CALLS if len(c) == 16]  # 4 prompts x 4 samples
    normalization = [q for c in helpers.REWARD_CALLS if len(c) != 16 for q in c]  # one sample per prompt
    assert len(normalization) == 8 and len(rollouts) == 3
    for qids in rollouts:
        groups = [qids[i : i + 4] for i in range(0, 16, 4)]
        assert all(len(set(g)) == 1 for g in groups) and len({g[0] for g in groups}) == 4, qids


@pytest.mark.parametrize("with_model_term", [False, True])
def test_a_reward_asking_for_a_column_the_data_lacks_fails_before_any_model_loads(
    tmp_path, cache_dir, monkeypatch, tiny_rm_dir, with_model_term
):
    """Also when a reward-model term is among ``reward.terms`` (the reward is then built after the
    policy loads, but its function terms are checked first)."""
    from ppo_lightning.jobs import factory

    f = tmp_path / "chat.jsonl"
    _write_chat_records(f, 8)
    f.open("a").write(json.dumps({"prompt": "no columns here", "answer": "1"}) + "\n")

    def no_model(*args, **kwargs):
        raise AssertionError("a model loaded before the data's columns were checked")

    monkeypatch.setattr(factory, "load_causal_lm", no_model)
    reward = ["reward.fn=tests.helpers.own_answer_trl"]
    if with_model_term:
        reward = [
            "reward.terms.own.fn=tests.helpers.own_answer_trl",
            "reward.terms.rm.kind=model",
            f"reward.terms.rm.name_or_path={tiny_rm_dir}",
        ]
    cfg = compose_cfg([*RUN, f"data.path={f}", *reward], tmp_path, cache_dir)
    with pytest.raises(
        ConfigError,
        match=r"chat.jsonl' line 9: reward (tests.helpers.own_answer_trl|reward.terms.own.fn=\S+) asks for column"
        r"\(s\) \['qid'\], which this record does not have \(its columns: "
        r"\['answer'\]\)",
    ):
        factory.build_module(cfg)


@pytest.mark.slow  # two ranks, killed, resumed
def test_metadata_stays_with_its_prompt_on_every_rank_and_after_a_kill(tmp_path, cache_dir):
    """``trainer=ddp_cpu``: each rank's rows carry their own prompts' columns (the reward raises
    otherwise), also in the run resumed from the checkpoint a SIGKILL left, which picks up the
    prompts where the killed run stopped."""
    import torch

    from tests.helpers import run_ranks

    _write_chat_records(tmp_path / "chat.jsonl", 16)
    args = [
        "experiment=tiny_char",
        *[a for a in RUN if not a.startswith(("callbacks=", "trainer.max_steps", "export_dir"))],
        "trainer=ddp_cpu",
        "trainer.max_steps=6",
        "export_dir=null",
        "callbacks.model_checkpoint.every_n_train_steps=2",
        f"data.path={tmp_path / 'chat.jsonl'}",
        "reward.fn=tests.helpers.own_answer_trl",
    ]
    killed = run_ranks(
        [
            *args,
            f"hydra.run.dir={tmp_path / 'killed'}",
            "+callbacks.kill._target_=tests.helpers.KillAtStep",
            "+callbacks.kill.step=3",
        ],
        cache_dir,
    )
    assert killed.returncode == -9, killed.stderr[-3000:]
    last = tmp_path / "killed" / "checkpoints" / "last.ckpt"
    assert torch.load(last, weights_only=True)["global_step"] == 2
    resumed = run_ranks([*args, f"hydra.run.dir={tmp_path / 'resumed'}", f"ckpt_path={last}"], cache_dir)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert [int(r["step"]) for r in read_metrics(tmp_path / "resumed" / "metrics.csv")] == [2, 3, 4, 5]


# ----------------------------------------------------------------------------- weighted terms
def test_reward_terms_compose_with_or_without_plus_and_are_checked(tmp_path, cache_dir):
    from ppo_lightning.config import validate

    cfg = compose_cfg(
        ["reward.terms.correct.fn=a.b", "+reward.terms.format.fn=c.d", "reward.terms.format.weight=0.2"],
        tmp_path,
        cache_dir,
    )
    assert {k: dict(v) for k, v in cfg.reward.terms.items()} == {
        "correct": {"fn": "a.b"},
        "format": {"fn": "c.d", "weight": 0.2},
    }
    with pytest.raises(ConfigError, match=r"^reward.terms.correct.wieght: not a reward term key; choose from kind"):
        validate(compose_cfg(["reward.terms.correct.fn=a.b", "reward.terms.correct.wieght=2"], tmp_path, cache_dir))
    with pytest.raises(ConfigError, match=r"^reward.terms.correct.kind='rule': choose one of function \| model"):
        validate(compose_cfg(["reward.terms.correct.kind=rule"], tmp_path, cache_dir))
    spaced = compose_cfg([], tmp_path, cache_dir)
    spaced.reward.terms["x y"] = {"fn": "a.b"}  # a name no command line can write, from a YAML file
    with pytest.raises(ConfigError, match=r"^reward.terms.x y: a term's name may hold"):
        validate(spaced)
    with pytest.raises(ConfigError, match=r"^reward.terms.correct.fn=.no.such.module.f.: cannot import"):
        from ppo_lightning.jobs.factory import check_inputs

        check_inputs(compose_cfg(["reward.terms.correct.fn=no.such.module.f"], tmp_path, cache_dir))


def test_the_math_reward_file_is_the_tutorials_gsm8k_reward_as_two_weighted_terms(tmp_path, cache_dir):
    """``reward=math``: ``math_answer`` + 0.2 x ``answer_format`` equals the tutorial's reward
    (``math_answer_and_format``) on every kind of response, with each term's raw scores kept."""
    from ppo_lightning.rewards import build_reward
    from ppo_lightning.rewards.base import RewardBatch
    from ppo_lightning.rewards.verifiable import math_answer_and_format

    cfg = compose_cfg(["reward=math"], tmp_path, cache_dir)
    reward = build_reward(cfg.reward)
    completions = ["<answer>7</answer>", "#### 7", "<answer>8</answer>", "<answer>8</answer><answer>7</answer>", "x"]
    inputs = RewardBatch.of_texts(["q"] * 5, completions, columns=[{"answer": "7"}] * 5)
    total, _, terms = reward.score(inputs)
    assert total.tolist() == pytest.approx(math_answer_and_format(None, completions, ["7"] * 5))
    assert terms["correct"].tolist() == [1, 1, 0, 1, 0] and terms["format"].tolist() == [1, 0, 1, 0, 0]


def test_a_run_with_two_weighted_terms_logs_each_terms_curve(tmp_path, cache_dir):
    """Per-term means and stds on the raw scale, whose weighted sum is the logged raw score; the
    samples file has a column per term."""
    import statistics

    from ppo_lightning.jobs.run import train

    rows = [{"prompt": [{"role": "user", "content": helpers._item(q)}], "answer": str(q + 1)} for q in range(8)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = compose_cfg(
        [
            *RUN,
            f"data.path={tmp_path / 'chat.jsonl'}",
            "reward=math",
            "reward.terms.format.weight=0.5",
            "+reward.terms.length.fn=ppo_lightning.rewards.rules.target_length",
            "+reward.terms.length.kwargs.target=4",
            "callbacks=default",
            "callbacks.samples.every_n_steps=1",
        ],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    metrics = read_metrics(tmp_path / "metrics.csv")
    for m in metrics:
        weighted = m["rewards/correct/mean"] + 0.5 * m["rewards/format/mean"] + m["rewards/length/mean"]
        assert m["objective/raw_scores"] == pytest.approx(weighted, abs=1e-5)
        assert 0 <= m["rewards/correct/std"] <= 0.5 and m["rewards/length/std"] >= 0
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert {"correct", "format", "length"} <= set(samples[0])
    first = [s for s in samples if s["step"] == 0]
    lengths = [s["length"] for s in first]
    assert all(-100 < x <= 0 for x in lengths) and statistics.fmean(lengths) <= 0


def test_sft_on_chat_records_sees_the_prompt_tokens_ppo_sees_and_learns_the_assistant_turn(tmp_path, tiny_lm_dir):
    """``task=sft`` renders a chat prompt as PPO does (template, system prompt): the same prompt
    tokens, masked out of the loss; the labels are the assistant turn and EOS."""
    from omegaconf import OmegaConf

    from ppo_lightning.config import DataConfig, SFTConfig
    from ppo_lightning.data.prompts import PromptDataModule
    from ppo_lightning.models.policy import load_tokenizer
    from ppo_lightning.stages.sft import IGNORE_INDEX, SFTDataModule

    rows = [
        {"prompt": [{"role": "user", "content": helpers._item(q)}], "response": f" {q + 1}", "answer": str(q + 1)}
        for q in range(6)
    ]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok = load_tokenizer(str(tiny_lm_dir))
    data = OmegaConf.structured(DataConfig(path=str(tmp_path / "chat.jsonl"), batch_size=2, system_prompt=SYSTEM))
    ppo = PromptDataModule(data, tok)
    ppo.load()
    ppo_prompts = sorted(tuple(item["input_ids"]) for item in ppo.dataset.items)
    sft = SFTDataModule(SFTConfig(path=str(tmp_path / "chat.jsonl"), val_fraction=0, system_prompt=SYSTEM), tok)
    sft.load()
    sft_prompts, responses = [], []
    for ex in sft.train_examples:
        n = ex["labels"].count(IGNORE_INDEX)
        assert ex["labels"][:n] == [IGNORE_INDEX] * n and ex["labels"][n:] == ex["input_ids"][n:]
        sft_prompts.append(tuple(ex["input_ids"][:n]))
        responses.append(tok.decode(ex["input_ids"][n:]))
    assert sorted(sft_prompts) == ppo_prompts
    assert tok.decode(ppo_prompts[0]).startswith(f"<|system|>{SYSTEM}\n<|user|>item ")
    assert sorted(responses) == sorted(f" {q + 1}{tok.eos_token}" for q in range(6))


@pytest.mark.parametrize("advantage", ["gae", "grpo"])
def test_truncated_completions_are_left_out_of_the_loss(tmp_path, cache_dir, advantage):
    """``ppo.mask_truncated_completions``: a response cut at ``max_new_tokens`` has no token in
    any loss (mask and advantages 0) and is counted; one that ended keeps its tokens."""
    import lightning as L

    from ppo_lightning.jobs.factory import build

    class Rollouts(L.Callback):
        seen: list = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append((pl_module.rollout, dict(pl_module.last_metrics)))

    extra = ["ppo.num_generations=4", "data.batch_size=4", "ppo.minibatch_size=16"] if advantage == "grpo" else []
    cfg = compose_cfg(
        [
            "sampling.max_new_tokens=3",
            "ppo.mask_truncated_completions=true",
            f"ppo.advantage={advantage}",
            *extra,
            f"sampling.stop_token_ids=[{','.join(map(str, range(70)))}]",  # about half the rows stop in 3 tokens
            "trainer.max_steps=2",
            "callbacks=none",
            "logger=csv",
            "export_dir=null",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
        ],
        tmp_path,
        cache_dir,
    )
    module, datamodule, trainer = build(cfg)
    trainer.callbacks.append(Rollouts())
    trainer.fit(module, datamodule=datamodule)
    cut_rows = ended_rows = 0
    for r, metrics in Rollouts.seen:
        cut = ~r.contains_eos
        assert (r.response_mask[cut] == 0).all() and (r.advantages[cut] == 0).all()
        assert (r.response_mask[~cut].sum(1) > 0).all()
        assert metrics["rollout/masked_truncated"] == cut.sum().item()
        cut_rows, ended_rows = cut_rows + int(cut.sum()), ended_rows + int((~cut).sum())
    assert cut_rows > 0 and ended_rows > 0  # both kinds seen, or the test says nothing


def test_none_means_a_reward_does_not_apply(tmp_path, cache_dir):
    """A term's None is out of that term's sum and statistics; a response no reward applies to is
    masked out of every loss and counted (a naive reference by hand, then a real run)."""
    import torch

    from ppo_lightning.rewards import build_reward
    from ppo_lightning.rewards.base import RewardBatch

    reward = build_reward(
        compose_cfg(
            [
                "+reward.terms.odd.fn=tests.helpers.none_for_odd_qid",
                "+reward.terms.len.fn=tests.helpers.own_answer_trl",
                "reward.terms.len.weight=0.5",
            ],
            tmp_path,
            cache_dir,
        ).reward
    )
    prompts = [[{"role": "user", "content": helpers._item(q)}] for q in (0, 1)]
    inputs = RewardBatch.of_texts(
        ["p0", "p1"],
        ["abcd", "abcdefgh"],
        [[1], [2]],
        prompts=prompts,
        columns=[{"qid": 0, "answer": "1"}, {"qid": 1, "answer": "2"}],
    )
    total, applies, terms = reward.score(inputs)
    assert total.tolist() == pytest.approx([0.5 + 0.5 * 0.5, 0.5 * 1.0]) and applies.tolist() == [True, True]
    assert terms["odd"][0] == 0.5 and torch.isnan(terms["odd"][1])
    single = build_reward(
        compose_cfg(["reward=function", "reward.fn=tests.helpers.none_for_odd_qid"], tmp_path, cache_dir).reward
    )
    values, applies, _ = single.score(inputs)
    assert values.tolist() == [0.5, 0.0] and applies.tolist() == [True, False]

    import lightning as L

    from ppo_lightning.jobs.factory import build

    class Rollouts(L.Callback):
        seen: list = []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.seen.append((pl_module.rollout, dict(pl_module.last_metrics)))

    _write_chat_records(tmp_path / "chat.jsonl", 8)
    cfg = compose_cfg(
        [
            *RUN,
            f"data.path={tmp_path / 'chat.jsonl'}",
            "reward.fn=tests.helpers.none_for_odd_qid",
            "reward.normalize=false",
            "trainer.max_steps=2",
        ],
        tmp_path,
        cache_dir,
    )
    module, datamodule, trainer = build(cfg)
    trainer.callbacks.append(Rollouts())
    trainer.fit(module, datamodule=datamodule)
    for r, metrics in Rollouts.seen:
        odd = ~r.scored  # the rows of odd qid, to which the only reward does not apply
        assert (r.response_mask[odd].sum(1) == 0).all() and (r.response_mask[~odd].sum(1) > 0).all()
        assert metrics["rollout/unscored"] == odd.sum().item() > 0


def _columns_of(records):
    return [(r.prompt, r.columns) for r in records]


def test_parquet_and_saved_datasets_read_as_the_same_records_as_jsonl(tmp_path):
    """``data.path`` takes a .parquet file and a ``save_to_disk`` directory (a Dataset, or a
    DatasetDict's ``data.hf_split``): the same prompts, chat messages included, and columns."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {"prompt": [{"role": "user", "content": f"q{i}"}], "answer": str(i), "data_source": "a" if i % 2 else "b"}
        for i in range(5)
    ]
    (tmp_path / "p.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    expected = _columns_of(read_prompt_records(tmp_path / "p.jsonl"))
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    assert _columns_of(read_prompt_records(tmp_path / "p.parquet")) == expected
    ds = datasets.Dataset.from_list(rows)
    ds.save_to_disk(str(tmp_path / "saved"))
    assert _columns_of(read_prompt_records(tmp_path / "saved")) == expected
    datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "splits"))
    assert _columns_of(read_prompt_records(tmp_path / "splits")) == expected
    assert _columns_of(read_prompt_records(tmp_path / "splits", hf_split="test")) == expected[:1]
    with pytest.raises(ConfigError, match=r"holds the splits \['test', 'train'\], not 'dev'; set data.hf_split"):
        read_prompt_records(tmp_path / "splits", hf_split="dev")
    (tmp_path / "plain").mkdir()
    with pytest.raises(
        ConfigError, match=r"data.path='.*plain' is a directory but not a directory written by datasets"
    ):
        read_prompt_records(tmp_path / "plain")
    (tmp_path / "bad.parquet").write_text("not parquet")
    with pytest.raises(ConfigError, match=r"bad.parquet': not a readable parquet file"):
        read_prompt_records(tmp_path / "bad.parquet")
    with pytest.raises(ConfigError, match=r"eval.path='.*p.parquet' row 0: no 'question' field"):
        read_prompt_records(tmp_path / "p.parquet", "question", key_prefix="eval")


def test_a_reward_model_term_is_weighed_with_a_function_term_and_moves_with_the_module(
    tmp_path, cache_dir, tiny_rm_dir
):
    """``reward.terms`` with a reward model beside a function: the raw score is the weighted sum of
    the two terms' logged means; the reward model is a submodule of the run (so Lightning moves it
    to the policy's device) and stays out of the checkpoint, as a single reward model does."""
    import torch

    from ppo_lightning.jobs.factory import build
    from ppo_lightning.rewards.model import RewardModel

    f = tmp_path / "chat.jsonl"
    _write_chat_records(f, 8)
    cfg = compose_cfg(
        [
            *RUN,
            f"data.path={f}",
            "reward.terms.own.fn=tests.helpers.own_answer_trl",
            "reward.terms.rm.kind=model",
            f"reward.terms.rm.name_or_path={tiny_rm_dir}",
            "reward.terms.rm.weight=0.5",
            "trainer.max_steps=2",
            "trainer.enable_checkpointing=true",
            "callbacks=default",
        ],
        tmp_path,
        cache_dir,
    )
    module, datamodule, trainer = build(cfg)
    assert any(isinstance(m, RewardModel) for m in module.reward_fn.modules())
    assert any(name.startswith("reward_fn.models.rm.") for name, _ in module.named_parameters())
    trainer.fit(module, datamodule=datamodule)
    for m in read_metrics(tmp_path / "metrics.csv"):
        weighted = m["rewards/own/mean"] + 0.5 * m["rewards/rm/mean"]
        assert m["objective/raw_scores"] == pytest.approx(weighted, abs=1e-5)
        assert m["rewards/rm/std"] > 0  # a model's scores vary; a constant would hide a broken term
    ckpt = torch.load(next((tmp_path / "checkpoints").glob("*.ckpt")), map_location="cpu", weights_only=True)
    assert not any(k.startswith("reward_fn.") for k in ckpt["state_dict"])
