"""Where episodes meet the sampler, the scorer and the loss, token by token: the budget's exact
edge, each turn reward on its turn's last policy token, an engine's logprobs on the tokens it
sampled, the environment's stop strings told to the sampler and read back as a stop, an answer
after an end-of-turn EOS that does not repeat it, and turn rewards scaled with the score. Each
test compares the episode with a naive walk over it, so that a small slip (one token late, one
stop forgotten) fails it; sums and counts alone let such slips through."""

from __future__ import annotations

import pytest
import torch

from ppo_lightning.config import EnvConfig
from ppo_lightning.envs import ChatRenderer, EpisodeRunner, ToolEnvironment
from ppo_lightning.generation import SamplingParams
from tests.multiturn import (
    CountedTurns,
    Echo,
    EngineScriptedBackend,
    ScriptedBackend,
    StoppingScriptedBackend,
    build_bpe_tokenizer,
    build_chatml_tokenizer,
    tool_call,
)

CALC = "ppo_lightning.envs.calculator.calculator"


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer()


def _ids(tok, *pieces: str) -> list[int]:
    """A model's own split of a text: each piece encoded alone (a token boundary between pieces)."""
    return [t for p in pieces for t in tok.encode(p, add_special_tokens=False)]


def _renderer(tok, tools: bool = False) -> ChatRenderer:
    renderer = ChatRenderer(tok)
    renderer.check_prefix_preserving("test-tokenizer", tools=tools)
    return renderer


def _play(
    tok, renderer, make_env, script, backend_cls=ScriptedBackend, questions=("hi",), params=None, columns=None, **loop
):
    """Play ``questions`` (one episode each, with ``columns``) as ``script`` says: the turns of each
    question's episode, through a backend of ``backend_cls``."""
    env = make_env()
    tools = list(getattr(env, "tools", None) or []) or None
    prompts = {q: tuple(renderer.prompt_ids([{"role": "user", "content": q}], tools)) for q in questions}
    by_prompt = {prompts[q]: turns for q, turns in script.items()}
    backend = (
        backend_cls(by_prompt, tok)
        if backend_cls is StoppingScriptedBackend
        else backend_cls(by_prompt, tok.pad_token_id)
    )
    runner = EpisodeRunner(make_env, renderer, EnvConfig(**{"max_observation_tokens": None, **loop}), tok)
    params = params or SamplingParams(max_new_tokens=32)
    columns = columns or [{} for _ in questions]
    return runner.run(list(questions), columns, backend, params, None, "cpu"), backend, prompts


def _turn_runs(loss_mask: list[int]) -> list[int]:
    """The last position of each maximal run of 1s: each policy turn's last token, walked naively."""
    return [t for t, m in enumerate(loss_mask) if m and (t + 1 == len(loss_mask) or not loss_mask[t + 1])]


# ----------------------------------------------------------------------------- the token budget
def test_the_token_budget_at_its_exact_edge_never_ends_an_episode_on_environment_tokens(bpe):
    """After a first turn of ``n`` tokens, an answer of ``k`` tokens fits a budget of ``n + k + 1``
    (the policy may say one token more, and says it) and is dropped at ``n + k``, the exact tie:
    the episode then ends on the policy's own last token, never on the environment's tokens
    with an empty turn after them."""
    tok = bpe
    renderer = _renderer(tok)
    turn = _ids(tok, "more?") + [tok.eos_token_id]
    # the answer's tokens, as the template renders them after the turn (after the "\n" that ends
    # an assistant message, which the policy did not sample)
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "more?"}]
    before = tok.apply_chat_template(conversation, tokenize=False)
    after = tok.apply_chat_template(
        conversation + [{"role": "user", "content": "go on"}], tokenize=False, add_generation_prompt=True
    )
    answer = tok.encode("\n" + after[len(before) :], add_special_tokens=False)
    n, k = len(turn), len(answer)

    def play(budget):
        played, _, _ = _play(
            tok, renderer, lambda: Echo(turns=9), {"hi": [turn] * 9}, max_turns=9, max_total_tokens=budget
        )
        return played.episodes[0]

    tie = play(n + k)
    assert tie.response_ids == turn and tie.loss_mask == [1] * n, tie.loss_mask
    assert tie.turns == 1 and tie.truncated and tie.messages[-1]["role"] == "assistant"
    fits = play(n + k + 1)
    assert fits.response_ids == turn + answer + turn[:1]
    assert fits.loss_mask == [1] * n + [0] * k + [1] and fits.turns == 2 and fits.truncated


# ----------------------------------------------------------------------------- turn rewards
def test_each_turn_reward_sits_on_its_turns_last_policy_token(bpe):
    """Three episodes of one, two and three turns of different lengths in one batch; turn ``j``
    earns ``j`` (``CountedTurns``), so a reward on the wrong turn shows too. ``turn_rewards [B, R]``
    equals a naive walk over each loss mask: turn ``j``'s reward on the last token of the
    ``j``-th run of policy tokens, 0 everywhere else (the environment's tokens, the padding)."""
    tok = bpe
    renderer = _renderer(tok)
    eos = [tok.eos_token_id]
    script = {
        "one": [_ids(tok, "4.") + eos],
        "two": [_ids(tok, "let me see") + eos, _ids(tok, "9") + eos],
        "three": [_ids(tok, "a") + eos, _ids(tok, "so the sum is") + eos, _ids(tok, "12") + eos],
    }
    played, _, _ = _play(
        tok,
        renderer,
        CountedTurns,
        script,
        questions=tuple(script),
        columns=[{"turns": len(turns)} for turns in script.values()],
        max_turns=5,
        max_total_tokens=400,
    )
    R = played.turn_rewards.shape[1]
    for i, (q, e) in enumerate(zip(script, played.episodes)):
        ends = _turn_runs(e.loss_mask)
        assert len(ends) == len(script[q]) == e.turns, q
        want = torch.zeros(R)
        for j, t in enumerate(ends):
            want[t] = float(j + 1)
        assert played.turn_rewards[i].tolist() == want.tolist(), (q, played.turn_rewards[i].nonzero().flatten(), ends)


# ----------------------------------------------------------------------------- an engine's logprobs
def test_an_engines_logprobs_sit_on_the_tokens_it_sampled_and_zero_under_the_environments(bpe):
    """An engine backend reports a logprob of its own per sampled token (each one distinct); over
    a batch of episodes of different lengths, stepping together (rows padded in every call), each
    episode's ``engine_logprobs`` holds, position by position, the engine's value for the token
    sampled there and 0 under the environment's tokens and the padding: a naive walk over the
    loss mask, taking the engine's values in the order it gave them. The episodes end after one,
    two and three turns, so later calls sample fewer rows."""
    tok = bpe
    renderer = _renderer(tok)
    eos = [tok.eos_token_id]
    script = {
        "one": [_ids(tok, "4.") + eos],
        "two": [_ids(tok, "let me see") + eos, _ids(tok, "9") + eos],
        "three": [_ids(tok, "a") + eos, _ids(tok, "so the sum is") + eos, _ids(tok, "12") + eos],
    }
    played, backend, prompts = _play(
        tok,
        renderer,
        CountedTurns,
        script,
        backend_cls=EngineScriptedBackend,
        questions=tuple(script),
        columns=[{"turns": len(turns)} for turns in script.values()],
        max_turns=5,
        max_total_tokens=400,
    )
    assert played.engine_logprobs is not None
    R = played.engine_logprobs.shape[1]
    for i, (q, e) in enumerate(zip(script, played.episodes)):
        given = iter(backend.given[prompts[q]])
        want = [next(given) if m else 0.0 for m in e.loss_mask] + [0.0] * (R - len(e.loss_mask))
        assert played.engine_logprobs[i].tolist() == pytest.approx(want), q
        assert next(given, None) is None, q  # every value the engine gave this episode was placed
        assert len(e.engine_logprobs) == len(e.response_ids), q


def test_the_worker_tags_each_policy_token_with_the_version_that_sampled_it(bpe):
    """``RolloutWorker.play(..., policy_version=v)``: every token the policy sampled carries ``v``
    (``Episodes.token_versions``), the environment's tokens between its turns and the padding
    ``-1``; episodes of one, two and three turns."""
    from ppo_lightning.rollouts import Prompts, RolloutWorker
    from ppo_lightning.rewards.function import FunctionReward

    tok = bpe
    renderer = _renderer(tok)
    eos = [tok.eos_token_id]
    script = {
        "one": [_ids(tok, "4.") + eos],
        "two": [_ids(tok, "let me see") + eos, _ids(tok, "9") + eos],
        "three": [_ids(tok, "a") + eos, _ids(tok, "so the sum is") + eos, _ids(tok, "12") + eos],
    }
    prompts = {q: tuple(renderer.prompt_ids([{"role": "user", "content": q}])) for q in script}
    runner = EpisodeRunner(CountedTurns, renderer, EnvConfig(max_turns=5, max_total_tokens=400), tok)
    worker = RolloutWorker(
        ScriptedBackend({prompts[q]: turns for q, turns in script.items()}, tok.pad_token_id),
        SamplingParams(max_new_tokens=32),
        FunctionReward("tests.helpers.constant_reward"),
        tok,
        runner,
    )
    ids = torch.zeros(3, 1, dtype=torch.long)  # the episodes render their own prompts from the texts
    columns = [{"turns": len(turns)} for turns in script.values()]
    ep = worker.play(Prompts(ids, torch.ones_like(ids), list(script), columns), policy_version=7)
    policy = ep.response_mask > 0
    environment = (ep.attention_mask[:, ep.context_length :] > 0) & ~policy
    assert environment.any(), "the episodes must hold environment tokens"
    assert bool((ep.token_versions[policy] == 7).all()) and bool((ep.token_versions[~policy] == -1).all())
    assert ep.token_versions.shape == ep.response_mask.shape


# ----------------------------------------------------------------------------- stops
def test_the_environments_stop_strings_reach_the_sampler(bpe):
    """A tool environment's parser stops a turn at ``</tool_call>`` (``env.stop_at_tool_call``):
    the sampler must be told, so that a policy that would ramble on past its call (here, writing
    the tool's answer itself) is cut right after it, and the environment answers that call. A
    backend that stops only where its params say shows whether the stop reached it."""
    tok = bpe
    renderer = _renderer(tok, tools=True)
    call = "Let me compute. " + tool_call("calculator", '{"expression": "347 * 26"}')
    ramble = "\n<|tool|>9022\n<|assistant|>The answer is 9022."
    turn1 = _ids(tok, call, ramble) + [tok.eos_token_id]
    turn2 = _ids(tok, "The answer is 9022.") + [tok.eos_token_id]
    played, backend, _ = _play(
        tok,
        renderer,
        lambda: ToolEnvironment(tools=[CALC]),
        {"What is 347 * 26?": [turn1, turn2]},
        backend_cls=StoppingScriptedBackend,
        questions=("What is 347 * 26?",),
        max_turns=4,
        max_total_tokens=400,
    )
    e = played.episodes[0]
    first = _ids(tok, call)
    assert e.response_ids[: e.turn_ends[0] + 1] == first, tok.decode(e.response_ids[: e.turn_ends[0] + 1])
    assert [m["content"] for m in e.messages[1:3]] == [call, "9022"] and e.counts["tool_calls"] == 1
    assert e.response_ids[-len(turn2) :] == turn2 and e.turns == 2


def test_a_turn_that_ends_on_a_stop_string_counts_as_stopped(bpe):
    """``stopped`` (what ``missing_eos_penalty`` and ``mask_truncated_completions`` read) is true
    for an episode whose last turn ended on any stop: EOS, a ``sampling.stop_strings`` string,
    and the tool parser's ``</tool_call>`` (the episode cut by ``max_turns`` right after its
    call); false for a turn cut at ``max_new_tokens``."""
    tok = bpe
    eos = [tok.eos_token_id]
    script = {
        "eos": [_ids(tok, "It is 4.") + eos],
        "string": [_ids(tok, "<answer>4</answer>", " and then more")],
        "cut": [_ids(tok, *"qwertyuiopzxcv")],  # 14 tokens, cut at 8
    }
    params = SamplingParams(max_new_tokens=8, stop_strings=("</answer>",))
    played, _, _ = _play(
        tok,
        _renderer(tok),
        lambda: Echo(turns=1),
        script,
        backend_cls=StoppingScriptedBackend,
        questions=tuple(script),
        params=params,
        max_turns=2,
        max_total_tokens=400,
    )
    assert [e.turns for e in played.episodes] == [1, 1, 1]
    assert tok.decode(played.episodes[1].response_ids).endswith("</answer>")
    assert len(played.episodes[2].response_ids) == 8 and played.episodes[2].response_ids[-1] != tok.eos_token_id
    assert played.stopped.tolist() == [True, True, False]

    call = tool_call("calculator", '{"expression": "2 + 2"}')
    played, _, _ = _play(
        tok,
        _renderer(tok, tools=True),
        lambda: ToolEnvironment(tools=[CALC]),
        {"What is 2 + 2?": [_ids(tok, call, " and then more")]},
        backend_cls=StoppingScriptedBackend,
        questions=("What is 2 + 2?",),
        max_turns=1,
        max_total_tokens=400,
    )
    (e,) = played.episodes
    assert e.truncated and e.messages[-1]["content"] == call  # cut by max_turns right after its call
    assert played.stopped.tolist() == [True]


# ----------------------------------------------------------------------------- the template's suffix
def test_an_answer_after_a_turn_ended_by_eos_does_not_repeat_the_eos():
    """ChatML whose EOS is ``<|im_end|>`` (Qwen's instruct layout): the assistant suffix
    ``<|im_end|>\\n`` starts with the EOS the policy sampled, so the environment's answer starts
    with the rest of it (``\\n``). The sequence, decoded, is then the template's rendering of
    the conversation (up to the ``\\n`` after the last turn), never ``<|im_end|><|im_end|>``."""
    tok = build_chatml_tokenizer()
    renderer = _renderer(tok)
    assert renderer.assistant_suffix == "<|im_end|>\n" and renderer.eos_text == "<|im_end|>"
    eos = [tok.eos_token_id]
    played, _, _ = _play(
        tok,
        renderer,
        lambda: Echo(turns=2),
        {"hi": [_ids(tok, "more?") + eos, _ids(tok, "done") + eos]},
        max_turns=4,
        max_total_tokens=200,
    )
    e = played.episodes[0]
    assert [m["content"] for m in e.messages] == ["hi", "more?", "go on", "done"]
    text = tok.decode(e.prompt_ids + e.response_ids, skip_special_tokens=False)
    assert text + "\n" == tok.apply_chat_template(e.messages, tokenize=False), text
    answer = tok.encode("\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)
    n1 = len(_ids(tok, "more?")) + 1
    assert e.response_ids[n1 : n1 + len(answer)] == answer and e.loss_mask[n1 : n1 + len(answer)] == [0] * len(answer)


# ----------------------------------------------------------------------------- scoring
def test_turn_rewards_are_scaled_by_the_reward_normalisation_gain(bpe):
    """With reward normalisation ``(gain, bias)``, an episode's return (score plus turn rewards)
    is normalised as one number: ``gain * (score + sum of turn rewards) + bias``, so each turn
    reward is scaled by the gain as the score is; through the rollout worker's episodes and
    ``finish_rollout``'s shaping, each turn reward still on its turn's last token."""
    from ppo_lightning.algo.rollout import ScoreShaping
    from ppo_lightning.rollouts import Prompts, RolloutWorker
    from tests.helpers import play_and_score, shaped
    from ppo_lightning.models.tiny import gpt2_config
    from ppo_lightning.rewards.function import FunctionReward
    from transformers import GPT2LMHeadModel

    tok = bpe
    renderer = _renderer(tok)
    eos = [tok.eos_token_id]
    questions = ["hi", "what is 2 + 2?"]
    prompts = {q: tuple(renderer.prompt_ids([{"role": "user", "content": q}])) for q in questions}
    script = {
        prompts["hi"]: [_ids(tok, "more?") + eos, _ids(tok, "done") + eos],
        prompts["what is 2 + 2?"]: [_ids(tok, "4") + eos, _ids(tok, "so the sum is 4") + eos],
    }
    runner = EpisodeRunner(lambda: Echo(turns=2), renderer, EnvConfig(max_turns=3, max_total_tokens=200), tok)
    config = gpt2_config()
    config.vocab_size = len(tok)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(config).eval()
    gain, bias = 2.5, -1.0
    ids = torch.zeros(2, 1, dtype=torch.long)  # the episodes render their own prompts from the texts
    worker = RolloutWorker(
        ScriptedBackend(script, tok.pad_token_id),
        SamplingParams(max_new_tokens=16),
        FunctionReward("tests.helpers.constant_reward"),
        tok,
        runner,
    )
    s = shaped(
        play_and_score(worker, Prompts(ids, torch.ones_like(ids), questions, [{}, {}]), ref), ScoreShaping((gain, bias))
    )
    earned = s.episodes.turn_rewards.sum(1)
    assert earned.tolist() == [1.0, 1.0]  # Echo: 0.5 a turn
    # constant_reward scores every episode 1
    torch.testing.assert_close(s.scores + s.turn_rewards.sum(1), gain * (1.0 + earned) + bias)
    on_turns = s.episodes.turn_rewards != 0
    assert s.turn_rewards[on_turns].tolist() == [gain * 0.5] * 4 and (s.turn_rewards[~on_turns] == 0).all()
