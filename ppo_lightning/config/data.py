"""``data``: the prompt records and how they are rendered, cut and batched."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from ppo_lightning.config import choices
from ppo_lightning.config.compat import DATA_WORKERS_REMOVED
from ppo_lightning.config.schema import param


@dataclass
class DataConfig:
    """PPO's prompts: read and tokenised once (no special tokens) before any model loads, cut or
    refused by ``truncation``, left-padded in batches. Under DDP every rank draws the same
    permutation (seeded by ``seed`` and the epoch) and takes every world-size-th prompt; the
    position in an epoch follows ``global_step``, so a resumed run continues with the next unseen
    batch. The stages read none of these keys (their records and batches are ``task.*``)."""

    path: Optional[str] = None
    """Local prompt records: ``.txt`` or no extension (one prompt per non-empty line), ``.jsonl``
    (one object a line with a ``prompt_field``), ``.json`` (a list of such objects), ``.parquet``
    (one row a record), or a directory written by ``datasets``' ``save_to_disk`` (the last two
    need ``pip install 'ppo_lightning[data]'``). Must exist, hold prompts and parse, checked
    before any model loads. Relative paths resolve against the launch directory."""
    hf_dataset: Optional[str] = None
    """Hugging Face dataset name, used when ``path`` is null (needs the ``data`` extra);
    ``path`` and ``hf_dataset`` both null is an error."""
    hf_split: str = "train"
    """Dataset split, of ``hf_dataset`` or of a ``save_to_disk`` directory holding several."""
    prompt_field: str = "prompt"
    """JSONL field or dataset column holding the prompt: a string, or a list of chat messages
    (``{"role", "content"}`` objects). Every other field of a record is that prompt's metadata
    (``answer``, ``data_source``, ...): it travels with the prompt, repeated for each of
    ``ppo.num_generations`` samples, to a reward function that asks for it by name."""
    chat_template: Optional[str] = None
    """A Jinja chat template (the string, or a ``.jinja`` / ``.j2`` / ``.txt`` file holding one)
    for chat prompts, instead of the tokenizer's; with it, a string prompt becomes one user
    message too. Chat prompts go through the template with ``add_generation_prompt=True``."""
    system_prompt: Optional[str] = None
    """Put first as a system message in every chat prompt that has none (and in every string
    prompt when ``chat_template`` is set)."""
    batch_size: int = param(16, ge=1)
    """Prompts per PPO iteration per rank (the rollout batch; globally ``batch_size * world``).
    Incomplete batches are dropped; the prompt set must fill one batch on every rank."""
    max_prompt_length: int = param(128, ge=1)
    """Prompt tokens kept; longer prompts follow ``truncation``."""
    truncation: str = param("left", choices=choices.PROMPT_TRUNCATION)
    """left: keep the last ``max_prompt_length`` tokens (one warning); error: refuse long prompts."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch."""
    num_workers: Optional[Any] = field(default=None, metadata={"removed": DATA_WORKERS_REMOVED})
