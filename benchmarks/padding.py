"""What removing padding buys in the update: one epoch of forwards and backwards, padded and not.

    python -m benchmarks.padding                      # ~2 min on 2 cores
    python -m benchmarks.padding --rounds 5 --threads 2
    python -m benchmarks.padding --packing --threads 2  # trimmed micro-batches against packed ones

The batch has the shape of an RL-from-verifiable-rewards rollout: 8 prompts of 100-200 tokens
(left-padded), each repeated for a group of 8 completions whose lengths spread uniformly between
16 and 256 tokens (right-padded): 64 rows of 456 columns. The model is Qwen2-shaped (4 layers,
256 wide, the byte vocabulary: the transformer's cost, not a large LM head's). One epoch is
what ``algorithm.PPO.learn`` runs per pass: the rows shuffled into 4 minibatches of 16, each
through ``algorithm.micro_batches`` and ``rollouts.forward.policy_forward`` (the update's own code), a
backward per micro-batch. Variants, at the same activation memory bound (micro-batches of at
most 8 x 456 = 3648 tokens):

* ``padded``: ``ppo.remove_padding=false ppo.micro_batch_size=8``: every forward the whole width;
* ``unpadded``: ``ppo.micro_batch_size=8``: each micro-batch on its rows' window;
* ``token_budget``: ``ppo.micro_batch_tokens=3648``: rows sorted by length and grouped under the
  budget, each group on its window;
* ``shared_prompt``: ``ppo.micro_batch_size=8`` with ``ppo.shared_prompt_forward`` (the default
  where groups exist): minibatches of two whole groups, each micro-batch one group on its window,
  its prompt encoded once and its 8 completions attending to its keys and values;
* ``shared_prompt_token_budget``: both: minibatches of two whole groups, rows sorted by
  response length under the budget (each distinct prompt counted once in a micro-batch's cost).

``--packing`` asks whether true packing would pay on top of the token budget: the same
micro-batches through the bare model, each as it is (its rows on their window) or packed (its
rows' real tokens end to end in one row, the positions restarting per sequence: Hugging Face
then builds a block-diagonal causal mask, and SDPA on CPU computes the packed row's whole
attention and masks it; there is no varlen kernel on CPU). Both give the same log-probabilities
(tested); the JSON line gives the seconds of each and the positions computed.

Printed, one JSON line: per variant the median seconds per epoch over ``--rounds`` alternating
rounds, the ratio to ``padded`` (per round, then the median), and the token positions its
forwards computed; and two floors: the real tokens (no padding at all) and the real tokens
with each prompt once per group (what ``ppo.shared_prompt_forward`` can reach).
"""

from __future__ import annotations

from benchmarks.lib import offline  # noqa: F401  (first: the environment before the libraries)

import json
import statistics
import tempfile
from pathlib import Path

import torch

from benchmarks.lib.cli import add_threads, parser, set_threads
from benchmarks.lib.measure import timed
from benchmarks.lib.runner import alternate, ratios

PROMPTS, GROUP, MINIBATCH = 8, 8, 16
PROMPT_TOKENS, RESPONSE_TOKENS = (100, 200), (16, 256)
VARIANTS = {
    "padded": dict(remove_padding=False, micro_batch_size=8),
    "unpadded": dict(micro_batch_size=8),
    "token_budget": dict(micro_batch_tokens=8 * (PROMPT_TOKENS[1] + RESPONSE_TOKENS[1])),
    "shared_prompt": dict(micro_batch_size=8, num_generations=GROUP),
    "shared_prompt_token_budget": dict(
        micro_batch_tokens=8 * (PROMPT_TOKENS[1] + RESPONSE_TOKENS[1]), num_generations=GROUP
    ),
}
SHARED = {
    "shared_prompt",
    "shared_prompt_token_budget",
}  # variants that encode each prompt once per group (ppo.shared_prompt_forward)


def build_rollout(seed: int = 0):
    """A rollout's tensors for the batch described above (zeros where the update's forward does
    not look: scores, advantages, ...)."""
    from ppo_lightning.algo.rollout import Rollout
    from ppo_lightning.models.policy import position_ids_from_mask

    g = torch.Generator().manual_seed(seed)
    P, R = PROMPT_TOKENS[1], RESPONSE_TOKENS[1]
    prompt_lens = torch.randint(PROMPT_TOKENS[0], PROMPT_TOKENS[1] + 1, (PROMPTS,), generator=g).repeat_interleave(
        GROUP
    )
    response_lens = torch.randint(RESPONSE_TOKENS[0], RESPONSE_TOKENS[1] + 1, (PROMPTS * GROUP,), generator=g)
    cols = torch.arange(P + R)
    mask = ((cols >= P - prompt_lens[:, None]) & (cols < P + response_lens[:, None])).long()
    ids = torch.randint(1, 256, mask.shape, generator=g) * mask
    zeros = torch.zeros(len(mask), R)
    rows = torch.zeros(len(mask))
    r = Rollout(
        ids, mask, position_ids_from_mask(mask), mask[:, P:].float(), zeros, zeros, zeros, zeros, zeros, rows,
        zeros, zeros, rows, rows, rows.bool(), P, {}, None, None, None, None, None, None, None, {}, None, 0.0,
    )  # fmt: skip
    return r, prompt_lens, response_lens


def build_policy(root: Path):
    from ppo_lightning.models.policy import PolicyWithValueHead, load_causal_lm, load_tokenizer
    from ppo_lightning.models.tiny import save_tiny_causal_lm

    path = save_tiny_causal_lm(root / "qwen2", n_layer=4, n_head=4, n_embd=256, n_positions=512, arch="qwen2")
    policy = PolicyWithValueHead(load_causal_lm(str(path), load_tokenizer(str(path))))
    return policy.train()


class _OneProcess:
    """The runtime ``algorithm.micro_batches`` asks: one process, its own group count."""

    def max_over_ranks(self, n: int) -> int:
        return n


def epoch(policy, r, variant: dict, seed: int) -> dict:
    """One pass over the rows in shuffled minibatches: forward and backward of every micro-batch."""
    from ppo_lightning.algo.algorithm import micro_batches, minibatch_rows
    from ppo_lightning.rollouts.forward import ForwardLayout, policy_forward
    from ppo_lightning.config import PPOConfig

    name, variant = variant
    cfg = PPOConfig(minibatch_size=MINIBATCH, **variant)
    layout = ForwardLayout(cfg.remove_padding, name in SHARED)
    computed = 0

    def run():
        nonlocal computed
        for idx in minibatch_rows(r.batch_size, cfg, layout.shared_prompt, torch.Generator().manual_seed(seed)):
            parts, _ = micro_batches(r.index(idx), cfg, _OneProcess(), layout.shared_prompt)
            for part in parts:
                entropy, values, logp = policy_forward(policy, part, 1.0, cfg.lm_head_chunk_size, False, layout)
                mask = part.response_mask
                ((logp * mask).sum() + (values * mask).pow(2).sum()).div(mask.sum()).backward()
                computed += _computed(part, layout)
        policy.zero_grad(set_to_none=True)

    _, seconds = timed(run)
    return {"epoch_s": seconds, "tokens_computed": computed}


def _computed(part, layout) -> int:
    """The token positions a micro-batch's forward computes: rows x its window's width, or with
    each prompt once, the distinct prompts' columns once and every row's response columns."""
    from ppo_lightning.rollouts.forward import padding_window
    from ppo_lightning.models.shared_prompt import prompt_groups

    ids, mask, P = part.query_responses, part.attention_mask, part.context_length
    start, stop = padding_window(mask, P) if layout.remove_padding else (0, ids.shape[1])
    groups = prompt_groups(ids[:, start:stop], mask[:, start:stop], P - start) if layout.shared_prompt else None
    if groups is None:
        return part.batch_size * (stop - start)
    return len(groups[0]) * (P - start) + part.batch_size * (stop - P)


def packing_epoch(policy, r, packed: bool, seed: int) -> dict:
    """One epoch of the ``token_budget`` variant's micro-batches through the bare model (its
    layers, then the head and a log-softmax on the response tokens), each micro-batch either as
    it is (its rows on their window, the attention mask hiding the padding) or ``packed``: its
    rows' real tokens end to end in one row, each sequence's positions from 0, so Hugging Face
    builds a block-diagonal causal mask from the position ids (SDPA with that mask: no varlen
    kernel on CPU, so the attention is computed over the packed row and masked)."""
    from ppo_lightning.algo.algorithm import micro_batches, minibatch_rows
    from ppo_lightning.rollouts.forward import unpadded
    from ppo_lightning.config import PPOConfig

    cfg = PPOConfig(minibatch_size=MINIBATCH, **VARIANTS["token_budget"])
    lm, computed, logp_sum = policy.lm, 0, 0.0

    def step(ids, mask, pos, targets):
        hidden = lm.model(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state
        logits = lm.lm_head(hidden[targets[0], targets[1] - 1])
        logp = torch.log_softmax(logits, -1).gather(-1, ids[targets].unsqueeze(-1))
        logp.sum().div(len(logp)).backward()
        return logp.sum().item()

    def run():
        nonlocal computed, logp_sum
        for idx in minibatch_rows(r.batch_size, cfg, False, torch.Generator().manual_seed(seed)):
            for part in micro_batches(r.index(idx), cfg, _OneProcess(), False)[0]:
                ids, mask, pos, P = unpadded(
                    part.query_responses, part.attention_mask, part.position_ids, part.context_length
                )
                response = torch.zeros_like(mask, dtype=torch.bool)
                response[:, P:] = mask[:, P:].bool()
                if packed:
                    real = mask.bool()
                    ids, pos, response = ids[real][None], pos[real][None], response[real][None]
                    mask = None
                logp_sum += step(ids, mask, pos, response.nonzero(as_tuple=True))
                computed += ids.numel()
        policy.zero_grad(set_to_none=True)

    _, seconds = timed(run)
    return {"epoch_s": seconds, "tokens_computed": computed, "logp_sum": logp_sum}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds (median reported)")
    ap.add_argument(
        "--packing", action="store_true", help="only the token budget's micro-batches, as they are and packed"
    )
    add_threads(ap)
    args = ap.parse_args()
    set_threads(args.threads)
    torch.manual_seed(0)
    r, prompt_lens, response_lens = build_rollout()
    if args.packing:
        return print_packing(r, args.rounds)
    with tempfile.TemporaryDirectory() as root:
        policy = build_policy(Path(root))
        epoch(policy, r, ("padded", VARIANTS["padded"]), seed=0)  # warm-up: allocator, kernels
        results = alternate(
            {name: (lambda k, v=(name, v): epoch(policy, r, v, seed=k)) for name, v in VARIANTS.items()},
            args.rounds,
            abba=True,
        )
    real = int(prompt_lens.sum() + response_lens.sum())
    out = {
        "benchmark": "padding",
        "rows": r.batch_size,
        "width": r.query_responses.shape[1],
        "threads": torch.get_num_threads(),
        "rounds": args.rounds,
        "floor_tokens_no_padding": real,
        "floor_tokens_prompt_once_per_group": int(prompt_lens[::GROUP].sum() + response_lens.sum()),
    }
    for name, rows in results.items():
        out[name] = {
            "epoch_s": round(statistics.median(x["epoch_s"] for x in rows), 3),
            "speedup_vs_padded": round(statistics.median(ratios(results["padded"], rows, "epoch_s")), 2),
            "tokens_computed": rows[0]["tokens_computed"],
        }
    print(json.dumps(out))


def print_packing(r, rounds: int) -> None:
    """``--packing``: the token budget's micro-batches trimmed against packed, one JSON line."""
    with tempfile.TemporaryDirectory() as root:
        policy = build_policy(Path(root))
        packing_epoch(policy, r, False, seed=0)  # warm-up
        results = alternate(
            {
                name: (lambda k, p=p: packing_epoch(policy, r, p, seed=k))
                for name, p in (("trimmed", False), ("packed", True))
            },
            rounds,
            abba=True,
        )
    out = {"benchmark": "padding --packing", "threads": torch.get_num_threads(), "rounds": rounds}
    for name, rows in results.items():
        out[name] = {
            "epoch_s": round(statistics.median(x["epoch_s"] for x in rows), 3),
            "speedup_vs_trimmed": round(statistics.median(ratios(results["trimmed"], rows, "epoch_s")), 2),
            "tokens_computed": rows[0]["tokens_computed"],
            "logp_sum": rows[0]["logp_sum"],  # the same in both: the packed mask is the padded one's
        }
    print(json.dumps(out))


if __name__ == "__main__":
    main()
