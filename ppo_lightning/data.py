"""Prompt datasets: a local ``.txt`` / ``.jsonl`` file or a Hugging Face dataset, tokenised once.

Prompts are tokenised when the datamodule is set up (not per batch), cut to
``data.max_prompt_length`` from the left (the end of a prompt is what the response continues) or
refused, by ``data.truncation``. Batches are left-padded, as generation needs: every prompt then
ends at the same column and the response starts right after it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import Dataset

from ppo_lightning.errors import ConfigError

log = logging.getLogger(__name__)

TRUNCATION = ("left", "error")  # data.truncation: keep a long prompt's last tokens, or refuse it


def read_prompts(path: str | Path, field: str = "prompt") -> list[str]:
    """Prompts from ``.txt`` (one per non-empty line) or ``.jsonl`` (``field`` of each object)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"data.path={str(path)!r}: no such file")
    prompts: list[str] = []
    if path.suffix == ".jsonl":
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ConfigError(f"data.path={str(path)!r} line {lineno}: not valid JSON ({e.msg}); "
                                      "each line must be one JSON object") from None
                if not isinstance(obj, dict) or not isinstance(obj.get(field), str):
                    raise ConfigError(f"data.path={str(path)!r} line {lineno}: expected an object with a "
                                      f"string {field!r} field (data.prompt_field={field!r})")
                prompts.append(obj[field])
    elif path.suffix in (".txt", ""):
        # split on "\n" only: str.splitlines would also split a prompt at form feeds or U+2028
        prompts = [ln.rstrip("\r") for ln in path.read_text(encoding="utf-8").split("\n") if ln.strip()]
    else:
        raise ConfigError(f"data.path={str(path)!r}: unsupported extension {path.suffix!r}; use .txt "
                          "(one prompt a line) or .jsonl")
    if not prompts:
        raise ConfigError(f"data.path={str(path)!r} holds no prompts; add one prompt per line")
    return prompts


def load_hf_prompts(name: str, split: str, field: str) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"data.hf_dataset={name!r} needs the 'datasets' package: pip install datasets") from None
    try:
        ds = datasets.load_dataset(name, split=split)
    except Exception as e:  # network, missing split, bad name: all user-fixable
        raise ConfigError(f"data.hf_dataset={name!r} (split {split!r}) could not be loaded: {e}. "
                          "For offline use give a local file with data.path=...") from None
    if field not in ds.column_names:
        raise ConfigError(f"data.prompt_field={field!r} is not a column of {name!r}: {ds.column_names}")
    return [str(x) for x in ds[field]]


def tokenize_prompts(prompts: list[str], tokenizer, max_length: int, truncation: str,
                     source: str) -> list[list[int]]:
    """Token ids per prompt; longer than ``max_length``: keep the last tokens (one warning) or raise."""
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    too_long = [i for i, x in enumerate(ids) if len(x) > max_length]
    if too_long:
        i = too_long[0]
        if truncation == "error":
            raise ConfigError(f"{source}: prompt {i} has {len(ids[i])} tokens > data.max_prompt_length="
                              f"{max_length}; raise data.max_prompt_length or set data.truncation=left")
        log.warning("%d of %d prompts are longer than data.max_prompt_length=%d tokens; keeping their "
                    "last %d tokens (data.truncation=left)", len(too_long), len(ids), max_length, max_length)
        ids = [x[-max_length:] for x in ids]
    empty = [i for i, x in enumerate(ids) if not x]
    if empty:
        raise ConfigError(f"{source}: prompt {empty[0]} tokenises to nothing; remove empty prompts")
    return ids


class PromptDataset(Dataset):
    def __init__(self, token_ids: list[list[int]]):
        self.token_ids = token_ids

    def __len__(self) -> int:
        return len(self.token_ids)

    def __getitem__(self, i: int) -> list[int]:
        return self.token_ids[i]


class LeftPadCollator:
    """Pads a list of token-id lists on the left: ``input_ids``, ``attention_mask`` ``[B, P]``."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: list[list[int]]) -> dict[str, torch.Tensor]:
        P = max(len(x) for x in batch)
        input_ids = torch.full((len(batch), P), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), P), dtype=torch.long)
        for i, x in enumerate(batch):
            input_ids[i, P - len(x):] = torch.tensor(x, dtype=torch.long)
            attention_mask[i, P - len(x):] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class PromptBatches:
    """Batches of prompts in an order fixed by ``(seed, epoch)``, sharded over ranks.

    Stateless by design, so that a resumed run continues exactly where the killed one stopped:
    every batch is one PPO iteration, so the number of batches already consumed is the trainer's
    ``global_step``, read through ``consumed()`` when an epoch starts. (A counter kept in the
    loader would be off by Lightning's one-batch prefetch.) Under DDP every rank draws the same
    permutation and takes every ``world_size``-th prompt, so ranks never overlap; Lightning's
    distributed sampler is not used (``trainer.use_distributed_sampler=false``).
    """

    def __init__(self, dataset: PromptDataset, batch_size: int, collate, shuffle: bool = True,
                 seed: int = 0, rank: int = 0, world_size: int = 1, consumed=None):
        self.dataset, self.batch_size, self.collate = dataset, batch_size, collate
        self.shuffle, self.seed, self.rank, self.world_size = shuffle, seed, rank, world_size
        self.consumed = consumed  # () -> batches consumed so far (global_step); None: count here
        self._epochs_started = 0

    def __len__(self) -> int:
        return len(self.dataset) // self.world_size // self.batch_size  # drop_last

    def order(self, epoch: int) -> list[int]:
        """This rank's prompt indices for ``epoch``, batch after batch."""
        n = len(self.dataset)
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 100_003 + epoch)
            perm = torch.randperm(n, generator=g).tolist()
        else:
            perm = list(range(n))
        return perm[self.rank::self.world_size][: len(self) * self.batch_size]

    def __iter__(self):
        if len(self) == 0:
            return
        done = self.consumed() if self.consumed is not None else self._epochs_started * len(self)
        self._epochs_started += 1
        epoch, start = divmod(done, len(self))
        order = self.order(epoch)
        for b in range(start, len(self)):
            idx = order[b * self.batch_size:(b + 1) * self.batch_size]
            yield self.collate([self.dataset[i] for i in idx])

    # Lightning treats loaders with these as resumable (no mid-epoch warning); the position
    # itself comes from global_step, see the class docstring.
    def state_dict(self) -> dict:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        pass


class PromptDataModule(L.LightningDataModule):
    def __init__(self, cfg, tokenizer, seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.seed = seed
        self.dataset: PromptDataset | None = None

    def load(self) -> None:
        """Read and tokenise the prompts; called before fitting so bad data fails early."""
        if self.dataset is not None:
            return
        c = self.cfg
        if c.path is not None:
            prompts, source = read_prompts(c.path, c.prompt_field), f"data.path={c.path!r}"
        else:
            prompts, source = load_hf_prompts(c.hf_dataset, c.hf_split, c.prompt_field), f"data.hf_dataset={c.hf_dataset!r}"
        ids = tokenize_prompts(prompts, self.tokenizer, c.max_prompt_length, c.truncation, source)
        if len(ids) < c.batch_size:
            raise ConfigError(f"{source} has {len(ids)} prompts, fewer than data.batch_size={c.batch_size}; "
                              "add prompts or lower data.batch_size")
        self.dataset = PromptDataset(ids)

    def setup(self, stage: str | None = None) -> None:
        self.load()

    def normalization_batches(self, n: int):
        """Batches covering ``n`` prompts for fitting reward normalisation (this rank's share,
        seeded by rank so ranks score different prompts)."""
        rank = self.trainer.global_rank if self.trainer is not None else 0
        g = torch.Generator().manual_seed(self.seed + 17 + rank)
        order = torch.randint(len(self.dataset), (n,), generator=g).tolist()
        collate = LeftPadCollator(self.tokenizer.pad_token_id)
        for s in range(0, n, self.cfg.batch_size):
            yield collate([self.dataset[i] for i in order[s:s + self.cfg.batch_size]])

    def train_dataloader(self):
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        if len(self.dataset) < self.cfg.batch_size * world:
            raise ConfigError(f"{len(self.dataset)} prompts cannot fill data.batch_size={self.cfg.batch_size} "
                              f"on each of {world} ranks; add prompts or lower data.batch_size")
        consumed = (lambda: trainer.global_step) if trainer is not None else None
        return PromptBatches(self.dataset, self.cfg.batch_size, LeftPadCollator(self.tokenizer.pad_token_id),
                             shuffle=self.cfg.shuffle, seed=self.seed, rank=rank, world_size=world,
                             consumed=consumed)
