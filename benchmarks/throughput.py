"""PPO throughput of ppo_lightning on a named workload: one JSON line on stdout.

    python -m benchmarks.throughput --workload tiny
    python -m benchmarks.throughput --workload small --compare-generate
    python -m benchmarks.throughput --workload medium   # GPT-2 small's shape, ~2 min on 2 cores

The run is the real thing: ``train.py``'s config composed by Hydra, the reward-model path
(``reward=model`` on a random GPT-2 sequence classifier), a Lightning Trainer, ``max_steps``
PPO iterations. Reported: ``episodes_per_s`` and ``generated_tokens_per_s`` over ``trainer.fit``
(model loading excluded), ``rollout_s`` / ``update_s`` summed from the module's per-iteration
timers, and peak RSS.

``--trainer grpo`` runs ppo_lightning's GRPO on the same workload instead (what
``benchmarks.compare_trl --trainer grpo`` sets beside TRL's ``GRPOTrainer``): ``--prompts`` P prompts x
``--generations`` G completions per iteration (default 8 x 4), ``ppo.advantage=grpo``, the k3
KL in the loss (``ppo.kl_in=loss``), one pass over one minibatch of all P x G rows, and a
function reward (``benchmarks/lib/grpo_workload.py``) instead of the reward model, for the workload's
``iterations`` (``--iterations``). ``episodes_per_s`` is then completions/s (also reported as
``completions_per_s``)::

    python -m benchmarks.throughput --workload tiny --trainer grpo
    python -m benchmarks.throughput --workload medium --trainer grpo --prompts 8 --generations 4

``--override KEY=VALUE`` (repeatable) adds a Hydra override last, e.g.
``--override trainer.precision=bf16-mixed`` for the update and the rollout's forwards under bf16
autocast.

``--backend hf|vllm`` picks the generation backend (``generation=<backend>``; default hf).
A backend whose ``conf/generation/<backend>.yaml`` does not exist, or that cannot be built here,
stops the run with "generation=<backend> not available".

``--compare-generate`` also times generation alone on one rollout batch, alternating our
KV-cache sampler (``generation.hf.generate``) with a bare ``model.generate(use_cache=True)`` on the same
prompts and lengths, and reports the ratio (median of ``--repeats`` alternations; both measured in
this process, so machine noise hits both).
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import json
import tempfile
from pathlib import Path

import torch

from benchmarks.lib import cli
from benchmarks.lib.grpo_workload import DEFAULT_GENERATIONS, DEFAULT_PROMPTS
from benchmarks.lib.measure import peak_rss_mb
from benchmarks.lib.ours import backend_available, compare_generate, run_ppo
from benchmarks.lib.workloads import WORKLOADS


def main() -> None:
    ap = cli.parser(__doc__)
    cli.add_workload(ap)
    cli.add_model_dir(ap)
    cli.add_threads(ap)
    ap.add_argument(
        "--compare-generate",
        action="store_true",
        help="also time generation alone against bare model.generate(use_cache=True)",
    )
    ap.add_argument("--repeats", type=int, default=5, help="alternations for --compare-generate")
    ap.add_argument("--trainer", choices=("ppo", "grpo"), default="ppo", help="the algorithm run (default: ppo)")
    ap.add_argument("--backend", default="hf", help="generation backend: generation=<backend> (hf, vllm; default hf)")
    ap.add_argument("--prompts", type=int, help="--trainer grpo: prompts per iteration (default 8)")
    ap.add_argument("--generations", type=int, help="--trainer grpo: completions per prompt (default 4)")
    ap.add_argument("--iterations", type=int, help="iterations (default: the workload's)")
    ap.add_argument(
        "--override",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a Hydra override of the run's config, last (repeatable; e.g. trainer.precision=bf16-mixed)",
    )
    args = ap.parse_args()
    if args.trainer == "ppo" and (args.prompts or args.generations):
        ap.error("--prompts and --generations need --trainer grpo (PPO takes the workload's shape)")
    if args.backend != "hf":
        backend_available(args.backend)
    cli.set_threads(args.threads)
    w = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory() as tmp:
        model_root = Path(args.model_dir) if args.model_dir else Path(tmp) / "models"
        out_dir = Path(tmp) / "run"
        out_dir.mkdir()
        run = run_ppo(
            w,
            model_root,
            out_dir,
            args.trainer,
            args.prompts or DEFAULT_PROMPTS,
            args.generations or DEFAULT_GENERATIONS,
            args.iterations,
            args.backend,
            overrides=args.override,
        )
        result = {"impl": "ppo_lightning", "workload": w.name, **run, "overrides": args.override}
        if args.compare_generate:
            result.update(compare_generate(w, model_root, args.repeats))
    result["peak_rss_mb"] = peak_rss_mb()
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
