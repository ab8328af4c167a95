"""Which ``ppo.engine_correction``: every mode's importance weights on the same engine samples, with
the vLLM engine in bfloat16 against a float32 trainer (the mismatch of a GPU run's bf16 engine).

    .venv-vllm/bin/python -m benchmarks.engine_correction                         # ~5 min on 2 cores
    .venv-vllm/bin/python -m benchmarks.engine_correction --engine-dtype float32  # no mismatch

One run of ``experiment=math_chat`` (its SFT policy: peaked distributions, as a real policy's)
for ``--iterations`` iterations with ``generation=vllm generation.dtype=<--engine-dtype>`` and
``ppo.engine_correction=none``. At every rollout a wrapper around ``algo.algorithm.engine_view``
(put there from outside; ``ppo_lightning`` is unchanged) keeps the old policy's logprobs of the
sampled tokens, the engine's, and the response mask. Then each mode's weights
(``algo.losses.engine_weights``, ``--cap``) over all of them. Printed, one JSON line a mode and a
markdown table:

* ``changed``: the share of response tokens whose weight is not 1 (by more than 1e-3);
* ``dropped``: the share whose weight is 0 (the ``*_mask`` modes past the cap);
* ``ess``: the weights' effective sample size over the tokens, ``(sum w)^2 / (n sum w^2)``;
* ``w_short`` / ``w_long``: the mean token weight in the shortest and the longest third of the
  completions. A ``sequence_*`` mode's ratio is a product over the completion, so its log grows
  with the length like a random walk, and long completions are capped or dropped more often.

and the mismatch itself, as a run logs it each rollout (``rollout/engine_kl``: ``E[log pi_engine -
log pi_old]``, ``engine_logprob_diff``: the mean ``|log rho|`` a token, ``engine_capped_frac``,
``engine_ess``; docs/metrics.md), over all the rollouts, and the largest ``|log rho|``.
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import json
import tempfile

from benchmarks.lib import cli

MODES = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def collect(iterations: int, engine_dtype: str, cache_dir: str, out_dir: str) -> list[tuple]:
    """Run math_chat under the engine and return each rollout's (old logprobs, engine logprobs,
    response mask)."""
    from ppo_lightning.algo import algorithm
    from ppo_lightning.jobs.factory import compose_config
    from ppo_lightning.jobs.run import run_task

    kept, original = [], algorithm.engine_view

    def engine_view(r, *args, **kwargs):
        original(r, *args, **kwargs)
        kept.append((r.sampling_logprobs.clone(), r.engine_logprobs.clone(), r.response_mask.clone()))

    algorithm.engine_view = engine_view
    try:
        cfg = compose_config(
            [
                "experiment=math_chat",
                "generation=vllm",
                f"generation.dtype={engine_dtype}",
                "generation.kv_cache_memory_bytes=268435456",
                f"trainer.max_steps={iterations}",
                "eval.every_n_iterations=null",
                "logger=csv",
                "callbacks=none",
                "export_dir=null",
                f"paths.output_dir={out_dir}",
                f"paths.cache_dir={cache_dir}",
                "trainer.enable_progress_bar=false",
            ]
        )
        run_task(cfg)
    finally:
        algorithm.engine_view = original
    return kept


def mode_stats(kept: list[tuple], mode: str, cap: float) -> dict:
    """The weights of ``mode`` over every kept rollout: what they change, drop, and weigh by length."""
    import torch

    from ppo_lightning.algo.losses import engine_weights

    ws, lengths = [], []
    for old, engine, mask in kept:
        w = engine_weights(old, engine, mask, mode, cap)
        w = mask if w is None else w
        n = mask.sum(1)
        ws += [w[i, mask[i].bool()] for i in range(len(n))]
        lengths += n.tolist()
    order = sorted(range(len(ws)), key=lambda i: lengths[i])
    third = len(order) // 3
    tokens = torch.cat(ws)
    mean_of = lambda idx: torch.cat([ws[i] for i in idx]).mean().item()  # noqa: E731
    return {
        "mode": mode,
        "changed": (tokens - 1).abs().gt(1e-3).float().mean().item(),
        "dropped": tokens.eq(0).float().mean().item(),
        "ess": (tokens.sum() ** 2 / (len(tokens) * (tokens**2).sum())).item(),
        "w_short": mean_of(order[:third]),
        "w_long": mean_of(order[-third:]),
    }


def mismatch(kept: list[tuple], cap: float) -> dict:
    """The engine's distance from the trainer over every kept response token: the figures a run
    logs each rollout (``train.metrics.engine_mismatch``: ``engine_kl``, ``engine_logprob_diff``,
    ``engine_capped_frac``, ``engine_ess``), pooled over the rollouts, and the largest
    ``|log rho|``."""
    from types import SimpleNamespace

    import torch

    from ppo_lightning.train.metrics import engine_mismatch

    old = torch.cat([o[mask.bool()] for o, _, mask in kept])  # every response token, end to end
    engine = torch.cat([e[mask.bool()] for _, e, mask in kept])
    pooled = SimpleNamespace(
        sampling_logprobs=old, engine_logprobs=engine, response_mask=torch.ones_like(old), staleness=None
    )
    figures = {k.removeprefix("rollout/"): v.item() for k, v in engine_mismatch(pooled, cap).items()}
    return {"tokens": len(old), **figures, "max_abs_log_rho": (old - engine).abs().max().item()}


def main() -> None:
    ap = cli.parser(__doc__)
    ap.add_argument("--iterations", type=int, default=8, help="math_chat iterations (16 prompts x 8 each)")
    ap.add_argument("--engine-dtype", default="bfloat16", help="generation.dtype (the trainer stays float32)")
    ap.add_argument("--cap", type=float, default=2.0, help="ppo.engine_correction_cap")
    ap.add_argument("--cache-dir", help="paths.cache_dir (the math_chat build; default: a temp dir)")
    cli.add_threads(ap)
    args = ap.parse_args()
    cli.set_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        kept = collect(args.iterations, args.engine_dtype, args.cache_dir or f"{tmp}/cache", f"{tmp}/run")
    print(json.dumps({"engine_dtype": args.engine_dtype, "cap": args.cap, **mismatch(kept, args.cap)}))
    rows = [mode_stats(kept, m, args.cap) for m in MODES]
    for r in rows:
        print(json.dumps(r))
    print("| mode | tokens changed | tokens dropped | ESS | mean weight, shortest third | longest third |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| `{r['mode']}` | {r['changed']:.2%} | {r['dropped']:.2%} | {r['ess']:.4f} "
            f"| {r['w_short']:.4f} | {r['w_long']:.4f} |"
        )


if __name__ == "__main__":
    main()
