"""Every environment runs safely: bad ``env`` keys and broken environment classes are refused in
one line before any model loads, every environment instance is closed (pooled and bounded on
request), a reward may come from the environment alone, and a turn that ends on an end-of-turn
token which is not EOS is trained once."""

from __future__ import annotations

import logging
import re

import pytest

from ppo_lightning.config import EnvConfig
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.envs import ChatRenderer, EpisodeRunner, Record, ToolEnvironment
from ppo_lightning.generation import SamplingParams
from ppo_lightning.jobs.factory import build_module, check_inputs
from tests.conftest import compose_cfg, read_metrics
from tests.env_sessions import Counter, Sessions, open_sessions
from tests.multiturn import Echo, ScriptedBackend, build_bpe_tokenizer

CALC = "ppo_lightning.envs.calculator.calculator"
TOOLS = ["env=tools", f"env.tools=[{CALC}]"]


@pytest.fixture(scope="module")
def bpe():
    return build_bpe_tokenizer()


# ----------------------------------------------------------------------------- bad input, up front
@pytest.mark.parametrize(
    "override, said",
    [
        ("env.max_turns=abc", "env.max_turns='abc': must be an integer"),
        ("env.max_turns=true", "env.max_turns=True: must be an integer"),
        ("env.tool_timeout_s=abc", "env.tool_timeout_s='abc': must be a number or null"),
        ("env.max_total_tokens=96.5", "env.max_total_tokens=96.5: must be an integer or null"),
        ("env.max_observation_tokens=2.5", "env.max_observation_tokens=2.5: must be an integer or null"),
        ("env.error_reward=abc", "env.error_reward='abc': must be a number"),
        ("env.max_concurrent=0", "env.max_concurrent=0: must be >= 1"),
        ("env.reuse_instances=3", "env.reuse_instances=3: must be true or false"),
    ],
)
def test_env_loop_keys_of_the_wrong_type_are_one_line_naming_the_key(tmp_path, cache_dir, override, said):
    """The ``env`` node is untyped at composition (its other keys are the class's constructor
    arguments), so these used to pass and fail later: a 21-line ``TypeError``, a crash after the
    model loaded, or only once an environment raised. ``check_inputs`` is what runs before any
    model loads."""
    cfg = compose_cfg([*TOOLS, override], tmp_path, cache_dir)
    with pytest.raises(ConfigError, match="^" + re.escape(said)) as e:
        check_inputs(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize(
    "target, said",
    [
        ("tests.env_sessions.NoStep", r"NoStep has no step\(\): an environment needs reset\(record\)"),
        ("tests.env_sessions.NoReset", r"NoReset has no reset\(\)"),
        (
            "tests.env_sessions.NeedsLevel",
            r"NeedsLevel.reset raised KeyError on the data's first record \('level'\); it must take every record's",
        ),
    ],
)
def test_an_environment_that_breaks_the_protocol_is_refused_before_any_model_loads(tmp_path, cache_dir, target, said):
    """A class without ``step`` once trained to exit 0 with every episode counted as an
    environment error; one without ``reset``, or whose ``reset`` cannot take the records'
    columns, stopped only after the models loaded. Now each is one line from ``check_inputs``,
    and the instance it built to check is closed."""
    cfg = compose_cfg(["env=function", f"env._target_={target}"], tmp_path, cache_dir)
    with pytest.raises(ConfigError, match=rf"^env._target_='{re.escape(target)}': {said}"):
        check_inputs(cfg)


def test_the_probe_instances_are_closed(tmp_path, cache_dir, bpe):
    """``check_inputs`` and the runner each build an instance to look at (protocol, tools, the
    reward owners) and close it at once."""
    Sessions.reset_counts()
    cfg = compose_cfg(["env=function", "env._target_=tests.env_sessions.Sessions"], tmp_path, cache_dir)
    check_inputs(cfg)
    assert Sessions.built == 1 and Sessions.resets == 1 and Sessions.open_now == 0
    _runner(bpe, Sessions)
    assert Sessions.built == 2 and Sessions.open_now == 0


@pytest.mark.slow  # a train.py process that loads the tiny model
def test_a_step_that_returns_the_wrong_type_is_one_error_line(cache_dir):
    from tests.helpers import run_train

    p = run_train(
        [
            "experiment=tiny_char",
            "env=function",
            "env._target_=tests.env_sessions.StepReturnsDict",
            "reward=environment",
            "reward.normalize=false",
            "trainer.max_steps=1",
            "logger=none",
            "callbacks=none",
            "export_dir=null",
        ],
        cache_dir,
    )
    assert p.returncode == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr, p.stderr[-2000:]
    errors = [line for line in p.stderr.splitlines() if line.startswith("error:")]
    assert errors == ["error: StepReturnsDict.step returned dict, not an EnvStep(messages, reward, done, info)"]


# ----------------------------------------------------------------------------- the episode loop
def _runner(tok, make_env, template: str | None = None, **loop):
    renderer = ChatRenderer(tok, template)
    renderer.check_prefix_preserving("tiny-bpe", tools=False)
    return EpisodeRunner(make_env, renderer, EnvConfig(**loop), tok)


def _script(tok, runner, prompts: list[str], turn: list[int]) -> ScriptedBackend:
    script = {tuple(runner.renderer.prompt_ids([{"role": "user", "content": p}])): [turn] * 4 for p in prompts}
    return ScriptedBackend(script, tok.pad_token_id)


def _play(tok, runner, prompts, score=None, **params):
    turn = tok.encode("ok", add_special_tokens=False) + [tok.eos_token_id]
    backend = _script(tok, runner, prompts, turn)
    return runner.run(
        prompts, [{}] * len(prompts), backend, SamplingParams(max_new_tokens=8, **params), None, "cpu", score
    )


PROMPTS = ["a", "b", "c", "d", "e"]


def test_every_episode_closes_its_environment_after_it_is_scored(bpe):
    """No session outlives its episode: ``close()`` runs once per instance, after the reward
    has scored the batch (a TRL reward may read an environment's state), including an episode
    whose environment raised."""
    Sessions.reset_counts()
    runner = _runner(bpe, lambda: Sessions(fail_every=2), max_turns=4)
    seen_live = []

    def score(played):
        seen_live.append(all(not e.env.closed for e in played.episodes))
        import torch

        n = len(played.episodes)
        return torch.zeros(n), torch.ones(n, dtype=torch.bool), {}

    played = _play(bpe, runner, PROMPTS, score)
    assert seen_live == [True] and Sessions.open_now == 0 and runner.live == 0
    assert Sessions.built == 1 + len(PROMPTS)  # the probe, then one per episode
    assert [e.env_error is not None for e in played.episodes] == [False, True, False, True, False]
    assert all(e.env.closed for e in played.episodes)
    assert played.scores[0].shape == (len(PROMPTS),)


def test_an_error_that_stops_the_batch_still_closes_every_instance(bpe):
    from ppo_lightning.envs import EnvError

    Sessions.reset_counts()
    runner = _runner(bpe, lambda: Sessions(fail_every=2), max_turns=4, on_error="raise")
    with pytest.raises(EnvError, match="Sessions.step raised ConnectionError"):
        _play(bpe, runner, PROMPTS)
    assert Sessions.open_now == 0 and runner.live == 0


def test_reused_instances_are_reset_for_later_episodes_and_closed_at_the_end(bpe):
    """``env.reuse_instances``: TRL's "construct once, reset often": a second batch builds no
    instance, the runner's probe serves as one of the pool, and ``close()`` (the end of the run)
    closes the pool."""
    Sessions.reset_counts()
    runner = _runner(bpe, Sessions, max_turns=4, reuse_instances=True)
    first = _play(bpe, runner, PROMPTS)
    assert Sessions.built == len(PROMPTS) and Sessions.open_now == len(PROMPTS)  # the probe is the pool's first
    second = _play(bpe, runner, PROMPTS)
    assert Sessions.built == len(PROMPTS) and Sessions.resets == 2 * len(PROMPTS)
    assert [e.response_ids for e in first.episodes] == [e.response_ids for e in second.episodes]
    runner.close()
    assert Sessions.open_now == 0 and runner.live == 0


def test_max_concurrent_plays_a_batch_in_waves_and_scores_it_the_same(bpe):
    """``env.max_concurrent=2``: never more than two sessions open, the batch played in three
    waves, each scored while its environments are live; episodes and scores equal those of
    the batch played at once (the scripted backend says the same to each prompt)."""
    import torch

    bound = {"open": len(PROMPTS)}

    def score(played):
        assert Sessions.open_now <= bound["open"]
        n = torch.tensor([float(len(e.response_ids)) for e in played.episodes])
        return n, torch.ones(len(n), dtype=torch.bool), {"length": n}

    Sessions.reset_counts()
    whole = _play(bpe, _runner(bpe, Sessions, max_turns=4), PROMPTS, score)
    assert Sessions.peak == len(PROMPTS)
    Sessions.reset_counts()
    bound["open"] = 2
    waves = _play(bpe, _runner(bpe, Sessions, max_turns=4, max_concurrent=2), PROMPTS, score)
    assert Sessions.peak == 2 and Sessions.open_now == 0
    assert [e.response_ids for e in waves.episodes] == [e.response_ids for e in whole.episodes]
    assert torch.equal(waves.query_responses, whole.query_responses)
    assert torch.equal(waves.scores[0], whole.scores[0]) and torch.equal(waves.scores[2]["length"], whole.scores[0])


def test_a_turn_cut_by_the_token_budget_is_counted(bpe):
    """A turn that the budget (``env.max_total_tokens``) cut before its own
    ``sampling.max_new_tokens`` is ``env/budget_cut_turns``; one that ends on its own is not."""
    tok = bpe
    runner = _runner(tok, lambda: Echo(turns=5, reply="go"), max_turns=5, max_total_tokens=14)
    long_turn = tok.encode("the answer is here", add_special_tokens=False)[:7]
    prompt = tuple(runner.renderer.prompt_ids([{"role": "user", "content": "a"}]))
    backend = ScriptedBackend({prompt: [long_turn + [tok.eos_token_id]] * 5}, tok.pad_token_id)
    played = runner.run(["a"], [{}], backend, SamplingParams(max_new_tokens=8), None, "cpu")
    e = played.episodes[0]
    assert len(e.response_ids) <= 14 and e.loss_mask[-1] == 1
    assert e.counts["budget_cut_turns"] == 1 and float(played.metrics()["env/budget_cut_turns"]) == 1
    assert not e.stopped  # the cut turn never reached its EOS


# ----------------------------------------------------------------------------- an end of turn that is not EOS
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture(scope="module")
def chatml():
    """A byte-level BPE ChatML tokenizer whose EOS (``<|endoftext|>``) is not its end-of-turn
    token (``<|im_end|>``): the Qwen2.5 base models' layout."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
    corpus = [
        f"<|im_start|>user\nsay hello {i}<|im_end|>\n<|im_start|>assistant\nhello there<|im_end|>\n" for i in range(50)
    ]
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|pad|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        padding_side="left",
        chat_template=CHATML,
    )


@pytest.mark.parametrize("stop", ["token", "string"])
def test_a_turn_ending_on_an_end_of_turn_token_that_is_not_eos_is_trained_once(chatml, stop):
    """The policy ends its turn with ``<|im_end|>``, a stop token (``sampling.stop_token_ids``)
    or stop string, not EOS. The template's assistant suffix starts with it, so it is treated as
    EOS is: the environment and the reward read ``hello``, and the sequence continues with the
    rest of the suffix (``\\n``), never ``<|im_end|><|im_end|>``."""
    tok = chatml
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tok.eos_token_id
    seen = []

    class Listens(Echo):
        def step(self, messages):
            seen.append(messages[-1]["content"])
            return super().step(messages)

    runner = _runner(tok, lambda: Listens(turns=2, reply="go on"), template=CHATML, max_turns=4)
    assert runner.renderer.assistant_suffix == "<|im_end|>\n"
    hello = tok.encode("hello", add_special_tokens=False)
    prompt = tuple(runner.renderer.prompt_ids([{"role": "user", "content": "hi"}]))
    backend = ScriptedBackend({prompt: [hello + [im_end]] * 2}, tok.pad_token_id)
    params = SamplingParams(max_new_tokens=8, **({"stop_token_ids": (im_end,)} if stop == "token" else {}))
    if stop == "string":
        params = params.replace(stop_strings=("<|im_end|>",))
    played = runner.run(["hi"], [{}], backend, params, None, "cpu")
    e = played.episodes[0]
    text = tok.decode(e.prompt_ids + e.response_ids, skip_special_tokens=False)
    assert seen == ["hello", "hello"]
    assert [m["content"] for m in e.completion if m["role"] == "assistant"] == ["hello", "hello"]
    assert "<|im_end|><|im_end|>" not in text
    assert text.endswith("hello<|im_end|>\n<|im_start|>user\ngo on<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>")
    # each policy turn is the sampled ids, its <|im_end|> trained once; the "\n" after it is the environment's
    assert e.loss_mask.count(1) == 2 * (len(hello) + 1) and e.stopped


# ----------------------------------------------------------------------------- TRL's environment_factory
def test_tools_are_discovered_on_the_class_not_by_reading_the_instance():
    """A property that needs ``reset()`` first would raise if tool discovery read the instance's
    members; the class's methods are read instead."""
    env = ToolEnvironment(environment="tests.env_sessions.LazyProperty")
    assert [t["function"]["name"] for t in env.tools] == ["move"]


def test_the_environment_takes_what_trls_environment_factory_takes():
    """A zero-argument callable, a class with constructor arguments (``env.environment_kwargs``),
    and a mapping of them chosen per record by its ``environment`` column (TRL's
    multi-environment mode), each closed with the episode."""
    from ppo_lightning.envs.tools import reward_owners

    env = ToolEnvironment(environment="tests.env_sessions.make_counter")
    assert env.reset(Record("Count.", {})) == [{"role": "user", "content": "Count. Start at 7."}]
    env = ToolEnvironment(environment="tests.env_sessions.Counter", environment_kwargs={"start": 3})
    assert env.reset(Record("Count.", {}))[0]["content"].endswith("Start at 3.")
    Counter.open_now = 0
    several = {"counter": "tests.env_sessions.Counter", "doubler": "tests.env_sessions.Doubler"}
    env = ToolEnvironment(environment=several, environment_kwargs={"doubler": {"start": 5}})
    assert Counter.open_now == 0  # nothing built before a record chooses
    env.reset(Record("Count.", {"environment": "doubler"}))
    assert sorted(t["function"]["name"] for t in env.tools) == ["add", "double"]
    assert env.environment.start == 5
    env.reset(Record("Count.", {"environment": "counter"}))
    assert [t["function"]["name"] for t in env.tools] == ["add"]
    env.close()
    assert Counter.open_now == 0
    assert [c.__name__ for c in reward_owners(ToolEnvironment(environment=several))] == ["Counter", "Doubler"]
    with pytest.raises(ConfigError, match=r"a record's 'environment' column is 'chess'; env.environment names"):
        env.reset(Record("Count.", {"environment": "chess"}))
    with pytest.raises(ConfigError, match=r"env.environment_kwargs.chess: no environment of that name"):
        ToolEnvironment(environment=several, environment_kwargs={"chess": {}})
    with pytest.raises(ConfigError, match=r"class NoReset has no reset method \(TRL's environment_factory contract"):
        ToolEnvironment(environment="tests.env_sessions.NoReset")


# ----------------------------------------------------------------------------- context and budgets, before loading
def test_the_context_is_checked_from_the_models_config_before_its_weights_load(tmp_path, cache_dir, monkeypatch):
    import ppo_lightning.jobs.factory as factory

    def no_load(*args, **kwargs):
        raise AssertionError("the weights loaded before the context check")

    monkeypatch.setattr(factory, "load_causal_lm", no_load)
    cfg = compose_cfg([*TOOLS, "data.max_prompt_length=64", "env.max_total_tokens=250"], tmp_path, cache_dir)
    with pytest.raises(ConfigError, match=r"data.max_prompt_length \+ env.max_total_tokens = 314 exceeds the model's"):
        build_module(cfg)


def test_env_max_total_tokens_defaults_to_what_fits_and_sets_the_length_norm(tmp_path, cache_dir):
    """``model=tiny env=tools`` with no budget key: the episode may fill the context the prompt
    leaves (256 - ``data.max_prompt_length``). ``seq_mean_token_sum_norm`` divides by the most
    policy tokens an episode can hold, every turn's (``max_turns x max_new_tokens``, here under
    the budget), not one turn's ``sampling.max_new_tokens``."""
    cfg = compose_cfg([*TOOLS, "env.max_turns=3", "sampling.max_new_tokens=20"], tmp_path, cache_dir)
    module, _ = build_module(cfg)
    runner = module.worker.runner
    assert runner.cfg.max_total_tokens == 256 - cfg.data.max_prompt_length
    assert module.algo.norm_length == 3 * 20
    cfg = compose_cfg(
        [*TOOLS, "env.max_turns=3", "sampling.max_new_tokens=20", "env.max_total_tokens=50"], tmp_path, cache_dir
    )
    assert build_module(cfg)[0].algo.norm_length == 50


# ----------------------------------------------------------------------------- whole runs
SESSIONS = [
    "env=function",
    "env._target_=tests.env_sessions.Sessions",
    "+env.capacity=8",
    "reward=environment",
    "sampling.max_new_tokens=8",
    "data.batch_size=4",
    "ppo.minibatch_size=4",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "export_dir=null",
]


def test_a_run_against_a_server_of_bounded_capacity_leaves_no_session_open(tmp_path, cache_dir):
    """A server of capacity 8 (``Sessions(capacity=8)``), batches of 4 episodes, the reward
    normalisation's 256 reference episodes before iteration 0: without closing, the ninth
    session would be refused. Zero sessions open after every iteration and after the run; the
    reward is the environment's turn rewards alone (``reward=environment``, no reward function),
    counted in ``objective/raw_scores`` and the rollout dump's ``reward``."""
    from ppo_lightning.jobs.run import train
    from tests.env_sessions import OpenSessions

    Sessions.reset_counts()
    OpenSessions.seen = []
    cfg = compose_cfg(
        [
            *SESSIONS,
            "trainer.max_steps=3",
            "ppo.rollout_dump=true",
            "callbacks=none",
            "+callbacks.sessions._target_=tests.env_sessions.OpenSessions",
        ],
        tmp_path,
        cache_dir,
    )
    metrics = train(cfg)
    assert OpenSessions.seen == [0, 0, 0] and Sessions.open_now == 0 and Sessions.peak <= 8
    rows = read_metrics(tmp_path / "metrics.csv")
    assert [r["objective/raw_scores"] for r in rows] == [1.0, 1.0, 1.0]  # two turns of 0.5
    assert metrics["env/turn_reward_mean"] == 1.0
    import json

    dumped = [json.loads(line) for line in (tmp_path / "rollouts" / "iter_0.jsonl").read_text().splitlines()]
    assert [d["reward"] for d in dumped] == [1.0] * 4


@pytest.mark.slow  # a train.py process, stopped by SIGTERM
def test_sigterm_leaves_no_session_open(tmp_path, cache_dir):
    from tests.helpers import run_train

    ledger = tmp_path / "ledger.txt"
    p = run_train(
        [
            "experiment=tiny_char",
            *SESSIONS,
            f"+env.ledger={ledger}",
            "env.reuse_instances=true",
            "reward.normalize=false",
            "trainer.max_steps=5",
            "logger=none",
            f"paths.output_dir={tmp_path}",
            "+callbacks.stop._target_=tests.helpers.SigtermAtStep",
            "+callbacks.stop.step=2",
        ],
        cache_dir,
    )
    assert p.returncode == 143, p.stderr[-2000:]
    assert ledger.read_text().count(" open ") >= 5  # the probes, and a pool of 4
    assert open_sessions(ledger) == 0


QUIET = ["trainer.enable_progress_bar=false", "callbacks=none", "logger=none", "export_dir=null"]
QUIET_SMALL_RUN = [
    "reward.normalize=false",
    "sampling.max_new_tokens=8",
    "data.batch_size=4",
    "ppo.minibatch_size=4",
    *QUIET,
]
"""A run of 4 episodes an iteration, no normalisation fit, nothing written but what a test reads."""


def test_an_iteration_with_no_score_at_all_says_so_once(tmp_path, cache_dir, caplog):
    """A reward that applies to no episode (None for every one) leaves nothing to learn but a
    loss of 0: the run says so, once, in one line."""
    from ppo_lightning.jobs.run import train

    cfg = compose_cfg(
        [
            "reward=function",
            "reward.fn=tests.env_sessions.no_score",
            "reward.normalize=false",
            "trainer.max_steps=2",
            *QUIET,
        ],
        tmp_path,
        cache_dir,
    )
    with caplog.at_level(logging.WARNING, logger="ppo_lightning"):
        train(cfg)
    lines = [r.getMessage() for r in caplog.records if "no reward applied to any" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("PPO iteration 0: no reward applied to any of its")


def test_a_first_iteration_where_every_episode_is_truncated_warns(tmp_path, cache_dir, caplog):
    from ppo_lightning.jobs.run import train

    cfg = compose_cfg(
        [
            "env=function",
            "env._target_=tests.multiturn.Echo",
            "+env.turns=3",
            "env.max_turns=1",
            "reward=environment",
            "trainer.max_steps=1",
            *QUIET_SMALL_RUN,
        ],
        tmp_path,
        cache_dir,
    )
    with caplog.at_level(logging.WARNING, logger="ppo_lightning"):
        train(cfg)
    assert any("every episode was cut by a budget" in r.getMessage() for r in caplog.records)


def test_trls_echo_example_runs_against_a_server_of_bounded_capacity(tmp_path, cache_dir):
    """TRL builds each environment once and resets it for every later episode; ``env=tools`` does
    the same (``env.reuse_instances: true``), so a class that opens a session in ``__init__`` and
    never closes it (TRL's OpenEnv echo example) holds a fixed number of sessions however long the
    run: here 6 iterations of 4 episodes against a server of 8 sessions. Its ``reset()`` takes no
    arguments: it gets none of the record's columns."""
    from ppo_lightning.jobs.run import train
    from tests.env_sessions import EchoServer

    EchoServer.sessions = 0
    cfg = compose_cfg(
        [
            "env=tools",
            "env.environment=tests.env_sessions.EchoClientEnv",
            "reward=environment",
            "trainer.max_steps=6",
            *QUIET_SMALL_RUN,
        ],
        tmp_path,
        cache_dir,
    )
    metrics = train(cfg)
    assert EchoServer.sessions <= 4 + 1  # the pool of 4 (the runner's probe its first), the check's, never closed
    assert "rewards/EchoClientEnv/mean" in metrics
