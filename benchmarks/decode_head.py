"""The sampler's LM head on a decode batch: ``F.linear`` against ``fast_decode.head_logits``.

    python -m benchmarks.decode_head --threads 2              # ~1 min on 2 cores
    python -m benchmarks.decode_head --width 896 --threads 2  # Qwen2-0.5B's head

Each decode step multiplies the few rows still sampling ``[B, E]`` by the whole head ``[V, E]``
(Qwen2's ``V = 151,936``): a matrix-vector product in disguise, which reads the weight once a step.
The two ways of computing it sum in different orders, and BLAS libraries block them differently:
``F.linear`` (``h @ W^T``, the model's own head) and ``head_logits`` (on a CPU in float32,
``(W @ h^T)^T``). Printed, one JSON line: per row count the median milliseconds of each over
``--repeats`` calls taken in turn, and their ratio.
"""

from __future__ import annotations

import json
import statistics

import torch
import torch.nn.functional as F

from benchmarks.lib.cli import add_threads, parser, set_threads
from benchmarks.lib.measure import timed
from ppo_lightning.generation.fast_decode import head_logits

ROWS = (1, 2, 4, 8, 16, 32, 64)


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--vocab", type=int, default=151936, help="the head's rows (default: Qwen2's vocabulary)")
    ap.add_argument("--width", type=int, default=256, help="the hidden size (default: gsm8k_like's model)")
    ap.add_argument("--repeats", type=int, default=20)
    add_threads(ap)
    args = ap.parse_args()
    set_threads(args.threads)
    weight = torch.randn(args.vocab, args.width) * 0.05
    rows = {}
    with torch.inference_mode():
        for B in ROWS:
            h = torch.randn(B, args.width)
            ways = {"linear": lambda: F.linear(h, weight), "head_logits": lambda: head_logits(h, weight)}
            for fn in ways.values():
                fn()  # warm-up
            ms = {name: [] for name in ways}
            for _ in range(args.repeats):
                for name, fn in ways.items():
                    ms[name].append(timed(fn)[1] * 1e3)
            linear, ours = statistics.median(ms["linear"]), statistics.median(ms["head_logits"])
            rows[B] = {
                "linear_ms": round(linear, 2),
                "head_logits_ms": round(ours, 2),
                "ratio": round(linear / ours, 2),
            }
    out = {
        "benchmark": "decode_head",
        "vocab": args.vocab,
        "width": args.width,
        "threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "rows": rows,
    }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
