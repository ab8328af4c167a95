"""``train.py`` as a user runs it: composition, fast failures with short messages, sweeps."""

from __future__ import annotations

import pytest

from tests.conftest import read_metrics
from tests.helpers import run_train

pytestmark = pytest.mark.slow  # every test runs train.py in a subprocess

TINY_RUN = [
    "experiment=tiny_char",
    "trainer.max_steps=2",
    "sampling.max_new_tokens=8",
    "data.batch_size=8",
    "ppo.minibatch_size=4",
    "ppo.ppo_epochs=1",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
]


def test_cfg_job_prints_composed_config(cache_dir):
    p = run_train(["model=gpt2", "ppo.clip=0.2", "--cfg", "job"], cache_dir)
    assert p.returncode == 0, p.stderr
    assert "name_or_path: gpt2" in p.stdout and "clip: 0.2" in p.stdout


def test_hub_model_offline_fails_fast_with_a_fix(tmp_path):
    """``model=gpt2`` offline fails in its one line before anything is built or loaded: the
    model's check comes first (without it ``from_pretrained`` retries for half a minute and ends
    in a traceback), and the reviews recipe of the default job never starts its build in an
    empty cache. An order of events rather than seconds, so it holds on a loaded machine."""
    cache = tmp_path / "cache"
    p = run_train(["model=gpt2", f"hydra.run.dir={tmp_path / 'run'}"], cache)
    assert p.returncode == 1
    assert "model.name_or_path='gpt2'" in p.stderr and "local directory" in p.stderr
    assert "Traceback" not in p.stderr
    assert not cache.exists() or not any(cache.iterdir()), list(cache.iterdir())  # nothing built


@pytest.mark.parametrize(
    "override, message",
    [
        ("ppo.clpi=0.1", "Could not override 'ppo.clpi'"),  # Hydra's, at composition
        ("ppo.minibatch_size=5", "ppo.minibatch_size=5: must divide data.batch_size=16"),  # ours, before models load
    ],
)
def test_bad_input_exits_1_with_one_message_and_no_traceback(cache_dir, tmp_path, override, message):
    """The interpreter's view of what ``test_bad_input.py`` checks in-process, case by case: the
    exit status and the stderr a user sees, for one error of each kind."""
    p = run_train(["experiment=tiny_char", override, f"hydra.run.dir={tmp_path}"], cache_dir)
    assert p.returncode == 1, p.stderr[-2000:]
    assert message in p.stderr
    assert "Traceback" not in p.stderr


def test_sweep_runs_every_job_and_logs_metrics(cache_dir, tmp_path):
    p = run_train(["-m", "ppo.clip=0.1,0.3", *TINY_RUN, f"hydra.sweep.dir={tmp_path}"], cache_dir)
    assert p.returncode == 0, p.stderr[-3000:]
    for job in ("0", "1"):
        rows = read_metrics(tmp_path / job / "metrics.csv")
        assert len(rows) == 2 and "objective/scores" in rows[0]
    assert "clip: 0.3" in (tmp_path / "1" / ".hydra" / "config.yaml").read_text()


def test_only_the_keys_the_user_typed_warn_and_each_once(cache_dir, tmp_path):
    """Weighted terms on top of a reward-model group (``reward=reviews``, the default job's): the
    group's reward-model keys (``name_or_path``, ``batch_size``, ``max_length``) are the group's,
    not the user's, so none of them warns; the one the user typed, ``reward.batch_size=8`` (read
    only by a lone reward model), warns once: a job validates its config once."""
    p = run_train(
        [
            "experiment=tiny_char",
            "reward=reviews",
            "+reward.terms.x.fn=ppo_lightning.rewards.rules.char_fraction",
            "reward.batch_size=8",
            "trainer.max_steps=1",
            "logger=csv",
            "export_dir=null",
            f"hydra.run.dir={tmp_path}",
        ],
        cache_dir,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    warned = [line for line in (p.stdout + p.stderr).splitlines() if "is ignored unless" in line]
    assert len(warned) == 1 and "reward.batch_size=8 is ignored unless reward.kind=model" in warned[0], warned
