"""A reward model: any ``AutoModelForSequenceClassification`` (hub id or local directory).

It scores the decoded ``prompt + response`` text with its own tokenizer, so the policy and the
reward model need not share a vocabulary. The score is the classifier's logit 0 (one label), or
``logit[label_index]`` for multi-label heads (reward normalisation is applied by the rollout).
It is an ``nn.Module`` so Lightning moves it to the policy's device; it stays frozen and in eval.
"""

from __future__ import annotations

import torch
from torch import nn

from ppo_lightning.config.errors import ConfigError
from ppo_lightning.models.policy import (
    TORCH_DTYPES,
    disable_dropout,
    fuse_activations,
    position_ids_from_mask,
    resolve_source,
)
from ppo_lightning.rewards.base import Reward, RewardBatch, Scored, check_scores
from ppo_lightning.config.choices import REWARD_INPUTS as INPUTS


class RewardModel(nn.Module, Reward):
    """A frozen sequence-classification reward model; ``score`` reads the batch's token ids
    (``use_policy_tokens`` decides) or its decoded text (``forward``)."""

    def __init__(
        self,
        name_or_path: str,
        batch_size: int = 32,
        max_length: int = 512,
        dtype: str = "float32",
        label_index: int = 0,
        trust_remote_code: bool = False,
    ):
        super().__init__()
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        key = "reward.name_or_path"
        source = resolve_source(name_or_path, key)
        self.name = str(name_or_path)
        self.tokenizer = AutoTokenizer.from_pretrained(source, trust_remote_code=trust_remote_code)
        # right padding, and truncate from the left so the response (the part being judged) stays
        self.tokenizer.padding_side = "right"
        self.tokenizer.truncation_side = "left"
        if self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token_id is None:
                raise ConfigError(
                    f"{key}={name_or_path!r}: the reward tokenizer has neither a pad "
                    "nor an EOS token; set tokenizer.pad_token and save_pretrained"
                )
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model, loading = AutoModelForSequenceClassification.from_pretrained(
            source, dtype=TORCH_DTYPES[dtype], trust_remote_code=trust_remote_code, output_loading_info=True
        )
        missing = sorted(loading["missing_keys"])
        if missing:  # transformers initialised them at random: the run would train against noise
            raise ConfigError(
                f"{key}={name_or_path!r} is not a trained reward model: its checkpoint lacks "
                f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''} (transformers would start "
                "them at random); train one with task=reward_model, or point reward.name_or_path at a "
                "sequence-classification checkpoint with its score head"
            )
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        disable_dropout(self.model)
        fuse_activations(self.model)
        self.model.requires_grad_(False)
        self.model.eval()
        self.batch_size, self.max_length, self.label_index = batch_size, max_length, label_index
        self.token_input = False  # see use_policy_tokens
        self.train(False)

    def score_head(self) -> nn.Linear:
        """The linear layer that maps the last hidden state to the score (for value-head init)."""
        for name in ("score", "classifier", "classification_head"):
            head = getattr(self.model, name, None)
            if isinstance(head, nn.Linear):
                return head
        raise ConfigError(
            f"reward.name_or_path={self.name!r}: no linear score head found "
            "(looked for .score / .classifier); use model.value_head_init=zeros"
        )

    def use_policy_tokens(self, policy_tokenizer, mode: str = "auto") -> bool:
        """Decide whether rollouts are scored from the policy's token ids (``score_tokens``).

        That path skips decoding every response and re-encoding the text, and the reward model
        sees exactly the tokens the policy sampled (a byte-level tokenizer decodes a broken UTF-8
        sequence to U+FFFD, which re-encodes to other bytes). It is only the same input as the
        text path when both tokenizers map the same strings to the same ids and the reward
        tokenizer adds no special tokens of its own (BERT-style [CLS] ... [SEP]).
        ``mode``: ``auto`` (use it when that holds), ``tokens`` (require it), ``text`` (never).
        """
        if mode not in INPUTS:
            raise ConfigError(f"reward.input={mode!r}: choose one of {', '.join(INPUTS)}")
        same_vocab = policy_tokenizer.get_vocab() == self.tokenizer.get_vocab()
        adds_specials = (
            self.tokenizer("a b")["input_ids"] != self.tokenizer("a b", add_special_tokens=False)["input_ids"]
        )
        ok = same_vocab and not adds_specials
        if mode == "tokens" and not ok:
            why = "a different vocabulary" if not same_vocab else "special tokens it adds to every text"
            raise ConfigError(
                f"reward.input=tokens, but the reward model {self.name!r} has {why} "
                "compared with the policy's tokenizer; use reward.input=text (or auto)"
            )
        self.token_input = ok and mode != "text"
        self._special_ids = torch.tensor(sorted(set(policy_tokenizer.all_special_ids)), dtype=torch.long)
        return self.token_input

    @torch.no_grad()
    def score_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores of left-padded ``prompt + response`` token ids (the policy's vocabulary).

        Special tokens (EOS, BOS, pad) are dropped from the input as ``skip_special_tokens``
        drops them from the decoded text: they become the reward model's pad token, masked, and
        positions count real tokens only, so the classifier pools the last real token. Keeps the
        last ``max_length`` positions, as the text path truncates from the left.
        """
        special = torch.isin(input_ids, self._special_ids.to(input_ids.device))
        real = attention_mask.bool() & ~special
        if input_ids.shape[1] > self.max_length:
            input_ids, real = input_ids[:, -self.max_length :], real[:, -self.max_length :]
        ids = input_ids.masked_fill(~real, self.model.config.pad_token_id)  # what the pooling skips
        mask = real.long()
        position_ids = position_ids_from_mask(mask)
        out = []
        for s in range(0, ids.shape[0], self.batch_size):
            sl = slice(s, s + self.batch_size)
            logits = self.model(input_ids=ids[sl], attention_mask=mask[sl], position_ids=position_ids[sl]).logits
            out.append(logits[:, self.label_index].float())
        return torch.cat(out)

    def score(self, batch: RewardBatch) -> Scored:
        """The score of every row (it applies everywhere): from the policy's token ids where
        ``use_policy_tokens`` chose them and the batch has them, else from the decoded text."""
        if self.token_input and batch.input_ids is not None:
            scores = self.score_tokens(batch.input_ids, batch.attention_mask).float()
        else:
            scores = self(batch.prompt_texts, batch.responses)
        return Scored(scores, torch.ones_like(scores, dtype=torch.bool), {})

    def train(self, mode: bool = True):  # frozen: never switch to train mode
        return super().train(False)

    @torch.no_grad()
    def forward(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        texts = [p + r for p, r in zip(prompts, responses)]
        out = []
        for s in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[s : s + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
            ).to(device)
            logits = self.model(**enc).logits  # [b, num_labels]
            out.append(logits[:, self.label_index].float())
        return check_scores(torch.cat(out), prompts, f"model {self.name}", allow_nonfinite=True)
