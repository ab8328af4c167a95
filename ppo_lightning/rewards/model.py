"""A reward model: any ``AutoModelForSequenceClassification`` (hub id or local directory).

It scores the decoded ``prompt + response`` text with its own tokenizer, so the policy and the
reward model need not share a vocabulary. The score is the classifier's logit 0 (one label), or
``logit[label_index]`` for multi-label heads, then ``gain * score + bias`` (reward normalisation).
It is an ``nn.Module`` so Lightning moves it to the policy's device; it stays frozen and in eval.
"""

from __future__ import annotations

import torch
from torch import nn

from ppo_lightning.errors import ConfigError
from ppo_lightning.policy import DTYPES, disable_dropout, resolve_source
from ppo_lightning.rewards.base import check_scores


class RewardModel(nn.Module):
    def __init__(self, name_or_path: str, batch_size: int = 32, max_length: int = 512,
                 dtype: str = "float32", label_index: int = 0, gain: float = 1.0, bias: float = 0.0,
                 trust_remote_code: bool = False):
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
                raise ConfigError(f"{key}={name_or_path!r}: the reward tokenizer has neither a pad "
                                  "nor an EOS token; set tokenizer.pad_token and save_pretrained")
            self.tokenizer.pad_token = self.tokenizer.eos_token
        self.model = AutoModelForSequenceClassification.from_pretrained(
            source, dtype=DTYPES[dtype], trust_remote_code=trust_remote_code)
        if self.model.config.pad_token_id is None:
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        disable_dropout(self.model)
        self.model.requires_grad_(False)
        self.model.eval()
        self.batch_size, self.max_length, self.label_index = batch_size, max_length, label_index
        self.gain, self.bias = float(gain), float(bias)
        self.train(False)

    def score_head(self) -> nn.Linear:
        """The linear layer that maps the last hidden state to the score (for value-head init)."""
        for name in ("score", "classifier", "classification_head"):
            head = getattr(self.model, name, None)
            if isinstance(head, nn.Linear):
                return head
        raise ConfigError(f"reward.name_or_path={self.name!r}: no linear score head found "
                          "(looked for .score / .classifier); use model.value_head_init=zeros")

    def fit_normalization(self, prompts: list[str], responses: list[str], reduce=None) -> tuple[float, float]:
        """Set gain/bias so scores of these (reference-policy) samples have mean 0 and std 1.

        ``reduce`` sums a tensor over ranks under DDP, so every rank gets the same gain/bias.
        """
        self.gain, self.bias = 1.0, 0.0
        raw = self(prompts, responses).double()
        stats = torch.stack([raw.sum(), (raw ** 2).sum(), torch.tensor(float(len(raw)), dtype=torch.float64)])
        if reduce is not None:
            stats = reduce(stats.to(next(self.model.parameters()).device)).cpu()
        total, sq, n = stats.tolist()
        mean = total / n
        std = max((sq / n - mean ** 2) ** 0.5, 1e-6)
        self.gain, self.bias = 1.0 / std, -mean / std
        return self.gain, self.bias

    def train(self, mode: bool = True):  # frozen: never switch to train mode
        return super().train(False)

    @torch.no_grad()
    def forward(self, prompts: list[str], responses: list[str]) -> torch.Tensor:
        device = next(self.model.parameters()).device
        texts = [p + r for p, r in zip(prompts, responses)]
        out = []
        for s in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(texts[s:s + self.batch_size], return_tensors="pt", padding=True,
                                 truncation=True, max_length=self.max_length).to(device)
            logits = self.model(**enc).logits  # [b, num_labels]
            out.append(logits[:, self.label_index].float())
        scores = torch.cat(out) * self.gain + self.bias
        return check_scores(scores, prompts, f"model {self.name}", allow_nonfinite=True)
