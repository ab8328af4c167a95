"""Evaluation during training: the unbiased pass@k against a brute-force count, eval metrics at
the steps asked for, and the same training trajectory with eval on or off."""

from __future__ import annotations

import itertools
import json
import math

import pytest

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.train.evaluation import pass_at_k, pass_ks
from tests import helpers
from tests.conftest import compose_cfg, read_metrics


@pytest.mark.parametrize("n, c", [(1, 0), (1, 1), (4, 0), (4, 1), (4, 3), (5, 2), (6, 6)])
def test_pass_at_k_is_the_chance_that_some_k_of_the_n_samples_pass(n, c):
    """The unbiased estimator equals the fraction of k-subsets of the n samples holding a pass."""
    samples = [True] * c + [False] * (n - c)
    for k in range(1, n + 1):
        subsets = list(itertools.combinations(samples, k))
        brute = sum(any(s) for s in subsets) / len(subsets)
        assert pass_at_k(n, c, k) == pytest.approx(brute), (n, c, k)
    assert pass_ks(1) == [1] and pass_ks(4) == [1, 2, 4] and pass_ks(6) == [1, 2, 4, 6]


def test_pass_at_k_refuses_more_draws_than_samples():
    """With k > n there is no k-subset to draw: refused, not 1.0 for samples of which none passed."""
    with pytest.raises(ValueError, match=r"pass@k needs 1 <= k <= n"):
        pass_at_k(2, 0, 4)
    with pytest.raises(ValueError, match=r"0 <= c <= n"):
        pass_at_k(2, 3, 1)


def _records(path, qs, sources=False):
    rows = [{"prompt": [{"role": "user", "content": helpers._item(q)}], "answer": str(q + 1), "qid": q} for q in qs]
    if sources:  # alternate two sources
        rows = [{**r, "data_source": "ab"[i % 2]} for i, r in enumerate(rows)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


RUN = [
    "data=file",
    "reward=function",
    "reward.fn=tests.helpers.own_answer_trl",
    "data.batch_size=4",
    "ppo.minibatch_size=4",
    "ppo.ppo_epochs=1",
    "sampling.max_new_tokens=6",
    "trainer.max_steps=4",
    "callbacks=none",
    "logger=csv",
    "export_dir=null",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


@pytest.mark.slow  # two runs
def test_eval_logs_before_every_n_and_after_without_moving_the_training_trajectory(tmp_path, cache_dir):
    from ppo_lightning.jobs.run import train

    _records(tmp_path / "train.jsonl", range(8))
    _records(tmp_path / "eval.jsonl", range(100, 106), sources=True)  # 6 prompts: batches of 4 and 2
    runs = {}
    for name, extra in (
        ("off", []),
        (
            "on",
            [
                f"eval.path={tmp_path / 'eval.jsonl'}",
                "eval.every_n_iterations=2",
                "eval.num_samples=2",
                "eval.temperature=0",
                "eval.metrics.again=tests.helpers.own_answer_trl",  # the reward again, as a metric only
            ],
        ),
    ):
        out = tmp_path / name
        train(compose_cfg([*RUN, f"data.path={tmp_path / 'train.jsonl'}", *extra], out, cache_dir))
        runs[name] = read_metrics(out / "metrics.csv")
    training = [{k: v for k, v in row.items() if not k.startswith("eval/")} for row in runs["on"] if "lr" in row]
    helpers.assert_same_metrics(runs["off"], training)
    evals = {int(row["step"]): row for row in runs["on"] if "eval/reward/mean@2" in row}
    assert sorted(evals) == [0, 2, 4]  # before training, before iteration 2, after the last (4)
    for row in evals.values():
        assert row["eval/pass@1"] == pytest.approx(row["eval/pass@2"])  # greedy: both samples agree
        assert row["eval/response_length"] > 0 and math.isfinite(row["eval/kl"])
    assert evals[0]["eval/kl"] == pytest.approx(0.0, abs=1e-5)  # the policy is the reference before training
    for row in evals.values():  # an eval.metrics score is measured on the same samples as the reward
        assert row["eval/metrics/again/mean@2"] == pytest.approx(row["eval/reward/mean@2"])
    for row in evals.values():  # per data_source: 3 prompts each, which make up the whole
        for metric in ("reward/mean@2", "pass@1", "response_length", "kl", "metrics/again/mean@2"):
            whole = (row[f"eval/a/{metric}"] + row[f"eval/b/{metric}"]) / 2
            assert row[f"eval/{metric}"] == pytest.approx(whole, abs=1e-6), metric


def test_bad_eval_inputs_fail_before_any_model_loads(tmp_path, cache_dir):
    from ppo_lightning.jobs.factory import build_module, check_inputs

    _records(tmp_path / "train.jsonl", range(8))
    base = [*RUN, f"data.path={tmp_path / 'train.jsonl'}"]
    with pytest.raises(ConfigError, match=r"^eval.path='.*nope.jsonl': no such file"):
        check_inputs(compose_cfg([*base, f"eval.path={tmp_path / 'nope.jsonl'}"], tmp_path, cache_dir))
    with pytest.raises(ConfigError, match=r"has 2 prompts, fewer than data.batch_size=4"):
        build_module(compose_cfg([*base, "eval.split_fraction=0.75"], tmp_path, cache_dir))
    with pytest.raises(ConfigError, match=r"^eval.pass_term='correct': not a reward.terms name"):
        check_inputs(compose_cfg([*base, "eval.pass_term=correct"], tmp_path, cache_dir))
    with pytest.raises(ConfigError, match=r"^eval.metrics.x='tests.helpers.no_such_fn': module 'tests.helpers' has no"):
        check_inputs(compose_cfg([*base, "eval.metrics.x=tests.helpers.no_such_fn"], tmp_path, cache_dir))


@pytest.mark.slow  # one and two ranks
def test_eval_sharded_over_two_ranks_equals_one_process(tmp_path, cache_dir):
    """Five eval prompts over two ranks (three and two, the short rank padded with a weight-0
    row): the greedy eval of the initial policy is the one-process value."""
    from tests.helpers import run_ranks

    _records(tmp_path / "train.jsonl", range(16))
    _records(tmp_path / "eval.jsonl", range(100, 105))
    args = [
        "experiment=tiny_char",
        *RUN,
        f"data.path={tmp_path / 'train.jsonl'}",
        f"eval.path={tmp_path / 'eval.jsonl'}",
        "trainer.max_steps=1",
    ]
    evals = {}
    for trainer in ("cpu", "ddp_cpu"):
        p = run_ranks([*args, f"trainer={trainer}", f"hydra.run.dir={tmp_path / trainer}"], cache_dir)
        assert p.returncode == 0, p.stderr[-3000:]
        evals[trainer] = {int(r["step"]): r for r in read_metrics(tmp_path / trainer / "metrics.csv") if "eval/kl" in r}
    assert sorted(evals["ddp_cpu"]) == [0, 1]
    for k in ("eval/reward/mean@1", "eval/response_length", "eval/pass@1"):
        assert evals["ddp_cpu"][0][k] == pytest.approx(evals["cpu"][0][k], rel=1e-5), k


@pytest.mark.slow  # a run
def test_a_checkpoint_callback_keeps_the_best_checkpoint_by_an_eval_metric(tmp_path, cache_dir):
    import torch

    from ppo_lightning.jobs.run import train

    _records(tmp_path / "train.jsonl", range(8))
    _records(tmp_path / "eval.jsonl", range(100, 104))
    best = tmp_path / "best"
    cfg = compose_cfg(
        [
            *RUN,
            f"data.path={tmp_path / 'train.jsonl'}",
            f"eval.path={tmp_path / 'eval.jsonl'}",
            "eval.every_n_iterations=2",
            "+callbacks.best_eval._target_=lightning.pytorch.callbacks.ModelCheckpoint",
            f"+callbacks.best_eval.dirpath={best}",
            "+callbacks.best_eval.monitor=eval/reward/mean@1",
            "+callbacks.best_eval.mode=max",
            "+callbacks.best_eval.every_n_train_steps=2",
            "+callbacks.best_eval.save_top_k=1",
        ],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    (ckpt,) = best.glob("*.ckpt")
    saved = torch.load(ckpt, weights_only=True)["callbacks"]
    (state,) = [v for k, v in saved.items() if "eval/reward/mean@1" in k]
    evals = [r["eval/reward/mean@1"] for r in read_metrics(tmp_path / "metrics.csv") if "eval/reward/mean@1" in r]
    assert float(state["best_model_score"]) == pytest.approx(max(evals[:-1]))  # the final eval follows the last save


@pytest.mark.slow  # a run with W&B
def test_eval_samples_go_to_wandb_as_a_table(tmp_path, cache_dir, monkeypatch):
    from ppo_lightning.jobs.run import train

    monkeypatch.setenv("WANDB_MODE", "offline")
    _records(tmp_path / "train.jsonl", range(8))
    _records(tmp_path / "eval.jsonl", range(100, 104))
    cfg = compose_cfg(
        [
            *RUN,
            f"data.path={tmp_path / 'train.jsonl'}",
            f"eval.path={tmp_path / 'eval.jsonl'}",
            "logger=wandb",
            "trainer.max_steps=1",
        ],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    (run,) = (tmp_path / "wandb").glob("offline-run-*")
    tables = sorted(run.glob("files/media/table/eval_samples_*.table.json"))
    assert len(tables) == 2  # before training, and after the last iteration
    table = json.loads(tables[0].read_text())
    assert table["columns"] == ["step", "prompt", "response", "reward"] and len(table["data"]) == 4
    assert "item 100: what is 100 + 1?" in table["data"][0][1]
