"""Supervised fine-tuning: prompt-masked cross-entropy on (prompt, response) pairs.

The stage before PPO: it teaches a causal LM the response format, and its output directory is the
PPO policy (``model.name_or_path=<dir>``).

Examples are built so that training sees what PPO will later see. The prompt is tokenised alone
without special tokens (as ``ppo_lightning.data`` tokenises PPO prompts), the response alone with
EOS appended (PPO samples response tokens after the prompt tokens and stops at EOS), and the two are
concatenated. Labels are -100 on prompt and pad positions, so the loss is the mean cross-entropy
over response tokens (EOS included). Batches are right-padded; position ids come from the
attention mask, so left padding (the PPO policy's) gives the same loss.

Truncation (``truncation=truncate``, the default): the prompt keeps its last
``max_prompt_length`` tokens (its end is what the response continues), then the response is cut
from its end to fit ``max_length``; a cut response loses its EOS, so the model is never taught to
stop where the text was cut. ``drop`` skips such examples, ``error`` refuses them.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import lightning as L
import torch
import torch.nn.functional as F
from torchmetrics.aggregation import SumMetric

from ppo_lightning.config import SFTConfig
from ppo_lightning.data.prompts import PadCollator, chat_template_of, pad_rows, render_prompts
from ppo_lightning.data.records import PromptRecord
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.models.policy import (
    enable_activation_checkpointing,
    load_causal_lm,
    load_tokenizer,
    position_ids_from_mask,
)
from ppo_lightning.config.rules import validate_stage
from ppo_lightning.config.schema import as_dataclass, get_key
from ppo_lightning.config.task import DEFAULT_MAX_LENGTH
from ppo_lightning.stages.common import StageDataModule, stage_model, StageOptimization, reset_val_metrics, synced_value

log = logging.getLogger(__name__)

IGNORE_INDEX = -100


# ----------------------------------------------------------------------------- examples
def tokenize_sft(
    records: Sequence[Mapping[str, str]],
    tokenizer,
    max_length: int,
    max_prompt_length: int,
    truncation: str = "truncate",
    source: str = "records",
    key_prefix: str = "task",
) -> list[dict[str, list[int]]]:
    """``{"input_ids", "labels"}`` per record (``prompt`` / ``response`` keys); see the module doc."""
    if not records:
        raise ConfigError(f"{source} holds no records")
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ConfigError("the tokenizer has no EOS token, so responses cannot end; set eos_token")
    prompts = tokenizer([r["prompt"] for r in records], add_special_tokens=False)["input_ids"]
    responses = tokenizer([r["response"] for r in records], add_special_tokens=False)["input_ids"]
    out, n_long = [], 0
    for i, (p, r) in enumerate(zip(prompts, responses)):
        if not p:
            raise ConfigError(
                f"{source}: record {i} has a prompt that tokenises to nothing; "
                "the first response token needs a prompt token before it"
            )
        r = r + [eos]
        if len(p) > max_prompt_length or len(p) + len(r) > max_length:
            n_long += 1
            if truncation == "error":
                raise ConfigError(
                    f"{source}: record {i} has {len(p)} prompt + {len(r)} response tokens (with EOS), "
                    f"over {key_prefix}.max_prompt_length={max_prompt_length} or "
                    f"{key_prefix}.max_length={max_length}; raise them or set "
                    f"{key_prefix}.truncation=truncate or drop"
                )
            if truncation == "drop":
                continue
            p = p[-max_prompt_length:]
            r = r[: max_length - len(p)]
        out.append({"input_ids": p + r, "labels": [IGNORE_INDEX] * len(p) + r})
    if n_long:
        log.warning(
            "%d of %d SFT examples exceed %s.max_prompt_length=%d / %s.max_length=%d tokens; %s",
            n_long,
            len(records),
            key_prefix,
            max_prompt_length,
            key_prefix,
            max_length,
            "dropped" if truncation == "drop" else "truncated (prompt from the left, response from the right)",
        )
    if not out:
        raise ConfigError(
            f"{source}: every record is over the length limits and {key_prefix}.truncation=drop dropped them all"
        )
    return out


class SFTCollator(PadCollator):
    """Pads ``{"input_ids", "labels"}`` examples: ``input_ids``, ``attention_mask``, ``labels``
    ``[B, T]``, labels -100 on padding. Right padding by default; ``"left"`` works too (the module
    takes position ids from the mask)."""

    def __init__(self, pad_token_id: int, padding_side: str = "right"):
        super().__init__(pad_token_id, padding_side)

    def __call__(self, batch: list[dict[str, list[int]]]) -> dict[str, torch.Tensor]:
        out = super().__call__([x["input_ids"] for x in batch])
        out["labels"], _ = pad_rows([x["labels"] for x in batch], IGNORE_INDEX, self.padding_side)
        return out


class SFTDataModule(StageDataModule):
    """(prompt, response) records (``StageDataModule``), tokenised by ``tokenize_sft``."""

    config_class = SFTConfig

    def roles(self) -> dict[str, tuple[str, str]]:
        p, c = self.key_prefix, self.cfg
        return {"prompt": (f"{p}.prompt_field", c.prompt_field), "response": (f"{p}.response_field", c.response_field)}

    chat_roles = ("prompt",)  # a prompt may be chat messages

    def tokenize(self, records: list[dict[str, str]], source: str) -> list[dict[str, list[int]]]:
        """Chat prompts (and, with ``chat_template``, string ones) rendered as PPO renders them
        (``data.prompts.render_prompts``), so SFT and PPO see the same prompt tokens; then ``tokenize_sft``:
        the loss on the response (the assistant turn) and EOS only."""
        c = self.cfg
        if any(isinstance(r["prompt"], list) for r in records) or c.chat_template is not None:
            texts = render_prompts(
                [PromptRecord(r["prompt"], {}, f"{source} record {i}") for i, r in enumerate(records)],
                self.tokenizer,
                chat_template_of(c.chat_template, f"{self.key_prefix}.chat_template"),
                c.system_prompt,
            )
            records = [{**r, "prompt": t} for r, t in zip(records, texts)]
        return tokenize_sft(
            records,
            self.tokenizer,
            DEFAULT_MAX_LENGTH if c.max_length is None else c.max_length,
            c.max_prompt_length,
            c.truncation,
            source=source,
            key_prefix=self.key_prefix,
        )

    def collator(self) -> SFTCollator:
        return SFTCollator(self.tokenizer.pad_token_id, "right")


# ----------------------------------------------------------------------------- the module
def sft_loss_sums(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over labelled positions, and their count.

    Position ``t`` predicts token ``t + 1``; only positions whose next label is not -100 count, so
    only those logits are cast to float32.
    """
    target = labels[:, 1:]
    keep = target != IGNORE_INDEX
    sel = logits[:, :-1][keep].float()  # [N, V]
    loss_sum = F.cross_entropy(sel, target[keep], reduction="sum")
    return loss_sum, keep.sum()


class SFTModule(StageOptimization, L.LightningModule):
    """Prompt-masked cross-entropy on any ``AutoModelForCausalLM``, automatic optimisation.

    Logs ``train/loss`` (per batch, mean over its response tokens), ``train/lr``, and per
    validation run ``val/loss`` and ``val/perplexity``.

    ``val/loss`` is the mean next-token cross-entropy over all validation response tokens of all
    ranks: token-weighted, not a mean of batch means. Two torchmetrics ``SumMetric``s, the summed
    loss and the token count (float64), are updated per batch and synced over DDP ranks in
    ``compute()`` at the end of the run; ``val/loss`` is their ratio. ``val/perplexity`` is not a
    metric of its own: it is ``exp(val/loss)`` of that synced value (the exponent capped at 80).
    A sum pair rather than a weighted ``MeanMetric``: that one drops, imputes or raises on NaN
    unless ``nan_strategy="disable"``, which (torchmetrics 1.9) ignores the weights; here a
    diverged model logs NaN. Nothing is logged when no rank had a validation token.
    """

    def __init__(self, model, tokenizer, optim_cfg=None, max_grad_norm: Optional[float] = 1.0):
        super().__init__(model, tokenizer, optim_cfg, max_grad_norm)
        # module attributes, so Lightning moves them with the model; not in the state dict
        self.val_loss_sum = SumMetric(nan_strategy="disable")
        self.val_tokens = SumMetric(nan_strategy="disable")
        reset_val_metrics(self.val_loss_sum, self.val_tokens)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        out = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids_from_mask(attention_mask),
            use_cache=False,
        )
        return out.logits

    def loss_sums(self, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return sft_loss_sums(self(batch["input_ids"], batch["attention_mask"]), batch["labels"])

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        loss_sum, n = self.loss_sums(batch)
        loss = loss_sum / n.clamp(min=1)
        self.log("train/loss", loss.detach(), prog_bar=True, batch_size=batch["input_ids"].shape[0])
        self.log("train/lr", self.lr_schedulers().get_last_lr()[0])
        return loss

    def _val_metrics(self) -> tuple:
        return self.val_loss_sum, self.val_tokens

    def update_val_metrics(self, loss_sum: torch.Tensor, n: torch.Tensor) -> None:
        """Add one batch: its summed response-token loss and its number of response tokens."""
        self.val_loss_sum.update(loss_sum)
        self.val_tokens.update(n)

    def compute_val_metrics(self) -> dict[str, float]:
        """``val/loss`` and ``val/perplexity`` over every rank's updates since the last reset, or
        ``{}`` when there were no tokens. Under DDP every rank must call it (the metrics sync)."""
        n = synced_value(self.val_tokens).item()
        if n == 0:  # the same on every rank, so all skip the next sync together
            return {}
        val_loss = synced_value(self.val_loss_sum).item() / n
        return {"val/loss": val_loss, "val/perplexity": math.exp(min(val_loss, 80.0))}

    def validation_step(self, batch: dict, batch_idx: int) -> None:
        self.update_val_metrics(*self.loss_sums(batch))


# ----------------------------------------------------------------------------- build / save
def build_sft(
    model_cfg,
    optim_cfg,
    stage_cfg,
    tokenizer=None,
    *,
    records: Optional[Sequence[Mapping[str, Any]]] = None,
    key_prefix: str = "task",
    cache_dir: str | None = None,
) -> tuple[SFTModule, SFTDataModule]:
    """The SFT module and datamodule that the configs describe.

    ``model_cfg``: ``model.*`` (name_or_path, tokenizer_name_or_path, dtype, trust_remote_code,
    gradient_checkpointing, build_tiny); ``optim_cfg``: ``optimizer.*``; ``stage_cfg``: an
    ``SFTConfig`` (or dict / DictConfig / None), the batches' keys included. ``tokenizer``: reuse one (else ``load_tokenizer``: left
    padding, a pad distinct from EOS). ``records``: in-memory ``{prompt, response}`` dicts instead
    of a file. The data is read and checked before the model loads; errors are ``ConfigError``s
    naming ``<key_prefix>.<key>``. ``cache_dir``: ``paths.cache_dir``, the only place
    ``model.build_tiny`` builds a model.
    """
    cfg = as_dataclass(stage_cfg, SFTConfig, key_prefix)
    validate_stage(cfg, SFTConfig, key_prefix, optimizer=optim_cfg if optim_cfg is not None else {})
    name, trust, cfg = stage_model(model_cfg, cfg, cache_dir, key_prefix)
    validate_stage(cfg, SFTConfig, key_prefix)  # max_length, now from the model's context
    if tokenizer is None:
        tokenizer = load_tokenizer(get_key(model_cfg, "tokenizer_name_or_path", None) or name, trust_remote_code=trust)
    elif tokenizer.eos_token_id is None or tokenizer.pad_token_id is None:
        raise ConfigError(
            "the tokenizer passed to build_sft needs an EOS and a pad token "
            "(ppo_lightning.models.policy.load_tokenizer adds a pad)"
        )
    datamodule = SFTDataModule(cfg, tokenizer, records=records, key_prefix=key_prefix)
    datamodule.load()

    model = load_causal_lm(name, tokenizer, get_key(model_cfg, "dtype", "float32"), trust)
    gc = getattr(model, "generation_config", None)
    if gc is not None and gc.eos_token_id is None:
        gc.eos_token_id = tokenizer.eos_token_id
    if get_key(model_cfg, "gradient_checkpointing", False):
        enable_activation_checkpointing(model)
    module = SFTModule(model, tokenizer, optim_cfg, max_grad_norm=cfg.max_grad_norm)
    return module, datamodule


def save(module: SFTModule, directory: str | os.PathLike) -> Path:
    """An HF directory (safetensors, tokenizer, generation config) that plain
    ``AutoModelForCausalLM.from_pretrained`` loads and PPO takes as ``model.name_or_path``.
    Under DDP call it on rank 0 only."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model, tok = module.model, module.tokenizer
    model.config.pad_token_id = tok.pad_token_id
    gc = getattr(model, "generation_config", None)
    if gc is not None:
        gc.pad_token_id = tok.pad_token_id
        if gc.eos_token_id is None:
            gc.eos_token_id = tok.eos_token_id
    model.save_pretrained(directory, safe_serialization=True)
    tok.save_pretrained(directory)
    return directory
