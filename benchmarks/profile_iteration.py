"""Where one iteration's time goes, ppo_lightning against TRL: phase timers and a CPU profile.

    python -m benchmarks.profile_iteration --workload medium --threads 1 --out prof/   # ~20 min on 2 cores
    python -m benchmarks.profile_iteration --workload tiny --trainer grpo --out prof/  # a smoke run

For each trainer (``--trainer ppo|grpo|both``) and each side (``--side ours|trl|both``) a fresh
subprocess (``python -m benchmarks.profile_iteration --child <side>``) runs the job
``benchmarks.compare_trl`` runs (ours: ``benchmarks.lib.ours.run_ppo``; TRL 1.12's ``PPOTrainer``:
``benchmarks.lib.trl_ppo`` under ``--trl-ppo-python``; TRL 1.16's ``GRPOTrainer``:
``benchmarks.lib.trl_grpo`` under ``--trl-python``), for ``--iterations`` iterations (default 3): the
first ones warm up, the second to last is timed by phase without the profiler, the last runs in
``torch.profiler.profile(activities=[CPU], record_shapes=False, with_flops=True)``. An iteration:
ours, Lightning's ``on_train_batch_start`` to ``on_train_batch_end`` (rollout and update);
PPOTrainer, one ``batch_generation`` call to the next (the last: to the end of ``train()``);
GRPOTrainer, ``on_step_begin`` to ``on_step_end``. Phases come from wrappers this script puts
around library calls from outside (nothing in ``ppo_lightning`` is changed), each timed and
inside ``record_function("phase:<name>")``:

* ``generation``: the sampling loop (ours: ``HFBackend.generate``; PPOTrainer:
  ``batch_generation``; GRPOTrainer: ``_generate_single_turn``, HF ``generate``);
* ``backward``: ``torch.autograd.backward`` (what ``loss.backward()`` calls);
* ``optimizer``: ``Optimizer.step`` (torch's global step hooks; ``Optimizer.step#`` /
  ``Optimizer.zero_grad#`` labels in the profile) and ``torch.nn.utils.clip_grad_norm_``;
* ``forwards+rest``: the rest of the iteration: the forwards outside generation (old-policy /
  value / reference / reward forwards, the training forward), losses, advantages, bookkeeping.

In the profiled iteration each phase has its wall time and its op time (the self CPU time of
every ``aten::`` op that started inside it); ``other`` is the wall time minus all op time: Python,
Lightning / HF / TRL code, autograd-engine and dispatcher overhead between ops. ``matmul`` is the
self time of the matmul-class ops (``aten::mm``, ``addmm``, ``bmm``, ``baddbmm``, ``matmul``,
``linear``, ``mv``, ``addmv``, their in-place ``addmm_`` and the like, ``_scaled_dot_product*``,
forward and backward alike), ``gflop`` the profiler's FLOP count of ``mm``/``addmm``/``bmm``/
``baddbmm``, and GFLOP/s that count over those ops' time. Not counted: attention inside
``_scaled_dot_product*`` (~3% on medium) and in-place ``addmm_`` (TRL 1.16's chunked LM-head
backward: ~10 GFLOP a completion on medium).

The machine's limit: each child also measures the GFLOP/s of a 2048 x 2048 fp32 matmul on its own
threads (``measure.gemm_peak_gflops``; both sides run fp32 on CPU), and the tables hold two MFUs
against it: the matmul ops' own rate (how well the iteration's shapes use the kernels) and the
iteration's (its counted matmul FLOPs over its unprofiled wall time: everything else counts
against it too).

The bound: with no overhead and no non-matmul ops, our iteration would take its matmul time,
estimated as the unprofiled wall time x the profiled matmul fraction, so our speedup over TRL
could be at most TRL's unprofiled wall / that.

The profiled iteration runs with glibc's mmap threshold fixed at ``--mmap-threshold`` (default 1
MiB, ``mallopt(M_MMAP_THRESHOLD)`` just before the profiler starts; the warm-up and the timed
iteration keep glibc's default). With glibc's dynamic threshold (up to 32 MiB) the profiler's
records, allocated between the tensors, fragment the heap: TRL's GRPO child on medium (11.4 GB
unprofiled) passed 23 GB and was OOM-killed, and 2 x ``generate`` of 32 x 64 tokens grew to 18 GB
and took 2.3x as long as unprofiled. Fixed, the RSS follows the live tensors, but every tensor over
the threshold is a fresh ``mmap`` whose page faults land in the op that first writes it; code that
allocates a lot (HF ``generate``'s ``torch.cat`` of the KV cache every token) slows down most, so
the profiled iteration's proportions overstate TRL's non-matmul time: read the wall times and
phases from the unprofiled iteration, and our matmul fraction (our side allocates little) and the
FLOPs from the profiled one.

Writes, under ``--out``: ``<trainer>_<side>.json`` (every number), ``<trainer>_<side>_ops.txt``
(the top ``--top`` ops by self CPU time; a ``phase:*`` row's self time is Python between ops),
and ``summary.md`` (the tables, also printed; ``--summarize`` rebuilds it from the JSON). Run with
``--threads 1`` (one intra-op thread on both sides; see ``benchmarks.compare_trl``).
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import argparse
import bisect
import collections
import ctypes
import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.lib import cli
from benchmarks.lib.grpo_workload import DEFAULT_GENERATIONS, DEFAULT_PROMPTS
from benchmarks.lib.measure import gemm_peak_gflops
from benchmarks.lib.runner import ROOT, absolute, module_cmd
from benchmarks.lib.workloads import WORKLOADS, build_models

MATMUL_OPS = frozenset(
    f"aten::{n}{inplace}"
    for n in ("mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "mv", "addmv", "dot")
    for inplace in ("", "_")
)
FLOP_OPS = frozenset(f"aten::{n}" for n in ("mm", "addmm", "bmm", "baddbmm"))  # the profiler counts these
PHASES = ("generation", "forwards+rest", "backward", "optimizer")
LABEL = "phase:"
M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter


def is_matmul(name: str) -> bool:
    return name in MATMUL_OPS or name.startswith(("aten::_scaled_dot_product", "aten::scaled_dot_product"))


# ----------------------------------------------------------------------------- in the child
class Iterations:
    """Called at each iteration's start and end (1-based): times iteration ``n - 1`` by phase,
    profiles iteration ``n``."""

    def __init__(self, n: int, mmap_threshold: int):
        if n < 2:
            raise ValueError("needs at least 2 iterations: one timed, one profiled")
        self.n, self.mmap_threshold = n, mmap_threshold
        self.timing: collections.Counter | None = None  # phase seconds while the timed iteration runs
        self.timed: dict | None = None
        self.prof = None
        self.wall_s: float | None = None  # the profiled iteration's

    def begin(self, k: int) -> None:
        if k == self.n - 1:
            self.timing, self.t0 = collections.Counter(), time.perf_counter()
        elif k == self.n:
            import torch

            if self.mmap_threshold:
                ctypes.CDLL("libc.so.6").mallopt(M_MMAP_THRESHOLD, self.mmap_threshold)
            self.prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=False, with_flops=True
            )
            self.prof.__enter__()
            self.t0 = time.perf_counter()

    def end(self, k: int) -> None:
        if k == self.n - 1 and self.timing is not None and self.timed is None:
            wall = time.perf_counter() - self.t0
            phases = {p: self.timing[p] for p in PHASES if p != "forwards+rest"}
            phases["forwards+rest"] = wall - sum(phases.values())
            self.timed, self.timing = {"wall_s": wall, "phases": phases}, None
        elif k == self.n and self.prof is not None and self.wall_s is None:
            self.wall_s = time.perf_counter() - self.t0
            self.prof.__exit__(None, None, None)

    def add(self, phase: str, seconds: float) -> None:
        if self.timing is not None:
            self.timing[phase] += seconds

    def analyse(self, top: int) -> tuple[dict, str]:
        """The profiled iteration's breakdown (seconds) and its top-``top`` ops table."""
        if self.wall_s is None or self.timed is None:
            raise RuntimeError("the timed or the profiled iteration never ran")
        events = self.prof.events()
        intervals = []  # (start_us, end_us, phase) of the phase labels
        for e in events:
            phase = None
            if e.name.startswith(LABEL):
                phase = e.name[len(LABEL) :]
            elif e.name.startswith(("Optimizer.step#", "Optimizer.zero_grad#")):
                phase = "optimizer"
            if phase is not None:
                intervals.append((e.time_range.start, e.time_range.end, phase))
        intervals.sort()
        outer = []  # outermost labels only
        for iv in intervals:
            if not outer or iv[0] >= outer[-1][1]:
                outer.append(iv)
        starts = [iv[0] for iv in outer]
        keys = ("wall_s", "op_s", "matmul_s", "gflop", "flop_op_s")
        ph = {p: dict.fromkeys(keys, 0.0) for p in PHASES}
        for s, e, p in outer:
            ph[p]["wall_s"] += (e - s) / 1e6
        ph["forwards+rest"]["wall_s"] = self.wall_s - sum(ph[p]["wall_s"] for p in PHASES if p != "forwards+rest")
        for e in events:
            if not e.name.startswith("aten::"):
                continue  # labels, autograd nodes, the engine's own events: not op time
            t = e.time_range.start
            i = bisect.bisect_right(starts, t) - 1
            p = outer[i][2] if i >= 0 and t < outer[i][1] else "forwards+rest"
            self_s = e.self_cpu_time_total / 1e6
            ph[p]["op_s"] += self_s
            if is_matmul(e.name):
                ph[p]["matmul_s"] += self_s
            if e.name in FLOP_OPS:
                ph[p]["gflop"] += (e.flops or 0) / 1e9
                ph[p]["flop_op_s"] += self_s
        op_s = sum(v["op_s"] for v in ph.values())
        profiled = {
            "wall_s": self.wall_s,
            "op_s": op_s,
            "other_s": self.wall_s - op_s,
            **{k: sum(v[k] for v in ph.values()) for k in ("matmul_s", "gflop", "flop_op_s")},
            "phases": ph,
        }
        table = self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=top)
        return {"timed": self.timed, "profiled": profiled}, table


def label(name: str, fn, its: Iterations):
    """``fn`` timed into ``its`` and inside ``record_function("phase:<name>")``."""
    import torch

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(LABEL + name):
                return fn(*args, **kwargs)
        finally:
            its.add(name, time.perf_counter() - t0)

    return wrapped


def label_backward_and_optimizer(its: Iterations) -> None:
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    torch.autograd.backward = label("backward", torch.autograd.backward, its)  # what Tensor.backward calls
    torch.nn.utils.clip_grad_norm_ = label("optimizer", torch.nn.utils.clip_grad_norm_, its)
    t0 = [0.0]  # the profile has torch's own Optimizer.step# label; the timed iteration these hooks
    register_optimizer_step_pre_hook(lambda opt, a, k: t0.__setitem__(0, time.perf_counter()))
    register_optimizer_step_post_hook(lambda opt, a, k: its.add("optimizer", time.perf_counter() - t0[0]))


def child_ours(args, w, model_root: Path, its: Iterations) -> dict:
    import lightning as L
    import torch

    import ppo_lightning.generation.hf as hf
    from benchmarks.lib.ours import run_ppo

    hf.HFBackend.generate = label("generation", hf.HFBackend.generate, its)
    label_backward_and_optimizer(its)
    cli.set_threads(args.threads)

    class Phases(L.Callback):
        k = 0  # batch_idx restarts with each epoch over the prompt set

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.k += 1
            its.begin(self.k)

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            its.end(self.k)

    prompts, generations = args.prompts or DEFAULT_PROMPTS, args.generations or DEFAULT_GENERATIONS
    with tempfile.TemporaryDirectory() as tmp:
        out_dir = Path(tmp) / "run"
        out_dir.mkdir()
        run_ppo(w, model_root, out_dir, args.trainer, prompts, generations, its.n, callbacks=[Phases()])
    rows = prompts * generations if args.trainer == "grpo" else w.rollout_batch
    return {"completions": rows, "threads": torch.get_num_threads()}


def child_trl_ppo(args, w, model_root: Path, its: Iterations) -> dict:
    import torch
    import trl
    import trl.experimental.ppo.ppo_trainer as ppo_trainer_module

    from benchmarks.lib.trl_ppo import build_trainer, train

    label_backward_and_optimizer(its)
    run = build_trainer(w, model_root, episodes=its.n * w.rollout_batch, threads=args.threads)
    generation, k = label("generation", ppo_trainer_module.batch_generation, its), [0]  # over the timer's

    def batch_generation(*a, **kw):  # once per iteration: one chunk of rollout_batch rows
        if k[0]:
            its.end(k[0])
        k[0] += 1
        its.begin(k[0])
        return generation(*a, **kw)

    ppo_trainer_module.batch_generation = batch_generation
    orig_train = run.trainer.train

    def train_then_end():
        out = orig_train()
        its.end(k[0])
        return out

    run.trainer.train = train_then_end
    train(run)
    run.tmp.cleanup()
    return {"completions": w.rollout_batch, "trl_version": trl.__version__, "threads": torch.get_num_threads()}


def child_trl_grpo(args, w, model_root: Path, its: Iterations) -> dict:
    import torch
    import trl
    from transformers import TrainerCallback

    from benchmarks.lib.trl_grpo import build_trainer, train

    label_backward_and_optimizer(its)
    prompts, generations = args.prompts or DEFAULT_PROMPTS, args.generations or DEFAULT_GENERATIONS
    with tempfile.TemporaryDirectory(prefix="trl-grpo-") as tmp:
        trainer, timer = build_trainer(w, model_root, prompts, generations, its.n, Path(tmp))
        if args.threads:
            torch.set_num_threads(args.threads)
        trainer._generate_single_turn = label("generation", trainer._generate_single_turn, its)  # over the timer's

        class Phases(TrainerCallback):
            def on_step_begin(self, a, state, control, **kwargs):
                its.begin(state.global_step + 1)

            def on_step_end(self, a, state, control, **kwargs):
                its.end(state.global_step)

        trainer.add_callback(Phases())
        train(w, trainer, timer, prompts, generations, its.n)
    return {"completions": prompts * generations, "trl_version": trl.__version__, "threads": torch.get_num_threads()}


def child(args) -> None:
    w = WORKLOADS[args.workload]
    its = Iterations(args.iterations, args.mmap_threshold)
    if args.child == "ours":
        fn = child_ours
    else:
        from benchmarks.lib.trl_side import stdout_for_one_line

        stdout_for_one_line()  # TRL's prints go to stderr; nothing is read from stdout here
        fn = child_trl_grpo if args.trainer == "grpo" else child_trl_ppo
    info = fn(args, w, Path(args.model_dir), its)
    info["gemm_peak_gflops"] = gemm_peak_gflops("float32")  # on the threads the run had
    breakdown, table = its.analyse(args.top)
    name = f"{args.trainer}_{args.child}"
    out = Path(args.out)
    (out / f"{name}_ops.txt").write_text(table)
    result = {"side": args.child, "trainer": args.trainer, "workload": w.name, "iterations": its.n, **info}
    result.update(breakdown, mmap_threshold=args.mmap_threshold)
    (out / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")


# ----------------------------------------------------------------------------- the parent
def shape_gflop(w, trainer: str) -> float:
    """A lower bound on the matmul GFLOP one completion needs (the model's shape, no attention):
    sampling (prompt prefill, then one token a step, the LM head on the sampled positions only),
    the reference forward and one training forward over prompt + response (the head on response
    positions), its backward (2x); PPO adds the reward model's forward (the backbone, once) and
    the rest of its ``ppo_epochs`` forward+backward passes (the value head is one row: free); at
    the workload's mean prompt and completion lengths where they vary (``gsm8k_like``)."""
    d, L, V, P, R = w.n_embd, w.n_layer, w.vocab_size or 258, w.expected_prompt_tokens, w.expected_response_tokens
    n = 12 * d * d * L  # the blocks' weights (attention 4d^2, MLP 8d^2 a layer)
    h = d * V  # the LM head
    fwd = 2 * n * (P + R) + 2 * h * R  # one forward over prompt + response, head on the response
    sample = 2 * n * (P + R - 1) + 2 * h * R
    flops = sample + fwd + 3 * fwd  # + the reference forward, + a training forward and its backward
    if trainer == "ppo":
        flops += 2 * n * (P + R) + (w.ppo_epochs - 1) * 3 * fwd
    return flops / 1e9


def sec(x: float) -> str:
    return f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def our_matmul_s(ours: dict) -> float:
    """Our matmul time in the unprofiled iteration: its wall x the profiled matmul fraction."""
    return ours["timed"]["wall_s"] * ours["profiled"]["matmul_s"] / ours["profiled"]["wall_s"]


def mfu(v: dict) -> tuple[float, float] | None:
    """A side's two MFUs against its ``gemm_peak_gflops``: its matmul ops' rate (profiled FLOPs
    over those ops' time) and its iteration's (profiled FLOPs over the unprofiled wall time);
    None for a result from before the peak was measured."""
    peak, p = v.get("gemm_peak_gflops"), v["profiled"]
    if not peak or not p["flop_op_s"]:
        return None
    return p["gflop"] / p["flop_op_s"] / peak, p["gflop"] / v["timed"]["wall_s"] / peak


def summary(results: dict, workload) -> str:
    """Two markdown tables, a column per (trainer, side) profiled, then the bound per trainer."""
    cols = [
        (
            f"{t.upper()} {'ours' if side == 'ours' else 'TRL ' + results[t, side].get('trl_version', '')}",
            results[t, side],
        )
        for t in ("grpo", "ppo")
        for side in ("ours", "trl")
        if (t, side) in results
    ]
    if not cols:
        return ""
    rows = {t: next((r["completions"] for (tt, _), r in results.items() if tt == t), "-") for t in ("grpo", "ppo")}
    lines = []

    def table(title, body):
        lines.extend([title, "", "| | " + " | ".join(k for k, _ in cols) + " |", "|---" * (len(cols) + 1) + "|"])
        for name, fn in body:
            lines.append(f"| {name} | " + " | ".join(fn(v) for _, v in cols) + " |")
        lines.append("")

    def pct(v, key):
        return f"{sec(v['profiled'][key])} ({v['profiled'][key] / v['profiled']['wall_s']:.0%})"

    table(
        f"{workload.name}, one iteration (GRPO {rows['grpo']} completions, PPO {rows['ppo']}), threads "
        f"{cols[0][1]['threads']}; seconds. Phases: the unprofiled iteration; op classes: the profiled one",
        [
            ("iteration wall", lambda v: sec(v["timed"]["wall_s"])),
            ("generation (sampling loop)", lambda v: sec(v["timed"]["phases"]["generation"])),
            ("forwards outside generation, losses, rest", lambda v: sec(v["timed"]["phases"]["forwards+rest"])),
            ("backward", lambda v: sec(v["timed"]["phases"]["backward"])),
            ("optimizer step + clip", lambda v: sec(v["timed"]["phases"]["optimizer"])),
            ("profiled iteration wall", lambda v: sec(v["profiled"]["wall_s"])),
            ("matmul-class ops, fwd + bwd", lambda v: pct(v, "matmul_s")),
            (
                "other ops",
                lambda v: (
                    f"{sec(v['profiled']['op_s'] - v['profiled']['matmul_s'])} "
                    f"({(v['profiled']['op_s'] - v['profiled']['matmul_s']) / v['profiled']['wall_s']:.0%})"
                ),
            ),
            ("overhead: wall - op time", lambda v: pct(v, "other_s")),
            ("matmul GFLOP / completion", lambda v: f"{v['profiled']['gflop'] / v['completions']:.3g}"),
            (
                "matmul GFLOP/s",
                lambda v: (
                    f"{v['profiled']['gflop'] / v['profiled']['flop_op_s']:.0f}" if v["profiled"]["flop_op_s"] else "-"
                ),
            ),
            ("GEMM peak GFLOP/s (2048^2, fp32, same threads)", lambda v: f"{v.get('gemm_peak_gflops', 0):.0f}"),
            ("MFU of the matmul ops", lambda v: f"{mfu(v)[0]:.0%}" if mfu(v) else "-"),
            ("MFU of the iteration", lambda v: f"{mfu(v)[1]:.0%}" if mfu(v) else "-"),
        ],
    )
    table(
        "The profiled iteration by phase: wall (op time, of which matmul)",
        [
            (
                p,
                lambda v, p=p: (
                    f"{sec(v['profiled']['phases'][p]['wall_s'])} ({sec(v['profiled']['phases'][p]['op_s'])}, "
                    f"{sec(v['profiled']['phases'][p]['matmul_s'])})"
                ),
            )
            for p in PHASES
        ],
    )
    for t in ("grpo", "ppo"):
        ours, trl = results.get((t, "ours")), results.get((t, "trl"))
        if ours and trl:
            lines.append(
                f"- {t.upper()}: TRL wall / ours {trl['timed']['wall_s'] / ours['timed']['wall_s']:.2f}x unprofiled "
                f"({trl['profiled']['wall_s'] / ours['profiled']['wall_s']:.2f}x profiled); our matmul time "
                f"{sec(our_matmul_s(ours))} s, so at most {trl['timed']['wall_s'] / our_matmul_s(ours):.2f}x with "
                f"zero overhead and zero non-matmul ops on our side; TRL executes "
                f"{trl['profiled']['gflop'] / ours['profiled']['gflop']:.2f}x our counted matmul FLOPs; the "
                f"shape's minimum is {shape_gflop(workload, t):.3g} GFLOP a completion"
            )
    return "\n".join(lines)


def main() -> None:
    ap = cli.parser(__doc__)
    cli.add_workload(ap, default="medium")
    ap.add_argument("--trainer", choices=("ppo", "grpo", "both"), default="both")
    ap.add_argument("--side", choices=("ours", "trl", "both"), default="both")
    cli.add_threads(ap, help="torch.set_num_threads on both sides (pass 1)")
    ap.add_argument("--out", required=True, help="directory for the tables and the JSON")
    cli.add_model_dir(ap)
    ap.add_argument("--trl-python", default=".venv-trl/bin/python", help="the interpreter with trl 1.16 (GRPO)")
    ap.add_argument("--trl-ppo-python", default=".venv-bench/bin/python", help="the interpreter with trl 1.12 (PPO)")
    ap.add_argument("--prompts", type=int, help="GRPO: prompts per iteration (default 8)")
    ap.add_argument("--generations", type=int, help="GRPO: completions per prompt (default 4)")
    ap.add_argument("--iterations", type=int, default=3, help="iterations a run; the last two timed, profiled")
    ap.add_argument("--top", type=int, default=15, help="rows of the top-ops table")
    ap.add_argument(
        "--mmap-threshold",
        type=int,
        default=1 << 20,
        help="glibc's mmap threshold in the profiled iteration, bytes (default 1 MiB; 0: glibc's dynamic one)",
    )
    ap.add_argument("--summarize", action="store_true", help="only rebuild summary.md from the JSON under --out")
    ap.add_argument("--child", choices=("ours", "trl"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args)
    w = WORKLOADS[args.workload]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    trainers = ("grpo", "ppo") if args.trainer == "both" else (args.trainer,)
    sides = ("ours", "trl") if args.side == "both" else (args.side,)
    t0 = time.perf_counter()
    results = {}
    if args.summarize:
        trainers = ()
        for f in sorted(out.glob("*_*.json")):
            r = json.loads(f.read_text())
            results[r["trainer"], r["side"]] = r
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = absolute(args.model_dir or tmp)  # the children run from ROOT
        if trainers:
            build_models(w, model_dir)
        for trainer in trainers:
            for side in sides:
                python = None  # this interpreter
                if side == "trl":
                    python = args.trl_python if trainer == "grpo" else args.trl_ppo_python
                cmd = ["--child", side, "--trainer", trainer, "--workload", w.name]
                cmd += ["--model-dir", model_dir, "--out", absolute(out), "--top", str(args.top)]
                cmd += ["--iterations", str(args.iterations), "--mmap-threshold", str(args.mmap_threshold)]
                for k in ("threads", "prompts", "generations"):
                    if getattr(args, k) and (trainer == "grpo" or k == "threads"):
                        cmd += [f"--{k}", str(getattr(args, k))]
                cmd = module_cmd("profile_iteration", *cmd, python=python)
                print(f"[profile_iteration] {trainer} {side}: {' '.join(cmd)}", file=sys.stderr, flush=True)
                p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
                if p.returncode:
                    sys.exit(f"{trainer} {side} failed ({p.returncode}):\n{p.stderr[-4000:]}")
                results[(trainer, side)] = json.loads((out / f"{trainer}_{side}.json").read_text())
    text = summary(results, w)
    (out / "summary.md").write_text(text + "\n")
    print(text, flush=True)
    print(f"[profile_iteration] {time.perf_counter() - t0:.0f} s; tables and top ops under {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
