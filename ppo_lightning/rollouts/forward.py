"""The forwards over a batch of sequences: how their rows are laid out (cut to the columns they use,
each distinct prompt encoded once, grouped under a token budget), the no-grad logprob forwards of
the rollout (the old policy's logprobs and values, the reference's logprobs) and the update's
forward with gradients. Everything here gives the same numbers whatever the layout; the layouts
only spend less compute (``docs/implementation.md``).

Layout of one batch (``P`` prompt positions, ``R`` response positions, ``T = P + R``)::

    query_responses  [B, T]   <pad><pad> prompt tokens | response tokens <eos> <pad> <pad>
    attention_mask   [B, T]      0    0    1 ... 1     |   1  ...  1      1     0     0
"""

from __future__ import annotations

import dataclasses
import logging
from typing import NamedTuple

import torch
from torch import Tensor

from ppo_lightning.models.lean_head import head_outputs, use_lean_head
from ppo_lightning.models.policy import PolicyWithValueHead, position_ids_from_mask
from ppo_lightning.models.shared_prompt import AUTO_MIN_PROMPT_TOKENS, prompt_groups, response_outputs
from ppo_lightning.models.shared_prompt import unsupported as shared_prompt_unsupported

log = logging.getLogger("ppo_lightning.algo.algorithm")  # the name its warning has always had in the run log

PolicyOutput = tuple[Tensor, Tensor | None, Tensor]  # entropies [B, R], values [B, R], logprobs [B, R]


class Sequences(NamedTuple):
    """What every forward reads of a batch: ``query_responses [B, T]``, ``attention_mask [B, T]``,
    ``position_ids [B, T]`` (left padding skipped: ``position_ids_from_mask``) and the prompt's
    ``context_length`` P. Unpacks into ``forward_logprobs``' arguments in order."""

    query_responses: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    context_length: int

    @classmethod
    def of(cls, query_responses: Tensor, attention_mask: Tensor, context_length: int) -> "Sequences":
        """The sequences with their positions computed from the attention mask."""
        return cls(query_responses, attention_mask, position_ids_from_mask(attention_mask), context_length)


@dataclasses.dataclass(frozen=True)
class ForwardLayout:
    """How a scoring forward lays out its rows, each way giving the same numbers for less work:
    cut to the columns they use (``remove_padding``: ``padding_window``), and each distinct prompt
    encoded once, its responses attending to its keys and values (``shared_prompt``:
    ``models.shared_prompt``; ``ppo.shared_prompt_forward``, resolved by ``PPO``). With
    ``shared_prompt`` minibatches hold whole groups; a forward shares its prompts where its prompt
    columns are at least ``min_prompt_tokens`` (``auto``: ``AUTO_MIN_PROMPT_TOKENS``)."""

    remove_padding: bool = True
    shared_prompt: bool = False
    min_prompt_tokens: int = 1

    def shares(self, context_length: int) -> bool:
        """Whether a forward whose prompts span ``context_length`` columns encodes each once."""
        return self.shared_prompt and context_length >= self.min_prompt_tokens


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
                ids, mask, pos, P, temperature, head_chunk, entropy_grad=False, shared=layout.shares(P)
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
    groups = prompt_groups(ids, mask, P) if layout.shares(P) and width > 1 else None
    spec = (responses, temperature, head_chunk, mask[:, P:]) if lean else None  # real response tokens only
    out, _ = response_outputs(lm, ids, mask, pos, P, groups, spec)
    return head_outputs(out, lean, responses, temperature, False)[0]


def layout_for(c, policy: PolicyWithValueHead | None) -> ForwardLayout:
    """The forward layout of this run (``c``, a ``config.PPOConfig``): ``ppo.remove_padding``, and
    ``ppo.shared_prompt_forward`` resolved. ``auto`` shares where it applies (groups of
    ``num_generations > 1``, minibatches of whole groups, no gradient checkpointing; ``true``
    where one of these fails is refused by ``config.rules``) on an architecture it is tested on
    (any other: a warning, and each row encodes its prompt), in the forwards whose prompts span
    at least ``AUTO_MIN_PROMPT_TOKENS`` columns; ``true`` in every forward."""
    n = c.num_generations
    off = ForwardLayout(c.remove_padding, shared_prompt=False)
    if policy is None or c.shared_prompt_forward is False or n == 1 or c.minibatch_size % n or policy.checkpointing:
        return off
    why = shared_prompt_unsupported(policy.lm)
    if why is not None:
        log.warning("ppo.shared_prompt_forward: %s; every row encodes its prompt itself", why)
        return off
    min_tokens = 1 if c.shared_prompt_forward is True else AUTO_MIN_PROMPT_TOKENS
    return ForwardLayout(c.remove_padding, shared_prompt=True, min_prompt_tokens=min_tokens)


def policy_forward(
    policy, mb, temperature: float, head_chunk: int | None, entropy_grad: bool, layout: ForwardLayout
) -> PolicyOutput:
    """Entropies, values and logprobs of the responses ``[B, R]`` of ``mb`` (a rollout or a part of
    one: ``query_responses``, ``attention_mask``, ``position_ids``, ``context_length``) at the sampling temperature
    (as the rollout's logprobs), the LM head in chunks of ``head_chunk`` (``ppo.lm_head_chunk_size``);
    laid out as ``layout`` says (on the rows' ``padding_window``: zeros past the longest
    response; each prompt once)."""
    rows = (mb.query_responses, mb.attention_mask, mb.position_ids)
    ids, mask, pos, P = unpadded(*rows, mb.context_length) if layout.remove_padding else (*rows, mb.context_length)
    logp, entropy, values = policy.score_responses(
        ids, mask, pos, P, temperature, head_chunk, entropy_grad=entropy_grad, shared=layout.shares(P)
    )
    R = mb.query_responses.shape[1] - mb.context_length
    return pad_responses(entropy, R), pad_responses(values, R), pad_responses(logp, R)


def row_prompts(query_responses: Tensor, attention_mask: Tensor, context_length: int) -> list[int]:
    """Each row's prompt as an index shared by the rows with the same prompt (``prompt_groups``):
    what ``token_budget_groups`` counts once per micro-batch with a shared prompt."""
    return prompt_groups(query_responses, attention_mask, context_length)[1].tolist()
