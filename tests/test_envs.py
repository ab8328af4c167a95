"""Multi-turn episodes (``ppo_lightning/envs``): tool calls parsed and answered, faults answered
instead of raised, the chat template's delta checked, and the sequence an episode trains on equal,
token for token, to the sampled turns and the environment's deltas."""

from __future__ import annotations

import json
import re

import pytest

from ppo_lightning.config import EnvConfig
from ppo_lightning.envs import ChatRenderer, EnvError, EnvStep, EpisodeRunner, ToolEnvironment, calculator
from ppo_lightning.envs.parsers import HermesParser, ToolCall
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.generation import SamplingParams
from tests.multiturn import Echo, IncrementEnv, Raises, ScriptedBackend, WrongTypes, build_bpe_tokenizer, tool_call

CALC = "ppo_lightning.envs.calculator.calculator"


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer()


# ----------------------------------------------------------------------------- parsing and tools
def test_hermes_calls_are_parsed_and_malformed_ones_described():
    p = HermesParser()
    text = (
        "First "
        + tool_call("f", '{"x": 1}')
        + " then\n<tool_call>\n"
        + '{"name": "g", "arguments": "{\\"y\\": 2}"}\n</tool_call>'
    )
    turn = p.parse(text)
    assert turn.calls == [ToolCall("f", {"x": 1}), ToolCall("g", {"y": 2})] and not turn.malformed
    assert p.parse("no call here").empty
    bad = p.parse("<tool_call>{not json}</tool_call><tool_call>[1]</tool_call>" + tool_call("h", "3") + "<tool_call>{")
    assert not bad.calls and len(bad.malformed) == 4
    assert "not valid JSON" in bad.malformed[0] and "not closed" in bad.malformed[3]


def test_the_calculator_computes_and_refuses_what_is_not_arithmetic():
    assert calculator("347 * 26 + 18") == "9040"
    assert calculator("(2 + 3) ** 2 - 7 // 2") == "22"
    assert calculator("7 / 2") == "3.5" and calculator("-4 + +1") == "-3" and calculator("8 / 2") == "4"
    for bad, why in [
        ("__import__('os').system('x')", "only numbers"),
        ("9 ** 9 ** 9", "exponent"),
        ("10 ** 99 * 10 ** 99", "digits"),
        ("1 / 0", "division by zero"),
        ("2 +", "cannot parse"),
        ("'a' * 3", "only numbers"),
        ("x + 1", "only numbers"),
    ]:
        with pytest.raises(ValueError, match=why):
            calculator(bad)


def test_a_tool_environment_answers_every_fault_with_an_error_and_counts_it():
    env = ToolEnvironment(tools=[CALC, "tests.multiturn.broken", "tests.multiturn.slow"], tool_timeout_s=0.2)
    from transformers.utils import get_json_schema

    assert env.tools[0] == get_json_schema(calculator)  # transformers' schema builder, not a second one
    msg = lambda text: [{"role": "assistant", "content": text}]  # noqa: E731
    ok = env.step(msg(tool_call("calculator", '{"expression": "12 * 12"}')))
    assert ok.messages == [{"role": "tool", "name": "calculator", "content": "144"}] and not ok.done
    assert ok.info["tool_calls"] == 1 and ok.info["tool_errors"] == 0
    cases = [
        (tool_call("nope", "{}"), "unknown tool 'nope'", "malformed_calls"),
        (tool_call("calculator", '{"expr": "1"}'), "does not take these arguments", "malformed_calls"),
        ("<tool_call>{oops</tool_call>", "not valid JSON", "malformed_calls"),
        (tool_call("broken", '{"x": 3}'), "broken raised RuntimeError: broken tool got 3", "tool_errors"),
        (tool_call("slow", '{"seconds": 5}'), "did not finish within 0.2 s", "tool_timeouts"),
        (
            tool_call("calculator", '{"expression": "1/0"}'),
            "calculator raised ValueError: division by zero",
            "tool_errors",
        ),
    ]
    for text, said, counter in cases:
        step = env.step(msg(text))
        assert len(step.messages) == 1 and step.messages[0]["content"].startswith("error: ")
        assert said in step.messages[0]["content"], step.messages[0]
        assert step.info[counter] == 1 and not step.done
    assert env.step(msg("The answer is 4.")).done  # no call: the episode ends


def test_bad_tools_are_refused_naming_the_key():
    with pytest.raises(ConfigError, match=r"env.tools\[0\]: cannot describe tool no_hints .*type hint"):
        ToolEnvironment(tools=["tests.multiturn.no_hints"])
    with pytest.raises(ConfigError, match=r"env.tools\[0\]='tests.multiturn.NOT_A_FUNCTION' is a int, not a callable"):
        ToolEnvironment(tools=["tests.multiturn.NOT_A_FUNCTION"])
    with pytest.raises(ConfigError, match=r"env.tools\[0\]='tests.nowhere.f': cannot import module"):
        ToolEnvironment(tools=["tests.nowhere.f"])
    with pytest.raises(ConfigError, match="env=tools has no tools"):
        ToolEnvironment()


def test_a_trl_environment_runs_unchanged():
    """``IncrementEnv`` follows TRL's documented ``environment_factory`` contract: ``reset`` gets the
    columns and appends text to the last user message, public methods are the tools (not
    ``reset``/``get_reward``), state lives in the instance."""
    from ppo_lightning.envs import Record

    env = ToolEnvironment(environment="tests.multiturn.IncrementEnv")
    assert [t["function"]["name"] for t in env.tools] == ["increment"]
    messages = env.reset(Record([{"role": "user", "content": "Count."}], {"target": 5}))
    assert messages == [{"role": "user", "content": "Count. Reach 5."}]
    step = env.step([*messages, {"role": "assistant", "content": tool_call("increment", '{"step": 5}')}])
    assert step.messages[0]["content"] == "5" and env.environment.get_reward() == 1.0
    assert isinstance(env.environment, IncrementEnv)


# ----------------------------------------------------------------------------- the template
QWEN3_LIKE = (  # drops the <think> block of every assistant turn before the last user message
    "{% set ns = namespace(last=0) %}{% for m in messages %}{% if m['role'] == 'user' %}"
    "{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' and loop.index0 < ns.last %}"
    "{{ m['content'].split('</think>')[-1] }}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
NO_TOOL_ROLE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tool role') }}{% endif %}"
    "<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_the_template_check_passes_a_prefix_preserving_template_and_refuses_the_rest(bpe):
    r = ChatRenderer(bpe)
    r.check_prefix_preserving("tiny-bpe")
    assert r.assistant_suffix == "\n"
    r.check_renders_tools("tiny-bpe", ToolEnvironment(tools=[CALC]).tools)
    with pytest.raises(
        ConfigError, match=r"^data.chat_template of tiny-bpe is not prefix-preserving.*data.chat_template"
    ):
        ChatRenderer(bpe, QWEN3_LIKE).check_prefix_preserving("tiny-bpe")
    with pytest.raises(
        ConfigError, match=r"cannot render a conversation with the roles user, assistant, tool and tools"
    ):
        ChatRenderer(bpe, NO_TOOL_ROLE).check_prefix_preserving("tiny-bpe")
    with pytest.raises(ConfigError, match=r"cannot render tools.*set data.chat_template"):
        ChatRenderer(bpe, NO_TOOL_ROLE).check_renders_tools("tiny-bpe", ToolEnvironment(tools=[CALC]).tools)


def test_the_template_check_probes_only_the_roles_the_run_uses(bpe):
    """A template with no tool role serves an environment without tools, and one that refuses
    system messages (Gemma's kind) a run without ``data.system_prompt``; each is refused, naming
    the roles, where the run would need them."""
    ChatRenderer(bpe, NO_TOOL_ROLE).check_prefix_preserving("tiny-bpe", tools=False)
    no_system = NO_TOOL_ROLE.replace("'tool'", "'system'").replace("no tool role", "no system role")
    ChatRenderer(bpe, no_system).check_prefix_preserving("tiny-bpe", tools=True)
    with pytest.raises(ConfigError, match=r"roles system, user, assistant, tool and tools .*no system role"):
        ChatRenderer(bpe, no_system).check_prefix_preserving("tiny-bpe", tools=True, system=True)


HIDES_EARLIER_SECRETS = (  # prefix-preserving, except for an assistant turn that says SECRET
    "{% for m in messages %}<|{{ m['role'] }}|>{% if m['role'] == 'assistant' and not loop.last %}"
    "{{ m['content'].replace('SECRET', '') }}{% else %}{{ m['content'] }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_an_answer_the_template_would_re_render_is_tokenised_after_the_probe_and_counted(bpe):
    """The probe passes, one episode's conversation does not (its turn says SECRET, which the
    template hides once another message follows): the answer's tokens are its rendering after
    the probe's first turn, and the episode counts the fallback (``env/template_fallbacks``)."""
    r = ChatRenderer(bpe, HIDES_EARLIER_SECRETS)
    r.check_prefix_preserving("tiny-bpe", tools=False)
    answer = [{"role": "user", "content": "go on"}]
    plain = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}]
    expected = r.encode(
        r.assistant_suffix + r.render(plain + answer, add_generation_prompt=True)[len(r.render(plain)) :]
    )
    assert r.observation_ids(plain, answer, None, ended_with="") == expected and r.fallbacks == 0
    secret = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "a SECRET"}]
    assert r.observation_ids(secret, answer, None, ended_with="") == expected and r.fallbacks == 1

    prompt = tuple(r.prompt_ids([{"role": "user", "content": "hi"}]))
    backend = ScriptedBackend({prompt: [_ids(bpe, "a SECRET"), _ids(bpe, "x")]}, bpe.pad_token_id)
    runner = EpisodeRunner(lambda: Echo(turns=2), r, EnvConfig(max_turns=4), bpe)
    played = runner.run(["hi"], [{}], backend, SamplingParams(max_new_tokens=8), None, "cpu")
    assert float(played.metrics()["env/template_fallbacks"]) == 1


# ----------------------------------------------------------------------------- token in, token out
def _runner(tok, make_env, **loop):
    renderer = ChatRenderer(tok)
    renderer.check_prefix_preserving("tiny-bpe")
    return EpisodeRunner(make_env, renderer, EnvConfig(**loop), tok)


def _ids(tok, *pieces: str) -> list[int]:
    """A model's own split of a text: each piece encoded alone (not how the whole would encode)."""
    return [t for p in pieces for t in tok.encode(p, add_special_tokens=False)]


def test_the_trained_ids_are_the_sampled_turns_and_the_environment_deltas(bpe):
    """A scripted backend says a tool call (its own split of the text), then an answer; the
    episode's response must be those ids, then the template's delta for the tool's message
    tokenised once, then the answer's ids, token for token. Re-rendering and re-encoding the
    whole conversation gives other ids (BPE merges across the turn boundary), so a loop that
    re-encodes would train on tokens nobody sampled."""
    tok = bpe
    runner = _runner(tok, lambda: ToolEnvironment(tools=[CALC]), max_turns=4, max_total_tokens=400)
    env = runner.make_env()
    messages = [{"role": "user", "content": "What is 347 * 26?"}]
    prompt_ids = tok.encode(
        tok.apply_chat_template(messages, tools=env.tools, tokenize=False, add_generation_prompt=True)
    )
    call = "Let me compute. " + tool_call("calculator", '{"expression": "347 * 26"}')
    turn1 = _ids(tok, "Let me", " compute. ", call[len("Let me compute. ") :])
    turn2 = _ids(tok, "The answer is ", "9022.") + [tok.eos_token_id]
    backend = ScriptedBackend({tuple(prompt_ids): [turn1, turn2]}, tok.pad_token_id)
    params = SamplingParams(max_new_tokens=64)
    played = runner.run(["What is 347 * 26?"], [{}], backend, params, None, "cpu")
    e = played.episodes[0]

    # the environment's delta, computed here as text: render(conv + tool) minus render(conv)
    conv = [*messages, {"role": "assistant", "content": call}]
    tool_msg = [{"role": "tool", "name": "calculator", "content": "9022"}]
    before = tok.apply_chat_template(conv, tools=env.tools, tokenize=False)
    after = tok.apply_chat_template(conv + tool_msg, tools=env.tools, tokenize=False, add_generation_prompt=True)
    assert after.startswith(before)
    # preceded by the assistant suffix "\n" that the template writes and the policy did not sample
    delta = tok.encode("\n" + after[len(before) :])
    assert e.prompt_ids == prompt_ids
    assert e.response_ids == turn1 + delta + turn2
    assert e.loss_mask == [1] * len(turn1) + [0] * len(delta) + [1] * len(turn2)
    assert e.turn_ends == [len(turn1) - 1, len(turn1) + len(delta) + len(turn2) - 1]
    assert e.messages[1:] == [
        {"role": "assistant", "content": call},
        tool_msg[0],
        {"role": "assistant", "content": "The answer is 9022."},
    ]
    # what a decode-and-re-encode loop would train on differs from the sampled ids
    reencoded = tok.encode(tok.apply_chat_template(e.messages, tools=env.tools, tokenize=False))
    assert reencoded != prompt_ids + e.response_ids
    # the second turn's context was the first turn's ids and the delta, not a re-rendering
    assert backend.calls[1][0] == prompt_ids + turn1 + delta
    # the batch tensors: left-padded prompt, response, masks
    assert played.query_responses[0, played.context_length :].tolist()[: len(e.response_ids)] == e.response_ids
    assert played.loss_mask[0].tolist()[: len(e.loss_mask)] == e.loss_mask
    assert bool(played.stopped[0])
    # a backend without logprobs of its own (hf, this one) gives the episodes none: no zeros that
    # ppo.engine_correction would read as an engine's logprobs (weights of pi_old, not 1)
    assert e.engine_logprobs == [] and played.engine_logprobs is None


def naive_loss_mask(tok, runner_env, prompt_messages, turns):
    """The loss mask of a conversation walked message by message: 1 for each token of a policy
    turn as given, 0 for each token of the text the template adds between turns."""
    mask, conv = [], list(prompt_messages)
    for i, (ids, answer) in enumerate(turns):
        mask += [1] * len(ids)
        content = tok.decode(ids[:-1] if ids[-1] == tok.eos_token_id else ids)
        conv.append({"role": "assistant", "content": content})
        if answer is None:
            break
        before = tok.apply_chat_template(conv, tools=runner_env.tools, tokenize=False)
        after = tok.apply_chat_template(
            conv + answer, tools=runner_env.tools, tokenize=False, add_generation_prompt=True
        )
        mask += [0] * len(tok.encode("\n" + after[len(before) :]))  # the "\n" the policy did not write
        conv += answer
    return mask


def test_the_loss_mask_is_a_naive_loops_over_a_batch_of_episodes(bpe):
    """Three episodes of different shapes in one batch (one turn; a call then an answer; two
    calls then an answer), stepping together: each loss mask equals a naive walk over its turns."""
    tok = bpe
    runner = _runner(
        tok, lambda: ToolEnvironment(tools=[CALC, "tests.multiturn.lookup"]), max_turns=5, max_total_tokens=600
    )
    env = runner.make_env()
    questions = ["What is 2 + 2?", "What is 3 * 3?", "What is a cat times 2?"]
    prompts = {
        q: tok.encode(
            tok.apply_chat_template(
                [{"role": "user", "content": q}], tools=env.tools, tokenize=False, add_generation_prompt=True
            )
        )
        for q in questions
    }
    c1 = tool_call("calculator", '{"expression": "3 * 3"}')
    c2, c3 = tool_call("lookup", '{"key": "cat"}'), tool_call("calculator", '{"expression": "1 + 1"}')
    end = [tok.eos_token_id]
    script = {
        tuple(prompts[questions[0]]): [_ids(tok, "4.") + end],
        tuple(prompts[questions[1]]): [_ids(tok, c1), _ids(tok, "9") + end],
        tuple(prompts[questions[2]]): [_ids(tok, "hm ", c2), _ids(tok, c3), _ids(tok, "2 cats") + end],
    }
    played = runner.run(
        questions,
        [{}, {}, {}],
        ScriptedBackend(script, tok.pad_token_id),
        SamplingParams(max_new_tokens=80),
        None,
        "cpu",
    )
    answers = {
        questions[0]: [None],
        questions[1]: [[{"role": "tool", "name": "calculator", "content": "9"}], None],
        questions[2]: [
            [{"role": "tool", "name": "lookup", "content": "a small animal"}],
            [{"role": "tool", "name": "calculator", "content": "2"}],
            None,
        ],
    }
    for e, q in zip(played.episodes, questions):
        turns = list(zip(script[tuple(prompts[q])], answers[q]))
        assert e.loss_mask == naive_loss_mask(tok, env, [{"role": "user", "content": q}], turns), q
        assert e.turns == len(turns) and not e.truncated
    assert [e.counts["tool_calls"] for e in played.episodes] == [0, 1, 2]
    m = played.metrics()
    assert float(m["env/turns_mean"]) == pytest.approx(2.0) and float(m["env/tool_calls_mean"]) == pytest.approx(1.0)
    assert 0 < float(m["env/env_token_frac"]) < 1


def test_budgets_end_episodes_and_never_on_environment_tokens(bpe):
    """``max_turns``: the environment's last answer is dropped; ``max_total_tokens``: an answer
    that leaves the policy no room ends the episode; ``max_observation_tokens`` cuts a message."""
    tok = bpe
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    )
    turn = _ids(tok, "more?") + [tok.eos_token_id]
    script = {tuple(prompt): [turn] * 10}

    def run(**loop):
        runner = _runner(tok, lambda: Echo(turns=10, reply="go on " * 20), **loop)
        return runner.run(
            ["hi"], [{}], ScriptedBackend(script, tok.pad_token_id), SamplingParams(max_new_tokens=16), None, "cpu"
        )

    e = run(max_turns=2, max_total_tokens=500, max_observation_tokens=None).episodes[0]
    assert e.turns == 2 and e.truncated and e.loss_mask[-1] == 1 and e.response_ids[-len(turn) :] == turn
    e = run(max_turns=9, max_total_tokens=60, max_observation_tokens=None).episodes[0]
    assert e.truncated and len(e.response_ids) <= 60 and e.loss_mask[-1] == 1
    played = run(max_turns=3, max_total_tokens=500, max_observation_tokens=4)
    e = played.episodes[0]
    assert e.counts["truncated_observations"] == 2 and float(played.metrics()["env/truncated_observations"]) == 2
    assert all(len(tok.encode(m["content"])) <= 4 for m in e.messages if m["role"] == "user" and m["content"] != "hi")
    assert e.turn_rewards == [0.5, 0.5, 0.5] and e.info["n"] == [1, 2, 3]


def test_an_environment_that_raises_ends_its_episode_unless_asked_to_raise(bpe):
    tok = bpe
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    )
    script = {tuple(prompt): [_ids(tok, "x") + [tok.eos_token_id]]}
    backend = ScriptedBackend(script, tok.pad_token_id)
    played = _runner(tok, Raises).run(["hi"], [{}], backend, SamplingParams(max_new_tokens=8), None, "cpu")
    e = played.episodes[0]
    assert (
        e.env_error == "ValueError: the game server is down"
        and e.done
        and float(played.metrics()["env/env_errors"]) == 1
    )
    with pytest.raises(
        EnvError, match=r"Raises.step raised ValueError: the game server is down \(env.on_error=raise\)"
    ):
        _runner(tok, Raises, on_error="raise").run(
            ["hi"], [{}], ScriptedBackend(script, tok.pad_token_id), SamplingParams(max_new_tokens=8), None, "cpu"
        )
    with pytest.raises(EnvError, match=r"^WrongTypes.step: EnvStep.reward is 'high', not a float or None"):
        _runner(tok, WrongTypes).run(
            ["hi"], [{}], ScriptedBackend(script, tok.pad_token_id), SamplingParams(max_new_tokens=8), None, "cpu"
        )


def test_an_episode_whose_environment_raised_scores_error_reward_and_keeps_its_earned_turn_rewards(bpe):
    """``env.error_reward`` replaces what the reward terms would have said of a broken episode
    (its terms NaN: they were not asked); the turn rewards it earned before the fault stay on
    their turns. The other episodes of the batch are scored as usual."""
    from ppo_lightning.rewards.function import FunctionReward
    from ppo_lightning.rewards.dispatch import score_episodes
    from tests.multiturn import DownOnSecondTurn

    tok = bpe
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    )
    backend = ScriptedBackend({tuple(prompt): [_ids(tok, "x") + [tok.eos_token_id]]}, tok.pad_token_id)
    played = _runner(tok, DownOnSecondTurn).run(
        ["hi", "hi"], [{"down": True}, {"down": False}], backend, SamplingParams(max_new_tokens=8), None, "cpu"
    )
    broken, fine = played.episodes
    assert broken.env_error == "ConnectionError: the game server is down" and fine.env_error is None
    assert broken.turn_rewards == [0.5, None] and fine.turn_rewards == [0.5, None]
    reward = FunctionReward("tests.helpers.constant_reward")
    total, applies, _ = score_episodes(reward, tok, played, error_reward=-2.0)
    assert total.tolist() == [-2.0, 1.0] and applies.all()
    assert played.turn_rewards.sum(1).tolist() == [0.5, 0.5]  # earned before the fault: kept
    assert float(played.metrics()["env/env_errors"]) == 1


def test_env_step_types_are_checked_field_by_field():
    from ppo_lightning.envs.base import check_step

    env = Echo()
    assert check_step(EnvStep([{"role": "tool", "content": "1"}], 1.0, True, {"a": 2}), env)
    for bad, field in [
        ("nope", "returned str, not an EnvStep"),
        (EnvStep({"role": "user"}), "EnvStep.messages is a dict"),
        (EnvStep([{"role": "assistant", "content": "x"}]), "has role 'assistant'"),
        (EnvStep([{"role": "user", "content": 3}]), "a message is a dict with string"),
        (EnvStep(done="yes"), "EnvStep.done is 'yes'"),
        (EnvStep(info={"a": "b"}), "EnvStep.info['a'] is 'b'"),
    ]:
        with pytest.raises(EnvError, match=r"^Echo\.step.*" + re.escape(field)):
            check_step(bad, env)


def test_dump_rows_are_json(bpe):
    tok = bpe
    prompt = tok.encode(
        tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    )
    played = _runner(tok, lambda: Echo(turns=2)).run(
        ["hi"],
        [{"k": 1}],
        ScriptedBackend({tuple(prompt): [_ids(tok, "ok") + [0]] * 2}, 1),
        SamplingParams(max_new_tokens=8),
        None,
        "cpu",
    )
    row = json.loads(json.dumps(played.episodes[0].dump()))
    assert row["turns"] == 2 and len(row["loss_mask"]) == len(row["response_ids"]) and set(row["loss_mask"]) == {0, 1}
    e = played.episodes[0]
    # two turns of 0.5, each on its last token: the last 1 of each run of the loss mask
    ends = [t for t, m in enumerate(e.loss_mask) if m and (t + 1 == len(e.loss_mask) or not e.loss_mask[t + 1])]
    assert e.turn_ends == ends and played.turn_rewards[0].nonzero().flatten().tolist() == ends
    assert played.turn_rewards[0, ends].tolist() == [0.5, 0.5]
