"""``reward``: one scorer, or several weighted terms (``reward.terms``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional
import re

from ppo_lightning.config import choices
from ppo_lightning.config.schema import param


@dataclass
class RewardConfig:
    """The scorer: ``reward_fn(prompts, responses) -> one float per response``, on the decoded text
    (``prompt + response`` is the decoded whole sequence, cut at the first EOS). Every batch is
    checked: a wrong count or a non-number raises ``RewardError`` naming the prompt (as does an
    exception in ``fn``); NaN/inf pass through to the non-finite guard. The raw scores then go
    through ``gain * raw + bias`` (reward normalisation) for every kind."""

    kind: str = param("function", choices=choices.REWARD_KINDS)
    """function: a Python callable (``fn``); model: an ``AutoModelForSequenceClassification``;
    environment: no scorer of its own, the episode's environment scores it (the ``get_reward()`` of
    ``env.environment``, a class written for TRL's ``environment_factory``), as TRL allows."""
    fn: Optional[str] = None
    """(function) ``pkg.module.fn`` or ``pkg.module:fn``, imported before any model loads, returning
    one float per response. Its parameters choose the call (``rewards/function.py``): with one
    named ``completions``, TRL's ``fn(prompts=, completions=, completion_ids=, **columns)``
    (prompts as written, strings or chat messages); else ``fn(prompts, responses, **kwargs)`` on
    the decoded texts. Any other parameter ``kwargs`` does not set is a column of the prompt
    records (``answer``, ...), one value per response: without a default, every record must have
    it (checked before any model loads). ``None`` for a response: this reward does not apply
    there (left out of the sum; a response no reward applies to is masked out of every loss)."""
    kwargs: Dict[str, Any] = param(factory=dict)
    """(function) Extra keyword arguments for ``fn``: ``+reward.kwargs.<arg>=<value>`` (the ``+``
    adds a key the dict does not have), or ``'reward.kwargs={word:good}'``."""
    name_or_path: Optional[str] = None
    """(model) Hub id or local directory of the reward model, with its own tokenizer (right
    padding, left truncation; pad = EOS if it has none). Checked like ``model.name_or_path``."""
    batch_size: int = param(32, ge=1)
    """(model) Texts scored per forward."""
    max_length: int = param(512, ge=1)
    """(model) Tokens kept per ``prompt + response``, cut from the left (the response end stays)."""
    dtype: str = param("float32", choices=choices.DTYPES)
    """(model) Weights dtype of the reward model."""
    input: str = param("auto", choices=choices.REWARD_INPUTS)
    """(model) tokens: score the policy's token ids directly (special tokens masked as
    ``skip_special_tokens`` drops them; no decode and re-encode; needs the policy's vocabulary and
    a reward tokenizer that adds no special tokens, else a config error at startup). text: always
    score the decoded text with the reward model's own tokenizer. auto: tokens when possible."""
    label_index: int = param(0, ge=0)
    """(model) Which logit is the score."""
    gain: float = 1.0
    """score = gain * raw + bias, for every reward kind, when ``normalize`` is off."""
    bias: float = 0.0
    """See ``gain``."""
    normalize: bool = True
    """Before the first iteration, fit gain and bias so the scores of responses sampled from the
    reference policy on the run's prompts have mean 0 and std 1 ([N+] reward normalisation), for
    every reward kind: the KL coefficient then means the same thing whatever the reward's scale.
    Fitted once per run (own seeded sampler), saved in checkpoints, restored on resume. Scores
    without variance are only centred (one warning); non-finite ones are left out."""
    normalize_samples: int = param(256, ge=2)
    """Reference responses scored for the fit, split over ranks (``normalize_samples // world``):
    at least one per rank."""
    trust_remote_code: bool = False
    """(model) Run code shipped with the reward model."""
    terms: Dict[str, Any] = field(default_factory=dict)
    """Several rewards, weighted: ``{name: {kind, fn, kwargs, weight, ...}}``, each term configured
    as this node is (``RewardTermConfig``; ``weight`` 1.0 by default). When given, the terms are
    the reward: their weighted sum, normalised as one score (normalising each term would replace
    the weights by the terms' spreads); ``kind``/``fn``/the model keys above are then unused. Add
    one from the command line with or without ``+``: ``reward.terms.correct.fn=my.fn
    reward.terms.format.fn=my.fmt reward.terms.format.weight=0.2``, or from a file in
    ``conf/reward/`` (``reward=math``). Each term's raw scores are logged as
    ``rewards/<name>/mean`` and ``rewards/<name>/std``. A term of kind model reads text."""


@dataclass
class RewardTermConfig:
    """One term of ``reward.terms``: the keys of ``reward`` that describe one scorer, and its weight."""

    kind: str = param("function", choices=choices.REWARD_KINDS)
    fn: Optional[str] = None
    kwargs: Dict[str, Any] = field(default_factory=dict)
    weight: float = 1.0
    name_or_path: Optional[str] = None
    batch_size: int = param(32, ge=1)
    max_length: int = param(512, ge=1)
    dtype: str = param("float32", choices=choices.DTYPES)
    label_index: int = param(0, ge=0)
    trust_remote_code: bool = False


TERM_NAME = re.compile(r"^[A-Za-z0-9_-]+$")  # a term's name is part of its metric keys
