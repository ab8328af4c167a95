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
from ppo_lightning.rewards.base import RewardBatch

trl_rewards = pytest.importorskip("trl.rewards", reason="trl is in the dev extra")


def _module(name: str, **attrs) -> str:
    """Register a module holding ``attrs`` (reward functions, as a user's file would) and return its name."""
    mod = types.ModuleType(name)
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return name


CHAT = [[{"role": "user", "content": "What is 1 + 1?"}], [{"role": "user", "content": "What is 2 + 2?"}]]


def _inputs(responses, ids=None, columns=None, prompts=CHAT):
    return RewardBatch.of_texts(
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
    scores = fmt.score(_inputs(["<think>\nhm\n</think>\n2", "no think"])).total
    assert scores.tolist() == [1.0, 0.0]
    acc = FunctionReward(f"{name}.accuracy_reward")
    assert acc.required_columns == ("solution",)
    scores = acc.score(
        _inputs(["The answer is $2$.", "It is $5$."], columns=[{"solution": "$2$"}, {"solution": "$4$"}])
    ).total
    assert scores.tolist() == [1.0, 0.0]


def test_trls_soft_overlong_punishment_takes_only_completion_ids():
    """TRL's factory returns a reward that takes only ``completion_ids`` (and ``**kwargs``): it is
    called with them by keyword, where a positional ``(prompts, responses)`` call raised."""
    punish = trl_rewards.get_soft_overlong_punishment(max_completion_len=10, soft_punish_cache=4)
    name = _module("user_overlong", overlong=punish)
    fn = FunctionReward(f"{name}.overlong")
    assert fn.trl_style
    scores = fn.score(_inputs(["a", "b"], ids=[[0] * 5, [0] * 9])).total
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
    assert FunctionReward(f"{name}.only_ids").score(_inputs(["x", "y"], ids=[[1], [1, 2]])).total.tolist() == [1.0, 2.0]
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
    """Two episodes played through the episode loop (a tool call, its result and an answer; an
    answer alone) and scored as the rollout scores them (``score_episodes``): ``prompts`` are the
    prompt messages, ``completions`` every message after them as played, ``completion_ids`` every
    response token (the environment's too); ``counts_tool_calls`` scores 1 and 0."""
    from ppo_lightning.rewards.dispatch import score_episodes
    from ppo_lightning.config import EnvConfig
    from ppo_lightning.envs import ChatRenderer, EpisodeRunner, ToolEnvironment
    from ppo_lightning.generation import SamplingParams
    from tests.multiturn import ScriptedBackend, build_bpe_tokenizer, tool_call

    seen = {}

    def recorded(prompts, completions, completion_ids, **kwargs):
        seen.update(prompts=prompts, completions=completions, completion_ids=completion_ids)
        return [float(sum(m["role"] == "tool" for m in c)) for c in completions]

    tok = build_bpe_tokenizer()
    renderer = ChatRenderer(tok)
    renderer.check_prefix_preserving("tiny-bpe")
    runner = EpisodeRunner(
        lambda: ToolEnvironment(tools=["ppo_lightning.envs.calculator.calculator"]),
        renderer,
        EnvConfig(max_turns=4, max_total_tokens=400),
        tok,
    )
    questions = ["What is 2 + 2?", "What is 3 + 3?"]
    call = tool_call("calculator", '{"expression": "2 + 2"}')
    encode = lambda text: tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]  # noqa: E731
    script = {
        tuple(renderer.prompt_ids([{"role": "user", "content": questions[0]}], runner.probe_tools())): [
            tok.encode(call, add_special_tokens=False),
            encode("It is 4."),
        ],
        tuple(renderer.prompt_ids([{"role": "user", "content": questions[1]}], runner.probe_tools())): [
            encode("It is 6.")
        ],
    }
    played = runner.run(
        questions, [{}, {}], ScriptedBackend(script, tok.pad_token_id), SamplingParams(max_new_tokens=64), None, "cpu"
    )
    total, _, _ = score_episodes(FunctionReward(f"{_module('user_recorded', recorded=recorded)}.recorded"), tok, played)
    assert seen["prompts"] == [[{"role": "user", "content": q}] for q in questions]
    assert seen["completions"] == [
        [
            {"role": "assistant", "content": call},
            {"role": "tool", "name": "calculator", "content": "4"},
            {"role": "assistant", "content": "It is 4."},
        ],
        [{"role": "assistant", "content": "It is 6."}],
    ]
    assert seen["completion_ids"] == [e.response_ids for e in played.episodes]
    assert 0 in played.episodes[0].loss_mask  # the tool's tokens are among them
    total, _, _ = score_episodes(FunctionReward("tests.multiturn.counts_tool_calls"), tok, played)
    assert total.tolist() == [1.0, 0.0]


def test_completion_ids_are_each_rows_sampled_tokens_without_the_padding():
    """Through the rollout's own sampling and scoring (``RolloutWorker.play``, ``score``): prompts
    left-padded to one width and responses of 6, 2 and 4 tokens right-padded to 6 reach a
    function that asks for ``completion_ids`` as each row's sampled tokens, no pad among them."""
    from ppo_lightning.rollouts import Prompts, RolloutWorker
    from tests.helpers import constant_reward
    from ppo_lightning.generation import SamplingParams
    from tests.multiturn import ScriptedBackend, build_bpe_tokenizer

    seen = []

    def ids_length(completion_ids, **kwargs):
        seen.extend(completion_ids)
        return [float(len(ids)) for ids in completion_ids]

    tok = build_bpe_tokenizer()
    texts = ["What is 1 + 1?", "hi", "What is 347 * 26?"]
    rows = [tok.encode(t, add_special_tokens=False) for t in texts]
    chars = lambda text: [tok.encode(c, add_special_tokens=False)[0] for c in text]  # noqa: E731
    sampled = [chars("It is") + [tok.eos_token_id], chars("4") + [tok.eos_token_id], chars("9022")]
    assert [len(x) for x in sampled] == [6, 2, 4]
    width = max(len(r) for r in rows)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    prompts = Prompts(ids, mask, texts, [{}, {}, {}])
    backend = ScriptedBackend({tuple(r): [s] for r, s in zip(rows, sampled)}, tok.pad_token_id)
    worker = RolloutWorker(backend, SamplingParams(max_new_tokens=8), constant_reward, tok)
    s = worker.play(prompts)
    assert s.responses.shape[1] == 6  # right-padded to the longest
    total, applies, _ = worker.score(s, FunctionReward(f"{_module('user_ids', ids_length=ids_length)}.ids_length"))
    assert seen == sampled
    assert total.tolist() == [6.0, 2.0, 4.0] and applies.all()
