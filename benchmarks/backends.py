"""Rollout sampling speed of the two generation backends, ``hf`` and ``vllm``, side by side.

    python -m benchmarks.backends --workload small --rows 8,32
    python -m benchmarks.backends --workload medium --rows 8,32 --repeats 3

Needs vLLM (a venv of its own on a CPU machine: ``make .venv-vllm``, then
``.venv-vllm/bin/python -m benchmarks.backends ...``). On the workload's policy (built once by
``workloads.build_models``), for each row count: both backends sample the same prompts to the
workload's response length (``stop_at_eos=false``: every row runs to the end, temperature 1),
alternately, ``--repeats`` times; reported are each side's median generated tokens per second
and their ratio (both measured in this process, so machine noise hits both). Also reported: the
engine's start (``enforce_eager``) and the median time of a weight sync that sends every weight
(full fine-tuning: every module has a trainable parameter), as ``perf/time_weight_sync_s``
measures it in a run. One JSON line on stdout.
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import json
import statistics
import tempfile

import torch

from benchmarks.lib import cli
from benchmarks.lib.measure import MB, timed
from benchmarks.lib.runner import alternate
from benchmarks.lib.workloads import WORKLOADS, build_models, render_prompts


def main() -> None:
    ap = cli.parser(__doc__)
    cli.add_workload(ap, default="small")
    ap.add_argument("--rows", default="8,32", help="comma-separated batch sizes")
    ap.add_argument("--repeats", type=int, default=3, help="alternations per row count")
    ap.add_argument("--syncs", type=int, default=5, help="weight syncs timed")
    cli.add_threads(ap)
    cli.add_model_dir(ap)
    args = ap.parse_args()
    cli.set_threads(args.threads)
    from ppo_lightning.generation.hf import HFBackend
    from ppo_lightning.generation.params import SamplingParams
    from ppo_lightning.generation.vllm import VLLMBackend
    from ppo_lightning.models.policy import load_causal_lm, load_tokenizer

    w = WORKLOADS[args.workload]
    with tempfile.TemporaryDirectory() as tmp:
        policy_dir, _ = build_models(w, args.model_dir or tmp)
        tok = load_tokenizer(str(policy_dir))
        lm = load_causal_lm(str(policy_dir), tok).eval()
        rows = [int(r) for r in args.rows.split(",")]
        prompts = render_prompts(w, tok)
        hf = HFBackend(lm, tok)
        vllm = VLLMBackend(lm, tok, kv_cache_memory_bytes=2 * 2**30, max_model_len=w.prompt_tokens + w.response_tokens)
        params = SamplingParams(max_new_tokens=w.response_tokens, stop_at_eos=False)
        _, start_s = timed(vllm._engine)
        result = {"workload": w.name, "response_tokens": w.response_tokens, "engine_start_s": round(start_s, 2)}
        g = torch.Generator().manual_seed(0)
        for n in rows:
            enc = tok([prompts[i % len(prompts)] for i in range(n)], return_tensors="pt", padding=True)

            def sample(backend, n=n, enc=enc):  # seconds for one batch of n rows, every row full length
                (responses, _, _), seconds = timed(
                    lambda: backend.generate(enc.input_ids, enc.attention_mask, params, g)
                )
                assert responses.shape == (n, w.response_tokens), responses.shape
                return seconds

            times = alternate({"hf": lambda r: sample(hf), "vllm": lambda r: sample(vllm)}, args.repeats)
            tps = {k: n * w.response_tokens / statistics.median(v) for k, v in times.items()}
            result[f"rows_{n}"] = {
                "tokens_per_s_hf": round(tps["hf"], 1),
                "tokens_per_s_vllm": round(tps["vllm"], 1),
                "speedup": round(tps["vllm"] / tps["hf"], 2),
            }
        for p in lm.parameters():
            p.requires_grad_(True)
        syncs = [vllm.sync_weights() for _ in range(args.syncs)]
        result["weight_sync_s"] = round(statistics.median(syncs), 4)
        result["weights_synced_mb"] = round(
            sum(t.numel() * t.element_size() for _, t in vllm.engine_weights(True)) / MB, 1
        )
    result["threads"] = torch.get_num_threads()
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
