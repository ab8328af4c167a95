"""Reward functions are called as TRL's GRPOTrainer calls them: by keyword, with what each asks
for. TRL's own reward functions run unchanged; ``log_metric`` reaches the metrics; a column never
replaces a configured kwarg or a call argument; the row a failure names is called with its own
arguments; in a multi-turn episode ``completions`` is the conversation after the prompt."""

from __future__ import annotations

import logging
import sys
import types

import pytest
import torch

from ppo_lightning.rewards import FunctionReward, RewardError, pop_reward_logs
from ppo_lightning.rewards.base import RewardInputs

trl_rewards = pytest.importorskip("trl.rewards", reason="trl is in the dev extra")


def _module(name: str, **attrs) -> str:
    """Register a module holding ``attrs`` (reward functions, as a user's file would) and return its name."""
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return name


CHAT = [[{"role": "user", "content": "What is 1 + 1?"}], [{"role": "user", "content": "What is 2 + 2?"}]]


def _inputs(responses, ids=None, columns=None, prompts=CHAT):
    return RewardInputs(
        prompt_texts=["p0", "p1"][: len(responses)],
        responses=responses,
        completion_ids=ids or [[1, 2, 3]] * len(responses),
        prompts=prompts,
        columns=columns or [{}] * len(responses),
    )


def test_trls_think_format_and_accuracy_rewards_run_unchanged():
    name = _module(
        "user_trl_rewards",
        think_format_reward=trl_rewards.think_format_reward,
        accuracy_reward=trl_rewards.accuracy_reward,
    )
    fmt = FunctionReward(f"{name}.think_format_reward")
    assert fmt.trl_style and fmt.required_columns == ()
    scores = fmt.score(_inputs(["<think>\nhm\n</think>\n2", "no think"]))
    assert scores.tolist() == [1.0, 0.0]
    acc = FunctionReward(f"{name}.accuracy_reward")
    assert acc.required_columns == ("solution",)
    scores = acc.score(
        _inputs(["The answer is $2$.", "It is $5$."], columns=[{"solution": "$2$"}, {"solution": "$4$"}])
    )
    assert scores.tolist() == [1.0, 0.0]


def test_trls_soft_overlong_punishment_takes_only_completion_ids():
    """TRL's factory returns a reward that takes only ``completion_ids`` (and ``**kwargs``): it is
    called with them by keyword, where a positional ``(prompts, responses)`` call raised."""
    punish = trl_rewards.get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    name = _module("user_overlong", overlong=punish)
    fn = FunctionReward(f"{name}.overlong")
    assert fn.trl_style
    scores = fn.score(_inputs(["a", "b"], ids=[[0] * 5, [0] * 9]))
    assert scores.tolist() == pytest.approx([0.0, -0.75])


def test_a_function_gets_only_what_it_names_unless_it_takes_kwargs():
    seen = {}

    def only_ids(completion_ids):
        seen["ids"] = completion_ids
        return [float(len(x)) for x in completion_ids]

    def prompts_and_column(prompts, answer):
        seen["both"] = (prompts, answer)
        return [1.0] * len(prompts)

    name = _module("user_narrow", only_ids=only_ids, prompts_and_column=prompts_and_column)
    assert FunctionReward(f"{name}.only_ids").score(_inputs(["x", "y"], ids=[[1], [1, 2]])).tolist() == [1.0, 2.0]
    fn = FunctionReward(f"{name}.prompts_and_column")
    assert fn.trl_style and fn.required_columns == ("answer",)
    fn.score(_inputs(["x", "y"], columns=[{"answer": "2"}, {"answer": "4"}]))
    assert seen["both"] == (CHAT, ["2", "4"])


def test_log_metric_reaches_rewards_term_name():
    def logs(completions, log_metric, **kwargs):
        log_metric("length", sum(len(c[0]["content"]) for c in completions) / len(completions))
        return [0.0] * len(completions)

    name = _module("user_logs", logs=logs)
    fn = FunctionReward(f"{name}.logs")
    fn.score(_inputs(["ab", "abcd"]))
    fn.score(_inputs(["a", "a"]))
    assert pop_reward_logs(fn) == {"rewards/logs/length": pytest.approx(2.0)}
    assert pop_reward_logs(fn) == {}  # popped


def test_a_colliding_column_never_replaces_a_kwarg_or_a_call_argument(caplog):
    got = {}

    def f(prompts, completions, completion_ids, target, **kwargs):
        got.update(prompts=prompts, completion_ids=completion_ids, target=target, kwargs=kwargs)
        return [0.0] * len(prompts)

    name = _module("user_collide", f=f)
    fn = FunctionReward(f"{name}.f", kwargs={"target": "configured"})
    columns = [{"target": "column", "prompts": "bad", "completion_ids": "bad", "answer": 1}] * 2
    with caplog.at_level(logging.WARNING):
        fn.score(_inputs(["x", "y"], columns=columns))
        fn.score(_inputs(["x", "y"], columns=columns))
    assert got["target"] == "configured" and got["prompts"] == CHAT and got["completion_ids"] == [[1, 2, 3]] * 2
    assert got["kwargs"]["answer"] == [1, 1] and "prompts" not in got["kwargs"]
    warned = [r.getMessage() for r in caplog.records if "column" in r.getMessage()]
    assert len(warned) == 3  # one per colliding column, once
    assert any("'target'" in w and "reward.kwargs" in w for w in warned)


def test_the_failing_row_is_called_with_its_own_arguments():
    """Only row 1's own chat prompt and ids make the function raise: the message names row 1."""

    def picky(prompts, completions, completion_ids, **kwargs):
        for p, ids in zip(prompts, completion_ids):
            if "2 + 2" in p[-1]["content"] and len(ids) == 2:
                raise ValueError("row 1 fails")
        return [0.0] * len(prompts)

    name = _module("user_picky", picky=picky)
    with pytest.raises(RewardError, match=r"raised ValueError: row 1 fails \(on prompt 1 'p1'"):
        FunctionReward(f"{name}.picky").score(_inputs(["x", "y"], ids=[[1], [1, 2]]))


def test_in_an_episode_completions_are_the_conversation_after_the_prompt():
    from tests.multiturn import counts_tool_calls

    conversation = [
        {"role": "assistant", "content": "<tool_call>...</tool_call>"},
        {"role": "tool", "name": "calculator", "content": "4"},
        {"role": "assistant", "content": "4"},
    ]
    inputs = _inputs(["x", "y"])
    inputs.completions = [conversation, conversation[-1:]]
    fn = FunctionReward("tests.multiturn.counts_tool_calls")
    assert fn.score(inputs).tolist() == [1.0, 0.0] and counts_tool_calls
    assert torch.is_tensor(fn.score(inputs))
