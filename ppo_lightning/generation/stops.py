"""Where a response stops: EOS, stop token ids, and stop strings matched on the decoded text.

A stop string is matched on text, as Hugging Face's ``StopStringCriteria`` and vLLM's ``stop=``
match it: a response stops at the token that completes the string, however the tokenizer split it.
(Tokenising the string once and matching those ids would miss ``'.</', 'answer', '>'`` for a stop
``</answer>`` that tokenises as ``'</', 'answer', '>'`` alone.) The token that completes it may
carry more text after the string (a BPE token ``">\\n"``); the response keeps that token whole.

Each sampling step decodes only the last ``window`` tokens of each row: a string of ``n`` bytes
spans at most ``n`` tokens (every token holds at least one byte), and a row stops the first time
the string appears, so it can only appear ending at the newest token.
"""

from __future__ import annotations

import torch
from torch import Tensor


class StopChecker:
    """Stops of one sampling call: ``eos_token_id`` (when ``stop_at_eos``), ``stop_token_ids``
    and ``stop_strings`` (decoded with ``tokenizer``)."""

    def __init__(self, eos_token_id: int, stop_token_ids=(), stop_strings=(), tokenizer=None):
        self.ids = (int(eos_token_id), *(int(i) for i in stop_token_ids))
        self.strings = tuple(stop_strings)
        if self.strings and tokenizer is None:
            raise ValueError("stop strings are matched on decoded text: pass the tokenizer")
        self.tokenizer = tokenizer
        self.window = max((len(s.encode("utf-8")) for s in self.strings), default=0) + 1

    def at_last(self, responses: Tensor) -> Tensor:
        """``[B]`` bool: a stop ends at the last column of ``responses [B, n]`` (its token is a stop
        token, or it completes a stop string)."""
        last = responses[:, -1]
        hit = last == self.ids[0]
        for i in self.ids[1:]:
            hit |= last == i
        if self.strings:
            texts = self.tokenizer.batch_decode(responses[:, -self.window :].tolist())
            hit |= torch.tensor([any(s in t for s in self.strings) for t in texts], device=hit.device)
        return hit

    def first_stops(self, responses: Tensor) -> Tensor:
        """``[B]`` long: the position of each row's first stop, or ``R`` where none (for a
        response an engine returned whole)."""
        B, R = responses.shape
        hits = torch.zeros(B, R, dtype=torch.bool, device=responses.device)
        for i in self.ids:
            hits |= responses == i
        first = torch.where(hits.any(1), hits.float().argmax(1), torch.full((B,), R, device=responses.device))
        if self.strings:
            rows = responses.tolist()
            for b in range(B):
                for t in range(min(int(first[b]), R)):
                    if self.ends_at(rows[b][: t + 1]):
                        first[b] = t
                        break
        return first.long()

    def ends_at(self, tokens: list[int]) -> bool:
        """Whether the last of ``tokens`` ends a stop (whatever came before it)."""
        if not tokens:
            return False
        if tokens[-1] in self.ids:
            return True
        if not self.strings:
            return False
        # completed by the last token: in the text of the last ``window`` tokens, not in that of the
        # ``window - 1`` before it (which holds any string that ended one token earlier)
        now, before = self.tokenizer.batch_decode([tokens[-self.window :], tokens[-self.window : -1]])
        return any(s in now and s not in before for s in self.strings)

    def mask(self, responses: Tensor) -> Tensor:
        """``[B, R]`` float: 1 up to and including each row's first stop, 0 after it."""
        first = self.first_stops(responses)
        return (torch.arange(responses.shape[1], device=responses.device)[None, :] <= first[:, None]).float()
