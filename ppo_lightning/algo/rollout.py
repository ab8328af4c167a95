"""Rollouts: responses sampled to left-padded prompts (through a generation backend,
``ppo_lightning/generation``), then everything PPO needs to learn from those samples, gathered in
one ``Rollout`` (a dataclass of tensors). No Lightning here.

Layout of one rollout (``P`` prompt positions, ``R`` response positions, ``T = P + R``)::

    query_responses  [B, T]   <pad><pad> prompt tokens | response tokens <eos> <pad> <pad>
    attention_mask   [B, T]      0    0    1 ... 1     |   1  ...  1      1     0     0
    response_mask    [B, R]                            |   1  ...  1      1     0     0

Everything after the first EOS is masked out of every loss and statistic ([N+] detail).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Callable

import torch
from torch import Tensor

from ppo_lightning.algo.advantages import (
    AdvantageInputs,
    estimate,
    from_policy_tokens,
    policy_token_order,
    to_policy_tokens,
)
from ppo_lightning.algo.kl import kl_k1, kl_penalty
from ppo_lightning.generation import GenerationBackend, SamplingParams, stopped_rows
from ppo_lightning.models.signature import logits_to_keep
from ppo_lightning.models.lean_head import head_outputs, use_lean_head
from ppo_lightning.models.shared_prompt import prompt_groups, response_outputs
from ppo_lightning.models.policy import PolicyWithValueHead, position_ids_from_mask
from ppo_lightning.rewards.base import Normalization, RewardInputs, normalized

if TYPE_CHECKING:
    from ppo_lightning.envs import EpisodeBatch, EpisodeRunner


class _Sequences:
    """What ``Rollout`` and ``Samples`` share: ``query_responses [B, T]`` = left-padded prompt
    (``context_length`` = P positions) + response."""

    query_responses: Tensor
    context_length: int

    @property
    def batch_size(self) -> int:
        return self.query_responses.shape[0]

    @property
    def responses(self) -> Tensor:
        return self.query_responses[:, self.context_length :]


PolicyOutput = tuple[Tensor, Tensor | None, Tensor]  # entropies [B, R], values [B, R], logprobs [B, R]


@dataclasses.dataclass
class Rollout(_Sequences):
    """One PPO batch: sampled responses and the old policy's view of them. All tensors share B.
    What ``values``, ``advantages`` and ``returns`` hold depends on ``ppo.advantage``."""

    query_responses: Tensor  # [B, T] long
    attention_mask: Tensor  # [B, T] long: prompt mask | response mask
    position_ids: Tensor  # [B, T] long: left padding skipped
    response_mask: Tensor  # [B, R] float: 1 on response tokens up to and including EOS
    logprobs: Tensor  # [B, R] old policy log pi(a_t | s_t), logits / temperature
    ref_logprobs: Tensor  # [B, R] reference model, same temperature
    values: Tensor  # [B, R] gae: the value head's V(s_t) at sampling time; critic-free: zeros
    kl: Tensor  # [B, R] per-token k1 = logprobs - ref_logprobs (for metrics)
    rewards: Tensor  # [B, R] -beta * KL_t (kl_in=reward), plus the score at the last real token
    non_score_reward: Tensor  # [B] sum over tokens of -beta * KL_t (the KL part of the return)
    advantages: Tensor  # [B, R] what the policy loss weighs each token by: gae, whitened GAE;
    # grpo / rloo, the group-relative score plus the KL return-to-go; reinforce_pp, whitened returns
    returns: Tensor  # [B, R] gae: value targets, advantages (before whitening) + values; else a record
    scores: Tensor  # [B] reward of each full response: normalised, after the missing-EOS penalty
    raw_scores: Tensor  # [B] the reward's own output, before normalisation and penalty; with episodes
    # plus the turns' EnvStep rewards (the episode's raw return)
    contains_eos: Tensor  # [B] bool
    context_length: int  # P
    term_scores: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # reward.terms: raw [B] each
    scored: Tensor | None = None  # [B] bool: some reward applies (False: it returned None; masked out)
    first_forward: PolicyOutput | None = None  # the old policy's forward with gradients, when fused
    # (algorithm.PPO._old_logprobs_and_values): the first update reuses it, once
    collect_time_s: float = 0.0  # wall time of sampling, scoring and the rollout's forwards
    engine_logprobs: Tensor | None = None  # [B, R] an engine backend's logprobs of its samples (metrics)
    sampling_logprobs: Tensor | None = None  # [B, R] the old policy's under the sampling's truncation
    # (truncated_logprobs; logprobs when there is none): what engine_logprobs are compared with
    engine_weights: Tensor | None = None  # [B, R] ppo.engine_correction's weights of the policy loss
    turn_rewards: Tensor | None = None  # [B, R] multi-turn: each turn's EnvStep.reward on its last token
    episodes: "EpisodeBatch | None" = None  # multi-turn: the episodes as played (metrics, dumps)
    reward_logs: dict[str, float] = dataclasses.field(default_factory=dict)  # rewards/<term>/<name>: log_metric
    records: tuple[list, list] | None = None  # each row's prompt as written and its columns (rollout dumps)

    def is_finite(self) -> Tensor:
        """Whether every score, logprob, value and advantage is finite (a 0-dim bool tensor)."""
        return torch.stack(
            [
                torch.isfinite(t).all()
                for t in (self.scores, self.logprobs, self.ref_logprobs, self.values, self.advantages, self.returns)
            ]
        ).all()

    def describe_nonfinite(self, tokenizer) -> str:
        """What is not finite, for the warning: the first bad score with its prompt, or the rest."""
        bad = (~torch.isfinite(self.scores)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            prompt = tokenizer.decode(self.query_responses[i, : self.context_length], skip_special_tokens=True)
            return f"reward {self.scores[i].item()} for prompt {prompt[:60]!r}"
        return "logprobs, values or advantages in the rollout"

    def index(self, idx: Tensor | slice) -> "Rollout":
        """The rows ``idx`` of every tensor: a minibatch, or a micro-batch of one."""
        skip = ("first_forward", "episodes", "reward_logs", "records")  # used once / the whole iteration's
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skip}
        fields["term_scores"] = {k: v[idx] for k, v in self.term_scores.items()}
        return Rollout(**{k: v[idx] if isinstance(v, Tensor) else v for k, v in fields.items()})


# ----------------------------------------------------------------------------- scoring forwards
@dataclasses.dataclass(frozen=True)
class ForwardLayout:
    """How a scoring forward lays out its rows, each way giving the same numbers for less work:
    cut to the columns they use (``remove_padding``: ``padding_window``), and each distinct prompt
    encoded once, its responses attending to its keys and values (``shared_prompt``:
    ``models.shared_prompt``; ``ppo.shared_prompt_forward``, resolved by ``PPO``)."""

    remove_padding: bool = True
    shared_prompt: bool = False


def padding_window(attention_mask: Tensor, context_length: int) -> tuple[int, int]:
    """``(start, stop)``: the columns of a ``[B, T]`` batch that hold a real token in some row.
    Left of ``start`` every row's prompt is padding, right of ``stop`` every row's response has
    ended. Attention masks padding out, so a forward on the window gives every real position the
    same logits as one on the whole width, for less work: a micro-batch costs its longest row,
    not the rollout's width (``ppo.remove_padding``). The window keeps the prompt's last column
    (it predicts the first response token) and at least one response column: the union of the
    rows' ``row_windows``. One host sync."""
    starts, stops = row_windows(attention_mask, context_length)
    return min(starts), max(stops)


def unpadded(query_responses: Tensor, attention_mask: Tensor, position_ids: Tensor, context_length: int):
    """The batch cut to its ``padding_window``: ``(query_responses, attention_mask, position_ids,
    context_length)`` with the columns no row uses removed (positions keep their values)."""
    start, stop = padding_window(attention_mask, context_length)
    window = slice(start, stop)
    return query_responses[:, window], attention_mask[:, window], position_ids[:, window], context_length - start


def row_windows(attention_mask: Tensor, context_length: int) -> tuple[list[int], list[int]]:
    """Each row's own window: ``(starts, stops)``, its first attended token and one past its last
    (at least the prompt's last column and one response column)."""
    real = attention_mask.bool()
    T, idx = real.shape[1], torch.arange(real.shape[1], device=real.device)
    starts = torch.where(real, idx, T).min(1).values.clamp(max=context_length - 1)
    stops = (torch.where(real, idx, -1).max(1).values + 1).clamp(min=context_length + 1)
    return starts.tolist(), stops.tolist()


def token_budget_groups(
    starts: list[int], stops: list[int], budget: int, prompts: list[int] | None = None, context_length: int = 0
) -> list[Tensor]:
    """Rows grouped for dynamic micro-batches: sorted by width (``stop - start``), longest first,
    each group taking the next rows while the tokens its forward computes stay within ``budget``:
    ``rows x (max stop - min start)`` on its ``padding_window``. A row wider than the budget forms
    a group alone. Returns each group's row indices.

    With ``prompts`` (each row's prompt, ``shared_prompt``: each distinct prompt encoded once),
    rows are sorted by response length and a group costs ``distinct prompts x (context_length -
    min start) + rows x (max stop - context_length)``: rows of one length from several groups
    share a micro-batch, each prompt still encoded once in it."""
    if prompts is None:
        order = sorted(range(len(starts)), key=lambda i: (starts[i] - stops[i], i))
    else:
        order = sorted(range(len(starts)), key=lambda i: (-stops[i], prompts[i], i))

    def cost(rows: list[int], lo: int, hi: int) -> int:
        if prompts is None:
            return len(rows) * (hi - lo)
        return len({prompts[i] for i in rows}) * (context_length - lo) + len(rows) * (hi - context_length)

    groups, current, lo, hi = [], [], 0, 0
    for i in order:
        new_lo, new_hi = (min(lo, starts[i]), max(hi, stops[i])) if current else (starts[i], stops[i])
        if current and cost([*current, i], new_lo, new_hi) > budget:
            groups.append(current)
            current, new_lo, new_hi = [], starts[i], stops[i]
        current.append(i)
        lo, hi = new_lo, new_hi
    groups.append(current)
    return [torch.tensor(g) for g in groups]


def split_to(groups: list[Tensor], n: int) -> list[Tensor]:
    """``groups`` split until there are ``n`` (the group with most rows halved each time, its
    longer rows first): every rank runs the same number of forwards. ``n`` is at most the rows."""
    groups = list(groups)
    while len(groups) < n:
        i = max(range(len(groups)), key=lambda j: len(groups[j]))
        g = groups.pop(i)
        half = (len(g) + 1) // 2
        groups[i:i] = [g[:half], g[half:]]
    return groups


def pad_responses(x: Tensor | None, width: int) -> Tensor | None:
    """``[B, R']`` response-position values (logprobs, entropies, values) zero-padded on the right
    to ``width`` columns: the rollout's ``R``, where every loss and statistic masks them out."""
    return x if x is None or x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))


def row_chunks(
    query_responses: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    context_length: int,
    chunk_size: int | None,
    remove_padding: bool,
):
    """The rows in chunks of ``chunk_size`` (None: one chunk), each ``(query_responses,
    attention_mask, position_ids, context_length)`` cut to its ``padding_window`` when
    ``remove_padding``: what the rollout's no-grad forwards run on."""
    B = query_responses.shape[0]
    chunk_size = chunk_size or B
    for s in range(0, B, chunk_size):
        rows = (
            query_responses[s : s + chunk_size],
            attention_mask[s : s + chunk_size],
            position_ids[s : s + chunk_size],
        )
        yield unpadded(*rows, context_length) if remove_padding else (*rows, context_length)


@torch.no_grad()
def forward_logprobs(
    policy: PolicyWithValueHead | None,
    lm,
    query_responses: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    context_length: int,
    temperature: float,
    chunk_size: int | None = None,
    head_chunk: int | None = None,
    layout: ForwardLayout = ForwardLayout(),
) -> tuple[Tensor, Tensor | None]:
    """Logprobs of the response tokens (and values, when ``policy`` is given), in row chunks of
    ``chunk_size``, each laid out as ``layout`` says (on its ``padding_window``, each prompt once);
    with ``head_chunk``, the LM head in chunks of that many positions (``lean_head``, when the
    head allows it; ``ppo.lm_head_chunk_size``).

    Logits are divided by the sampling temperature before the log-softmax, so the logprobs are
    those of the distribution the tokens were sampled from ([N+] detail).
    """
    R = query_responses.shape[1] - context_length
    logps, values = [], []
    for ids, mask, pos, P in row_chunks(
        query_responses, attention_mask, position_ids, context_length, chunk_size, layout.remove_padding
    ):
        if policy is not None:
            logp, _, v = policy.score_responses(
                ids, mask, pos, P, temperature, head_chunk, entropy_grad=False, shared=layout.shared_prompt
            )
            if v is not None:  # a policy without a value head (critic-free estimators) gives none
                values.append(pad_responses(v, R))
            logps.append(pad_responses(logp, R))
            continue
        logps.append(pad_responses(_lm_logprobs(lm, ids, mask, pos, P, temperature, head_chunk, layout), R))
    return torch.cat(logps), (torch.cat(values) if values else None)


def _lm_logprobs(lm, ids: Tensor, mask: Tensor, pos: Tensor, P: int, temperature: float, head_chunk, layout) -> Tensor:
    """``forward_logprobs`` of a bare LM (the reference) on one chunk of rows."""
    responses, width = ids[:, P:], ids.shape[1] - P
    lean = use_lean_head(lm, head_chunk)
    groups = prompt_groups(ids, mask, P) if layout.shared_prompt and width > 1 else None
    spec = (responses, temperature, head_chunk, mask[:, P:]) if lean else None  # real response tokens only
    out, _ = response_outputs(lm, ids, mask, pos, P, groups, spec)
    return head_outputs(out, lean, responses, temperature, False)[0]


TRUNCATED_LOGPROB_FLOOR = -30.0
"""``truncated_logprobs`` of a token outside the trainer's truncation (a tie at its boundary that
the engine broke the other way): a finite floor, so the mismatch metrics stay finite and the
token's correction weight is ~0."""


@torch.no_grad()
def truncated_logprobs(
    lm,
    query_responses: Tensor,
    attention_mask: Tensor,
    position_ids: Tensor,
    context_length: int,
    params: SamplingParams,
    chunk_size: int | None = None,
    remove_padding: bool = True,
    min_p_first: bool = False,
) -> Tensor:
    """Logprobs ``[B, R]`` of the response tokens under the distribution the sampler drew them
    from, truncation included: logits / temperature, then top-k, top-p and min-p as the ``hf``
    sampler applies them (``generation.hf.sampling_probs``; ``min_p_first``: in the engine's
    order), renormalised over the tokens kept.

    An engine reports its logprobs of that distribution (vLLM's ``processed_logprobs``), and
    ``forward_logprobs`` gives the full softmax's: the two differ by the log of the mass the
    truncation keeps, whatever the engine's numerics. The engine's mismatch and its correction
    (``ppo.engine_correction``) compare these instead. One no-grad forward per chunk of
    ``chunk_size`` rows, each on its ``padding_window``; the truncation one position's ``[V]``
    row at a time per response column (``[rows, V]``)."""
    from ppo_lightning.generation.hf import sampling_probs

    R = query_responses.shape[1] - context_length
    out = []
    for ids, mask, pos, P in row_chunks(
        query_responses, attention_mask, position_ids, context_length, chunk_size, remove_padding
    ):
        width = ids.shape[1] - P
        logits = lm(
            input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False, **logits_to_keep(lm, width + 1)
        ).logits[:, -(width + 1) : -1]
        logp = torch.empty(ids.shape[0], width, device=ids.device)
        for t in range(width):
            z = logits[:, t]
            probs = sampling_probs(z, params.temperature, params.top_k, params.top_p, params.min_p, min_p_first)
            picked = probs.gather(-1, ids[:, P + t, None]).squeeze(-1)
            logp[:, t] = (picked / probs.sum(-1)).log().clamp(min=TRUNCATED_LOGPROB_FLOOR)
        out.append(pad_responses(logp, R))
    return torch.cat(out)


# ----------------------------------------------------------------------------- decoding
def decode_prompts_and_responses(
    tokenizer, input_ids: Tensor, responses: Tensor, response_mask: Tensor
) -> tuple[list[str], list[str]]:
    """Prompt and response texts such that ``prompt + response`` is the decoded whole sequence.

    A response decoded on its own can lose the space (or other joiner) that the tokenizer only
    emits between tokens: word-level and SentencePiece tokenizers do. So the whole sequence is
    decoded and the response is what follows the decoded prompt; the reward then judges exactly
    the text a user would read.
    """
    pad = tokenizer.pad_token_id
    responses = responses.masked_fill(response_mask == 0, pad)
    prompts = tokenizer.batch_decode(input_ids, skip_special_tokens=True)
    full = tokenizer.batch_decode(torch.cat([input_ids, responses], dim=1), skip_special_tokens=True)
    alone = None
    texts = []
    for i, (p, f) in enumerate(zip(prompts, full)):
        if f.startswith(p):
            texts.append(f[len(p) :])
        else:  # a tokenizer whose joint decoding rewrites the prompt: fall back to the response alone
            alone = alone or tokenizer.batch_decode(responses, skip_special_tokens=True)
            texts.append(alone[i])
    return prompts, texts


def score_responses(
    reward_fn: Callable,
    tokenizer,
    input_ids: Tensor,
    attention_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    prompts: list | None = None,
    columns: list[dict] | None = None,
) -> Tensor:
    """The scorer's raw score of each row, float32, on the rollout's device; NaN where no reward
    applies (``score_terms``)."""
    total, applies, _ = score_terms(
        reward_fn, tokenizer, input_ids, attention_mask, responses, response_mask, prompts, columns
    )
    return torch.where(applies, total, torch.full_like(total, float("nan")))


def score_terms(
    reward_fn: Callable,
    tokenizer,
    input_ids: Tensor,
    attention_mask: Tensor,
    responses: Tensor,
    response_mask: Tensor,
    prompts: list | None = None,
    columns: list[dict] | None = None,
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``(raw score [B], applies [B] bool, {term: raw scores [B]})`` on the rollout's device.

    ``applies`` is False where the reward (every term, with ``reward.terms``) returned None: "does
    not apply to this response"; the score there is 0. The terms' raw scores are NaN where that
    term returned None, and the dict is empty without ``reward.terms``.

    A reward model that shares the policy's vocabulary (``RewardModel.token_input``) reads the
    token ids directly. A scorer with ``score_applies`` (a reward function, weighted terms) gets
    ``RewardInputs``: the decoded texts, and each row's prompt as the user wrote it and its
    record's ``columns`` when the batch has them; any other scorer gets ``(prompts, responses)``
    as decoded text.
    """
    device = input_ids.device
    if getattr(reward_fn, "token_input", False):
        ids = torch.cat([input_ids, responses], dim=1)
        mask = torch.cat([attention_mask, response_mask.to(attention_mask.dtype)], dim=1)
        scores = reward_fn.score_tokens(ids, mask).float().to(device)
        return scores, torch.ones_like(scores, dtype=torch.bool), {}
    prompt_texts, texts = decode_prompts_and_responses(tokenizer, input_ids, responses, response_mask)
    if not hasattr(reward_fn, "score_applies"):
        scores = torch.as_tensor(reward_fn(prompt_texts, texts), dtype=torch.float32).to(device)
        return scores, torch.ones_like(scores, dtype=torch.bool), {}
    completion_ids = None
    if getattr(reward_fn, "trl_style", False):
        completion_ids = [row[m > 0].tolist() for row, m in zip(responses.cpu(), response_mask.cpu())]
    inputs = RewardInputs(prompt_texts, texts, completion_ids, prompts, columns)
    out = reward_fn.score_applies(inputs)
    total, applies, terms = out if len(out) == 3 else (*out, {})
    total = torch.where(applies, total, torch.zeros_like(total))
    return total.to(device), applies.to(device), {k: v.to(device) for k, v in terms.items()}


def score_episodes(
    reward_fn: Callable, tokenizer, played: EpisodeBatch, error_reward: float = 0.0
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``score_terms`` for multi-turn episodes: the reward sees the whole conversation (a reward
    function: ``prompts`` the episode's prompt messages, ``completions`` its messages after them,
    ``completion_ids`` every response token, ``environments``; a reward model: the rendered
    sequence). An episode whose environment raised scores ``error_reward``, its terms NaN."""
    eps, P, device = played.episodes, played.context_length, played.loss_mask.device
    prompt_ids, responses = played.query_responses[:, :P], played.query_responses[:, P:]
    response_attention = played.attention_mask[:, P:]
    if getattr(reward_fn, "token_input", False):
        total = reward_fn.score_tokens(played.query_responses, played.attention_mask).float().to(device)
        applies, terms = torch.ones_like(total, dtype=torch.bool), {}
    else:
        prompt_texts, texts = decode_prompts_and_responses(tokenizer, prompt_ids, responses, response_attention)
        if not hasattr(reward_fn, "score_applies"):
            total = torch.as_tensor(reward_fn(prompt_texts, texts), dtype=torch.float32).to(device)
            applies, terms = torch.ones_like(total, dtype=torch.bool), {}
        else:
            inputs = RewardInputs(
                prompt_texts,
                texts,
                [e.response_ids for e in eps],
                [e.prompt_messages for e in eps],
                [e.record.columns for e in eps],
                completions=[e.completion for e in eps],
                environments=[getattr(e.env, "environment", None) or e.env for e in eps],
            )
            out = reward_fn.score_applies(inputs)
            total, applies, terms = out if len(out) == 3 else (*out, {})
            total = torch.where(applies, total, torch.zeros_like(total)).to(device)
            applies, terms = applies.to(device), {k: v.to(device) for k, v in terms.items()}
    failed = torch.tensor([e.env_error is not None for e in eps], dtype=torch.bool, device=device)
    if failed.any():  # the environment broke: its score, not the reward's
        total = torch.where(failed, torch.full_like(total, error_reward), total)
        applies = applies | failed
        terms = {k: torch.where(failed, torch.full_like(v, float("nan")), v) for k, v in terms.items()}
    return total, applies, terms


# ----------------------------------------------------------------------------- sampling
@dataclasses.dataclass(frozen=True)
class Prompts:
    """A batch of left-padded prompts: ``input_ids`` and ``attention_mask`` ``[B, P]``, and each
    row's prompt as written (``texts``) with its record's ``columns``, None when the data has none
    (what a reward function and an environment read)."""

    input_ids: Tensor
    attention_mask: Tensor
    texts: list | None = None
    columns: list[dict] | None = None

    @classmethod
    def of(cls, batch: dict, device=None) -> "Prompts":
        """The prompts of a DataLoader batch (its tensors moved to ``device``, when given)."""
        ids, am = batch["input_ids"], batch["attention_mask"]
        if device is not None:
            ids, am = ids.to(device), am.to(device)
        return cls(ids, am, batch.get("prompts"), batch.get("columns"))


@dataclasses.dataclass(frozen=True)
class Sampler:
    """How responses are drawn, as one object: the generation ``backend`` with its ``params``,
    from ``generator``'s stream; with ``episodes`` (an ``envs.EpisodeRunner``, ``env``) each prompt
    record is played as a multi-turn episode through them instead."""

    backend: GenerationBackend
    params: SamplingParams
    generator: torch.Generator | None = None
    episodes: EpisodeRunner | None = None

    @property
    def error_reward(self) -> float:
        """The score of an episode whose environment raised (``env.error_reward``)."""
        return 0.0 if self.episodes is None else self.episodes.cfg.error_reward


@dataclasses.dataclass
class Sampled(_Sequences):
    """Responses as sampled, before any scoring or forward: the prompt and response of each row in
    ``query_responses [B, T]``, what the model attends to (``attention_mask [B, T]``) and the
    policy's own tokens (``response_mask [B, R]``); with episodes, the episodes as ``played``."""

    query_responses: Tensor
    attention_mask: Tensor
    response_mask: Tensor
    context_length: int
    played: "EpisodeBatch | None" = None


def sample(prompts: Prompts, sampler: Sampler, score: Callable | None = None) -> Sampled:
    """One response per prompt row through ``sampler`` (or, with episodes, one episode per row;
    ``score``, a batch of episodes' reward, runs while their environments are live, and its
    ``(total, applies, terms)`` are ``played.scores``)."""
    if sampler.episodes is None:
        ids, am = prompts.input_ids, prompts.attention_mask
        responses, response_mask = sampler.backend.generate(ids, am, sampler.params, sampler.generator)
        query_responses = torch.cat([ids, responses], dim=1)  # [B, T]
        full_mask = torch.cat([am, response_mask.to(am.dtype)], dim=1)
        return Sampled(query_responses, full_mask, response_mask, ids.shape[1])
    played = sampler.episodes.run(
        prompts.texts,
        prompts.columns,
        sampler.backend,
        sampler.params,
        sampler.generator,
        prompts.input_ids.device,
        score=score,
    )
    return Sampled(played.query_responses, played.attention_mask, played.loss_mask, played.context_length, played)


def score_sampled(
    reward_fn: Callable, tokenizer, s: Sampled, prompts: Prompts, error_reward: float = 0.0
) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
    """``score_terms`` of sampled responses, or ``score_episodes`` of played episodes (an episode
    whose environment raised scores ``error_reward``)."""
    if s.played is not None:
        return score_episodes(reward_fn, tokenizer, s.played, error_reward)
    ids, am = prompts.input_ids, prompts.attention_mask
    return score_terms(reward_fn, tokenizer, ids, am, s.responses, s.response_mask, prompts.texts, prompts.columns)


def sample_scored(
    prompts: Prompts, sampler: Sampler, reward_fn: Callable, tokenizer
) -> tuple[Sampled, Tensor, Tensor, dict[str, Tensor]]:
    """``(samples, raw score [B], applies [B], {term: raw [B]})``: fresh samples and the reward's
    scores of them. Episodes are scored while their environments are live (a TRL reward may read
    an environment's state), then the environments are closed."""
    if sampler.episodes is None:
        s = sample(prompts, sampler)
        return s, *score_sampled(reward_fn, tokenizer, s, prompts)

    def score(played: EpisodeBatch) -> tuple[Tensor, Tensor, dict[str, Tensor]]:
        return score_episodes(reward_fn, tokenizer, played, sampler.error_reward)

    s = sample(prompts, sampler, score)
    return s, *s.played.scores


def sample_returns(
    prompts: Prompts, sampler: Sampler, reward_fn: Callable, tokenizer
) -> tuple[Sampled, Tensor, Tensor, dict[str, Tensor]]:
    """``(samples, return [B], applies [B], {term: raw [B]})`` of fresh samples: each row's raw
    score, with episodes plus its turn rewards (the episode's return), as evaluation and reward
    normalisation measure them."""
    s, raw, applies, terms = sample_scored(prompts, sampler, reward_fn, tokenizer)
    if s.played is not None:
        raw = raw + s.played.turn_rewards.sum(1)
    return s, raw, applies, terms


@torch.no_grad()
def reference_scores(sampler: Sampler, reward_fn: Callable, tokenizer, batches, device) -> Tensor:
    """The raw scores of the reference's responses to ``batches`` of prompts, sampled (through the
    reference's ``sampler``) and scored as the rollouts are (what reward normalisation is fitted
    on); with episodes, of the reference's episodes, each its score plus its turn rewards (the
    episode's return). NaN where no reward applies."""
    raw = []
    for batch in batches:
        _, total, applies, _ = sample_returns(Prompts.of(batch, device), sampler, reward_fn, tokenizer)
        raw.append(torch.where(applies, total, torch.full_like(total, float("nan"))))
    return torch.cat(raw)


@dataclasses.dataclass(frozen=True)
class Scorer:
    """How a response's raw reward becomes its training score, as one object: ``reward_fn``
    judges the texts ``tokenizer`` decodes; ``norm = (gain, bias)`` maps the raw score to
    ``gain * raw + bias`` ([N+] reward normalisation, fitted by ``rewards.fit_normalization``;
    None leaves it raw; turn rewards are scaled by the gain); ``missing_eos_penalty`` is taken
    from responses that never stopped ([N+]); ``mask_truncated`` takes those out of every loss
    (DAPO's overlong filtering)."""

    reward_fn: Callable
    tokenizer: object
    norm: Normalization | None = None
    missing_eos_penalty: float | None = None
    mask_truncated: bool = False

    @property
    def gain(self) -> float:
        return (self.norm or (1.0, 0.0))[0]

    def scores(self, raw_scores: Tensor, contains_eos: Tensor, stop_at_eos: bool) -> Tensor:
        """The training score of each row: normalised, then the missing-EOS penalty."""
        scores = normalized(raw_scores, self.norm)
        if self.missing_eos_penalty is not None and stop_at_eos:
            scores = torch.where(contains_eos, scores, scores - self.missing_eos_penalty)  # [N+] detail
        return scores

    def kept(self, scored: Tensor, contains_eos: Tensor, stop_at_eos: bool) -> Tensor:
        """``[B]`` bool: the rows that stay in every loss. Out: responses no reward applies to (raw
        score 0, as TRL), and with ``mask_truncated`` those cut at ``max_new_tokens``."""
        return scored & contains_eos if self.mask_truncated and stop_at_eos else scored


# ----------------------------------------------------------------------------- the whole step
@dataclasses.dataclass
class Samples(_Sequences):
    """Sampled, scored responses: the part of a rollout that does not need the policy's forward.

    ``finish_rollout`` completes it from the old policy's logprobs and values: a no-grad forward
    (``forward_logprobs``), or, when one PPO minibatch is the whole batch, the first update's own
    forward run early (``algorithm.PPO._old_logprobs_and_values``).
    """

    query_responses: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T]
    position_ids: Tensor  # [B, T]
    response_mask: Tensor  # [B, R] float
    ref_logprobs: Tensor  # [B, R] (unmasked)
    scores: Tensor  # [B] normalised, after the missing-EOS penalty
    raw_scores: Tensor  # [B] the reward's own output; with episodes plus the turns' rewards (raw return)
    contains_eos: Tensor  # [B] bool: stopped by EOS or a stop sequence
    context_length: int  # P
    term_scores: dict[str, Tensor] = dataclasses.field(default_factory=dict)  # reward.terms: raw [B] each
    scored: Tensor | None = None  # [B] bool: some reward applies (False: it returned None; masked out)
    turn_rewards: Tensor | None = None  # [B, R] multi-turn: turn rewards on their turns' last tokens
    episodes: "EpisodeBatch | None" = None  # multi-turn: the episodes as played


@torch.no_grad()
def sample_and_score(
    prompts: Prompts,
    sampler: Sampler,
    scorer: Scorer,
    ref_lm,
    *,
    forward_chunk_size: int | None = None,
    head_chunk: int | None = None,
    layout: ForwardLayout = ForwardLayout(),
) -> Samples:
    """Sample responses to left-padded ``prompts`` through ``sampler`` (the policy's backend, as
    its params say); reference logprobs (in row chunks of ``forward_chunk_size``, each laid out as
    ``layout`` says, the LM head in chunks of ``head_chunk``) and ``scorer``'s scores for them. With episodes (an ``env``), each
    prompt record is played out as a multi-turn episode instead (``envs.EpisodeRunner``, from the
    prompts as written and their columns): the response holds every turn, the environment's
    tokens attended to but out of ``response_mask``."""
    s, raw_scores, scored, term_scores = sample_scored(prompts, sampler, scorer.reward_fn, scorer.tokenizer)
    params, played = sampler.params, s.played
    if played is None:
        contains_eos = stopped_rows(s.responses, s.response_mask, params, scorer.tokenizer)
    else:
        contains_eos = played.stopped
    P, position_ids = s.context_length, position_ids_from_mask(s.attention_mask)
    ref_logprobs, _ = forward_logprobs(
        None,
        ref_lm,
        s.query_responses,
        s.attention_mask,
        position_ids,
        P,
        params.temperature,
        forward_chunk_size,
        head_chunk,
        layout,
    )
    keep = scorer.kept(scored, contains_eos, params.stop_at_eos)
    response_mask = s.response_mask if keep.all() else s.response_mask * keep[:, None]
    return Samples(
        query_responses=s.query_responses,
        attention_mask=s.attention_mask,
        position_ids=position_ids,
        response_mask=response_mask,
        ref_logprobs=ref_logprobs,
        scores=scorer.scores(raw_scores, contains_eos, params.stop_at_eos),
        # the episode's raw return: the reward's score and the environment's turn rewards
        raw_scores=raw_scores if played is None else raw_scores + played.turn_rewards.sum(1),
        contains_eos=contains_eos,
        context_length=P,
        term_scores=term_scores,
        scored=scored,
        turn_rewards=None if played is None else played.turn_rewards * scorer.gain * response_mask,
        episodes=played,
    )


@torch.no_grad()
def finish_rollout(
    s: Samples, logprobs: Tensor, values: Tensor | None, *, kl_coef: float, kl_estimator: str, cfg
) -> Rollout:
    """The rollout of ``s`` given the old policy's ``logprobs`` and ``values`` ``[B, R]``: the
    per-token KL penalty (``-kl_coef`` x the ``kl_estimator`` KL), then the advantages of the
    estimator ``cfg.advantage`` names (a ``config.PPOConfig``; ``algo.advantages.ESTIMATORS``:
    GAE on the values, or a critic-free one, whose ``values`` are None and the rollout's zeros).
    Multi-turn: the estimator sees the policy's tokens only, each row's gathered to its front (an
    environment span is neither a step nor a discount); the results go back to their positions."""
    mask = s.response_mask
    values = torch.zeros_like(logprobs) if values is None else values
    logprobs, ref_logprobs, values = logprobs * mask, s.ref_logprobs * mask, values * mask
    kl = kl_k1(logprobs, ref_logprobs) * mask  # k1, for the objective/kl metric
    per_token_kl = kl if kl_estimator == "k1" else kl_penalty(logprobs, ref_logprobs, kl_estimator, mask)
    kl_rewards = -kl_coef * per_token_kl  # [B, R]
    order = policy_token_order(mask)
    inputs = AdvantageInputs(
        scores=s.scores,
        kl_rewards=to_policy_tokens(kl_rewards, order),
        mask=to_policy_tokens(mask, order),
        values=to_policy_tokens(values, order),
        turn_rewards=None if s.turn_rewards is None else to_policy_tokens(s.turn_rewards, order),
        gamma=cfg.gamma,
        lam=cfg.lam,
        group_size=cfg.num_generations,
        scale_by_std=cfg.scale_by_group_std,
        whiten_rewards=cfg.whiten_rewards,
    )
    advantages, returns, rewards = (from_policy_tokens(x, order) for x in estimate(cfg.advantage, inputs))
    non_score_reward = kl_rewards.sum(1)
    return Rollout(
        query_responses=s.query_responses,
        attention_mask=s.attention_mask,
        position_ids=s.position_ids,
        response_mask=mask,
        logprobs=logprobs,
        ref_logprobs=ref_logprobs,
        values=values,
        kl=kl,
        rewards=rewards,
        non_score_reward=non_score_reward,
        advantages=advantages,
        returns=returns,
        scores=s.scores,
        raw_scores=s.raw_scores,
        contains_eos=s.contains_eos,
        context_length=s.context_length,
        term_scores=s.term_scores,
        scored=s.scored,
        turn_rewards=s.turn_rewards,
        episodes=s.episodes,
    )
