"""Cost of the PPO iteration's cross-rank metric reduction: one stacked all_reduce vs torchmetrics.

    python -m benchmarks.metric_sync
    python -m benchmarks.metric_sync --metrics 20 --iterations 200 --world-size 2

``train.metrics.iteration_metrics`` reduces its ~20 scalar metrics per iteration with ONE collective: it
stacks them and calls ``trainer.strategy.reduce(values, reduce_op="mean")`` (an all_reduce, then a
division by the world size). The alternative measured here is one ``torchmetrics`` ``MeanMetric``
per metric, each ``update(x)``, ``compute()`` (which syncs over the process group) and
``reset()``; torchmetrics syncs every state of every metric separately (a barrier and an
all_gather each, and a ``MeanMetric`` has two states), so the collectives per iteration are
counted too.

Setup: ``--world-size`` processes (``torch.multiprocessing.spawn``) on this machine, a gloo
process group on CPU (MASTER_ADDR=127.0.0.1, a free MASTER_PORT), one intra-op thread each. Per
"iteration" each rank has ``--metrics`` fresh float32 scalars (drawn before the clock starts);
timed is the reduction up to Python floats on every rank, as the module logs them. After
``--warmup`` iterations of each variant, ``--rounds`` rounds alternate the two variants
(ABBA order) so machine noise hits both, ``--iterations`` timed iterations per variant in all.
Both variants must give the same means (asserted). The MeanMetrics use ``nan_strategy="disable"``
so that, as in the module, a NaN metric stays NaN (the default drops NaNs with a warning).

Output, on rank 0: one JSON line with the workload, the median milliseconds per iteration of
each variant (rank 0's clock; a collective's time includes waiting for the other ranks), the
ratio torchmetrics / stacked, and the collectives per iteration.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.lib import cli
from benchmarks.lib.runner import alternate, free_port


def stacked(xs: list[torch.Tensor], world: int) -> list[float]:
    """What ``train.metrics.iteration_metrics`` does: one all_reduce of the stacked metrics, then the mean."""
    values = torch.stack(xs)
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    values /= world
    return values.tolist()


def with_torchmetrics(xs: list[torch.Tensor], metrics: list) -> list[float]:
    """One MeanMetric per metric: update, compute (syncs over the group), reset."""
    out = []
    for m, x in zip(metrics, xs):
        m.update(x)
        out.append(float(m.compute()))
        m.reset()
    return out


def count_collectives(fn) -> int:
    """Collective calls (all_reduce, all_gather, barrier, ...) that ``fn()`` makes."""
    names = (
        "all_reduce",
        "all_gather",
        "all_gather_into_tensor",
        "barrier",
        "broadcast",
        "reduce",
        "gather",
        "reduce_scatter",
    )
    saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}
    calls = [0]

    def counting(f):
        def wrapper(*a, **kw):
            calls[0] += 1
            return f(*a, **kw)

        return wrapper

    for n, f in saved.items():
        setattr(dist, n, counting(f))
    try:
        fn()
    finally:
        for n, f in saved.items():
            setattr(dist, n, f)
    return calls[0]


def worker(rank: int, world: int, port: int, args: argparse.Namespace, result_queue) -> None:
    from torchmetrics.aggregation import MeanMetric

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)
    dist.init_process_group(args.backend, rank=rank, world_size=world)
    try:
        metrics = [MeanMetric(nan_strategy="disable") for _ in range(args.metrics)]
        g = torch.Generator().manual_seed(1000 + rank)
        n_total = 2 * args.warmup + 2 * args.iterations + 2
        inputs = [list(torch.randn(args.metrics, generator=g).unbind()) for _ in range(n_total)]
        feed = iter(inputs)
        times = {"stacked": [], "torchmetrics": []}
        mismatch = []

        def run(variant: str, n: int, timed: bool) -> None:
            for _ in range(n):
                xs = next(feed)
                dist.barrier()  # start together, untimed
                t0 = time.perf_counter()
                if variant == "stacked":
                    got = stacked(xs, world)
                else:
                    got = with_torchmetrics(xs, metrics)
                dt = time.perf_counter() - t0
                if timed:
                    times[variant].append(dt)
                # the other variant on the same inputs, untimed: the numbers must agree
                other = with_torchmetrics(xs, metrics) if variant == "stacked" else stacked(xs, world)
                if not torch.allclose(torch.tensor(got), torch.tensor(other), rtol=1e-6, atol=1e-7):
                    mismatch.append((got, other))

        with warnings.catch_warnings():
            warnings.filterwarnings("error", message=r"The ``compute`` method")  # before update
            run("stacked", args.warmup, timed=False)
            run("torchmetrics", args.warmup, timed=False)
            per_round = max(1, args.iterations // args.rounds)

            def timed_round(variant: str):
                def go(r: int) -> None:  # the last round runs what the others left
                    run(variant, per_round if r < args.rounds - 1 else args.iterations - per_round * r, timed=True)

                return go

            alternate({v: timed_round(v) for v in ("stacked", "torchmetrics")}, args.rounds, abba=True)
            xs_a, xs_b = next(feed), next(feed)
            collectives = {
                "stacked": count_collectives(lambda: stacked(xs_a, world)),
                "torchmetrics": count_collectives(lambda: with_torchmetrics(xs_b, metrics)),
            }
        assert not mismatch, f"rank {rank}: stacked and torchmetrics means differ: {mismatch[0]}"
        # the stacked mean equals the mean computed from every rank's inputs
        everyone = [torch.empty(args.metrics) for _ in range(world)]
        dist.all_gather(everyone, torch.stack(inputs[0]))
        ref = torch.stack(everyone).mean(0)
        assert torch.allclose(torch.tensor(stacked(inputs[0], world)), ref, rtol=1e-6, atol=1e-7)
        if rank == 0:
            a = statistics.median(times["stacked"]) * 1e3
            b = statistics.median(times["torchmetrics"]) * 1e3
            result_queue.put(
                {
                    "benchmark": "metric_sync",
                    "metrics": args.metrics,
                    "world_size": world,
                    "backend": args.backend,
                    "device": "cpu",
                    "iterations": len(times["stacked"]),
                    "warmup": args.warmup,
                    "rounds": args.rounds,
                    "threads_per_rank": 1,
                    "stacked_all_reduce_ms": round(a, 4),
                    "torchmetrics_mean_metric_ms": round(b, 4),
                    "ratio_torchmetrics_over_stacked": round(b / a, 2),
                    "collectives_per_iteration": collectives,
                    "torch": torch.__version__,
                    "torchmetrics": __import__("torchmetrics").__version__,
                }
            )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def main() -> None:
    ap = cli.parser(__doc__)
    ap.add_argument("--metrics", type=int, default=20, help="scalar metrics per iteration")
    ap.add_argument("--iterations", type=int, default=200, help="timed iterations per variant")
    ap.add_argument("--warmup", type=int, default=20, help="untimed iterations per variant first")
    ap.add_argument("--rounds", type=int, default=10, help="alternations of the two variants")
    ap.add_argument("--world-size", type=int, default=2, help="processes")
    ap.add_argument("--backend", default="gloo", help="process group backend (CPU: gloo)")
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(worker, args=(args.world_size, free_port(), args, queue), nprocs=args.world_size, join=True)
    print(json.dumps(queue.get()), flush=True)


if __name__ == "__main__":
    main()
