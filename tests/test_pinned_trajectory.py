"""The single-turn trajectory, pinned: short PPO and GRPO runs give the metrics recorded in
``tests/pinned/<name>.json``, every metric that is not a wall-clock time, to 1e-4 relative (clip fractions to 0.02).

The files were first recorded on commit 4db251b, before multi-turn episodes existed, and held the
promise that the single-turn run (``env=none``) did not move when episodes arrived and through the
re-housing. They were recorded again when the ``hf`` sampler moved from an exponential race (a
uniform per vocabulary entry) to an inverse-CDF draw (one uniform per row), which changes every
seeded sample; they keep the trajectory through later refactors. A change that is meant to alter
the trajectory records them again
(``PPO_LIGHTNING_REPIN=1 pytest tests/test_pinned_trajectory.py``) and says why in its commit.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import compose_cfg, read_metrics

PINNED = Path(__file__).parent / "pinned"
RUNS = {
    "ppo": [],
    # each row encodes its prompt, and minibatches are shuffled rows, as when the pin was recorded
    # (tests/test_shared_prompt.py: encoding each prompt once gives the same update)
    "grpo": [
        "ppo.advantage=grpo",
        "ppo.num_generations=4",
        "ppo.kl_in=loss",
        "ppo.kl_coef=0.04",
        "ppo.shared_prompt_forward=false",
    ],
}
SHORT = [
    "data.batch_size=8",
    "ppo.minibatch_size=4",
    "ppo.ppo_epochs=2",
    "sampling.max_new_tokens=8",
    "trainer.max_steps=3",
    "trainer.enable_progress_bar=false",
    "trainer.enable_model_summary=false",
    "callbacks=none",
    "export_dir=null",
]


def wall_clock(key: str) -> bool:
    """A metric that times something: no two runs agree on it (``tests.helpers.wall_clock``)."""
    return key.startswith("perf/") or key == "env/time_s"


def run_rows(name: str, tmp_path: Path, cache_dir: Path) -> list[dict[str, float]]:
    """The metrics rows of run ``name`` (``experiment=tiny_char``, 3 iterations), wall clock left
    out. On one thread: the sums inside a matrix product are split by thread count, and a few
    roundings apart a clip decision (``val/clipfrac_avg``) can flip; one thread gives the same
    floats on any number of cores (and under ``pytest -n``). A clip fraction counts tokens at a
    threshold, so it is compared to 0.02 (one token of 128 is 0.008): since ``ppo.remove_padding``
    each minibatch's forward runs on its own window, a rounding apart from the rollout's."""
    import torch

    from ppo_lightning.jobs.run import train

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        train(compose_cfg([*SHORT, *RUNS[name]], tmp_path, cache_dir))
    finally:
        torch.set_num_threads(threads)
    return [{k: v for k, v in row.items() if not wall_clock(k)} for row in read_metrics(tmp_path / "metrics.csv")]


@pytest.mark.parametrize("name", list(RUNS))
def test_the_single_turn_trajectory_is_the_pinned_one(name, tmp_path, cache_dir):
    got = run_rows(name, tmp_path, cache_dir)
    path = PINNED / f"{name}.json"
    if os.environ.get("PPO_LIGHTNING_REPIN") == "1":
        path.write_text(json.dumps({"overrides": [*SHORT, *RUNS[name]], "rows": got}, indent=1) + "\n")
    pinned = json.loads(path.read_text())["rows"]
    assert len(got) == len(pinned) == 3
    for step, (want, row) in enumerate(zip(pinned, got)):
        assert set(want) <= set(row), (step, sorted(set(want) - set(row)))  # a metric may be added, not lost
        for key, value in want.items():
            tol = dict(abs=0.02) if "clipfrac" in key else dict(rel=1e-4, abs=1e-6)  # counts at a threshold
            assert row[key] == pytest.approx(value, **tol), (name, step, key)
