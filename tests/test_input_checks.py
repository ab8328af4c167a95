"""A job checks each input once: ``check_inputs`` before any recipe build or model load, then
``check_built_inputs`` on what the job's recipe built, and ``build`` runs neither again."""

from __future__ import annotations

import pytest

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.jobs import factory
from tests.conftest import compose_cfg
from tests.env_sessions import Sessions

SESSIONS = ["env=function", "env._target_=tests.env_sessions.Sessions"]
RUN = [
    "reward=environment",
    "reward.normalize=false",
    "sampling.max_new_tokens=8",
    "data.batch_size=4",
    "ppo.minibatch_size=4",
    "trainer.max_steps=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "logger=none",
    "export_dir=null",
]


def _counting(monkeypatch, name: str) -> list[int]:
    calls = []
    real = getattr(factory, name)

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(factory, name, counted)
    return calls


def test_a_ppo_job_validates_its_config_and_builds_its_environment_to_check_once(tmp_path, cache_dir, monkeypatch):
    """``jobs.run.train`` checks its inputs, then builds the run with ``checked=True``: the
    config is validated once and the environment built once for its check (the runner's probe and
    the episodes' instances are the run's own)."""
    from ppo_lightning.jobs.run import train

    validated, env_checked = _counting(monkeypatch, "validate"), _counting(monkeypatch, "check_env")
    train(compose_cfg([*SESSIONS, *RUN], tmp_path, cache_dir))
    assert (len(validated), len(env_checked)) == (1, 1)


def test_a_build_that_was_not_told_the_inputs_are_checked_checks_them(tmp_path, cache_dir, monkeypatch):
    """``build_module`` alone (a script, a recipe's inner run, ``task=export``) checks first."""
    validated = _counting(monkeypatch, "validate")
    factory.build_module(compose_cfg([], tmp_path, cache_dir))
    assert len(validated) == 1
    with pytest.raises(ConfigError, match=r"^ppo.clip=0.0: must be > 0"):
        factory.build_module(compose_cfg(["ppo.clip=0"], tmp_path, cache_dir))


def test_what_the_recipe_builds_is_checked_after_the_build_and_the_rest_before(tmp_path, cache_dir):
    """Paths under the recipe's build root are skipped by ``check_inputs`` (they do not exist yet)
    and checked by ``check_built_inputs``; the environment's ``reset`` takes the first record of
    prompts the recipe wrote once they are there, and its other checks are not repeated without
    the record."""
    built = tmp_path / "built"
    prompts = built / "prompts.jsonl"
    cfg = compose_cfg([*SESSIONS, "reward=environment", f"data.path={prompts}"], tmp_path, cache_dir)
    Sessions.reset_counts()
    factory.check_inputs(cfg, built_by_recipe=built)  # no prompts yet: the environment is built, not reset
    assert (Sessions.built, Sessions.resets, Sessions.open_now) == (1, 0, 0)

    built.mkdir()
    prompts.write_text("\n")
    with pytest.raises(ConfigError, match=r"^data.path='.*prompts.jsonl' holds no prompts"):
        factory.check_built_inputs(cfg, built)
    prompts.write_text('{"prompt": "hello"}\n')
    factory.check_built_inputs(cfg, built)
    assert (Sessions.built, Sessions.resets, Sessions.open_now) == (2, 1, 0)

    outside = compose_cfg([*SESSIONS, "reward=environment", f"data.path={tmp_path / 'nope.txt'}"], tmp_path, cache_dir)
    factory.check_built_inputs(outside, built)  # not the recipe's: check_inputs' to check, not repeated here
    with pytest.raises(ConfigError, match=r"^data.path='.*nope.txt': no such file"):
        factory.check_inputs(outside, built_by_recipe=built)
