"""``SamplingParams``: how responses are sampled, one typed value for every caller."""

from __future__ import annotations

import dataclasses

from ppo_lightning.config.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How a backend samples. A run builds one from its config (``from_config``) and passes that
    same value to every call: the rollouts, reward normalisation's reference samples and the
    recipes' evaluations sample alike. Greedy evaluations use ``replace(greedy=True)``.
    """

    max_new_tokens: int
    """Response length limit; a batch stops early once every row has stopped."""
    temperature: float = 1.0
    """Logits are divided by it before the draw (and before every logprob PPO takes)."""
    top_k: int = 0
    """Draw from the k most likely tokens; 0 = off."""
    top_p: float = 1.0
    """Nucleus mass; 1.0 = off (at least one token is kept)."""
    min_p: float = 0.0
    """Drop tokens less likely than ``min_p`` times the most likely one; 0 = off. Applied after
    temperature, top-k and top-p, in Hugging Face's order of logits processors."""
    stop_at_eos: bool = True
    """Stop a row at its first EOS or stop sequence; False runs every row to ``max_new_tokens``."""
    stop_token_ids: tuple[int, ...] = ()
    """Token ids that end a response as EOS does (``sampling.stop_token_ids``)."""
    stop_strings: tuple[str, ...] = ()
    """Strings that end a response, matched on the decoded text (``sampling.stop_strings``,
    ``generation/stops.py``): the response stops at the token that completes one."""
    greedy: bool = False
    """Argmax instead of a draw (evaluations)."""
    row_max_new_tokens: tuple[int, ...] | None = None
    """Each row's own limit, at most ``max_new_tokens`` (an episode's room left under
    ``env.max_total_tokens``); None: ``max_new_tokens`` for every row. With ``stop_at_eos``."""
    chunk_size: int | None = None
    """Rows sampled per call (bounds the KV cache); null = the whole batch. A seeded run draws
    other tokens with another value (the random stream is consumed in another order)."""

    @property
    def truncates(self) -> bool:
        """Whether top-k, top-p or min-p cut the distribution the tokens are drawn from."""
        return self.top_k > 0 or self.top_p < 1.0 or self.min_p > 0.0

    @classmethod
    def from_config(cls, cfg, tokenizer) -> "SamplingParams":
        """The run's sampling: the ``sampling.*`` node (``config.SamplingConfig``), its stop token
        ids checked against the tokenizer's vocabulary."""
        return cls(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            min_p=cfg.min_p,
            stop_at_eos=cfg.stop_at_eos,
            chunk_size=cfg.chunk_size,
            stop_token_ids=checked_stop_ids(tokenizer, cfg.stop_token_ids),
            stop_strings=checked_stop_strings(cfg.stop_strings),
        )

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)

    def rows(self, index: slice) -> "SamplingParams":
        """These params for the rows ``index`` of a batch (their own limits)."""
        if self.row_max_new_tokens is None:
            return self
        return self.replace(row_max_new_tokens=self.row_max_new_tokens[index])


def checked_stop_ids(tokenizer, token_ids) -> tuple[int, ...]:
    """``sampling.stop_token_ids``, each inside the tokenizer's vocabulary."""
    vocab = len(tokenizer)
    bad = [i for i in token_ids if not 0 <= int(i) < vocab]
    if bad:
        raise ConfigError(f"sampling.stop_token_ids: {bad} outside the tokenizer's {vocab} ids")
    return tuple(int(i) for i in token_ids)


def checked_stop_strings(strings) -> tuple[str, ...]:
    """``sampling.stop_strings``, none empty (an empty string would stop every response at once)."""
    strings = tuple(strings)
    if any(not s for s in strings):
        raise ConfigError(
            "sampling.stop_strings: an empty string would stop every response at its first token; remove it"
        )
    return strings
