"""Every bad input stops ``train.py`` early with exit code 1 and a message naming the key or file.

``train.py``'s ``main`` runs in-process (Hydra and all) to keep this fast; ``test_cli.py`` checks
the same path in a subprocess.
"""

from __future__ import annotations

import json
import runpy
import sys

import pytest

from tests.conftest import ROOT
from tests.helpers import rebind_log_streams

SMALL = [
    "experiment=tiny_char",
    "data.batch_size=8",
    "ppo.minibatch_size=4",
    "ppo.ppo_epochs=1",
    "sampling.max_new_tokens=4",
    "trainer.max_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "export_dir=null",
]


def run_main(args: list[str], tmp_path, cache_dir, monkeypatch, capfd) -> tuple[int, str]:
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    rebind_log_streams()
    monkeypatch.setattr(
        sys, "argv", ["train.py", *SMALL, f"hydra.run.dir={tmp_path / 'run'}", f"paths.cache_dir={cache_dir}", *args]
    )
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    err = capfd.readouterr().err
    assert "Traceback" not in err
    return e.value.code, err


def _write(path, text):
    path.write_text(text)
    return path


CASES = {
    "unknown key": (["ppo.clpi=0.1"], ["clpi"]),
    "wrong type": (["ppo.clip=abc"], ["ppo.clip", "abc"]),
    "clip zero": (["ppo.clip=0"], ["ppo.clip=0.0: must be > 0"]),
    "clip negative": (["ppo.clip=-0.1"], ["ppo.clip=-0.1: must be > 0"]),
    "lam above one": (["ppo.lam=1.5"], ["ppo.lam=1.5: must be in [0, 1]"]),
    "gamma below zero": (["ppo.gamma=-0.1"], ["ppo.gamma=-0.1: must be in [0, 1]"]),
    "minibatch does not divide": (["ppo.minibatch_size=3"], ["ppo.minibatch_size=3: must divide data.batch_size=8"]),
    "missing model dir": (
        ["model.name_or_path=/no/such/model"],
        ["model.name_or_path='/no/such/model': no such directory"],
    ),
    "context too long": (
        ["data.max_prompt_length=250", "sampling.max_new_tokens=16"],
        ["exceeds the model's context of 256"],
    ),
    "reward import": (
        ["reward=function", "reward.fn=no_such_pkg.score"],
        ["reward.fn='no_such_pkg.score'", "cannot import"],
    ),
    "reward wrong length": (
        ["reward=function", "reward.fn=tests.helpers.wrong_length"],
        ["tests.helpers.wrong_length returned 7 scores for 8 responses"],
    ),
    "reward not numbers": (
        ["reward=function", "reward.fn=tests.helpers.not_numbers"],
        ["returned 'good'", "for prompt 0"],
    ),
    "reward raises": (
        ["reward=function", "reward.fn=tests.helpers.raises_on_a", "data.shuffle=false"],
        ["raised ZeroDivisionError", "on prompt"],
    ),
    "missing reward model": (
        ["reward=model", "reward.name_or_path=/no/such/rm"],
        ["reward.name_or_path='/no/such/rm'"],
    ),
    "missing ckpt": (["ckpt_path=/no/such.ckpt"], ["ckpt_path='/no/such.ckpt': no such checkpoint"]),
    "unknown logger": (["logger=nope"], ["logger", "nope"]),
    "unknown trainer": (["trainer=nope"], ["trainer", "nope"]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input(name, tmp_path, cache_dir, monkeypatch, capfd):
    args, expected = CASES[name]
    code, err = run_main(args, tmp_path, cache_dir, monkeypatch, capfd)
    assert code == 1, err
    for text in expected:
        assert text in err, f"{text!r} not in:\n{err}"


def test_empty_prompt_file(tmp_path, cache_dir, monkeypatch, capfd):
    f = _write(tmp_path / "empty.txt", "\n\n")
    code, err = run_main([f"data.path={f}"], tmp_path, cache_dir, monkeypatch, capfd)
    assert code == 1 and f"data.path='{f}' holds no prompts" in err


def test_malformed_jsonl_names_the_line(tmp_path, cache_dir, monkeypatch, capfd):
    f = _write(tmp_path / "p.jsonl", json.dumps({"prompt": "a"}) + "\n{not json\n")
    code, err = run_main([f"data.path={f}"], tmp_path, cache_dir, monkeypatch, capfd)
    assert code == 1 and "p.jsonl" in err and "line 2" in err


def test_prompt_longer_than_limit_with_truncation_error(tmp_path, cache_dir, monkeypatch, capfd):
    f = _write(tmp_path / "p.txt", "short\n" * 10 + "x" * 100 + "\n")
    code, err = run_main(
        [f"data.path={f}", "data.max_prompt_length=32", "data.truncation=error"],
        tmp_path,
        cache_dir,
        monkeypatch,
        capfd,
    )
    assert code == 1 and "data.max_prompt_length=32" in err and "prompt 10" in err


def test_tokenizer_without_pad_or_eos(tmp_path, cache_dir, monkeypatch, capfd):
    from ppo_lightning.models.tiny import build_byte_tokenizer, save_tiny_causal_lm

    d = save_tiny_causal_lm(tmp_path / "no-eos")
    tok = build_byte_tokenizer()
    tok.eos_token = None
    tok.pad_token = None
    tok.bos_token = None
    tok.save_pretrained(d)
    code, err = run_main([f"model.name_or_path={d}", "model.build_tiny=null"], tmp_path, cache_dir, monkeypatch, capfd)
    assert code == 1 and "no EOS token" in err and "model.name_or_path" in err


def test_stage_key_with_wrong_type(tmp_path, cache_dir, monkeypatch, capfd):
    code, err = run_main(
        ["task=sft", "task.val_fraction=abc", "task.path=x.jsonl"], tmp_path, cache_dir, monkeypatch, capfd
    )
    assert code == 1 and "task.val_fraction" in err and "abc" in err


@pytest.mark.parametrize("case", ["empty prompts", "malformed prompts", "missing model", "bad range"])
def test_the_default_job_checks_its_inputs_before_building_the_recipe(case, tmp_path, monkeypatch, capfd):
    """``python train.py data.path=empty.txt`` (the default job: the reviews recipe) says what is
    wrong before it builds or loads anything: the recipe's cache directory is never created, and
    no model is loaded (an order of events, not seconds: the check holds on a loaded machine)."""
    from transformers import PreTrainedModel

    empty_cache = tmp_path / "cache"
    loaded = []
    monkeypatch.setattr(PreTrainedModel, "from_pretrained", classmethod(lambda cls, *a, **k: loaded.append(cls)))
    args = {
        "empty prompts": [f"data.path={_write(tmp_path / 'empty.txt', chr(10) * 3)}"],
        "malformed prompts": [f"data.path={_write(tmp_path / 'p.jsonl', '{nope' + chr(10))}"],
        "missing model": ["model.name_or_path=/no/such/model"],
        "bad range": ["ppo.clip=0"],
    }[case]
    expected = {
        "empty prompts": "holds no prompts",
        "malformed prompts": "line 1: not valid JSON",
        "missing model": "model.name_or_path='/no/such/model': no such directory",
        "bad range": "ppo.clip=0.0: must be > 0",
    }[case]
    monkeypatch.delenv("HYDRA_FULL_ERROR", raising=False)
    rebind_log_streams()
    monkeypatch.setattr(
        sys, "argv", ["train.py", f"hydra.run.dir={tmp_path / 'run'}", f"paths.cache_dir={empty_cache}", *args]
    )
    with pytest.raises(SystemExit) as e:
        runpy.run_path(str(ROOT / "train.py"), run_name="__main__")
    out, err = capfd.readouterr()
    assert e.value.code == 1 and expected in err and "Traceback" not in err, err
    assert loaded == []  # stopped before any model loaded
    if case == "empty prompts":  # data.path alone keeps data=reviews and its preset: said once
        assert "choose data=file" in out + err
    assert not empty_cache.exists() or not any(empty_cache.iterdir())


def test_a_missing_recipe_output_names_the_recipe(tmp_path, monkeypatch, capfd):
    """Keeping reward=reviews without data=reviews drops the preset (and its recipe): the missing
    reward model's error says which recipe builds it."""
    prompts = _write(tmp_path / "p.txt", "hello\n" * 40)
    code, err = run_main(
        ["reward=reviews", "data=file", f"data.path={prompts}"], tmp_path, tmp_path / "cache", monkeypatch, capfd
    )  # a cache where no recipe has been built
    assert code == 1 and "reward.name_or_path=" in err and "built by recipe=reviews" in err, err


def test_reward_model_without_a_trained_score_head(tmp_path, cache_dir, tiny_lm_dir, monkeypatch, capfd):
    """A directory that is not a reward model (here a causal LM; a sentence-embedding encoder is
    the same case) loads as a sequence classifier with a random score head: refused, naming
    the key and the missing weights, instead of training against noise."""
    code, err = run_main(
        ["reward=model", f"reward.name_or_path={tiny_lm_dir}"], tmp_path, cache_dir, monkeypatch, capfd
    )
    assert code == 1 and "reward.name_or_path=" in err and "is not a trained reward model" in err
    assert "score.weight" in err


@pytest.mark.parametrize("exists", [True, False])
def test_the_stages_never_build_the_tiny_model_into_a_users_directory(tmp_path, cache_dir, monkeypatch, capfd, exists):
    """``model=tiny`` builds its random model only inside ``paths.cache_dir``. ``task=sft`` with
    ``model.name_or_path`` pointing at a directory of the user's (empty, or not there yet) fails
    with the key named, and writes nothing there, as PPO does."""
    user = tmp_path / "my_model"
    if exists:
        user.mkdir()
    data = _write(tmp_path / "sft.jsonl", json.dumps({"prompt": "a", "response": "b"}) + "\n")
    code, err = run_main(
        ["task=sft", f"task.path={data}", f"model.name_or_path={user}"], tmp_path, cache_dir, monkeypatch, capfd
    )
    assert code == 1 and f"model.name_or_path='{user}'" in err, err
    assert (list(user.iterdir()) == []) if exists else not user.exists()


CALC = "ppo_lightning.envs.calculator.calculator"
ENV_CASES = {
    "env class not importable": (
        ["env=function", "env._target_=no_pkg.Env"],
        "env._target_='no_pkg.Env': cannot import",
    ),
    "env class not named": (["env=function"], "env._target_ is null: name the environment class"),
    "env tool not a function": (
        ["env=tools", "env.tools=[tests.multiturn.NOT_A_FUNCTION]"],
        "env.tools[0]='tests.multiturn.NOT_A_FUNCTION' is a int, not a callable",
    ),
    "env tool without type hints": (
        ["env=tools", "env.tools=[tests.multiturn.no_hints]"],
        "env.tools[0]: cannot describe tool no_hints",
    ),
    "env max_turns below one": (
        ["env=tools", f"env.tools=[{CALC}]", "env.max_turns=0"],
        "env.max_turns=0: must be >= 1",
    ),
    "env on_error unknown": (
        ["env=tools", f"env.tools=[{CALC}]", "env.on_error=crash"],
        "env.on_error='crash': choose one of count | raise",
    ),
    "env argument unknown": (
        ["env=tools", f"env.tools=[{CALC}]", "+env.bogus=1"],
        "unexpected keyword argument 'bogus'",
    ),
    "env parser unknown": (
        ["env=tools", f"env.tools=[{CALC}]", "env.parser=mistral"],
        "env.parser='mistral': choose one of hermes, or give the dotted path of a class",
    ),
    "env parser not a parser": (
        ["env=tools", f"env.tools=[{CALC}]", "env.parser=tests.multiturn.Echo"],
        "env.parser='tests.multiturn.Echo' is not a parser class",
    ),
    "reward environment without an environment": (
        ["reward=environment"],
        "reward=environment takes the reward from the environment, but there is no environment (env=none)",
    ),
    "reward environment whose tools give no reward": (
        ["reward=environment", "env=tools", f"env.tools=[{CALC}]"],
        "has none (its tools are plain functions); set env.environment=my_pkg.MyEnv",
    ),
    "env class without step": (
        ["env=function", "env._target_=tests.env_sessions.NoStep"],
        "env._target_='tests.env_sessions.NoStep': NoStep has no step()",
    ),
    "env without stops": (
        ["env=tools", f"env.tools=[{CALC}]", "sampling.stop_at_eos=false"],
        "sampling.stop_at_eos=false with env",
    ),
}


@pytest.mark.parametrize("name", list(ENV_CASES))
def test_bad_env_input_fails_before_any_model_loads(name, tmp_path, cache_dir, monkeypatch, capfd):
    import ppo_lightning.jobs.factory as factory

    def no_model(*args, **kwargs):
        raise AssertionError("a model loaded before the check")

    monkeypatch.setattr(factory, "load_causal_lm", no_model)
    args, expected = ENV_CASES[name]
    code, err = run_main(args, tmp_path, cache_dir, monkeypatch, capfd)
    assert code == 1 and expected in err, err
    assert "a model loaded" not in err
    assert sum("error:" in line for line in err.splitlines()) == 1  # one line


def test_a_tokenizer_whose_template_cannot_render_tools_needs_data_chat_template(
    tmp_path, cache_dir, monkeypatch, capfd
):
    """The byte tokenizer with a template that ignores ``tools``: refused before any model loads,
    naming the tokenizer and ``data.chat_template``; with a template that renders them it runs."""
    import ppo_lightning.jobs.factory as factory
    from ppo_lightning.models.tiny import build_byte_tokenizer

    tok = build_byte_tokenizer()
    tok.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    tok.save_pretrained(tmp_path / "tok")
    monkeypatch.setattr(
        factory, "load_causal_lm", lambda *a, **k: (_ for _ in ()).throw(AssertionError("model loaded"))
    )
    args = ["env=tools", f"env.tools=[{CALC}]", f"model.tokenizer_name_or_path={tmp_path / 'tok'}"]
    code, err = run_main(args, tmp_path, cache_dir, monkeypatch, capfd)
    assert code == 1 and "model loaded" not in err, err
    assert f"the tokenizer's chat template of {tmp_path / 'tok'} cannot render tools" in err
    assert "set data.chat_template" in err
