"""Evaluation during training: the policy's answers to held-out prompts, scored by the run's reward.

``evaluate`` samples ``n`` responses per eval prompt through the same generation backend and
``SamplingParams`` as the rollout (greedy, or another temperature, as ``eval.*`` says), with a
generator of its own so the training trajectory does not move, on this rank's share of the
prompts; it plays and scores them through the run's ``rollouts.RolloutWorker`` as the rollout
does (the prompt as written and its columns reach the reward), and reduces sums over ranks once. Metrics (``docs/metrics.md``):

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

import dataclasses
import math
from collections import defaultdict
from typing import NamedTuple

import torch
from torch import Tensor

from ppo_lightning.rewards.base import as_reward
from ppo_lightning.rollouts import Episodes, Prompts, RolloutWorker
from ppo_lightning.rollouts.forward import Sequences, forward_logprobs


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


@dataclasses.dataclass(frozen=True)
class EvalSpec:
    """What one evaluation measures, as one object (the ``eval.*`` node with the run's data and
    numerics): ``num_samples`` responses per prompt (``n``), a pass when the score (or
    ``pass_term``'s) reaches ``pass_threshold``; per ``data_source`` too with ``sources`` (every eval
    record's, the same list on every rank); ``metrics`` (``eval.metrics``: name -> scorer) scored on
    the same samples apart from the reward; up to ``max_samples`` sample rows kept; the LM head in
    chunks of ``head_chunk`` (``ppo.lm_head_chunk_size``)."""

    num_samples: int
    pass_threshold: float
    pass_term: str | None = None
    sources: tuple[str, ...] = ()
    metrics: dict = dataclasses.field(default_factory=dict)
    max_samples: int = 8
    head_chunk: int | None = None

    @property
    def ks(self) -> list[int]:
        return pass_ks(self.num_samples)


@torch.no_grad()
def evaluate(
    batches, worker: RolloutWorker, policy, ref_lm, spec: EvalSpec, runtime, device, generator=None, samples=None
) -> dict[str, float]:
    """The ``eval/*`` metrics over every rank's ``batches`` (``(batch, weight [B])`` pairs: a row of
    weight 0 pads a rank's share, and counts nowhere): each batch played by ``worker`` from
    ``generator``'s stream, scored by its raw reward (and ``spec.metrics``), its KL to ``ref_lm``
    measured, and the sums reduced over ranks once. ``samples``, when given, receives up to
    ``spec.max_samples`` of this rank's ``(prompt, response, reward)`` rows. With an environment
    each prompt is played as a multi-turn episode, scored on its outcome (its score plus its turn
    rewards), its length the policy's tokens, and ``eval/env/turns_mean`` and
    ``eval/env/tool_calls_mean`` are logged too."""
    sums: dict[str, Tensor] = defaultdict(lambda: torch.zeros((), dtype=torch.float64, device=device))
    with runtime.rollout_context(policy, ref_lm):
        for batch, weight in batches:
            ep = worker.play(Prompts.of(batch, device).repeated(spec.num_samples), generator)
            raw, terms = ep.returns, ep.term_scores
            kl = _kl_to_reference(policy, ref_lm, ep, worker.params.temperature, spec)
            per_row = {**_per_row(ep, raw, terms, kl), **_metric_scores(spec, worker, ep)}
            w = weight.to(device, torch.float64)
            if samples is not None and len(samples) < spec.max_samples:
                real = w.repeat_interleave(spec.num_samples) > 0
                _keep_samples(samples, spec.max_samples, worker.tokenizer, ep, raw, real)
            judged = terms[spec.pass_term] if spec.pass_term else raw
            groups = _groups(batch, w, spec.sources, device)
            _add(sums, per_row, _pass_at_ks(judged, spec, device), groups, spec.num_samples)
    return _means(sums, runtime, spec)


def _kl_to_reference(policy, ref_lm, ep: Episodes, temperature: float, spec: EvalSpec) -> Tensor:
    """``[B, R]`` k1 = logp - ref of the sampled tokens (at the sampling temperature)."""
    seq = Sequences.of(ep.query_responses, ep.attention_mask, ep.context_length)
    logp, _ = forward_logprobs(policy, None, *seq, temperature, head_chunk=spec.head_chunk)
    ref, _ = forward_logprobs(None, ref_lm, *seq, temperature, head_chunk=spec.head_chunk)
    return logp - ref


def _per_row(ep: Episodes, raw: Tensor, terms: dict[str, Tensor], kl: Tensor) -> dict[str, Tensor]:
    """Each row's measures ``[B]`` float64: reward, length, KL (summed over the response), each
    term's raw score, and with episodes their turns and tool calls."""
    mask, device = ep.response_mask, raw.device
    extra = ep.played.eval_measures()  # with an environment: turns and tool calls
    return {
        "reward": raw.double(),
        "length": mask.sum(1).double(),
        "kl": (kl * mask).sum(1).double(),
        **{f"term/{name}": t.double().nan_to_num(0.0) for name, t in terms.items()},
        **{f"extra/{k}": v.to(device) for k, v in extra.items()},
    }


def _metric_scores(spec: EvalSpec, worker: RolloutWorker, ep: Episodes) -> dict[str, Tensor]:
    """Each ``eval.metrics`` scorer's score ``[B]`` of the same episodes (not part of the reward)."""
    return {f"metric/{name}": worker.score(ep, fn).total.double() for name, fn in spec.metrics.items()}


def _keep_samples(samples: list, max_samples: int, tokenizer, ep: Episodes, raw: Tensor, real: Tensor) -> None:
    """Append the real rows' ``(prompt, response, reward)`` to ``samples``, up to ``max_samples``;
    with episodes the whole conversation, each message under its role."""
    prompt_texts, texts = ep.played.conversations(tokenizer)
    rows_here = [(p, r, float(x)) for p, r, x, ok in zip(prompt_texts, texts, raw.tolist(), real) if ok]
    samples.extend(rows_here[: max_samples - len(samples)])


def _pass_at_ks(judged: Tensor, spec: EvalSpec, device) -> dict[str, Tensor]:
    """Each prompt's ``pass@k`` ``[B / n]`` from its ``n`` consecutive rows' scores."""
    n = spec.num_samples
    passed = (judged >= spec.pass_threshold).view(-1, n).sum(1).tolist()  # per prompt
    return {
        f"pass@{k}": torch.tensor([pass_at_k(n, int(c), k) for c in passed], dtype=torch.float64, device=device)
        for k in spec.ks
    }


def _groups(batch: dict, w: Tensor, sources, device) -> list[tuple[str, Tensor]]:
    """``(prefix, prompt weights)``: every prompt, then the prompts of each source, by weight."""
    groups = [("", w)]
    for src in sources:
        in_src = [str(col.get("data_source")) == src for col in batch["columns"]]
        groups.append((f"{src}/", w * torch.tensor(in_src, dtype=torch.float64, device=device)))
    return groups


def _add(sums: dict, per_row: dict, per_prompt: dict, groups: list, n: int) -> None:
    """Add one batch's weighted sums (rows weigh their prompt's weight) to ``sums``."""
    for prefix, gw in groups:
        rows = gw.repeat_interleave(n)
        sums[f"{prefix}rows"] += rows.sum()
        sums[f"{prefix}prompts"] += gw.sum()
        for key, x in per_row.items():
            sums[f"{prefix}{key}"] += (rows * x).sum()
        for key, x in per_prompt.items():
            sums[f"{prefix}{key}"] += (gw * x).sum()


def _means(sums: dict[str, Tensor], runtime, spec: EvalSpec) -> dict[str, float]:
    """The ``eval/*`` metrics: the sums reduced over ranks (one collective), over rows or prompts."""
    n, names = spec.num_samples, sorted(sums)
    total = dict(zip(names, runtime.reduce_sum(torch.stack([sums[k] for k in names])).tolist()))
    out = {}
    for prefix in ["", *(f"{src}/" for src in spec.sources)]:
        rows, prompts = max(total[f"{prefix}rows"], 1.0), max(total[f"{prefix}prompts"], 1.0)
        out[f"eval/{prefix}reward/mean@{n}"] = total[f"{prefix}reward"] / rows
        out[f"eval/{prefix}response_length"] = total[f"{prefix}length"] / rows
        out[f"eval/{prefix}kl"] = total[f"{prefix}kl"] / rows
        for kind, label, suffix in (
            ("term", "rewards/", f"/mean@{n}"),
            ("metric", "metrics/", f"/mean@{n}"),
            ("extra", "", ""),
        ):
            for name in (k[len(f"{prefix}{kind}/") :] for k in names if k.startswith(f"{prefix}{kind}/")):
                out[f"eval/{prefix}{label}{name}{suffix}"] = total[f"{prefix}{kind}/{name}"] / rows
        for k in spec.ks:
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


class Evaluation:
    """Evaluation during training, for a ``PPOModule``: the ``eval.*`` node (``cfg``, a
    ``config.EvalConfig``; None: never), the ``eval.metrics`` rewards (name -> ``rewards.Reward``, a
    plain callable wrapped once; measured on eval samples only), and every evaluation of this process in order (``history``: the recipes'
    before/after tables). It evaluates only when the data has eval prompts."""

    def __init__(self, cfg=None, metrics: dict | None = None):
        self.cfg, self.metrics = cfg, {name: as_reward(fn) for name, fn in (metrics or {}).items()}
        self.history: list[EvalPoint] = []

    def due(self, datamodule, step: int | None) -> bool:
        """Whether to evaluate before iteration ``step`` (None: after the last one; ``due``)."""
        return due(self.cfg, datamodule, step)

    def __call__(self, step: int, worker: RolloutWorker, policy, ref_lm, runtime, datamodule, **where) -> EvalPoint:
        """The ``eval/*`` metrics of ``policy`` as it is now (``run``), kept with rank 0's first
        samples in ``history`` as the evaluation before iteration ``step``."""
        samples: list = []
        point = EvalPoint(
            step, self.run(worker, policy, ref_lm, runtime, datamodule, samples=samples, **where), samples
        )
        self.history.append(point)
        return point

    def run(
        self,
        worker: RolloutWorker,
        policy,
        ref_lm,
        runtime,
        datamodule,
        *,
        device,
        seed: int,
        head_chunk: int | None = None,
        samples: list | None = None,
    ) -> dict[str, float]:
        """``evaluate`` of ``policy`` as it is now, on ``datamodule``'s eval prompts (moved to
        ``device``): through the run's ``worker`` with its sampling made greedy (or at
        ``eval.temperature``), from a generator of its own (``seed``: the same eval samples for the
        same weights; the training stream untouched), the LM head in chunks of ``head_chunk``
        (``ppo.lm_head_chunk_size``); rank 0's first samples go to ``samples`` when given."""
        e = self.cfg
        greedy = e.temperature == 0
        params = worker.params.replace(greedy=greedy, **({} if greedy else {"temperature": e.temperature}))
        spec = EvalSpec(
            e.num_samples,
            e.pass_threshold,
            e.pass_term,
            tuple(datamodule.eval_sources()),
            self.metrics,
            head_chunk=head_chunk,
        )
        return evaluate(
            datamodule.eval_batches(),
            worker.replace(params=params),
            policy,
            ref_lm,
            spec,
            runtime,
            device,
            runtime.new_generator(seed + 104_729, stride=1),
            samples,
        )


def log_sample_table(loggers, step: int, samples: list) -> None:
    """Rank 0's first eval samples as the W&B table ``eval_samples``, at ``step``."""
    from lightning.pytorch.loggers import WandbLogger

    for lg in loggers:
        if isinstance(lg, WandbLogger) and samples:
            lg.log_table(
                key="eval_samples",
                columns=["step", "prompt", "response", "reward"],
                data=[[step, *row] for row in samples],
                step=step,
            )
