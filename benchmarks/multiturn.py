"""What a multi-turn iteration costs against a single-turn one of the same token count.

    python -m benchmarks.multiturn                         # hf backend, 3 turns of 16 tokens
    .venv-vllm/bin/python -m benchmarks.multiturn --backend vllm

Both sides run the real job (``train.py``'s config composed by Hydra, a Lightning Trainer) on the
tiny byte model and the toy prompts, alternating, ``--rounds`` times:

- **multi-turn**: ``env=function`` with ``FixedReply``, an environment that answers each policy
  turn with a user message of ``--reply`` characters, ``--turns`` policy turns of at most
  ``--turn-tokens`` tokens each (``sampling.max_new_tokens``);
- **single-turn**: no environment, every response ``stop_at_eos=false`` at the multi-turn run's
  mean response length (policy and environment tokens), so both update on the same number of
  positions.

Reported per side: the median seconds of an iteration (rollout + update, the first iteration
left out), of its rollout and its update, response tokens per episode, and the ratio
multi / single, with ``env/time_s`` (the episode loop outside sampling) and the environment's
share of the tokens. One JSON line.
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import json
import statistics
import tempfile
from pathlib import Path

import lightning as L

from benchmarks.lib import cli
from benchmarks.lib.measure import median_of
from benchmarks.lib.runner import alternate, ratios
from ppo_lightning.envs import Environment, EnvStep


class FixedReply(Environment):
    """Answers each of the first ``turns - 1`` policy turns with ``reply`` as a user message."""

    def __init__(self, turns: int = 3, reply: str = "go on"):
        self.turns, self.reply = turns, reply

    def reset(self, record):
        self.n = 0
        return None

    def step(self, messages):
        self.n += 1
        done = self.n >= self.turns
        return EnvStep([] if done else [{"role": "user", "content": self.reply}], done=done)


class IterationTimes(L.Callback):
    def __init__(self):
        self.rows: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.rows.append(dict(pl_module.last_metrics))


def run(overrides: list[str], out: Path) -> list[dict]:
    from ppo_lightning.jobs.factory import build_module, compose_config
    from ppo_lightning.jobs.trainer import build_trainer

    cfg = compose_config(
        [
            "experiment=tiny_char",
            "logger=none",
            "callbacks=none",
            "export_dir=null",
            "trainer.enable_progress_bar=false",
            "trainer.enable_model_summary=false",
            "reward.normalize=false",
            f"paths.output_dir={out}",
            *overrides,
        ]
    )
    module, datamodule = build_module(cfg)
    times = IterationTimes()
    trainer = build_trainer(cfg, extra_callbacks=[times])
    trainer.fit(module, datamodule=datamodule)
    return times.rows


def summary(rows: list[dict]) -> dict:
    rows = rows[1:]  # the first iteration warms up (allocations, the engine's start)

    def med(key: str) -> float:
        return median_of(rows, key)

    rollout, update = med("perf/time_rollout_s"), med("perf/time_update_s")
    out = {
        "iteration_s": round(rollout + update, 4),
        "rollout_s": round(rollout, 4),
        "update_s": round(update, 4),
        "policy_tokens_per_episode": round(med("rollout/response_length"), 2),
    }
    if "env/turns_mean" in rows[0]:
        out.update(
            turns=round(med("env/turns_mean"), 2),
            env_token_frac=round(med("env/env_token_frac"), 3),
            env_time_s=round(med("env/time_s"), 4),
        )
    return out


def main() -> None:
    ap = cli.parser(__doc__)
    ap.add_argument("--backend", default="hf", choices=["hf", "vllm"])
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument("--reply", default="go on, say more", help="the environment's message")
    ap.add_argument("--iterations", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    common = [
        f"generation={args.backend}",
        f"data.batch_size={args.batch}",
        f"ppo.minibatch_size={args.batch}",
        f"trainer.max_steps={args.iterations}",
        "data.max_prompt_length=64",
    ]
    multi = [
        *common,
        "env=function",
        "env._target_=benchmarks.multiturn.FixedReply",
        f"+env.turns={args.turns}",
        f"+env.reply='{args.reply}'",
        "env.max_total_tokens=180",
        f"env.max_turns={args.turns}",
        f"sampling.max_new_tokens={args.turn_tokens}",
    ]
    length = 0  # the single-turn responses': the multi-turn run's of the same round, policy and env tokens

    def multi_turn(r: int) -> dict:
        nonlocal length
        rows = run(multi, Path(tmp) / f"multi{r}")
        length = round(
            statistics.mean(row["rollout/response_length"] / (1 - row["env/env_token_frac"]) for row in rows)
        )
        return summary(rows)

    def single_turn(r: int) -> dict:
        single = [*common, f"sampling.max_new_tokens={length}", "sampling.stop_at_eos=false"]
        return {**summary(run(single, Path(tmp) / f"single{r}")), "response_tokens": length}

    with tempfile.TemporaryDirectory() as tmp:
        results = alternate({"multi_turn": multi_turn, "single_turn": single_turn}, args.rounds)
    per_round = ratios(results["multi_turn"], results["single_turn"], "iteration_s")
    print(
        json.dumps(
            {
                "backend": args.backend,
                "turns": args.turns,
                "turn_tokens": args.turn_tokens,
                "batch": args.batch,
                "rounds": results,
                "ratio_multi_over_single": round(statistics.median(per_round), 3),
                "ratios": [round(x, 3) for x in per_round],
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
