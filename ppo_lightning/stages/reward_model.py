"""Reward modelling: a Bradley-Terry model of pairwise preferences.

A sequence classifier with one output scores a text; on a pair it is trained so that
``P(chosen preferred) = sigmoid(r(prompt + chosen) - r(prompt + rejected))``, i.e. with the loss
``-log sigmoid(r_chosen - r_rejected)``. The saved directory is what PPO's reward path loads
(``reward=model reward.name_or_path=<dir>``, ``ppo_lightning.rewards.RewardModel``).

Training scores exactly the strings and token ids the PPO reward path scores: the text is
``prompt + response`` concatenated as strings, tokenised by the reward model's own tokenizer
with its default special tokens, truncated from the LEFT to ``max_length`` (the response end,
the part being judged, is kept) and right-padded. Keep ``reward.max_length`` equal to this
stage's ``max_length`` when PPO uses the model.

Any ``AutoModelForSequenceClassification`` works; a causal-LM directory (an SFT output, the tiny
offline model) loads with its backbone and a newly initialised score head (``num_labels=1``).
The tokenizer gets a pad token distinct from EOS when it has none or reuses EOS: classifiers
score the last non-pad token, which must not be confused with an EOS in the text.
"""

from __future__ import annotations

import copy
import logging
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics.aggregation import MeanMetric, SumMetric

from ppo_lightning.config import RewardModelConfig
from ppo_lightning.data.prompts import PadCollator
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.models.policy import (
    enable_activation_checkpointing,
    DEFAULT_PAD_TOKEN,
    TORCH_DTYPES,
    disable_dropout,
    fuse_activations,
    resolve_source,
)
from ppo_lightning.config.rules import validate_stage
from ppo_lightning.config.schema import as_dataclass, get_key
from ppo_lightning.config.task import DEFAULT_MAX_LENGTH
from ppo_lightning.stages.common import StageDataModule, stage_model, StageOptimization, reset_val_metrics, synced_value

log = logging.getLogger(__name__)


# ----------------------------------------------------------------------------- tokenizer, data
def prepare_reward_tokenizer(tokenizer):
    """A copy set up as the PPO reward path uses it: right padding, left truncation, and a pad
    token distinct from EOS (added when missing; the model's embeddings must then be resized)."""
    tok = copy.deepcopy(tokenizer)
    tok.padding_side = "right"
    tok.truncation_side = "left"
    if tok.pad_token_id is None or (tok.eos_token_id is not None and tok.pad_token_id == tok.eos_token_id):
        tok.add_special_tokens({"pad_token": DEFAULT_PAD_TOKEN})
    return tok


def load_reward_tokenizer(name_or_path: str, trust_remote_code: bool = False, key: str = "model.name_or_path"):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(resolve_source(name_or_path, key), trust_remote_code=trust_remote_code)
    return prepare_reward_tokenizer(tok)


def tokenize_pairs(
    records: Sequence[Mapping[str, str]], tokenizer, max_length: int, source: str = "records", key_prefix: str = "task"
) -> list[dict[str, list[int]]]:
    """``{"chosen", "rejected"}`` token ids of ``prompt + chosen`` / ``prompt + rejected``, tokenised
    exactly as ``RewardModel`` does (default special tokens, left truncation to ``max_length``)."""
    if not records:
        raise ConfigError(f"{source} holds no records")
    if tokenizer.truncation_side != "left":
        raise ValueError("the reward tokenizer must truncate from the left (prepare_reward_tokenizer)")
    texts = [r["prompt"] + r["chosen"] for r in records] + [r["prompt"] + r["rejected"] for r in records]
    ids = tokenizer(texts, truncation=True, max_length=max_length)["input_ids"]
    n = len(records)
    empty = [i for i, x in enumerate(ids) if not x]
    if empty:
        i = empty[0] % n
        raise ConfigError(
            f"{source}: record {i}: prompt + {'chosen' if empty[0] < n else 'rejected'} "
            "tokenises to nothing; remove empty records"
        )
    at_limit = sum(len(x) >= max_length for x in ids)
    if at_limit:
        log.warning(
            "%d of %d reward-model texts reach %s.max_length=%d tokens and are cut from the left",
            at_limit,
            len(ids),
            key_prefix,
            max_length,
        )
    return [{"chosen": ids[i], "rejected": ids[n + i]} for i in range(n)]


class PairCollator(PadCollator):
    """``input_ids`` / ``attention_mask`` ``[2B, T]``, right-padded: the B chosen texts, then the B
    rejected ones (one forward scores both)."""

    def __init__(self, pad_token_id: int):
        super().__init__(pad_token_id, "right")

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        return super().__call__([x["chosen"] for x in batch] + [x["rejected"] for x in batch])


class PreferenceDataModule(StageDataModule):
    """(prompt, chosen, rejected) records (``StageDataModule``), tokenised by ``tokenize_pairs``;
    batches count pairs."""

    config_class = RewardModelConfig

    def roles(self) -> dict[str, tuple[str, str]]:
        p, c = self.key_prefix, self.cfg
        return {
            "prompt": (f"{p}.prompt_field", c.prompt_field),
            "chosen": (f"{p}.chosen_field", c.chosen_field),
            "rejected": (f"{p}.rejected_field", c.rejected_field),
        }

    def tokenize(self, records: list[dict[str, str]], source: str) -> list[dict[str, list[int]]]:
        max_length = DEFAULT_MAX_LENGTH if self.cfg.max_length is None else self.cfg.max_length
        return tokenize_pairs(records, self.tokenizer, max_length, source, self.key_prefix)

    def collator(self) -> PairCollator:
        return PairCollator(self.tokenizer.pad_token_id)


# ----------------------------------------------------------------------------- the module
def bradley_terry_loss(r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair ``-log sigmoid(r_chosen - r_rejected)``."""
    return -F.logsigmoid(r_chosen - r_rejected)


class RewardModelModule(StageOptimization, L.LightningModule):
    """Bradley-Terry training of a one-output ``AutoModelForSequenceClassification``.

    Logs ``train/loss``, ``train/accuracy``, ``train/lr`` per step and, per validation run over
    the whole validation split (across ranks), ``val/loss`` (mean BT loss), ``val/accuracy``
    (fraction of pairs with r_chosen > r_rejected; a tie counts as wrong) and ``val/margin``
    (mean r_chosen - r_rejected): means over all pairs of all ranks, not of batch means.

    They are torchmetrics ``MeanMetric``s (float64) updated with one value per pair and synced
    over DDP ranks in ``compute()`` at the end of the run, plus a ``SumMetric`` pair count that
    decides whether there is anything to log. Accuracy is the mean of ``r_chosen - r_rejected > 0``
    rather than ``BinaryAccuracy`` on the difference: that one would apply a sigmoid only when some
    difference lies outside [0, 1], then threshold at 0.5 (and sigmoid(1e-8) is 0.5 in float32).
    ``nan_strategy="disable"``: a NaN reward logs NaN instead of being dropped.
    """

    def __init__(
        self, model, tokenizer, optim_cfg=None, max_grad_norm: Optional[float] = 1.0, center_rewards_coef: float = 0.0
    ):
        super().__init__(model, tokenizer, optim_cfg, max_grad_norm)
        self.center_rewards_coef = center_rewards_coef
        # module attributes, so Lightning moves them with the model; not in the state dict
        self.val_loss = MeanMetric(nan_strategy="disable")
        self.val_accuracy = MeanMetric(nan_strategy="disable")
        self.val_margin = MeanMetric(nan_strategy="disable")
        self.val_pairs = SumMetric(nan_strategy="disable")
        reset_val_metrics(*self._val_metrics())

    def _val_metrics(self) -> tuple:
        return self.val_loss, self.val_accuracy, self.val_margin, self.val_pairs

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """One reward per row ``[N]`` (float32), called as ``RewardModel`` calls the model."""
        return self.model(input_ids=input_ids, attention_mask=attention_mask).logits[:, 0].float()

    def pair_rewards(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        r = self(batch["input_ids"], batch["attention_mask"])
        return r.chunk(2)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        rc, rr = self.pair_rewards(batch)
        loss = bradley_terry_loss(rc, rr).mean()
        if self.center_rewards_coef > 0:
            loss = loss + self.center_rewards_coef * ((rc + rr) ** 2).mean()
        B = rc.shape[0]
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=B)
        self.log("train/accuracy", (rc > rr).float().mean(), batch_size=B)
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0])
        return loss

    def update_val_metrics(self, r_chosen: torch.Tensor, r_rejected: torch.Tensor) -> None:
        """Add a batch of pairs' rewards ``[B]``."""
        diff = (r_chosen - r_rejected).double()
        self.val_loss.update(bradley_terry_loss(r_chosen, r_rejected))
        self.val_accuracy.update((diff > 0).double())
        self.val_margin.update(diff)
        self.val_pairs.update(diff.numel())

    def compute_val_metrics(self) -> dict[str, float]:
        """``val/loss``, ``val/accuracy``, ``val/margin`` over every rank's pairs since the last
        reset, or ``{}`` when there were none. Under DDP every rank must call it (the metrics sync)."""
        if synced_value(self.val_pairs).item() == 0:  # the same on every rank: all skip together
            return {}
        return {
            "val/loss": synced_value(self.val_loss).item(),
            "val/accuracy": synced_value(self.val_accuracy).item(),
            "val/margin": synced_value(self.val_margin).item(),
        }

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.update_val_metrics(*self.pair_rewards(batch))


# ----------------------------------------------------------------------------- build / save
def load_sequence_classifier(
    name_or_path: str,
    tokenizer,
    dtype: str = "float32",
    trust_remote_code: bool = False,
    seed: int = 0,
    key: str = "model.name_or_path",
):
    """A one-output classifier from a classifier or causal-LM directory / hub id (a new score head
    is initialised from ``seed``, leaving the global RNG alone), embeddings resized to the tokenizer,
    ``config.pad_token_id`` set, dropout off."""
    from transformers import AutoModelForSequenceClassification

    source = resolve_source(name_or_path, key)
    if dtype not in TORCH_DTYPES:
        raise ConfigError(f"model.dtype={dtype!r}: choose float32, bfloat16 or float16")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            model = AutoModelForSequenceClassification.from_pretrained(
                source, num_labels=1, dtype=TORCH_DTYPES[dtype], trust_remote_code=trust_remote_code
            )
        except (ValueError, RuntimeError) as e:
            raise ConfigError(
                f"{key}={name_or_path!r} does not load as a one-output sequence classifier "
                f"(AutoModelForSequenceClassification, num_labels=1): {e}"
            ) from None
    if len(tokenizer) > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(len(tokenizer))
    model.config.pad_token_id = tokenizer.pad_token_id
    disable_dropout(model)
    fuse_activations(model)
    return model


def build_reward_model(
    model_cfg,
    optim_cfg,
    stage_cfg,
    tokenizer=None,
    *,
    records: Optional[Sequence[Mapping[str, Any]]] = None,
    key_prefix: str = "task",
    cache_dir: str | None = None,
) -> tuple[RewardModelModule, PreferenceDataModule]:
    """The reward-model module and datamodule that the configs describe.

    ``model_cfg``: ``model.*`` (name_or_path: a classifier or causal-LM directory / hub id,
    tokenizer_name_or_path, dtype, trust_remote_code, gradient_checkpointing, build_tiny);
    ``optim_cfg``: ``optimizer.*``; ``stage_cfg``: a ``RewardModelConfig`` (or dict / DictConfig /
    None), the batches' keys included (``batch_size`` in pairs). ``tokenizer``: reuse one (a copy is set up with ``prepare_reward_tokenizer``).
    ``records``: in-memory ``{prompt, chosen, rejected}`` dicts instead of a file. The data is read
    and checked before the model loads; errors are ``ConfigError``s naming ``<key_prefix>.<key>``.
    ``cache_dir``: ``paths.cache_dir``, the only place ``model.build_tiny`` builds a model.
    """
    cfg = as_dataclass(stage_cfg, RewardModelConfig, key_prefix)
    validate_stage(cfg, RewardModelConfig, key_prefix, optimizer=optim_cfg if optim_cfg is not None else {})
    name, trust, cfg = stage_model(model_cfg, cfg, cache_dir, key_prefix)
    if tokenizer is None:
        tokenizer = load_reward_tokenizer(get_key(model_cfg, "tokenizer_name_or_path", None) or name, trust)
    else:
        tokenizer = prepare_reward_tokenizer(tokenizer)
    datamodule = PreferenceDataModule(cfg, tokenizer, records=records, key_prefix=key_prefix)
    datamodule.load()

    model = load_sequence_classifier(name, tokenizer, get_key(model_cfg, "dtype", "float32"), trust, seed=cfg.seed)
    if get_key(model_cfg, "gradient_checkpointing", False):
        enable_activation_checkpointing(model)
    module = RewardModelModule(
        model, tokenizer, optim_cfg, max_grad_norm=cfg.max_grad_norm, center_rewards_coef=cfg.center_rewards_coef
    )
    return module, datamodule


def save(module: RewardModelModule, directory: str | os.PathLike) -> Path:
    """An HF directory (safetensors, tokenizer) that ``ppo_lightning.rewards.RewardModel`` and plain
    ``AutoModelForSequenceClassification.from_pretrained`` load. Under DDP call it on rank 0 only."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    module.model.config.pad_token_id = module.tokenizer.pad_token_id
    module.model.save_pretrained(directory, safe_serialization=True)
    module.tokenizer.save_pretrained(directory)
    return directory
