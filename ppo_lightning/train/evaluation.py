"""Evaluation during training: the policy's answers to held-out prompts, scored by the run's reward.

``evaluate`` samples ``n`` responses per eval prompt through the same generation backend and
``SamplingParams`` as the rollout (greedy, or another temperature, as ``eval.*`` says), with a
generator of its own so the training trajectory does not move, on this rank's share of the
prompts; it scores them as the rollout does (``rollout.score_terms``: the prompt as written and
its columns reach the reward), and reduces sums over ranks once. Metrics (``docs/metrics.md``):

- ``eval/reward/mean@n``: the raw reward, mean over every response;
- ``eval/rewards/<name>/mean@n``: each ``reward.terms`` term's raw score;
- ``eval/metrics/<name>/mean@n``: each ``eval.metrics`` score, measured here only (not a reward);
- ``eval/pass@k`` for k = 1, 2, 4, ... up to n: the Codex paper's unbiased estimator of the chance
  that one of k responses passes (its score, or ``eval.pass_term``'s, reaches
  ``eval.pass_threshold``), mean over prompts;
- ``eval/response_length`` and ``eval/kl`` (k1 to the reference, summed over the response);
- with an ``env``, the episodes' ``eval/env/turns_mean`` and ``eval/env/tool_calls_mean``;
- with a ``data_source`` column, each of these per source too: ``eval/<source>/reward/mean@n``,
  ``eval/<source>/pass@k``, ... (as verl reports its validation).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import NamedTuple

import torch
from torch import Tensor

from ppo_lightning.generation import GenerationBackend, SamplingParams
from ppo_lightning.models.policy import position_ids_from_mask
from ppo_lightning.envs.template import conversation_text
from ppo_lightning.rewards import pop_reward_logs
from ppo_lightning.algo.rollout import decode_prompts_and_responses, forward_logprobs, score_episodes, score_terms


class EvalPoint(NamedTuple):
    """One evaluation: before iteration ``step`` (``max_steps``: after the last), its ``eval/*``
    metrics, and up to 8 of rank 0's ``(prompt, response, reward)`` samples."""

    step: int
    metrics: dict[str, float]
    samples: list[tuple[str, str, float]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimator of pass@k from ``n`` samples of which ``c`` pass (Chen et al. 2021,
    "Evaluating Large Language Models Trained on Code"): ``1 - C(n - c, k) / C(n, k)``. It needs
    ``k <= n``: with fewer samples than ``k`` there is nothing to estimate (the formula would say 1
    with no sample passing)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 1 <= k <= n and 0 <= c <= n (got n={n}, c={c}, k={k})")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def pass_ks(n: int) -> list[int]:
    """The k of the ``eval/pass@k`` metrics: 1, 2, 4, ... and n."""
    ks = [2**i for i in range(n.bit_length()) if 2**i <= n]
    return ks if ks[-1] == n else [*ks, n]


@torch.no_grad()
def evaluate(
    batches,
    *,
    sampler: GenerationBackend,
    params: SamplingParams,
    generator: torch.Generator,
    policy,
    ref_lm,
    reward_fn,
    tokenizer,
    runtime,
    num_samples: int,
    pass_threshold: float,
    pass_term: str | None,
    device,
    sources: list[str] = (),
    metrics: dict | None = None,
    samples: list | None = None,
    max_samples: int = 8,
    head_chunk: int | None = None,
    episodes=None,
) -> dict[str, float]:
    """The ``eval/*`` metrics over every rank's ``batches`` (``(batch, weight [B])`` pairs: a row of
    weight 0 pads a rank's share, and counts nowhere); with ``sources`` (every eval record's
    ``data_source``, the same list on every rank) per source as well. ``samples``, when given,
    receives up to ``max_samples`` of this rank's ``(prompt, response, reward)`` rows. ``metrics``
    (``eval.metrics``: name -> scorer) are scored on the same samples, apart from the reward.
    With ``episodes`` (an ``envs.EpisodeRunner``) each prompt is played as a multi-turn episode,
    scored on its outcome (its score plus its turn rewards), its length the policy's tokens, and
    ``eval/env/turns_mean`` and ``eval/env/tool_calls_mean`` are logged too."""
    n, ks = num_samples, pass_ks(num_samples)
    sums: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64, device=device))
    with runtime.rollout_context(policy, ref_lm):
        for batch, weight in batches:
            ids = batch["input_ids"].to(device).repeat_interleave(n, dim=0)
            am = batch["attention_mask"].to(device).repeat_interleave(n, dim=0)
            prompts = [p for p in batch["prompts"] for _ in range(n)]
            columns = [c for c in batch["columns"] for _ in range(n)]
            w = weight.to(device, torch.float64)
            if episodes is None:
                resp, mask = sampler.generate(ids, am, params, generator)
                raw, _, terms = score_terms(reward_fn, tokenizer, ids, am, resp, mask, prompts, columns)
                P = ids.shape[1]
                seq = torch.cat([ids, resp], dim=1)
                full = torch.cat([am, mask.to(am.dtype)], dim=1)
                extra = {}
            else:  # multi-turn: each eval prompt played as an episode; its outcome is its return
                played = episodes.run(prompts, columns, sampler, params, generator, device)
                raw, _, terms = score_episodes(reward_fn, tokenizer, played, episodes.cfg.error_reward)
                raw = raw + played.turn_rewards.sum(1)
                P, seq, full, mask = (
                    played.context_length,
                    played.query_responses,
                    played.attention_mask,
                    played.loss_mask,
                )
                extra = {
                    "env/turns_mean": torch.tensor([e.turns for e in played.episodes], dtype=torch.float64),
                    "env/tool_calls_mean": torch.tensor(
                        [e.counts["tool_calls"] for e in played.episodes], dtype=torch.float64
                    ),
                }
            pos = position_ids_from_mask(full)
            logp, _ = forward_logprobs(policy, None, seq, full, pos, P, params.temperature, head_chunk=head_chunk)
            ref, _ = forward_logprobs(None, ref_lm, seq, full, pos, P, params.temperature, head_chunk=head_chunk)
            per_row = {
                "reward": raw.double(),
                "length": mask.sum(1).double(),
                "kl": ((logp - ref) * mask).sum(1).double(),
                **{f"term/{name}": t.double().nan_to_num(0.0) for name, t in terms.items()},
                **{f"extra/{k}": v.to(device) for k, v in extra.items()},
            }
            for name, fn in (metrics or {}).items():
                if episodes is None:
                    score, _, _ = score_terms(fn, tokenizer, ids, am, resp, mask, prompts, columns)
                else:
                    score, _, _ = score_episodes(fn, tokenizer, played, episodes.cfg.error_reward)
                per_row[f"metric/{name}"] = score.double()
            if samples is not None and len(samples) < max_samples:
                real = w.repeat_interleave(n) > 0
                if episodes is None:
                    prompt_texts, texts = decode_prompts_and_responses(tokenizer, ids, resp, mask)
                else:  # the whole conversation, each message under its role
                    prompt_texts = [conversation_text(e.prompt_messages) for e in played.episodes]
                    texts = [conversation_text(e.completion) for e in played.episodes]
                rows_here = [(p, r, float(x)) for p, r, x, ok in zip(prompt_texts, texts, raw.tolist(), real) if ok]
                samples.extend(rows_here[: max_samples - len(samples)])
            judged = terms[pass_term] if pass_term else raw
            passed = (judged >= pass_threshold).view(-1, n).sum(1).tolist()  # per prompt
            per_prompt = {
                f"pass@{k}": torch.tensor([pass_at_k(n, int(c), k) for c in passed], dtype=torch.float64, device=device)
                for k in ks
            }
            groups = [("", w)]
            for src in sources:  # the prompts of each source, by weight
                in_src = [str(col.get("data_source")) == src for col in batch["columns"]]
                groups.append((f"{src}/", w * torch.tensor(in_src, dtype=torch.float64, device=device)))
            for prefix, gw in groups:
                rows = gw.repeat_interleave(n)
                sums[f"{prefix}rows"] += rows.sum()
                sums[f"{prefix}prompts"] += gw.sum()
                for key, x in per_row.items():
                    sums[f"{prefix}{key}"] += (rows * x).sum()
                for key, x in per_prompt.items():
                    sums[f"{prefix}{key}"] += (gw * x).sum()
    names = sorted(sums)
    total = dict(zip(names, runtime.reduce_sum(torch.stack([sums[k] for k in names])).tolist()))
    out = {}
    for prefix in ["", *(f"{src}/" for src in sources)]:
        rows, prompts = max(total[f"{prefix}rows"], 1.0), max(total[f"{prefix}prompts"], 1.0)
        out[f"eval/{prefix}reward/mean@{n}"] = total[f"{prefix}reward"] / rows
        out[f"eval/{prefix}response_length"] = total[f"{prefix}length"] / rows
        out[f"eval/{prefix}kl"] = total[f"{prefix}kl"] / rows
        for name in (k[len(f"{prefix}term/") :] for k in names if k.startswith(f"{prefix}term/")):
            out[f"eval/{prefix}rewards/{name}/mean@{n}"] = total[f"{prefix}term/{name}"] / rows
        for name in (k[len(f"{prefix}metric/") :] for k in names if k.startswith(f"{prefix}metric/")):
            out[f"eval/{prefix}metrics/{name}/mean@{n}"] = total[f"{prefix}metric/{name}"] / rows
        for name in (k[len(f"{prefix}extra/") :] for k in names if k.startswith(f"{prefix}extra/")):
            out[f"eval/{prefix}{name}"] = total[f"{prefix}extra/{name}"] / rows
        for k in ks:
            out[f"eval/{prefix}pass@{k}"] = total[f"{prefix}pass@{k}"] / prompts
    return out


def due(eval_cfg, datamodule, step: int | None) -> bool:
    """Whether to evaluate before iteration ``step`` (None: after the last one): never without eval
    prompts; at step 0 with ``eval.before_training``; every ``eval.every_n_iterations``."""
    if eval_cfg is None or getattr(datamodule, "eval_dataset", None) is None:
        return False
    if step is None:
        return True
    every = eval_cfg.every_n_iterations
    return (step == 0 and eval_cfg.before_training) or (bool(every) and step > 0 and step % every == 0)


def evaluate_module(module, samples: list | None = None) -> dict[str, float]:
    """``evaluate`` for a ``PPOModule`` as it is now: its backend and sampling (greedy, or at
    ``eval.temperature``), a generator of its own (the same eval samples for the same weights;
    the training stream untouched); rank 0's first samples go to a W&B logger as a table, and
    to ``samples`` when given."""
    from lightning.pytorch.loggers import WandbLogger

    e, dm = module.eval_cfg, module.trainer.datamodule
    samples = [] if samples is None else samples
    greedy = e.temperature == 0
    params = module.sampling.replace(greedy=greedy, **({} if greedy else {"temperature": e.temperature}))
    metrics = evaluate(
        dm.eval_batches(),
        sampler=module.sampler,
        params=params,
        generator=module.runtime.new_generator(module.seed + 104_729, stride=1),
        policy=module.policy,
        ref_lm=module.ref_lm,
        reward_fn=module.reward_fn,
        tokenizer=module.tokenizer,
        runtime=module.runtime,
        num_samples=e.num_samples,
        pass_threshold=e.pass_threshold,
        pass_term=e.pass_term,
        device=module.device,
        sources=dm.eval_sources(),
        metrics=module.eval_metrics,
        samples=samples,
        head_chunk=module.ppo_cfg.lm_head_chunk_size,
        episodes=module.algo.episodes,
    )
    pop_reward_logs(module.reward_fn)  # log_metric calls of eval scoring are not the training rollout's
    for lg in module.loggers:
        if isinstance(lg, WandbLogger) and samples:
            lg.log_table(
                key="eval_samples",
                columns=["step", "prompt", "response", "reward"],
                data=[[module.global_step, *row] for row in samples],
                step=module.global_step,
            )
    return metrics
