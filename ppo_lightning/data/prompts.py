"""Prompts rendered, tokenised and batched: chat templates, one padding collator, and PPO's
prompt datamodule.

``PadCollator`` pads token-id lists on the left (PPO prompts, which generation continues) or the
right (the stages' examples). PPO's prompts are tokenised when the datamodule is set up (not per
batch), cut to ``data.max_prompt_length`` from the left (the end of a prompt is what the response
continues) or refused, by ``data.truncation``. Batches are left-padded, as generation needs: every
prompt then ends at the same column and the response starts right after it.
"""

from __future__ import annotations

import logging
from pathlib import Path

import lightning as L
import torch
from torch.utils.data import Dataset

from ppo_lightning.config.errors import ConfigError

from ppo_lightning.data.records import PromptRecord, read_prompt_records, records_source

log = logging.getLogger(__name__)


def chat_template_of(value: str | None, key: str = "data.chat_template") -> str | None:
    """``data.chat_template`` (or ``key``): a Jinja string, or the path of a file holding one."""
    if value is None:
        return None
    path = Path(value)
    if "{" not in value and len(value) < 4096 and path.suffix in (".jinja", ".j2", ".txt", ".jinja2"):
        if not path.is_file():
            raise ConfigError(f"{key}={value!r}: no such file (give a Jinja string or a file)")
        return path.read_text(encoding="utf-8")
    return value


def render_prompts(
    records: list[PromptRecord],
    tokenizer,
    chat_template: str | None = None,
    system_prompt: str | None = None,
    chat: bool = False,
    tools: list[dict] | None = None,
) -> list[str]:
    """The text the policy continues, per record: a string prompt as it is (or, with
    ``chat_template`` or ``chat``, as one user message), a list of messages through the chat
    template (``chat_template``, else the tokenizer's) with ``add_generation_prompt=True`` and
    the ``tools`` schemas, after ``system_prompt`` as a first system message when the messages
    have none."""
    texts = []
    for r in records:
        if not r.is_chat and chat_template is None and not chat:
            texts.append(r.prompt)
            continue
        messages = r.prompt if r.is_chat else [{"role": "user", "content": r.prompt}]
        if system_prompt is not None and not any(m["role"] == "system" for m in messages):
            messages = [{"role": "system", "content": system_prompt}, *messages]
        template = chat_template or getattr(tokenizer, "chat_template", None)
        if not template:
            raise ConfigError(
                f"{r.where}: chat messages, but the tokenizer has no chat template; set data.chat_template "
                "(a Jinja string or a file)"
            )
        try:
            texts.append(
                tokenizer.apply_chat_template(
                    messages, tools=tools, chat_template=template, tokenize=False, add_generation_prompt=True
                )
            )
        except Exception as e:  # the template's own checks (a role it rejects, alternation)
            raise ConfigError(f"{r.where}: the chat template rejects these messages: {e}") from None
    return texts


def tokenize_prompts(prompts: list[str], tokenizer, max_length: int, truncation: str, source: str) -> list[list[int]]:
    """Token ids per prompt; longer than ``max_length``: keep the last tokens (one warning) or raise."""
    ids = tokenizer(prompts, add_special_tokens=False)["input_ids"]
    too_long = [i for i, x in enumerate(ids) if len(x) > max_length]
    if too_long:
        i = too_long[0]
        if truncation == "error":
            raise ConfigError(
                f"{source}: prompt {i} has {len(ids[i])} tokens > data.max_prompt_length="
                f"{max_length}; raise data.max_prompt_length or set data.truncation=left"
            )
        log.warning(
            "%d of %d prompts are longer than data.max_prompt_length=%d tokens; keeping their "
            "last %d tokens (data.truncation=left)",
            len(too_long),
            len(ids),
            max_length,
            max_length,
        )
        ids = [x[-max_length:] for x in ids]
    empty = [i for i, x in enumerate(ids) if not x]
    if empty:
        raise ConfigError(f"{source}: prompt {empty[0]} tokenises to nothing; remove empty prompts")
    return ids


class ListDataset(Dataset):
    """A list as a map-style dataset (PPO's tokenised prompts, the stages' examples)."""

    def __init__(self, items: list):
        self.items = items

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int):
        return self.items[i]


def pad_rows(rows: list[list[int]], pad: int, side: str = "right") -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, T]`` ids padded with ``pad`` on ``side`` (``right``, else left), and the attention mask."""
    T = max(len(r) for r in rows)
    # padded as lists, then one tensor each: a row at a time costs a tensor and two slice writes
    # per row, which was 2% of a stage's step here
    if side == "right":
        ids = [list(r) + [pad] * (T - len(r)) for r in rows]
        mask = [[1] * len(r) + [0] * (T - len(r)) for r in rows]
    else:
        ids = [[pad] * (T - len(r)) + list(r) for r in rows]
        mask = [[0] * (T - len(r)) + [1] * len(r) for r in rows]
    return torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.long)


class PadCollator:
    """Pads a list of token-id lists: ``input_ids``, ``attention_mask`` ``[B, T]``. On the left
    (the default) for generation, which continues every row at the same column; the stages pad
    their examples on the right."""

    def __init__(self, pad_token_id: int, padding_side: str = "left"):
        if padding_side not in ("left", "right"):
            raise ValueError(f"padding_side={padding_side!r}: choose left or right")
        self.pad_token_id, self.padding_side = pad_token_id, padding_side

    def __call__(self, batch: list[list[int]]) -> dict[str, torch.Tensor]:
        input_ids, attention_mask = pad_rows(batch, self.pad_token_id, self.padding_side)
        return {"input_ids": input_ids, "attention_mask": attention_mask}


class PromptCollator:
    """A batch of PPO prompts: ``input_ids`` and ``attention_mask`` left-padded, plus each row's
    ``prompts`` (as the user wrote them) and ``columns`` (its metadata), lists in row order."""

    def __init__(self, pad_token_id: int):
        self.pad = PadCollator(pad_token_id)

    def __call__(self, items: list[dict]) -> dict:
        batch = self.pad([item["input_ids"] for item in items])
        batch["prompts"] = [item["prompt"] for item in items]
        batch["columns"] = [item["columns"] for item in items]
        return batch


class PromptBatches:
    """Batches of prompts in an order fixed by ``(seed, epoch)``, sharded over ranks.

    Stateless by design, so that a resumed run continues exactly where the killed one stopped:
    every batch is one PPO iteration, so the number of batches already consumed is the trainer's
    ``global_step``, read through ``consumed()`` when an epoch starts. (A counter kept in the
    loader would be off by Lightning's one-batch prefetch.) Under DDP every rank draws the same
    permutation and takes every ``world_size``-th prompt, so ranks never overlap; Lightning's
    distributed sampler is not used (``trainer.use_distributed_sampler=false``).
    """

    def __init__(
        self,
        dataset: ListDataset,
        batch_size: int,
        collate,
        shuffle: bool = True,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        consumed=None,
    ):
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
        return perm[self.rank :: self.world_size][: len(self) * self.batch_size]

    def __iter__(self):
        if len(self) == 0:
            return
        done = self.consumed() if self.consumed is not None else self._epochs_started * len(self)
        self._epochs_started += 1
        epoch, start = divmod(done, len(self))
        order = self.order(epoch)
        for b in range(start, len(self)):
            idx = order[b * self.batch_size : (b + 1) * self.batch_size]
            yield self.collate([self.dataset[i] for i in idx])

    # Lightning treats loaders with these as resumable (no mid-epoch warning); the position
    # itself comes from global_step, see the class docstring.
    def state_dict(self) -> dict:
        return {"seed": self.seed}

    def load_state_dict(self, state: dict) -> None:
        pass


EVAL_SPLIT_SEED = 20_241_201  # eval.split_fraction's own seed: the same held-out prompts for every run seed


class PromptDataModule(L.LightningDataModule):
    """PPO's prompts (``data.*``) and, with ``eval_cfg`` (``eval.*``), the held-out eval prompts:
    from ``eval.path``, or ``eval.split_fraction`` of ``data.path``'s taken out of training. With
    ``chat`` (multi-turn episodes) every prompt is rendered as a chat, with the ``tools`` schemas:
    as the episodes render them before an environment's ``reset`` adds anything, so that length
    limits and bad records fail before training."""

    def __init__(self, cfg, tokenizer, seed: int = 0, eval_cfg=None, chat: bool = False, tools: list | None = None):
        super().__init__()
        self.cfg = cfg
        self.chat, self.tools = chat, tools  # multi-turn: every prompt a chat, rendered with the tools
        self.tokenizer = tokenizer
        self.seed = seed
        self.eval_cfg = eval_cfg
        self.dataset: ListDataset | None = None  # {"input_ids", "prompt", "columns"} per prompt
        self.eval_dataset: ListDataset | None = None  # the same, for eval; None: no eval prompts
        self.records: list[PromptRecord] = []
        self.eval_records: list[PromptRecord] = []

    def _items(self, records: list[PromptRecord], source: str) -> list[dict]:
        c = self.cfg
        texts = render_prompts(
            records, self.tokenizer, chat_template_of(c.chat_template), c.system_prompt, self.chat, self.tools
        )
        ids = tokenize_prompts(texts, self.tokenizer, c.max_prompt_length, c.truncation, source)
        return [{"input_ids": x, "prompt": r.prompt, "columns": r.columns} for x, r in zip(ids, records)]

    def load(self) -> None:
        """Read and tokenise the prompts; called before fitting so bad data fails early."""
        if self.dataset is not None:
            return
        c, e = self.cfg, self.eval_cfg
        source = records_source("data", c.path, c.hf_dataset)
        records = read_prompt_records(c.path, c.prompt_field, hf_dataset=c.hf_dataset, hf_split=c.hf_split)
        eval_records = []
        if e is not None and e.path is not None:
            eval_records = read_prompt_records(e.path, c.prompt_field, key_prefix="eval")
        elif e is not None and e.split_fraction > 0:
            n_eval = max(1, round(len(records) * e.split_fraction))
            held = set(
                torch.randperm(len(records), generator=torch.Generator().manual_seed(EVAL_SPLIT_SEED))[:n_eval].tolist()
            )
            eval_records = [r for i, r in enumerate(records) if i in held]
            records = [r for i, r in enumerate(records) if i not in held]
            if not records:
                raise ConfigError(f"eval.split_fraction={e.split_fraction} leaves no training prompts of {source}")
        if len(records) < c.batch_size:
            raise ConfigError(
                f"{source} has {len(records)} prompts, fewer than data.batch_size={c.batch_size}; "
                "add prompts or lower data.batch_size"
            )
        self.records = records
        self.dataset = ListDataset(self._items(records, source))
        if eval_records:
            eval_records = eval_records[: e.max_prompts] if e.max_prompts else eval_records
            self.eval_records = eval_records
            self.eval_dataset = ListDataset(
                self._items(eval_records, records_source("eval", e.path) if e.path else source)
            )

    def eval_sources(self) -> list[str]:
        """The ``data_source`` values of the eval records, sorted (empty when none has one)."""
        return sorted({str(r.columns["data_source"]) for r in self.eval_records if "data_source" in r.columns})

    def eval_batches(self):
        """This rank's eval prompts, ``data.batch_size`` at a time, as ``(batch, weight [B])``: every
        rank runs the same number of batches (sharded weights may need every rank's forward), a
        rank's missing rows repeating its first prompt with weight 0."""
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        items = self.eval_dataset.items
        per_rank = -(-len(items) // world)  # ceil
        mine = items[rank::world]
        weights = [1.0] * len(mine) + [0.0] * (per_rank - len(mine))
        mine = mine + [items[0]] * (per_rank - len(mine))
        collate, bs = PromptCollator(self.tokenizer.pad_token_id), self.cfg.batch_size
        for s in range(0, per_rank, bs):
            yield collate(mine[s : s + bs]), torch.tensor(weights[s : s + bs])

    def setup(self, stage: str | None = None) -> None:
        self.load()

    def normalization_batches(self, n: int):
        """Batches covering ``n`` prompts for fitting reward normalisation (this rank's share,
        seeded by rank so ranks score different prompts)."""
        rank = self.trainer.global_rank if self.trainer is not None else 0
        g = torch.Generator().manual_seed(self.seed + 17 + rank)
        order = torch.randint(len(self.dataset), (n,), generator=g).tolist()
        collate = PromptCollator(self.tokenizer.pad_token_id)
        for s in range(0, n, self.cfg.batch_size):
            yield collate([self.dataset[i] for i in order[s : s + self.cfg.batch_size]])

    def train_dataloader(self):
        trainer = self.trainer
        rank, world = (trainer.global_rank, trainer.world_size) if trainer is not None else (0, 1)
        if len(self.dataset) < self.cfg.batch_size * world:
            raise ConfigError(
                f"{len(self.dataset)} prompts cannot fill data.batch_size={self.cfg.batch_size} "
                f"on each of {world} ranks; add prompts or lower data.batch_size"
            )
        consumed = (lambda: trainer.global_step) if trainer is not None else None
        return PromptBatches(
            self.dataset,
            self.cfg.batch_size,
            PromptCollator(self.tokenizer.pad_token_id),
            shuffle=self.cfg.shuffle,
            seed=self.seed,
            rank=rank,
            world_size=world,
            consumed=consumed,
        )
