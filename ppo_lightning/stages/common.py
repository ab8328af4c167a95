"""What the SFT and reward-model stages share: records from a file, a list or a HF dataset (read
by ``data.records.read_records``, as PPO's prompts are), the validation split, model sources, the
optimizer, data loaders that shard themselves under DDP, and the handling of the torchmetrics
validation metrics.

Records are read once, checked field by field, and normalised to plain dicts keyed by *role*
(``prompt``, ``response`` / ``chosen``, ``rejected``) whatever the source columns are called, so
every error can name the line or record and the config key that chose the column.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler
from torchmetrics import Metric

from ppo_lightning.config.schema import as_dataclass, get_key
from ppo_lightning.config.task import DEFAULT_MAX_LENGTH
from ppo_lightning.data.prompts import ListDataset
from ppo_lightning.data.records import check_messages, read_records, records_source
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.train.optim import configure_optimizers
from ppo_lightning.models.policy import context_length

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- records
def read_role_records(
    roles: dict[str, tuple[str, str]],
    *,
    path: str | None,
    hf_dataset: str | None,
    hf_split: str,
    records: Sequence[Mapping] | None,
    key_prefix: str,
    chat_roles: Sequence[str] = (),
) -> tuple[list[dict[str, str]], str]:
    """Records as ``{role: text}`` dicts from exactly one source, and a name for that source.

    ``roles`` maps each role to ``(config key, column)``, e.g. ``{"prompt": ("task.prompt_field",
    "question")}``; errors name both. Sources, in order: ``records`` (an in-memory list of dicts),
    ``path`` (a local ``.jsonl``, one object a line, or ``.json``, a list of objects),
    ``hf_dataset`` (a Hugging Face dataset name); files and datasets through
    ``data.records.read_records``, the reader PPO's prompts use too. A role in ``chat_roles`` may also be
    a list of chat messages (``{"role", "content"}`` objects).
    """
    if records is not None:
        source = "records"
        rows = ((f"records[{i}]", r) for i, r in enumerate(records))
    elif path is not None or hf_dataset is not None:
        source = records_source(key_prefix, path, hf_dataset)
        rows = read_records(
            key_prefix, path=path, hf_dataset=hf_dataset, hf_split=hf_split, suffixes=(".jsonl", ".json", ".parquet")
        )
    else:
        raise ConfigError(
            f"{key_prefix}.path and {key_prefix}.hf_dataset are both null: set "
            f"{key_prefix}.path=data.jsonl (one JSON object a line with "
            f"{', '.join(repr(c) for _, c in roles.values())} fields) or "
            f"{key_prefix}.hf_dataset=<name>"
        )
    out = [_record(r, roles, where, chat_roles) for where, r in rows]
    if not out:
        raise ConfigError(f"{source} holds no records")
    return out, source


def _record(obj: Any, roles: dict[str, tuple[str, str]], where: str, chat_roles: Sequence[str] = ()) -> dict[str, str]:
    if not isinstance(obj, Mapping):
        raise ConfigError(
            f"{where}: expected a JSON object / dict with fields "
            f"{[c for _, c in roles.values()]}, got {type(obj).__name__}"
        )
    missing = [(k, c) for k, c in roles.values() if c not in obj]
    if missing:
        names = ", ".join(repr(c) for _, c in missing)
        keys = ", ".join(f"{k}={c!r}" for k, c in missing)
        raise ConfigError(f"{where}: missing field(s) {names} ({keys}); it has {sorted(map(str, obj))}")
    out = {}
    for role, (k, c) in roles.items():
        v = obj[c]
        if role in chat_roles and isinstance(v, list):
            check_messages(v, where, c)
        elif not isinstance(v, str):
            raise ConfigError(f"{where}: field {c!r} ({k}) must be a string, got {type(v).__name__}")
        out[role] = v
    return out


def split_indices(n: int, val_fraction: float, seed: int, source: str, key_prefix: str) -> tuple[list[int], list[int]]:
    """Deterministic train / validation indices: a permutation by ``seed``, the first
    ``max(1, round(n * val_fraction))`` go to validation (none when ``val_fraction`` is 0)."""
    if val_fraction <= 0:
        return list(range(n)), []
    n_val = max(1, round(n * val_fraction))
    if n - n_val < 1:
        raise ConfigError(
            f"{source} has {n} records: too few for {key_prefix}.val_fraction={val_fraction} "
            "to leave any for training; add records or lower it"
        )
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    return sorted(perm[n_val:]), sorted(perm[:n_val])


# ----------------------------------------------------------------------------- loaders
class ShardSampler(DistributedSampler):
    """This rank's share of a dataset in order, without the padding ``DistributedSampler`` adds
    (validation sums stay exact). A ``DistributedSampler``, so Lightning leaves it in place."""

    def __iter__(self):
        return iter(range(self.rank, len(self.dataset), self.num_replicas))

    def __len__(self) -> int:
        return len(range(self.rank, len(self.dataset), self.num_replicas))


class LengthGroupedSampler(DistributedSampler):
    """This rank's share of the training records, in batches of records of similar length, so
    that a batch padded to its longest record computes little on padding.

    Each epoch: a permutation by ``seed`` and the epoch (``DistributedSampler``'s order and its
    share per rank), cut into mega-batches of ``group`` batches; each mega-batch sorted by length
    and cut into batches; the full batches in a random order, then the one short batch (so a
    ``DataLoader`` of the same ``batch_size`` cuts exactly these batches). Every record is seen
    once an epoch, as with ``shuffle``, and every rank gets as many batches. Sorting only within
    a mega-batch keeps the batches' contents random beyond their length (Hugging Face's
    ``group_by_length`` does the same, with 50). A ``DistributedSampler``, so Lightning leaves it
    in place."""

    def __init__(
        self,
        lengths: Sequence[int],
        batch_size: int,
        *,
        num_replicas: int = 1,
        rank: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        group: int = 50,
    ):
        super().__init__(range(len(lengths)), num_replicas=num_replicas, rank=rank, shuffle=shuffle, seed=seed)
        self.lengths, self.batch_size, self.group = list(lengths), batch_size, group

    def batches(self) -> list[list[int]]:
        """This epoch's batches for this rank, in the order they are drawn."""
        share = list(super().__iter__())
        mega = self.batch_size * self.group
        full, short = [], []
        for s in range(0, len(share), mega):
            chunk = sorted(share[s : s + mega], key=lambda i: -self.lengths[i])
            for b in range(0, len(chunk), self.batch_size):
                (full if len(chunk[b : b + self.batch_size]) == self.batch_size else short).append(
                    chunk[b : b + self.batch_size]
                )
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch + 1)
            full = [full[i] for i in torch.randperm(len(full), generator=g).tolist()]
        return full + short

    def __iter__(self):
        return iter([i for batch in self.batches() for i in batch])


def example_length(example: Mapping[str, Any]) -> int:
    """The longest token list of a tokenised example: the width its batch pads to (a reward-model
    pair pads its chosen and rejected texts together)."""
    return max(len(v) for v in example.values() if isinstance(v, list))


def make_loader(
    dataset: Dataset,
    batch_size: int,
    collate,
    *,
    train: bool,
    shuffle: bool,
    seed: int,
    num_workers: int,
    trainer=None,
    lengths: Sequence[int] | None = None,
) -> DataLoader:
    """A loader that shards itself over DDP ranks, so it works whatever
    ``trainer.use_distributed_sampler`` says; the training order is fixed by ``seed``. With
    ``lengths`` (training only), batches group records of similar length (``LengthGroupedSampler``)."""
    world = trainer.world_size if trainer is not None else 1
    rank = trainer.global_rank if world > 1 else 0
    kwargs: dict[str, Any] = {}
    if train and lengths is not None:
        kwargs["sampler"] = LengthGroupedSampler(
            lengths, batch_size, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed
        )
    elif world > 1:
        if train:
            kwargs["sampler"] = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=shuffle, seed=seed)
        else:
            kwargs["sampler"] = ShardSampler(dataset, num_replicas=world, rank=rank, shuffle=False)
    elif train and shuffle:
        kwargs["shuffle"] = True
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    return DataLoader(
        dataset,
        batch_size=batch_size,
        collate_fn=collate,
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        **kwargs,
    )


# ----------------------------------------------------------------------------- models
class StageDataModule(L.LightningDataModule):
    """A stage's records from ``stage_cfg.path`` / ``stage_cfg.hf_dataset`` or ``records`` (an
    in-memory list of dicts with the configured fields), read and tokenised once (``load``, before
    any model loads, so bad data fails early), split by ``seed``, in batches of ``batch_size``
    (``val_batch_size``; ``shuffle``, ``num_workers``). A stage says which fields a record has
    (``roles``), how records become token ids (``tokenize``) and how those are padded
    (``collator``)."""

    config_class: type  # the stage's config dataclass
    chat_roles: tuple[str, ...] = ()  # roles that may be chat messages

    def __init__(
        self, stage_cfg, tokenizer, records: Sequence[Mapping[str, Any]] | None = None, key_prefix: str = "task"
    ):
        super().__init__()
        self.cfg = as_dataclass(stage_cfg, self.config_class, key_prefix)
        self.tokenizer, self.records, self.key_prefix = tokenizer, records, key_prefix
        self.train_examples: list[dict[str, list[int]]] | None = None
        self.val_examples: list[dict[str, list[int]]] = []

    def roles(self) -> dict[str, tuple[str, str]]:
        """Each role of a record -> (its config key, the field that holds it)."""
        raise NotImplementedError

    def tokenize(self, records: list[dict[str, str]], source: str) -> list[dict[str, list[int]]]:
        raise NotImplementedError

    def collator(self):
        raise NotImplementedError

    def load(self) -> None:
        """Read, check, tokenise and split; called before any model loads so bad data fails early."""
        if self.train_examples is not None:
            return
        c, p = self.cfg, self.key_prefix
        records, source = read_role_records(
            self.roles(),
            path=c.path,
            hf_dataset=c.hf_dataset,
            hf_split=c.hf_split,
            records=self.records,
            key_prefix=p,
            chat_roles=self.chat_roles,
        )
        train_idx, val_idx = split_indices(len(records), c.val_fraction, c.seed, source, p)
        self.train_examples = self.tokenize([records[i] for i in train_idx], source)
        self.val_examples = self.tokenize([records[i] for i in val_idx], source) if val_idx else []

    def setup(self, stage: str | None = None) -> None:
        self.load()

    def train_dataloader(self):
        c = self.cfg
        return make_loader(
            ListDataset(self.train_examples),
            c.batch_size,
            self.collator(),
            train=True,
            shuffle=c.shuffle,
            seed=c.seed,
            num_workers=c.num_workers,
            trainer=self.trainer,
            lengths=[example_length(x) for x in self.train_examples] if c.group_by_length else None,
        )

    def val_dataloader(self):
        if not self.val_examples:
            return []
        c = self.cfg
        return make_loader(
            ListDataset(self.val_examples),
            c.val_batch_size or c.batch_size,
            self.collator(),
            train=False,
            shuffle=False,
            seed=c.seed,
            num_workers=c.num_workers,
            trainer=self.trainer,
        )


def stage_model(model_cfg, cfg, cache_dir, key_prefix: str = "task"):
    """The model a stage trains, checked before its data is read: ``(name, trust_remote_code,
    cfg with max_length resolved)``. ``model=tiny`` builds its random model first, in
    ``paths.cache_dir`` only (``tiny.ensure_tiny_model``); a directory must hold a model."""
    from ppo_lightning.models.policy import resolve_source
    from ppo_lightning.models.tiny import ensure_tiny_model

    name = get_key(model_cfg, "name_or_path", None)
    if not name:
        raise ConfigError("model.name_or_path is empty: set it to a hub id or a save_pretrained directory")
    trust = bool(get_key(model_cfg, "trust_remote_code", False))
    ensure_tiny_model(model_cfg, cache_dir)
    source = resolve_source(name, "model.name_or_path")
    max_length = resolve_max_length(cfg.max_length, source, trust, f"{key_prefix}.max_length")
    return name, trust, dataclasses.replace(cfg, max_length=max_length)


def resolve_max_length(max_length: int | None, source: str, trust_remote_code: bool, key: str) -> int:
    """``max_length`` checked against the model's context, read from its config before any weights
    load; null becomes the context, at most ``DEFAULT_MAX_LENGTH``."""
    from transformers import AutoConfig

    ctx = context_length(AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code))
    if max_length is None:
        return min(DEFAULT_MAX_LENGTH, ctx) if ctx else DEFAULT_MAX_LENGTH
    if ctx is not None and max_length > ctx:
        raise ConfigError(
            f"{key}={max_length} exceeds the model's context of {ctx} tokens; lower it "
            "(or null: the context, at most 512)"
        )
    return max_length


# ----------------------------------------------------------------------------- validation metrics
def reset_val_metrics(*metrics: Metric) -> None:
    """Zero validation metrics and keep their states in float64, as sums of many losses need.

    Called at the start of every validation run: a ``16-true`` / ``bf16-true`` trainer casts the
    whole module with ``.to(dtype)``, and torchmetrics lets that cast metric states too (it guards
    only ``.half()`` / ``.float()`` / ``.double()`` / ``.type()``), which would sum in bf16.
    """
    for m in metrics:
        m.set_dtype(torch.float64)
        m.reset()


def synced_value(metric: Metric) -> torch.Tensor:
    """``metric.compute()``: its value over every rank's updates.

    torchmetrics all-gathers a metric's states over the process group inside ``compute()``, so
    under DDP every rank must call this for the same metrics in the same order, a rank without
    updates included (its "``compute`` called before ``update``" warning is expected, and silenced).
    """
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r"The ``compute`` method of metric", category=UserWarning)
        return metric.compute()


class StageOptimization:
    """What both stage modules do alike (mixed into a LightningModule that defines
    ``_val_metrics()`` and ``compute_val_metrics()``): the model and tokenizer it trains, the
    optimizer (``optimizer.*`` with its schedule), gradient clipping (``task.max_grad_norm``
    unless ``trainer.gradient_clip_val`` is set), the validation metrics' reset and logging, and
    ``last_metrics``."""

    def __init__(self, model, tokenizer, optim_cfg=None, max_grad_norm: float | None = 1.0):
        super().__init__()
        self.model, self.tokenizer, self.optim_cfg, self.max_grad_norm = model, tokenizer, optim_cfg, max_grad_norm
        self.model.train()  # from_pretrained leaves eval mode, which Lightning would keep for fit

    def on_validation_epoch_start(self) -> None:
        reset_val_metrics(*self._val_metrics())

    def on_validation_epoch_end(self) -> None:
        metrics = self.compute_val_metrics()
        reset_val_metrics(*self._val_metrics())
        if metrics:
            self.log_dict(metrics, prog_bar=True)

    @property
    def last_metrics(self) -> dict[str, float]:
        """The trainer's latest value of every logged metric."""
        from ppo_lightning.parallel.lightning_compat import attached_trainer

        if attached_trainer(self) is None:
            return {}
        return {k: float(v) for k, v in self.trainer.callback_metrics.items()}

    def configure_optimizers(self):
        return configure_optimizers(self, [p for p in self.model.parameters() if p.requires_grad], self.optim_cfg)

    def configure_gradient_clipping(self, optimizer, gradient_clip_val=None, gradient_clip_algorithm=None):
        if gradient_clip_val is None and self.max_grad_norm:
            gradient_clip_val, gradient_clip_algorithm = self.max_grad_norm, "norm"
        self.clip_gradients(
            optimizer, gradient_clip_val=gradient_clip_val, gradient_clip_algorithm=gradient_clip_algorithm
        )
