"""``task``: the job a command runs; the SFT and reward-model stages' keys (``task=sft``, ``task=reward_model``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ppo_lightning.config import choices
from ppo_lightning.config.schema import param

DEFAULT_MAX_LENGTH = 512
"""A stage's ``max_length`` when it is null and the model states no context (else the context, at most this)."""


@dataclass
class StageConfig:
    """What both stages read the same way: their records, the validation split and the batches
    (``data.*`` is PPO's prompts; a stage reads none of it)."""

    path: Optional[str] = None
    """Local ``.jsonl`` (one JSON object a line) or ``.json`` (a list of objects) of records:
    (prompt, response) pairs for SFT, (prompt, chosen, rejected) for the reward model."""
    hf_dataset: Optional[str] = None
    """Hugging Face dataset name, used when ``path`` is null (needs ``pip install datasets``)."""
    hf_split: str = "train"
    """Split of ``hf_dataset`` to read; the validation split is carved out of it."""
    prompt_field: str = "prompt"
    """JSON field / dataset column holding the prompt."""
    val_fraction: float = param(0.05, ge=0, lt=1, hint="0 turns validation off")
    """Fraction of records held out for validation (at least one; 0 turns validation off); at
    least one record must remain for training."""
    seed: int = 0
    """Seed of the train / validation split and of the training order (and of a new score
    head's init)."""
    batch_size: int = param(16, ge=1)
    """Records per training batch per rank (a reward-model pair is two rows of its forward)."""
    shuffle: bool = True
    """Reshuffle the training records every epoch (in an order fixed by ``seed``)."""
    group_by_length: bool = False
    """Batch training records of similar length (sorted within mega-batches of 50 batches, the
    batches in random order): each batch pads to its longest record, so less compute goes to
    padding. Every record is still seen once an epoch, but a batch is no longer a random sample:
    where length tracks content it holds one kind of record. The reviews recipe builds with it
    (15-25% faster stages, the same table); math_chat (two- and three-step problems) and
    calculator_tool (answers with and without a call) learned much worse with it, so they do not."""
    num_workers: int = param(0, ge=0)
    """DataLoader workers."""
    val_batch_size: Optional[int] = param(None, ge=1)
    """Records per validation batch (null: ``batch_size``)."""
    max_grad_norm: Optional[float] = param(1.0, ge=0)
    """Gradient norm clip (0 or null: off; ``trainer.gradient_clip_val`` wins when set)."""


@dataclass
class SFTConfig(StageConfig):
    """Keys of the SFT stage (with ``StageConfig``'s)."""

    response_field: str = "response"
    """JSON field / dataset column holding the target response (the assistant turn of a chat prompt)."""
    max_length: Optional[int] = param(None, ge=2)
    """Tokens per example: prompt + response + EOS (null: the model's context, at most 512); at
    most the model's context."""
    max_prompt_length: int = param(128, ge=1)
    """Prompt tokens kept (the last ones); must be < ``max_length``. Keep PPO's
    ``data.max_prompt_length`` (default 128) at most this, so PPO prompts look like SFT ones."""
    truncation: str = param("truncate", choices=choices.SFT_TRUNCATION)
    """Examples over a limit. truncate: cut the prompt from the left, then the response's end
    (losing its EOS); drop: skip them (one warning); error: refuse them."""
    chat_template: Optional[str] = None
    """As ``data.chat_template``: a prompt that is a list of chat messages (and, when set, a string
    prompt as one user message) is rendered as PPO renders it, so SFT and PPO see the same prompt
    tokens; the loss is on the response (the assistant turn) and EOS only. Give PPO the same
    ``data.chat_template`` and ``data.system_prompt``."""
    system_prompt: Optional[str] = None
    """As ``data.system_prompt``."""


@dataclass
class RewardModelConfig(StageConfig):
    """Keys of the reward-model stage (with ``StageConfig``'s)."""

    chosen_field: str = "chosen"
    """JSON field / dataset column holding the preferred response."""
    rejected_field: str = "rejected"
    """JSON field / dataset column holding the dispreferred response."""
    max_length: Optional[int] = param(None, ge=1)
    """Tokens per scored text, cut from the left (null: the model's context, at most 512). Give
    PPO's ``reward.max_length`` (default 512) the same value."""
    center_rewards_coef: float = param(0.0, ge=0)
    """Weight of mean((r_chosen + r_rejected)^2) in the loss: keeps rewards centred on 0
    (Eisenstein et al. 2023; TRL's ``center_rewards_coefficient``). 0 = off."""


@dataclass
class SFTTask(SFTConfig):
    """``task=sft`` (``stages/sft.py``): supervised fine-tuning with prompt-masked cross-entropy
    (prompt tokenised alone without special tokens, response alone plus EOS, loss on the response
    tokens and EOS). Uses ``model.*``, ``optimizer.*`` (schedule per optimizer step),
    ``trainer.*`` (``max_steps`` = optimizer steps), ``logger`` and ``callbacks``; its records and
    batches are ``task.*``'s. Unknown ``task.*`` keys and wrong types fail at composition."""

    name: str = "sft"
    """The job (``jobs/run.py:run_task``)."""
    save_dir: str = "${paths.output_dir}/sft_model"
    """Output HF directory (safetensors, tokenizer, generation config), written on rank 0: a PPO
    policy (``model.name_or_path=<save_dir>``). Must be non-empty."""


@dataclass
class RewardModelTask(RewardModelConfig):
    """``task=reward_model`` (``stages/reward_model.py``): a Bradley-Terry reward model, loss
    ``-log sigmoid(r(prompt + chosen) - r(prompt + rejected))`` on a one-output
    ``AutoModelForSequenceClassification`` (a causal-LM directory loads with a new score head),
    texts tokenised as ``reward=model`` scores them in PPO. Uses the same groups as ``task=sft``."""

    name: str = "reward_model"
    """The job (``jobs/run.py:run_task``)."""
    save_dir: str = "${paths.output_dir}/reward_model"
    """Output HF directory (safetensors, tokenizer), written on rank 0, for
    ``reward=model reward.name_or_path=<save_dir>``. Must be non-empty."""
