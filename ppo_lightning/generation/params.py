"""``SamplingParams``: how responses are sampled, one typed value for every caller."""

from __future__ import annotations

import dataclasses

from ppo_lightning.errors import ConfigError

StopSequences = tuple[tuple[int, ...], ...]  # token-id sequences that end a response (besides EOS)


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
    stop_at_eos: bool = True
    """Stop a row at its first EOS or stop sequence; False runs every row to ``max_new_tokens``."""
    stop_sequences: StopSequences = ()
    """Token-id sequences that end a response as EOS does (``sampling.stop_token_ids``, ``sampling.stop_strings``)."""
    greedy: bool = False
    """Argmax instead of a draw (evaluations)."""
    chunk_size: int | None = None
    """Rows sampled per call (bounds the KV cache); null = the whole batch. A seeded run draws
    other tokens with another value (the random stream is consumed in another order)."""

    @classmethod
    def from_config(cls, cfg, tokenizer) -> "SamplingParams":
        """The run's sampling: the ``sampling.*`` node (``config.SamplingConfig``), its stop
        token ids and strings tokenised (``stop_sequences``)."""
        return cls(
            max_new_tokens=cfg.max_new_tokens,
            temperature=cfg.temperature,
            top_k=cfg.top_k,
            top_p=cfg.top_p,
            stop_at_eos=cfg.stop_at_eos,
            chunk_size=cfg.chunk_size,
            stop_sequences=stop_sequences(tokenizer, cfg.stop_token_ids, cfg.stop_strings),
        )

    def replace(self, **changes) -> "SamplingParams":
        return dataclasses.replace(self, **changes)


def stop_sequences(tokenizer, token_ids, strings) -> StopSequences:
    """``sampling.stop_token_ids`` (one token each) and ``sampling.stop_strings`` tokenised without special
    tokens, as the token-id sequences the samplers stop on (``SamplingParams.stop_sequences``)."""
    seqs = [(int(i),) for i in token_ids]
    for text in strings:
        ids = tuple(tokenizer.encode(text, add_special_tokens=False))
        if not ids:
            raise ConfigError(f"sampling.stop_strings: {text!r} is no token in the policy's tokenizer; remove it")
        seqs.append(ids)
    vocab = len(tokenizer)
    bad = [i for i in token_ids if not 0 <= int(i) < vocab]
    if bad:
        raise ConfigError(f"sampling.stop_token_ids: {bad} outside the tokenizer's {vocab} ids")
    return tuple(seqs)
