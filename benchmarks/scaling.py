"""How an iteration grows with the prompt length, the group or batch size and the completion
length (x2 each), ppo_lightning against TRL on gsm8k_like: on paper and measured.

    python -m benchmarks.scaling --trl-python .venv-trl/bin/python --threads 2               # GRPO
    python -m benchmarks.scaling --trainer ppo --trl-python .venv-bench/bin/python --threads 2

Four points, each a side-by-side pair as ``benchmarks.compare_trl`` runs it (the two sides
alternating, ``--rounds`` rounds, fresh processes): ``gsm8k_like`` (x1); its prompts twice as long
(``gsm8k_like_prompts_x2``: 200-400 tokens); twice the rows; its completions twice as long
(``gsm8k_like_completions_x2``: EOS at a mean of 192, at most 512).

* ``--trainer grpo`` (the default): GRPO against TRL 1.16's GRPOTrainer at ``--prompts`` P x
  ``--generations`` G an iteration, one iteration a run; twice the rows is the group twice as
  large (2G).
* ``--trainer ppo``: PPO against TRL 1.12's PPOTrainer at the workload's 8 prompts an iteration,
  ``--iterations`` iterations a run (default 2); twice the rows is 16 prompts an iteration
  (``gsm8k_like_batch_x2``).

For each side and point it prints seconds per completion and their growth over x1, measured,
beside the growth of the matmul FLOPs per completion on paper (``paper_gflop``,
``paper_gflop_ppo``: each side's work from the shapes, over lengths drawn as the workload draws
them; also at Qwen2.5-1.5B's shape, whose layers outweigh its head). The savings grow where TRL's
work grows faster than ours. Each run draws its own completion lengths (a mean of 16 geometric
draws varies by ~25%), so the seconds are read per generated token and scaled to the workload's
expected mean length (``s_per_completion_at_mean``; the raw figure and the drawn mean are in the
JSON lines).
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import dataclasses
import json
import random
import statistics
import tempfile

from benchmarks.lib import cli
from benchmarks.lib.runner import alternate, mean_length, run_benchmark
from benchmarks.lib.workloads import WORKLOADS, Workload, build_models, prompt_lengths

BASE = "gsm8k_like"
POINTS = {  # trainer: (label, workload, group-size factor) a point
    "grpo": (
        ("x1", BASE, 1),
        ("prompts x2", f"{BASE}_prompts_x2", 1),
        ("group x2", BASE, 2),
        ("completions x2", f"{BASE}_completions_x2", 1),
    ),
    "ppo": (
        ("x1", BASE, 1),
        ("prompts x2", f"{BASE}_prompts_x2", 1),
        ("batch x2", f"{BASE}_batch_x2", 1),
        ("completions x2", f"{BASE}_completions_x2", 1),
    ),
}


# ----------------------------------------------------------------------------- on paper
@dataclasses.dataclass(frozen=True)
class Shape:
    """What a decoder's matmul FLOPs depend on: width, depth, weights a layer, vocabulary."""

    d: int
    n_layer: int
    layer_weights: int
    vocab: int

    @classmethod
    def of(cls, w: Workload) -> "Shape":
        """The workload's Qwen2-shaped policy (``tiny.causal_lm_config``: q, k, v, o of width d and
        a gated MLP of width 2d, so 10 d^2 weights a layer)."""
        return cls(w.n_embd, w.n_layer, 10 * w.n_embd**2, w.vocab_size)


QWEN2_5_1_5B = Shape(1536, 28, 2 * 1536**2 + 2 * 1536 * 256 + 3 * 1536 * 8960, 151936)
"""Qwen2.5-1.5B's shape (GQA: k and v 256 wide; MLP 8960): 1.31 B weights in its layers against
the head's 0.23 B, where the workload's head is 15x its layers. On paper only: where prompt
length and group size weigh as they do on a real model."""


def layer_flops(s: Shape) -> tuple[float, float, float]:
    """(the layers' matmul FLOPs a token: 2 a weight of every layer; the attention's a token per
    context position: q k^T and the weighted sum of v, 2d each, in every layer; the LM head's a
    position)."""
    return 2 * s.layer_weights * s.n_layer * 1.0, 4 * s.d * s.n_layer * 1.0, 2 * s.d * s.vocab * 1.0


def completion_lengths(w: Workload, rng: random.Random, n: int) -> list[int]:
    """``n`` completion lengths as the baked EOS rate draws them: EOS with probability
    ``1 / eos_mean_tokens`` at every token (the EOS counted), at most ``response_tokens``."""
    p, out = 1.0 / w.eos_mean_tokens, []
    for _ in range(n):
        c = 1
        while c < w.response_tokens and rng.random() >= p:
            c += 1
        out.append(c)
    return out


def forward(s: Shape, prompt: float, tokens: float, head: float) -> float:
    """Matmul FLOPs of one causal forward: ``tokens`` positions through the layers, each
    attending to ``prompt`` positions before them plus the causal part of its own, the head on
    ``head`` positions."""
    f, att, h = layer_flops(s)
    return tokens * f + att * (tokens * prompt + tokens * tokens / 2) + head * h


def paper_gflop(
    w: Workload, prompts: int, generations: int, shape: Shape | None = None, draws: int = 200
) -> dict[str, float]:
    """Each side's expected matmul GFLOP per completion of one GRPO iteration (sampling, the
    reference forward, one training forward and backward at 3x a forward), over ``draws`` batches
    of the workload's lengths, on its model or another ``shape``:

    * ours (the defaults): the sampler prefills each group's prompt once (left-padded to the
      batch's longest) and each row decodes until its own EOS; the reference and training forwards
      encode each group's prompt once, its completions padded to the group's longest, the head on
      completion tokens only (and once more in the update: the lean head's recomputation);
    * TRL: the batch is padded to its longest prompt and decodes until its longest completion;
      the reference and the training forward run every row over that width, the head on every
      completion position;
    * the floor: the same passes with no padding, each group's prompt encoded once in each (the
      sampler's prefill too), the head once a pass on each completion token.
    """
    s, rng = shape or Shape.of(w), random.Random(0)
    lengths = prompt_lengths(w)
    ours = trl = floor = 0.0
    for _ in range(draws):
        ps = rng.sample(lengths, prompts)
        cs = [completion_lengths(w, rng, generations) for _ in ps]
        pmax, cmax, rows = max(ps), max(max(c) for c in cs), prompts * generations
        for p, group in zip(ps, cs):
            ours += forward(s, 0, pmax, 0) + sum(forward(s, pmax, c, c) for c in group)  # sampling
            shared = forward(s, 0, p, 0) + generations * forward(s, p, max(group), 0)
            ours += 4 * shared + 5 * sum(group) * layer_flops(s)[2]  # reference, update, head recompute
            floor += 5 * (forward(s, 0, p, 0) + sum(forward(s, p, c, c) for c in group))
        trl += rows * (forward(s, 0, pmax + cmax, cmax) + 4 * forward(s, 0, pmax + cmax, cmax))
    per = draws * prompts * generations * 1e9
    return {"ppo_lightning": ours / per, "trl": trl / per, "floor": floor / per}


def paper_gflop_ppo(w: Workload, shape: Shape | None = None, draws: int = 200) -> dict[str, float]:
    """Each side's expected matmul GFLOP per completion of one PPO iteration of ``w.rollout_batch``
    prompts (one epoch of one minibatch, as ``compare_trl --trainer ppo`` runs it), over ``draws``
    batches of the workload's lengths, on its model or another ``shape``. Both sides run their
    forwards over the batch's window (its longest prompt, left-padded, plus its longest
    completion):

    * ours (the defaults): the sampler prefills the prompts, left-padded to the longest, and each
      row decodes until its own EOS; the reference, the rollout's policy-and-value forward and the
      reward model's, then one training forward and backward (3x), the LM head on completion
      tokens only (and once more in the update: the lean head's recomputation); the value is a
      head on the policy;
    * TRL: the batch decodes until its longest completion ends (the rollout's policy logits come
      from ``generate``); the reference, and the policy's forward and backward, with the head on
      every position of the window; a separate value model (a forward in the rollout, a forward
      and backward in the update) and the reward model's forward;
    * the floor: no padding (each row over its own prompt and completion), the head once a pass
      on each completion token, the old policy's logprobs and values from the sampler's own
      forward (no second rollout forward), the reward model's layers: sampling, the reference,
      the update's forward and backward, and the reward model.
    """
    s, rng = shape or Shape.of(w), random.Random(0)
    lengths, head = prompt_lengths(w), layer_flops(s)[2]
    ours = trl = floor = 0.0
    for _ in range(draws):
        ps, cs = rng.sample(lengths, w.rollout_batch), completion_lengths(w, rng, w.rollout_batch)
        rows, width, cmax = len(ps), max(ps) + max(cs), max(cs)
        trunk = rows * forward(s, 0, width, 0)  # the layers over the window
        ours += rows * forward(s, 0, max(ps), 0) + sum(forward(s, max(ps), c, c) for c in cs)  # sampling
        ours += 6 * trunk + 6 * sum(cs) * head  # reference, rollout, reward (trunk), update x3, head recompute
        trl += rows * forward(s, 0, width, cmax)  # sampling
        trl += 4 * rows * forward(s, 0, width, width) + 5 * trunk  # reference, update x3; value x4, reward
        floor += sum(5 * forward(s, 0, p + c, c) + forward(s, 0, p + c, 0) for p, c in zip(ps, cs))
    per = draws * w.rollout_batch * 1e9
    return {"ppo_lightning": ours / per, "trl": trl / per, "floor": floor / per}


def paper(args, name: str, factor: int, shape: Shape | None = None) -> dict[str, float]:
    """The point's on-paper GFLOP per completion, of ``args.trainer``'s iteration."""
    if args.trainer == "ppo":
        return paper_gflop_ppo(WORKLOADS[name], shape)
    return paper_gflop(WORKLOADS[name], args.prompts, factor * args.generations, shape)


def commands(args, name: str, factor: int, model_dir: str) -> dict:
    """The point's two runs, ``benchmarks.throughput`` (ours) and TRL's baseline, as callables."""
    if args.trainer == "ppo":
        shape, trl_script = ["--iterations", str(args.iterations)], "trl_baseline"
    else:
        shape = ["--prompts", str(args.prompts), "--generations", str(factor * args.generations)]
        trl_script = "trl_grpo_baseline"
    ours_extra, trl_extra = ["--trainer", args.trainer, *shape], shape
    return {
        "ppo_lightning": lambda r: run_benchmark("throughput", name, model_dir, args.threads, extra=ours_extra),
        "trl": lambda r: run_benchmark(trl_script, name, model_dir, args.threads, args.trl_python, trl_extra),
    }


# ----------------------------------------------------------------------------- measured
def measure(args, model_dir: str) -> list[dict]:
    """Each point's compare pair, alternating within a point: one row a point and side."""
    rows = []
    for label, name, factor in POINTS[args.trainer]:
        build_models(WORKLOADS[name], model_dir)
        results = alternate(commands(args, name, factor, model_dir), args.rounds)
        on_paper, big = paper(args, name, factor), paper(args, name, factor, QWEN2_5_1_5B)
        for side, runs in results.items():
            # seconds per generated token, at the workload's expected mean length: each run draws
            # its own lengths (a mean of 16 geometric draws varies by ~25%)
            at_mean = [
                r["total_s"] / r["episodes"] * WORKLOADS[name].expected_response_tokens / mean_length(r) for r in runs
            ]
            rows.append(
                {
                    "trainer": args.trainer,
                    "point": label,
                    "side": side,
                    "s_per_completion": [r["total_s"] / r["episodes"] for r in runs],
                    "mean_tokens": [mean_length(r) for r in runs],
                    "s_per_completion_at_mean_runs": at_mean,
                    "s_per_completion_at_mean": statistics.median(at_mean),
                    "paper_gflop": on_paper[side],
                    "paper_gflop_floor": on_paper["floor"],
                    "paper_gflop_qwen2_5_1_5b": big[side],
                }
            )
    return rows


def table(rows: list[dict], points) -> str:
    """The markdown table: per point, each side's s / completion (at the workload's expected mean
    length: each run draws its own lengths, a mean of 16 geometric draws is within ~25%) and
    GFLOP / completion on paper, their growth over x1, and ours against TRL, at the mean length and
    raw with each side's drawn mean (where the two sides drew different lengths, per-token scaling
    under-counts the side whose batch ran to a long row, and raw seconds flatter the side that
    drew short ones)."""
    by = {(r["point"], r["side"]): r for r in rows}
    lines = [
        "| point | ours s/completion (growth) | TRL s/completion (growth) | ours GFLOP on paper (growth) "
        "| TRL GFLOP on paper (growth) | floor GFLOP on paper | speed-up measured | raw (mean tokens, ours / TRL) "
        "| FLOP ratio on paper | the same at Qwen2.5-1.5B's shape |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for label, _, _ in points:
        o, t = (by[(label, side)]["s_per_completion_at_mean"] for side in ("ppo_lightning", "trl"))
        o1, t1 = (by[("x1", side)]["s_per_completion_at_mean"] for side in ("ppo_lightning", "trl"))
        og, tg = (by[(label, side)]["paper_gflop"] for side in ("ppo_lightning", "trl"))
        og1, tg1 = (by[("x1", side)]["paper_gflop"] for side in ("ppo_lightning", "trl"))
        big = by[(label, "trl")]["paper_gflop_qwen2_5_1_5b"] / by[(label, "ppo_lightning")]["paper_gflop_qwen2_5_1_5b"]
        raw, tokens = (
            [statistics.median(by[(label, side)][key]) for side in ("ppo_lightning", "trl")]
            for key in ("s_per_completion", "mean_tokens")
        )
        lines.append(
            f"| {label} | {o:.2f} ({o / o1:.2f}x) | {t:.2f} ({t / t1:.2f}x) | {og:.1f} ({og / og1:.2f}x) "
            f"| {tg:.1f} ({tg / tg1:.2f}x) | {by[(label, 'trl')]['paper_gflop_floor']:.1f} | {t / o:.2f}x "
            f"| {raw[1] / raw[0]:.2f}x ({tokens[0]:.1f} / {tokens[1]:.1f}) | {tg / og:.2f}x | {big:.2f}x |"
        )
    return "\n".join(lines)


def main() -> None:
    ap = cli.parser(__doc__)
    ap.add_argument("--trainer", choices=tuple(POINTS), default="grpo", help="GRPO or PPO against TRL's (default grpo)")
    ap.add_argument("--trl-python", help="the interpreter with trl 1.16 (grpo) or 1.12 (ppo) (default: this one)")
    ap.add_argument("--prompts", type=int, default=2, help="grpo: prompts per iteration (default 2)")
    ap.add_argument("--generations", type=int, default=8, help="grpo: the group size at x1 (default 8)")
    ap.add_argument("--iterations", type=int, default=2, help="ppo: iterations a run (default 2)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--paper", action="store_true", help="only the on-paper columns (seconds, no runs)")
    cli.add_threads(ap, help="torch.set_num_threads on both sides (default: torch's choice)")
    args = ap.parse_args()
    if args.paper:
        for label, name, factor in POINTS[args.trainer]:
            for shape, model in ((None, "workload"), (QWEN2_5_1_5B, "qwen2.5-1.5b")):
                print(
                    json.dumps(
                        {"trainer": args.trainer, "point": label, "model": model, **paper(args, name, factor, shape)}
                    )
                )
        return
    with tempfile.TemporaryDirectory() as model_dir:
        rows = measure(args, model_dir)
    for r in rows:
        print(json.dumps(r))
    print(table(rows, POINTS[args.trainer]))


if __name__ == "__main__":
    main()
