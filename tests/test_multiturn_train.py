"""The real ``train(cfg)`` with an environment: episodes of several turns learn, TRL's environments
and reward functions run unchanged, every iteration can be dumped, and the default job has no
environment at all."""

from __future__ import annotations

import json

import pytest

from ppo_lightning.envs import SingleTurn
from ppo_lightning.jobs.run import train
from tests.conftest import compose_cfg, read_metrics

ECHO = [
    "env=function",
    "env._target_=tests.multiturn.Echo",
    "+env.turns=2",
    "env.max_total_tokens=80",
    "reward=function",
    "reward.fn=tests.multiturn.assistant_lowercase",
    "sampling.max_new_tokens=12",
    "data.batch_size=8",
    "ppo.minibatch_size=8",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "export_dir=null",
]


def test_the_default_job_has_no_environment(tmp_path, cache_dir):
    from ppo_lightning.jobs.factory import build_module

    cfg = compose_cfg([], tmp_path, cache_dir, experiment=None)
    assert cfg.env == {}
    module, _ = build_module(compose_cfg([], tmp_path, cache_dir))
    assert isinstance(module.worker.runner, SingleTurn)  # the null environment


@pytest.mark.slow  # 20 iterations, about 100 s on 2 cores
def test_episodes_of_two_turns_raise_the_reward_of_every_turn(tmp_path, cache_dir):
    """A random tiny model in two-turn episodes (the environment answers the first turn with a
    user message), rewarded for lowercase text in both of its turns: the reward rises, every
    episode has two turns, the environment's tokens are part of each response, and the reward
    function's log_metric reaches the metrics."""
    cfg = compose_cfg([*ECHO, "trainer.max_steps=20", "optimizer.lr=3e-3", "ppo.kl_coef=0.01"], tmp_path, cache_dir)
    train(cfg)
    rows = read_metrics(tmp_path / "metrics.csv")
    assert len(rows) == 20
    assert all(r["env/turns_mean"] == 2.0 for r in rows)
    assert all(0 < r["env/env_token_frac"] < 1 for r in rows)
    assert all(r["rewards/assistant_lowercase/assistant_turns"] == 2.0 for r in rows)
    first, last = (sum(r["objective/raw_scores"] for r in part) / 4 for part in (rows[:4], rows[-4:]))
    assert last > first + 0.1, (first, last)
    assert all(r["env/env_errors"] == 0 and r["env/truncated_frac"] < 1 for r in rows)


def test_the_first_update_of_an_episode_rollout_has_ratio_exactly_one(tmp_path, cache_dir):
    cfg = compose_cfg(
        [*ECHO, "trainer.max_steps=1", "ppo.ppo_epochs=1", "ppo.fuse_rollout_forward=false"], tmp_path, cache_dir
    )
    train(cfg)
    (row,) = read_metrics(tmp_path / "metrics.csv")
    assert row["val/ratio"] == 1.0 and row["val/ratio_var"] == 0.0 and row["policy/approxkl_avg"] == 0.0
    # EnvStep.info reaches env/<key> as the mean over every step (Echo's n: 1, then 2)
    assert row["env/n"] == 1.5 and row["env/turns_mean"] == 2.0 and row["env/time_s"] > 0


@pytest.mark.parametrize("multi_turn", [False, True])
def test_rollout_dump_writes_every_iterations_episodes(tmp_path, cache_dir, multi_turn):
    extra = ECHO if multi_turn else ["data.batch_size=8", "ppo.minibatch_size=8", "callbacks=none", "export_dir=null"]
    cfg = compose_cfg(
        [*extra, "trainer.max_steps=2", "ppo.rollout_dump=true", "trainer.enable_progress_bar=false"],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    files = sorted((tmp_path / "rollouts").iterdir())
    assert [f.name for f in files] == ["iter_0.jsonl", "iter_1.jsonl"]
    rows = [json.loads(line) for line in files[0].read_text().splitlines()]
    assert len(rows) == 8
    for row in rows:
        assert {"columns", "prompt_ids", "response_ids", "loss_mask", "messages", "reward", "turns"} <= set(row)
        assert len(row["loss_mask"]) == len(row["response_ids"]) and row["loss_mask"][0] == 1
        assert row["messages"][-1]["role"] == "assistant"
        assert row["turns"] == (2 if multi_turn else 1)
        assert (0 in row["loss_mask"]) == multi_turn  # only the environment's tokens are 0
    assert not list((tmp_path / "rollouts").glob("*.tmp"))  # each file written whole


TRL_ENV_JOB = [
    "data=file",
    "data.max_prompt_length=360",  # the tool's JSON schema, in bytes
    "model.name_or_path=${paths.cache_dir}/tiny-gpt2-p768",
    "model.build_tiny.n_positions=768",
    "env=tools",
    "env.max_total_tokens=160",
    "reward.normalize=false",
    "generation._target_=tests.multiturn.ReachTargetBackend",
    "sampling.max_new_tokens=80",
    "data.batch_size=8",
    "ppo.minibatch_size=8",
    "trainer.max_steps=2",
    "trainer.enable_progress_bar=false",
    "callbacks=none",
    "export_dir=null",
]


def _count_records(tmp_path):
    data = tmp_path / "count.jsonl"
    data.write_text(
        "".join(
            json.dumps({"prompt": [{"role": "user", "content": "Count."}], "target": t}) + "\n" for t in range(1, 9)
        )
    )
    return data


def test_a_trl_environment_class_runs_a_whole_job_and_scores_its_episodes(tmp_path, cache_dir):
    """``env=tools env.environment=<a class written for TRL's environment_factory>``, unchanged,
    in a real run: ``reset(**columns)`` reads each record's ``target`` and appends to the prompt,
    the policy (a rule-playing backend) calls ``increment``, the environment's ``get_reward()`` is
    one more reward term named after the class, beside the configured reward."""
    overrides = [
        *TRL_ENV_JOB,
        f"data.path={_count_records(tmp_path)}",
        "env.environment=tests.multiturn.IncrementEnv",
        "reward=function",
        "reward.fn=tests.multiturn.counts_tool_calls",
    ]
    from tests.multiturn import ReachTargetBackend

    ReachTargetBackend.calls.clear()  # this run's contexts only
    train(compose_cfg(overrides, tmp_path, cache_dir))
    rows = read_metrics(tmp_path / "metrics.csv")
    for r in rows:
        assert r["rewards/IncrementEnv/mean"] == 1.0  # every counter reached its record's target
        assert r["rewards/counts_tool_calls/mean"] == 1.0 and r["objective/raw_scores"] == 2.0
        assert r["env/turns_mean"] == 2.0 and r["env/tool_calls_mean"] == 1.0 and r["env/tool_errors"] == 0
    assert any("Count. Reach 5." in c for c in ReachTargetBackend.calls)  # reset's text, appended


def test_reward_environment_scores_with_an_async_get_reward_alone(tmp_path, cache_dir):
    """As TRL allows, the environment's ``get_reward`` may be the only reward
    (``reward=environment``), and a coroutine (awaited, the batch's together)."""
    overrides = [
        *TRL_ENV_JOB,
        f"data.path={_count_records(tmp_path)}",
        "env.environment=tests.multiturn.AsyncIncrementEnv",
        "reward=environment",
    ]
    train(compose_cfg(overrides, tmp_path, cache_dir))
    for r in read_metrics(tmp_path / "metrics.csv"):
        assert r["rewards/AsyncIncrementEnv/mean"] == 1.0 and r["objective/raw_scores"] == 1.0


def _dump(tmp_path, cache_dir, name: str, seed: int) -> list[str]:
    out = tmp_path / name
    cfg = compose_cfg([*ECHO, "trainer.max_steps=2", "ppo.rollout_dump=true", f"seed={seed}"], out, cache_dir)
    train(cfg)
    return [(out / "rollouts" / f"iter_{k}.jsonl").read_text() for k in range(2)]


def test_the_same_seed_plays_the_same_episodes_and_another_seed_others(tmp_path, cache_dir):
    a, b, c = (
        _dump(tmp_path, cache_dir, "a", 42),
        _dump(tmp_path, cache_dir, "b", 42),
        _dump(tmp_path, cache_dir, "c", 7),
    )
    assert a == b
    assert [json.loads(x)["response_ids"] for x in a[0].splitlines()] != [
        json.loads(x)["response_ids"] for x in c[0].splitlines()
    ]


@pytest.mark.slow  # two processes
def test_ddp_ranks_play_their_own_episodes_with_tools_and_stay_identical(tmp_path, cache_dir):
    """``env=tools`` under ``trainer=ddp_cpu``, every kind of tool turn played (a parser that
    reads a call, a malformed call or a failing call into a random policy's turns): each rank
    plays its own prompts' episodes (the dumps differ), the event counters are the sum of both
    ranks' episodes, and the ranks' weights end identical."""
    from tests.test_ddp import ddp_run

    run = ddp_run(
        tmp_path,
        cache_dir,
        "tools",
        [
            "env=tools",
            "env.tools=[ppo_lightning.envs.calculator.calculator]",
            "env.parser=tests.multiturn.EveryTurnCalls",
            "data.max_prompt_length=360",
            "model.name_or_path=${paths.cache_dir}/tiny-gpt2-p768",
            "model.build_tiny.n_positions=768",
            "env.max_total_tokens=64",
            "ppo.rollout_dump=true",
        ],
    )
    rollouts = tmp_path / "run_tools" / "rollouts"
    r0, r1 = ([json.loads(x) for x in (rollouts / f"iter_0.rank{r}.jsonl").read_text().splitlines()] for r in (0, 1))
    prompts = lambda rows: [row["messages"][0]["content"] for row in rows]  # noqa: E731
    assert len(r0) == len(r1) == 8 and not set(prompts(r0)) & set(prompts(r1))
    # the parser's reading of every assistant turn (the last one's too, whose answer the budget may
    # have dropped from the conversation) is what the environment counted
    from tests.multiturn import EveryTurnCalls

    turns = [
        EveryTurnCalls().parse(m["content"]) for row in r0 + r1 for m in row["messages"] if m["role"] == "assistant"
    ]
    calls = [c for t in turns for c in t.calls]
    first = run["rows"][0]
    assert first["env/tool_errors"] == sum(c.arguments["expression"] == "1 / 0" for c in calls) > 0
    assert first["env/malformed_calls"] == sum(len(t.malformed) for t in turns) > 0
    assert first["env/tool_calls_mean"] == pytest.approx(len(calls) / 16) and first["env/turns_mean"] > 1
    assert first["env/time_s"] > 0


def test_evaluation_plays_episodes_and_the_samples_show_the_conversation(tmp_path, cache_dir):
    """With an environment, evaluation plays each held-out prompt as an episode (its turns and
    tool calls logged beside mean@n and pass@k), and the samples file holds whole conversations,
    each message under its role."""
    cfg = compose_cfg(
        [
            *ECHO,
            "trainer.max_steps=1",
            "eval.split_fraction=0.1",
            "eval.max_prompts=4",
            "eval.num_samples=2",
            "eval.temperature=1.0",
            "callbacks=default",
        ],
        tmp_path,
        cache_dir,
    )
    train(cfg)
    rows = read_metrics(tmp_path / "metrics.csv")
    evals = [r for r in rows if "eval/reward/mean@2" in r]
    assert len(evals) == 2  # before the first iteration, after the last
    for r in evals:
        assert r["eval/env/turns_mean"] == 2.0 and r["eval/env/tool_calls_mean"] == 0.0
        # an episode's outcome: its score (a fraction) plus its two turn rewards of 0.5
        assert 0 <= r["eval/pass@2"] <= 1 and 1 <= r["eval/reward/mean@2"] <= 2
    sample = json.loads((tmp_path / "samples.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("[user] ") and "[assistant] " in sample["response"]
    assert "\n[user] go on\n[assistant] " in sample["response"]
