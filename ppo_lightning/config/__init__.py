"""Typed schemas for every config group: each key's default, type, range check and doc, together.

Each field is declared once: its type annotation, its default and its check (``param``), and the
docstring under it (litgpt style). ``docs/config.md`` is generated from these by
``python docs/gen_config.py`` (a test fails when it is stale), and ``validate`` checks every
field's range and choices from the same declaration. Choice lists come from ``choices.py``, which
imports nothing: loading this module imports no torch, Lightning or transformers.

``conf/train.yaml`` starts its defaults list with ``train_schema`` (registered below), so Hydra
merges every YAML and command-line override into these dataclasses while composing: an unknown key
(``ppo.clpi=0.1``) or a wrong type (``ppo.clip=abc``) fails at composition, naming the key, before
anything is loaded. ``validate(cfg)`` then checks ranges and cross-group constraints.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from ppo_lightning.config import choices
from ppo_lightning.config.errors import ConfigError

ASSETS = Path(__file__).parents[1] / "data"  # the package's own data files (toy_prompts.txt)
log = logging.getLogger(__name__)


def param(
    default: Any = MISSING, *, factory=None, choices=None, gt=None, ge=None, lt=None, le=None, hint: str | None = None
):
    """A config field with its check: ``choices`` (a registry: any iterable of the allowed
    values), bounds ``gt``/``ge``/``lt``/``le``, and a ``hint`` appended to the error message.
    A null value (an optional key left unset) is never checked."""
    meta = {k: v for k, v in dict(choices=choices, gt=gt, ge=ge, lt=lt, le=le, hint=hint).items() if v is not None}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def describe_check(meta: dict) -> str:
    """The check of a field in words: ``> 0``, ``in [0, 1]``, ``one of k1 | k2 | k3``."""
    if "choices" in meta:
        return "one of " + " | ".join(str(c) for c in meta["choices"])
    lo = ("(", meta["gt"]) if "gt" in meta else ("[", meta["ge"]) if "ge" in meta else None
    hi = (")", meta["lt"]) if "lt" in meta else ("]", meta["le"]) if "le" in meta else None
    if lo and hi:
        return f"in {lo[0]}{lo[1]}, {hi[1]}{hi[0]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {lo[1]}"
    if hi:
        return f"{'<' if hi[0] == ')' else '<='} {hi[1]}"
    return ""


def check_fields(node: Any, cls: type, prefix: str = "") -> None:
    """Check every field of dataclass ``cls`` in ``node`` (a DictConfig, a dataclass or a dict)
    against its ``param`` check; raises ``ConfigError`` naming ``<prefix>.<field>`` and the value."""
    for f in dataclasses.fields(cls):
        meta = f.metadata
        if not meta:
            continue
        value = node.get(f.name) if isinstance(node, dict) else getattr(node, f.name, None)
        if value is None:
            continue
        if "choices" in meta:
            ok = value in tuple(meta["choices"])
        else:
            ok = (
                ("gt" not in meta or value > meta["gt"])
                and ("ge" not in meta or value >= meta["ge"])
                and ("lt" not in meta or value < meta["lt"])
                and ("le" not in meta or value <= meta["le"])
            )
        if not ok:
            what = "choose " + describe_check(meta) if "choices" in meta else "must be " + describe_check(meta)
            hint = f" ({meta['hint']})" if "hint" in meta else ""
            key = f"{prefix}.{f.name}" if prefix else f.name
            raise ConfigError(f"{key}={value!r}: {what}{hint}")


# ============================================================================= schemas
@dataclass
class TinyModelConfig:
    """A random causal LM over a byte vocabulary (256 bytes + EOS + pad), built offline (``tiny.py``)."""

    arch: str = param("gpt2", choices=choices.TINY_ARCHITECTURES)
    """Architecture: GPT-2, or Llama, Qwen2 and GPT-NeoX layouts of the same size."""

    n_layer: int = param(2, ge=1)
    """Transformer layers."""
    n_head: int = param(2, ge=1)
    """Attention heads."""
    n_embd: int = param(64, ge=1)
    """Hidden size."""
    n_positions: int = param(256, ge=1)
    """Context length (bounds ``data.max_prompt_length + sampling.max_new_tokens``)."""
    seed: int = 0
    """Init seed of the random weights."""


LORA_DROPOUT_REMOVED = (
    "PPO needs logprobs that are a deterministic function of the weights (dropout would "
    "make the first update's ratio differ from 1); the adapters train without dropout"
)


DATA_WORKERS_REMOVED = (
    "the PPO prompt loader runs in the main process (its prompts are tokenised once, before "
    "any model loads); a stage's loader workers are task.num_workers"
)


@dataclass
class LoRAConfig:
    """Low-rank adapters through ``peft`` (``pip install -e ".[lora]"``): the base weights stay
    frozen and only the adapters and the value head train. The reference is then the same network
    with its adapters switched off (no second copy of the weights); checkpoints hold the adapters,
    the value head and the optimizer; export writes the merged model plus ``adapter/``."""

    r: int = param(0, ge=0, hint="0 turns LoRA off: full fine-tuning")
    """Adapter rank; 0 = off (full fine-tuning). 8 to 64 are usual."""
    alpha: float = param(32.0, gt=0)
    """Scale of the adapters' update: ``W + (alpha / r) B A``."""
    dropout: Optional[Any] = field(default=None, metadata={"removed": LORA_DROPOUT_REMOVED})
    target_modules: Optional[List[str]] = None
    """Names of the layers to adapt (e.g. ``[q_proj,v_proj]``); null = every linear layer but
    the output head, per architecture (GPT-2: c_attn, c_proj, c_fc; Llama and Qwen2: q/k/v/o_proj,
    gate/up/down_proj; GPT-NeoX: query_key_value, dense, dense_h_to_4h, dense_4h_to_h)."""


@dataclass
class ModelConfig:
    """The policy: any Hugging Face causal LM, with a value head on its last hidden state. The
    frozen reference is a copy of the initial model."""

    name_or_path: str = MISSING
    """Hub id (``gpt2``) or a local directory written by ``save_pretrained``. Checked before
    anything loads: a directory is used as is, a path-like string that is not a directory fails,
    a hub id must be in the HF cache or the hub must answer within ~3 s. A path a recipe builds
    (``${recipe_dir:<name>}``) is checked after the job's recipe has built it.
    ``data.max_prompt_length + sampling.max_new_tokens`` must fit the model's context."""
    tokenizer_name_or_path: Optional[str] = None
    """Tokenizer source when it differs from ``name_or_path``. It pads on the left and must define
    EOS; a ``<|pad|>`` token is added (embeddings resized) when it has no pad or pad == EOS."""
    dtype: str = param("float32", choices=choices.DTYPES)
    """Weights dtype of the policy and reference (the value head stays float32). Mixed precision
    is ``trainer.precision``."""
    trust_remote_code: bool = False
    """Run model and tokenizer code shipped with the checkpoint. Off unless you trust its source."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (Hugging Face's, non-reentrant)
    instead of keeping them: the same gradients (test), less memory, slower updates. The policy's LM
    then stays in train mode (dropout is zeroed) and samples in eval mode (KV cache)."""
    value_head_path: Optional[str] = None
    """Directory holding ``value_head.safetensors`` (e.g. a previous ``export_dir``) to start the
    value head from (else zeros). The file must exist."""
    value_head_init: str = param("zeros", choices=choices.VALUE_HEAD_INITS)
    """zeros: V = 0 at the start (unless ``value_head_path``). reward_model: copy the reward
    model's linear score head, mapped by the reward normalisation (needs ``reward.kind=model`` and
    the same hidden size; meaningful when policy and reward model share a backbone)."""
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    """LoRA adapters (``LoRAConfig``); off unless ``model.lora.r > 0``."""
    build_tiny: Optional[TinyModelConfig] = None
    """If set, ``name_or_path`` is inside ``paths.cache_dir`` and holds no ``config.json`` yet:
    build a tiny random GPT-2 there first (``model=tiny``). An existing directory is reused as
    is, so changing ``build_tiny.*`` needs a new ``name_or_path``."""


@dataclass
class RefConfig:
    """The frozen reference, the anchor of the KL penalty. Its memory: one more copy of the
    policy's weights in ``ref.dtype`` (params x 4 bytes in float32, x 2 in bfloat16), none with
    LoRA (the policy with its adapters off is the reference)."""

    name_or_path: Optional[str] = None
    """null: the policy's initial weights (a copy made after loading ``model.name_or_path``; with
    LoRA, the policy itself with its adapters off). Else a hub id or ``save_pretrained`` directory
    over the policy's vocabulary, e.g. the SFT model when the policy starts from another checkpoint.
    Checked like ``model.name_or_path``."""
    dtype: Optional[str] = param(None, choices=choices.DTYPES)
    """Weights dtype of the reference; null = ``model.dtype``. ``bfloat16`` halves its memory; under
    ``trainer.precision=bf16-mixed`` its matmuls run in bf16 anyway, so only the rounding of its
    weights differs, but the first iteration's KL is then not exactly 0."""


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


@dataclass
class OptimizerConfig:
    """The optimizer over the policy's trainable parameters (value head included), and its lr
    schedule, stepped once per PPO iteration (stages: once per optimizer step)."""

    name: str = param("adamw", choices=choices.OPTIMIZERS)
    """``torch.optim`` class; ``sgd`` uses ``lr`` and ``weight_decay`` only (no momentum)."""
    lr: float = param(1.0e-5, gt=0)
    """Base learning rate (``model=tiny``, ``model=reviews`` and ``model=arithmetic`` set the rate
    their small models need)."""
    betas: List[float] = param(factory=lambda: [0.9, 0.999])
    """Adam/AdamW only."""
    eps: float = param(1.0e-5, gt=0)
    """Adam/AdamW only. 1e-5 rather than torch's 1e-8, as OpenAI's RLHF code ([N+])."""
    weight_decay: float = param(0.0, ge=0)
    """Decoupled (AdamW) or L2 (Adam, SGD) weight decay."""
    scheduler: str = param("constant", choices=choices.SCHEDULERS)
    """Decay from 1 to ``min_lr_ratio`` between step ``warmup_steps`` and ``trainer.max_steps``
    (``optim.py:lr_lambda``)."""
    warmup_steps: int = param(0, ge=0)
    """Steps (PPO iterations) of linear warmup: step i < w trains at lr (i + 1) / (w + 1)."""
    min_lr_ratio: float = param(0.0, ge=0, le=1)
    """Final lr / lr of the linear and cosine decays, reached at ``trainer.max_steps``."""
    fused: bool = True
    """torch's fused implementation (one kernel per parameter for the whole update; an AdamW step
    on the 2-layer benchmark model: 0.2 ms against 0.7 ms); false: ``foreach`` (one kernel per op
    over all parameters). Same math either way."""


MOVED_KEYS = {
    "ppo.max_new_tokens": "sampling.max_new_tokens",
    "ppo.temperature": "sampling.temperature",
    "ppo.top_k": "sampling.top_k",
    "ppo.top_p": "sampling.top_p",
    "ppo.stop_at_eos": "sampling.stop_at_eos",
    "ppo.stop_token_ids": "sampling.stop_token_ids",
    "ppo.stop_strings": "sampling.stop_strings",
    "ppo.rollout_generate_batch_size": "sampling.chunk_size",
    "ppo.fast_decode": "generation.fast_decode",
}
"""Keys that moved, and their new homes. Each old key stays in its schema as a null placeholder,
so that setting it (on the command line or in a YAML file) composes and then fails validation
with one line naming the new key, instead of Hydra's "not in the schema"."""


REMOVED_KEYS = {"model.lora.dropout": LORA_DROPOUT_REMOVED, "data.num_workers": DATA_WORKERS_REMOVED}
"""Keys that were removed, and why; placeholders like the moved ones."""


def is_placeholder(f: dataclasses.Field) -> bool:
    """Whether a schema field only holds the place of a moved or removed key."""
    return "moved_to" in f.metadata or "removed" in f.metadata


def moved(new_home: str):
    """A placeholder for a key that moved to ``new_home`` (see ``MOVED_KEYS``); not documented."""
    return field(default=None, metadata={"moved_to": new_home})


@dataclass
class _MovedPPOKeys:
    """The sampling keys that were ``ppo.*`` (``MOVED_KEYS``)."""

    max_new_tokens: Optional[Any] = moved("sampling.max_new_tokens")
    temperature: Optional[Any] = moved("sampling.temperature")
    top_k: Optional[Any] = moved("sampling.top_k")
    top_p: Optional[Any] = moved("sampling.top_p")
    stop_at_eos: Optional[Any] = moved("sampling.stop_at_eos")
    stop_token_ids: Optional[Any] = moved("sampling.stop_token_ids")
    stop_strings: Optional[Any] = moved("sampling.stop_strings")
    rollout_generate_batch_size: Optional[Any] = moved("sampling.chunk_size")
    fast_decode: Optional[Any] = moved("generation.fast_decode")


@dataclass
class SamplingConfig:
    """How responses are sampled: by the rollout, by reward normalisation's reference samples and
    by the recipes' evaluations alike (``generation.SamplingParams``, built once per run). Which
    engine samples is the ``generation`` group."""

    max_new_tokens: int = param(32, ge=1)
    """Response length limit; sampling stops early once every row has stopped. Also the constant
    ``ppo.loss_agg=seq_mean_token_sum_norm`` divides by."""
    temperature: float = param(1.0, gt=0, hint="logprobs divide by it")
    """Sampling temperature. Every log-probability (policy, reference, update ratio, entropy) is
    taken from logits / temperature; top-k/top-p truncation is not applied to them (as in TRL
    and OpenAI's RLHF code)."""
    top_k: int = param(0, ge=0, hint="0 turns it off")
    """Sample from the k most likely tokens (0 = off)."""
    top_p: float = param(1.0, gt=0, le=1)
    """Nucleus sampling mass (1.0 = off); at least one token is always kept."""
    min_p: float = param(0.0, ge=0, lt=1, hint="0 turns it off")
    """Drop tokens whose probability is below ``min_p`` times the most likely token's (0 = off),
    after temperature, top-k and top-p (Hugging Face's order; vLLM applies it before top-k and
    top-p, so with those set the backends differ, and ``generation=vllm`` warns)."""
    stop_at_eos: bool = True
    """Stop a response at its first EOS (or stop token / string). False runs every response to
    ``max_new_tokens``, EOS an ordinary token, ``ppo.missing_eos_penalty`` ignored (benchmarks)."""
    stop_token_ids: List[int] = field(default_factory=list)
    """More token ids that end a response, as EOS does (kept, the last token of the response)."""
    stop_strings: List[str] = field(default_factory=list)
    """Strings that end a response, matched on the decoded text as Hugging Face's
    ``StopStringCriteria`` and vLLM's ``stop=`` match them: the response stops at the token that
    completes the string, however the tokenizer split it (that token is kept whole, with any text
    it holds after the string). A response that stops on one counts as ended for
    ``ppo.missing_eos_penalty``."""
    chunk_size: Optional[int] = param(None, ge=1)
    """Rows sampled at a time (null = the whole batch): bounds the KV cache,
    which grows with rows x (prompt + response) x layers x width. Greedy decoding gives the same
    tokens either way (test); a seeded sampling run draws different tokens with a different value."""


@dataclass
class PPOConfig(_MovedPPOKeys):
    """PPO's hyperparameters; names follow the tutorial the project started from
    (FareedKhan-dev/train-llm-from-scratch, ``src/post_training/ppo.py``)."""

    advantage: str = param("gae", choices=choices.ESTIMATORS)
    """How advantages are estimated. ``gae``: PPO's generalised advantage estimation with the
    value head (the critic). The critic-free estimators run no value head at all (no value
    forward, loss, parameters or optimizer state; ``vf_coef``, ``vf_clip`` and ``lam`` unused):
    ``grpo`` (each response's reward normalised within its prompt's group, DeepSeekMath),
    ``rloo`` (minus the mean reward of the group's other responses), both needing
    ``num_generations >= 2``; ``reinforce_pp`` (REINFORCE++: the per-token return-to-go,
    whitened over the batch). GRPO and RLOO compare the scores within a group and then add each
    token's return-to-go of the KL penalty (with ``kl_in=reward``), so KL noise cannot break the
    ties of a group whose scores are equal; REINFORCE++ whitens the score plus the KL penalty
    (``ppo_lightning/algo/advantages.py``)."""
    num_generations: int = param(1, ge=1)
    """Responses sampled per prompt. The rollout has ``data.batch_size * num_generations`` rows
    per rank, each prompt's responses on consecutive rows of one rank (a group: GRPO's and RLOO's
    statistics). ``minibatch_size`` counts these rows. Valid with every estimator."""
    scale_by_group_std: bool = True
    """GRPO only: divide by the group's score std (+1e-4). False subtracts the group mean only
    (Dr. GRPO: the division favours prompts that are almost always or almost never solved; pair
    it with ``loss_agg=seq_mean_token_sum_norm``). False with another estimator is refused."""
    clip: float = param(0.2, gt=0, hint="0.2 is the usual value")
    """Policy ratio clip epsilon: the ratio is clipped to [1 - clip, 1 + clip], unless
    ``clip_low`` / ``clip_high`` set a side."""
    clip_low: Optional[float] = param(None, gt=0, lt=1)
    """The lower clip epsilon (null: ``clip``): ratios below ``1 - clip_low`` are clipped."""
    clip_high: Optional[float] = param(None, gt=0)
    """The upper clip epsilon (null: ``clip``). Above ``clip_low`` it is DAPO's "clip-higher"
    (0.28 against 0.2): unlikely tokens may gain probability faster, which keeps entropy up."""
    dual_clip: Optional[float] = param(None, gt=1)
    """Dual clip's c (e.g. 3; null = off): for negative advantages the per-token loss is also
    capped at ``-c * A``, so a ratio far above 1 on a bad token cannot blow up the update."""
    loss_agg: str = param("token_mean", choices=choices.LOSS_AGGREGATIONS)
    """How the per-token policy loss (and the KL loss, ``kl_in=loss``) becomes one number:
    ``token_mean`` over this rank's minibatch tokens (the default; under DDP/FSDP the ranks'
    means are averaged, so a token on a rank with fewer tokens weighs more);
    ``token_mean_global``, over the tokens of every rank's minibatch (each token weighs the same
    wherever it was sampled: TRL's ``dapo``; one all-reduce of a count per update; the value loss
    and entropy then use the global count too); ``seq_mean_token_mean``, each response's token
    mean, averaged over responses (GRPO's original, DeepSeekMath eq. 3);
    ``seq_mean_token_sum``, each response's token sum, averaged; ``seq_mean_token_sum_norm``,
    that divided by the constant ``sampling.max_new_tokens`` (Dr. GRPO, TRL's ``dr_grpo``: no length bias,
    and gradients at a token mean's scale, so ``max_grad_norm`` keeps its meaning). Exact under
    micro-batches. The value loss is a token mean."""
    kl_in: str = param("reward", choices=choices.KL_PLACEMENTS)
    """Where the KL to the reference enters: ``reward``, as ``-kl_coef * KL_t`` per token
    (PPO, RLOO, REINFORCE++; with GRPO and RLOO it is added after the group comparison of the
    scores), or ``loss``, as ``kl_coef *`` an estimate of the KL on the current policy's
    logprobs (k3 unless ``kl_estimator`` says k2), added to the loss and aggregated like it
    (GRPO, DeepSeekMath eq. 3); the reward is then the score alone."""
    target_kl: Optional[float] = param(None, gt=0)
    """Stop an iteration's updates at the first minibatch whose ``policy/approxkl_avg`` to the
    rollout's policy (measured by its own forward, so after every step before it; mean over
    ranks) exceeds this, without taking that minibatch's step (Stable-Baselines3's early stop;
    e.g. 0.02; null = off). ``policy/epochs`` logs how many epochs ran, fractions counting
    minibatches. The first minibatch of an iteration measures 0 and always steps."""
    vf_clip: float = param(0.2, gt=0, hint="0.2 is the usual value")
    """Value clip range around the rollout's values (in reward units)."""
    gamma: float = param(1.0, ge=0, le=1)
    """Per-token discount: in GAE, and in REINFORCE++'s return-to-go. GRPO and RLOO judge a
    response by its score as a whole and refuse ``gamma < 1``."""
    lam: float = param(0.95, ge=0, le=1)
    """GAE lambda."""
    kl_coef: float = param(0.05, ge=0)
    """beta in ``reward_t = -beta * KL_t`` (plus the score at the last response token); the
    initial value when ``adaptive_kl``. Weighed against normalised scores (``reward.normalize``)."""
    kl_estimator: Optional[str] = param(None, choices=choices.KL_ESTIMATORS)
    """Per-token KL estimator (Schulman's k1 = log p/q, k2 = (log p/q)^2 / 2, k3 = (q/p - 1) -
    log q/p); null = k1 in the reward, k3 in the loss (``choices.DEFAULT_KL_ESTIMATOR``). In the loss
    only k2 (its gradient is that of KL(policy || ref)) and k3 (that of KL(ref || policy)) are
    accepted: k1's gradient has expectation 0 under the policy's samples. ``objective/kl`` and
    the adaptive controller always use k1."""
    adaptive_kl: bool = False
    """Ziegler et al. controller: after each iteration ``beta <- beta * (1 + clip(KL / kl_target - 1,
    +-0.2) * B * W / kl_horizon)`` with KL = ``objective/kl`` (skipped when non-finite)."""
    kl_target: float = param(6.0, gt=0)
    """Target ``objective/kl`` (nats per sequence) of the adaptive controller."""
    kl_horizon: int = param(10000, gt=0)
    """Horizon (episodes) of the adaptive controller."""
    vf_coef: float = param(0.1, ge=0)
    """Weight of the value loss: loss = pg_loss + vf_coef * vf_loss - ent_coef * entropy."""
    ent_coef: float = param(0.0, ge=0)
    """Weight of the entropy bonus; with 0 the entropy is a monitor computed without gradient."""
    ppo_epochs: int = param(4, ge=1)
    """Passes over each rollout."""
    minibatch_size: int = param(8, ge=1)
    """Episodes (rows) per gradient step, per rank; must divide the rollout's rows,
    ``data.batch_size * num_generations``. Updates per iteration: ``ppo_epochs * rows /
    minibatch_size``."""
    micro_batch_size: Optional[int] = param(None, ge=1)
    """Rows per forward and backward inside a minibatch (gradient accumulation); must divide
    ``minibatch_size``; null = the whole minibatch. Each micro-batch's losses are its share of the
    minibatch's token mean, so the step is the whole minibatch's (test): memory for activations
    scales with this, not with ``minibatch_size``."""
    max_grad_norm: float = 1.0
    """Global L2 gradient-norm clip; <= 0 disables it."""
    whiten_rewards: bool = False
    """GAE only: whiten per-token rewards (KL penalty + score) before GAE over the response tokens
    of all ranks, keeping the mean (TRL's PPO). Refused with the critic-free estimators, which
    normalise the scores themselves: whitening per-token rewards while keeping their mean adds a
    term proportional to each response's length to its return. The ``objective/*`` metrics are
    taken before it."""
    missing_eos_penalty: Optional[float] = None
    """Subtracted from the score of responses without EOS (only with ``stop_at_eos``)."""
    mask_truncated_completions: bool = False
    """Leave responses cut at ``sampling.max_new_tokens`` (no EOS or stop sequence) out of every
    loss: their tokens are masked, so they teach nothing (DAPO's overlong filtering; TRL's
    ``mask_truncated_completions``). Their scores still count in the group statistics of GRPO and
    RLOO, as in TRL. Logs ``rollout/masked_truncated``. Only with ``sampling.stop_at_eos``."""
    max_nonfinite_iterations: int = param(3, ge=1)
    """Stop the run (``NonFiniteError``, exit 1) after this many PPO iterations in a row with a
    skipped update (non-finite reward, rollout, loss or gradient; weights untouched, counted in
    ``health/skipped_updates``)."""
    rollout_forward_batch_size: Optional[int] = param(None, ge=1)
    """Rows per policy / reference scoring forward during the rollout (bounds memory; null = the
    whole batch). The reward model uses ``reward.batch_size``."""
    lm_head_chunk_size: Optional[int] = param(256, ge=1)
    """Response positions per chunk of the LM head when scoring responses (``lean_head``): the
    float32 ``[positions, vocab]`` logits, log-softmax and softmax exist for one chunk at a time,
    and the backward recomputes them chunk by chunk, instead of ``[batch, response, vocab]`` at
    once. The same logprobs, entropies and gradients to float32 rounding. It matters for large
    vocabularies: on a Qwen2-vocabulary workload (151,936 entries, 8 x 256 response tokens) the
    peak fell from 5.6 to 3.1 GB for 12% more update time; the small workload's time and memory
    did not change (README, Memory switches). Used by the update, the rollout's old and reference
    logprobs and evaluation, whenever the head is a plain linear layer (else the plain head).
    null: the whole ``[batch, response, vocab]`` logits at once."""
    fuse_rollout_forward: bool = True
    """When one minibatch is the whole batch, the rollout's old-policy forward runs with gradients
    and the first update reuses it (``algorithm.PPO._old_logprobs_and_values``): the same numbers
    (the weights have not moved), one policy forward fewer per iteration. False always runs a
    separate no-grad forward."""
    rollout_dump: bool = False
    """Write each iteration's episodes to ``rollouts/iter_<k>.jsonl`` in the run directory (one
    file per rank under DDP: ``iter_<k>.rank<r>.jsonl``), for debugging: per line the record's
    columns, ``prompt_ids`` and ``response_ids`` (no padding), ``loss_mask`` (one 0/1 per
    response id: 1 where the policy's own token trains), ``messages``, ``reward`` (raw),
    ``score`` (what PPO learned from) and ``turns``. Single-turn runs too (one assistant message)."""


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


@dataclass
class TrainerConfig:
    """Instantiated as ``lightning.Trainer`` (plus ``plugins=[AtomicCheckpointIO()]``); any other
    ``Trainer`` argument can be added with ``+trainer.<arg>=<value>``."""

    _target_: str = "lightning.Trainer"
    """Class instantiated."""
    accelerator: str = "auto"
    """cpu, gpu, auto, ..."""
    devices: Any = "auto"
    """Devices per node; -1 = all."""
    strategy: Any = "auto"
    """ddp (``trainer=ddp``; ``trainer=ddp_cpu``: 2 CPU processes), or FSDP2 through
    ``ppo_lightning.parallel.sharding.FSDP2Strategy`` (``trainer=fsdp``, ``fsdp_cpu``), which takes
    ``+trainer.strategy.gather_for_rollout=false`` (keep the rollout sharded: weights gathered per
    token instead of once per rollout) and ``+trainer.strategy.save_distributed_checkpoint=true``
    (per-rank shard files instead of one full-state file). Lightning's FSDP1 (``fsdp``) is refused."""
    num_nodes: int = param(1, ge=1)
    """Nodes; each runs ``trainer.devices`` processes, launched by torchrun or SLURM (README:
    Scaling up). FSDP shards over all of them."""
    """Nodes."""
    precision: Any = "32-true"
    """32-true, bf16-mixed (``trainer=gpu``) or bf16-true. The rollout runs in the same precision
    context as the update; the value head, logprobs and losses are float32 in every one. float16
    (16-mixed, 16-true) is refused: use bf16."""
    max_steps: int = param(100, ge=1, hint="the number of PPO iterations")
    """PPO: iterations (one rollout plus its updates each). Stages: optimizer steps. Also the
    horizon of the lr decay."""
    max_epochs: int = -1
    """Passes over the prompt set; -1 = until ``max_steps``."""
    log_every_n_steps: int = 1
    """Stages: how often ``train/*`` reach the loggers. PPO metrics are logged every iteration."""
    enable_progress_bar: bool = True
    """PPO shows ``objective/scores`` and ``objective/kl``."""
    enable_model_summary: bool = True
    """The parameter table at the start."""
    enable_checkpointing: bool = True
    """False also needs no ``ModelCheckpoint`` callbacks (``callbacks=none``): Lightning refuses them."""
    deterministic: Any = False
    """Lightning's ``deterministic`` switch."""
    default_root_dir: Optional[str] = "${paths.output_dir}"
    """Where Lightning puts what nothing else places (its default checkpoint with ``callbacks=none``)."""
    num_sanity_val_steps: int = 0
    """No sanity validation."""
    use_distributed_sampler: bool = False
    """Off: the PPO prompt loader and the stage loaders shard over ranks themselves, in an order a
    resumed run can replay."""
    limit_val_batches: Any = 0
    """PPO has no validation loop; ``task=sft`` / ``task=reward_model`` set 1.0."""
    val_check_interval: Any = None
    """Stages: validate every this many optimizer steps (the task files set 50)."""
    check_val_every_n_epoch: Optional[int] = 1
    """Null lets ``val_check_interval`` count steps across epochs (the task files set it)."""


@dataclass
class EnvConfig:
    """Multi-turn episodes (the ``env`` group, ``ppo_lightning/envs``): the policy writes, an
    environment answers (a tool's result, a user's or a game's reply), the policy writes again,
    and the whole conversation is scored. ``env=none`` (the default): no environment, an episode
    is one prompt and one response. ``env=tools``: tool calling (``ToolEnvironment``, keys below).
    ``env=function env._target_=my_pkg.MyEnv``: any class with ``reset(record)`` and
    ``step(messages) -> EnvStep`` (``envs/base.py``), one instance per episode. These keys are
    the episode loop's (``envs/episodes.py``); every other key of the group is an argument of
    ``env._target_``'s constructor (``+env.some_arg=3``). Only the policy's own sampled tokens
    train: the environment's are in the sequence, with no loss, KL, entropy or value target, and
    GAE steps over policy tokens only."""

    _target_: Optional[str] = None
    """The environment class (null: single-turn); must import, checked before any model loads."""
    max_turns: int = param(4, ge=1)
    """Policy turns per episode at most (each one generation call for all unfinished episodes)."""
    max_total_tokens: int = param(512, ge=1)
    """Response positions per episode at most, policy and environment tokens together; each
    policy turn is also bounded by ``sampling.max_new_tokens``. An environment answer that would
    not leave the policy a token to answer ends the episode as truncated, its tokens dropped."""
    max_observation_tokens: Optional[int] = param(256, ge=1)
    """Tokens of one environment message at most: a longer one is cut (counted,
    ``env/truncated_observations``). Null: no limit."""
    on_error: str = param("count", choices=choices.ENV_ERROR_MODES)
    """An environment whose ``step`` raises: ``count`` ends that episode with ``error_reward``
    and counts it (``env/env_errors``), so one bad episode cannot end a long run; ``raise``
    stops the run (for debugging an environment). A tool that fails is never an error of the
    environment: its message tells the policy what went wrong."""
    error_reward: float = 0.0
    """The score of an episode whose environment raised (``on_error=count``), instead of the
    reward's."""


@dataclass
class ToolsConfig:
    """``env=tools`` (``ppo_lightning.envs.ToolEnvironment``): tools the policy calls, their JSON
    schemas (from type hints and docstrings) in the prompt through the chat template's ``tools=``
    argument, calls parsed in the model family's format. A malformed call, a tool that raises
    and one that runs past ``tool_timeout_s`` are answered with an ``error: ...`` message and
    counted (``env/malformed_calls``, ``env/tool_errors``, ``env/tool_timeouts``); none stops
    the run. A turn with no tool call ends the episode."""

    tools: List[str] = field(default_factory=list)
    """Dotted paths of functions, each with type hints and a Google-style docstring
    (``ppo_lightning.envs.calculator.calculator`` is a safe arithmetic tool)."""
    environment: Optional[str] = None
    """A class written for TRL's GRPOTrainer ``environment_factory``, unchanged: one instance per
    episode, ``reset(**columns)`` returning None or text appended to the last user message, its
    public methods the tools, and an optional ``get_reward()`` scoring the finished episode as one
    more reward term named after the class."""
    parser: str = "hermes"
    """The tool-call format: ``hermes``, ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
    (Hermes, Qwen2.5, Qwen3); or the dotted path of a parser class of your own, with
    ``parse(text) -> ParsedTurn`` and ``stop_strings`` (``envs/parsers.py``)."""
    tool_timeout_s: Optional[float] = param(10.0, gt=0)
    """Seconds a tool call may run; a slower one is answered with an error (its thread finishes
    on its own). Null: no limit."""
    stop_at_tool_call: bool = True
    """End a policy turn at the end of its first tool call (the parser's stop strings, added to
    ``sampling.stop_strings``), so the policy never writes a tool's result itself; false lets it
    make several calls in one turn, ending the turn at EOS."""


@dataclass
class EvalConfig:
    """Evaluation during training, on held-out prompts (off unless ``path`` or ``split_fraction``
    gives some). At the start of iteration 0 (``before_training``) and of every
    ``every_n_iterations``-th iteration, and after the last, the policy answers each eval prompt
    ``num_samples`` times (its own seeded generator: the training trajectory is the same with eval
    on or off), sharded over ranks, scored by the run's reward; ``eval/*`` metrics are logged at
    that step (``docs/metrics.md``)."""

    path: Optional[str] = None
    """Eval prompt records, read as ``data.path`` is (same ``data.prompt_field``, template and
    system prompt)."""
    split_fraction: float = param(0.0, ge=0, lt=1)
    """With ``path`` null: hold this fraction of ``data.path``'s prompts out of training for eval
    (the same prompts for every ``seed``: the split has a seed of its own)."""
    every_n_iterations: Optional[int] = param(None, ge=1)
    """Evaluate before every n-th iteration (null: only before training and after the last)."""
    before_training: bool = True
    """Evaluate once before the first update: the "before" column of the curve."""
    num_samples: int = param(1, ge=1)
    """Responses per eval prompt: ``n`` in the ``@n`` metrics and the ``pass@k`` ones (k = 1, 2,
    4, ... up to n)."""
    temperature: float = param(0.0, ge=0)
    """0: greedy (then ``num_samples`` > 1 repeats one answer); else sampled at this temperature,
    with the run's top-k, top-p and stop sequences."""
    max_prompts: Optional[int] = param(None, ge=1)
    """Evaluate on the first this many eval prompts (null: all)."""
    pass_threshold: float = 1.0
    """A response passes when its score reaches this (``eval/pass@k``)."""
    pass_term: Optional[str] = None
    """The ``reward.terms`` term whose raw score decides a pass (null: the whole raw reward)."""
    metrics: Dict[str, str] = field(default_factory=dict)
    """Scores that are measured on the eval samples but are not the reward: name -> a function
    (``eval.metrics.sentiment=my_pkg.my_fn``, with or without ``+``), called as a reward function is (TRL's signature or
    ``(prompts, responses)``, columns by parameter name, None = does not apply) and logged as
    ``eval/metrics/<name>/mean@n``. A ground truth beside a learned reward tells a real gain from
    reward hacking (the default job's sentiment and grammar)."""


@dataclass
class PathsConfig:
    """Where a run writes and where reusable builds are cached."""

    output_dir: str = "${hydra:runtime.output_dir}"
    """The run directory (logs, checkpoints, samples, exported policy):
    ``outputs/<task_name>/<date_time>``, or ``multirun/<task_name>/<date_time>/<job>`` in a sweep."""
    cache_dir: str = "${oc.env:PPO_LIGHTNING_CACHE,${oc.env:HOME,.}/.cache/ppo_lightning}"
    """Recipe builds (``${recipe_dir:<name>}``), built tiny models and other reusable artefacts."""


@dataclass
class TrainConfig:
    """The root: one field per config group, then the run-level keys."""

    task: Any = field(default_factory=lambda: {"name": "ppo"})
    """The job: ``task.name`` = ppo | sft | reward_model | export, plus that task's own keys
    (``conf/task/*.yaml``; ``task=sft`` / ``task=reward_model`` type their keys by ``SFTTask`` /
    ``RewardModelTask`` at composition, and check their ranges before anything loads)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """The policy (``ModelConfig``)."""
    ref: RefConfig = field(default_factory=RefConfig)
    """The frozen reference (``RefConfig``)."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """The reward (``RewardConfig``)."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """The optimizer and lr schedule (``OptimizerConfig``)."""
    ppo: PPOConfig = field(default_factory=PPOConfig)
    """The algorithm (``PPOConfig``)."""
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    """How responses are sampled (``SamplingConfig``)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation during training on held-out prompts (``EvalConfig``)."""
    data: DataConfig = field(default_factory=DataConfig)
    """The prompts (``DataConfig``)."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The Lightning Trainer (``TrainerConfig``)."""
    env: Dict[str, Any] = field(default_factory=dict)  # train.yaml selects env: none
    """Multi-turn episodes: the environment class (``_target_``) and its arguments, and the
    episode loop's keys (``conf/env/*.yaml``; ``EnvConfig`` and ``ToolsConfig`` below). Empty
    (``env=none``): single-turn."""
    generation: Dict[str, Any] = field(default_factory=dict)  # train.yaml selects generation: hf
    """The generation backend every sampler goes through (``conf/generation/*.yaml``): a
    ``_target_`` class instantiated as a partial (``_partial_: true``) and called with the LM to
    sample and its tokenizer, plus any options of its own. ``hf``: the live module with a KV
    cache (``ppo_lightning/generation/hf.py``); its option ``generation.fast_decode`` (default
    true) samples an exact ``GPT2LMHeadModel``, ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
    ``GPTNeoXForCausalLM`` (whole unsharded weights; SDPA attention and fixed rotary frequencies
    for the rotary ones; ``fast_decode.py`` lists the rest) with a lean per-token step: the same
    ops on the same weights, logits bitwise equal to the model's forward, about half the
    per-token overhead; the prefill and every logprob PPO learns from still go through the
    model's forward, and other models always decode through it. ``vllm``: a colocated vLLM
    engine with its own copy of the policy's weights, synced after every iteration
    (``ppo_lightning/generation/vllm.py``; architectures vLLM implements natively; with several
    processes, an engine per rank, a sharded policy gathered for each sync).
    Its options: ``generation.dtype`` (the engine's weights; ``auto``: the policy's dtype),
    ``enforce_eager`` (true: no CUDA graphs or ``torch.compile``, a start in seconds),
    ``gpu_memory_utilization`` (the GPU share the engine may take), ``kv_cache_memory_bytes``
    (the KV cache's size instead; on CPUs null is vLLM's ``VLLM_CPU_KVCACHE_SPACE`` default),
    ``max_model_len``, ``max_num_seqs`` and ``engine_kwargs`` (any other ``vllm.LLM`` argument),
    passed to ``vllm.LLM``. How every backend samples is ``sampling.*`` (``sampling.chunk_size``
    does not apply to ``vllm``, which schedules its own batches)."""
    paths: PathsConfig = field(default_factory=PathsConfig)
    """Output and cache directories (``PathsConfig``)."""
    logger: Dict[str, Any] = field(default_factory=dict)
    """Named Lightning loggers, each a mapping with a ``_target_`` (null entries are skipped);
    each gets the resolved config through ``log_hyperparams``."""
    callbacks: Dict[str, Any] = field(default_factory=dict)
    """Named Lightning callbacks, each a mapping with a ``_target_`` (null entries are skipped)."""
    task_name: str = "${task.name}"
    """Names the run directories (``outputs/<task_name>/<date_time>``)."""
    seed: int = 42
    """``L.seed_everything(seed)``, the prompt order; rank r samples with ``seed + 1000 r``."""
    ckpt_path: Optional[str] = None
    """A Lightning checkpoint to resume from (PPO and stages) or to export (``task=export``); must
    be an existing file. Keep ``model.*``: the reference is rebuilt from ``model.name_or_path``."""
    export_dir: Optional[str] = "${paths.output_dir}/policy"
    """PPO: where rank 0 writes the trained policy as a Hugging Face directory (safetensors,
    tokenizer, generation config, plus ``value_head.safetensors``); null skips it.
    ``task=export``: the target, required."""
    recipe: Optional[str] = param(None, choices=choices.RECIPES)
    """The recipe this job runs (set by its preset, ``conf/experiment/preset``): before PPO it
    builds its models and prompts once (cached under ``${recipe_dir:<name>}``, atomically), after
    PPO rank 0 prints a before/after table of the run's first and last evaluation (``eval.*``,
    which its preset sets) and writes ``eval.json``. Null: none."""
    optimized_metric: str = "objective/scores"
    """Metric whose last logged value ``train.py`` returns to Hydra sweepers (docs/metrics.md); an
    unknown name or a non-finite value returns None."""


# ============================================================================= the stages (task=sft, task=reward_model)


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
    """The job (``jobs.py:run_task``)."""
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
    """The job (``jobs.py:run_task``)."""
    save_dir: str = "${paths.output_dir}/reward_model"
    """Output HF directory (safetensors, tokenizer), written on rank 0, for
    ``reward=model reward.name_or_path=<save_dir>``. Must be non-empty."""


# ============================================================================= registration
def register_configs() -> None:
    cs = ConfigStore.instance()
    schema = OmegaConf.structured(TrainConfig)
    # reward.terms and eval.metrics take new names without a "+": reward.terms.correct.fn=my.fn
    OmegaConf.set_struct(schema.reward.terms, False)
    OmegaConf.set_struct(schema.eval.metrics, False)
    cs.store(name="train_schema", node=schema)
    # the task=sft / task=reward_model nodes: conf/task/<name>.yaml puts them at `task`
    cs.store(group="task", name="sft_schema", node=SFTTask)
    cs.store(group="task", name="reward_model_schema", node=RewardModelTask)
    if not OmegaConf.has_resolver("ppo_asset"):
        # ${ppo_asset:toy_prompts.txt} -> a data file shipped inside the package
        OmegaConf.register_new_resolver("ppo_asset", lambda name: str(ASSETS / name))
    if not OmegaConf.has_resolver("recipe_dir"):
        # ${recipe_dir:reviews} -> where recipe=reviews builds its models and prompts
        OmegaConf.register_new_resolver("recipe_dir", _recipe_dir)


def recipe_root(cache_dir: str | Path, name: str) -> Path:
    """Where task ``name`` (``recipe=<name>``) builds its models and prompts."""
    if name not in choices.RECIPES:
        raise ConfigError(f"recipe={name!r}: choose one of {list(choices.RECIPES)} or null")
    return Path(cache_dir) / choices.RECIPES[name]


def _recipe_dir(name: str, *, _root_) -> str:
    return str(recipe_root(_root_.paths.cache_dir, name))


register_configs()


# ============================================================================= ignored-unless rules
@dataclass(frozen=True)
class IgnoredUnless:
    """Key ``key`` is read only when ``mode`` holds (``active(cfg)``); set to anything but its
    schema default in another mode, it does nothing, and ``validate`` warns."""

    key: str
    mode: str
    active: Any  # (cfg) -> bool


_PPO = lambda cfg: cfg.task.name == "ppo"  # noqa: E731
_CRITIC = lambda cfg: choices.ESTIMATORS.spec(cfg.ppo.advantage).critic  # noqa: E731
_FUNCTION = lambda cfg: cfg.reward.kind == "function" and not cfg.reward.terms  # noqa: E731
_MODEL = lambda cfg: cfg.reward.kind == "model" and not cfg.reward.terms  # noqa: E731
_STOPS = lambda cfg: cfg.sampling.stop_at_eos  # noqa: E731
IGNORED_UNLESS = (
    IgnoredUnless("ppo.vf_coef", "ppo.advantage=gae (the only estimator with a critic)", _CRITIC),
    IgnoredUnless("ppo.vf_clip", "ppo.advantage=gae (the only estimator with a critic)", _CRITIC),
    IgnoredUnless("ppo.lam", "ppo.advantage=gae (GAE's lambda)", _CRITIC),
    IgnoredUnless(
        "ppo.clip",
        "ppo.clip_low or ppo.clip_high is null (each side defaults to ppo.clip)",
        lambda cfg: cfg.ppo.clip_low is None or cfg.ppo.clip_high is None,
    ),
    IgnoredUnless("ppo.kl_target", "ppo.adaptive_kl=true", lambda cfg: cfg.ppo.adaptive_kl),
    IgnoredUnless("ppo.kl_horizon", "ppo.adaptive_kl=true", lambda cfg: cfg.ppo.adaptive_kl),
    IgnoredUnless("ppo.missing_eos_penalty", "sampling.stop_at_eos=true", _STOPS),
    IgnoredUnless("ppo.mask_truncated_completions", "sampling.stop_at_eos=true", _STOPS),
    IgnoredUnless("sampling.stop_token_ids", "sampling.stop_at_eos=true", _STOPS),
    IgnoredUnless("sampling.stop_strings", "sampling.stop_at_eos=true", _STOPS),
    IgnoredUnless(
        "reward.gain", "reward.normalize=false (normalisation fits gain and bias)", lambda cfg: not cfg.reward.normalize
    ),
    IgnoredUnless(
        "reward.bias", "reward.normalize=false (normalisation fits gain and bias)", lambda cfg: not cfg.reward.normalize
    ),
    IgnoredUnless("reward.normalize_samples", "reward.normalize=true", lambda cfg: cfg.reward.normalize),
    IgnoredUnless("reward.fn", "reward.kind=function and no reward.terms", _FUNCTION),
    IgnoredUnless("reward.kwargs", "reward.kind=function and no reward.terms", _FUNCTION),
    *(
        IgnoredUnless(f"reward.{k}", "reward.kind=model and no reward.terms", _MODEL)
        for k in ("name_or_path", "batch_size", "max_length", "dtype", "input", "label_index", "trust_remote_code")
    ),
    IgnoredUnless("data.hf_split", "data.hf_dataset is read (data.path is null)", lambda cfg: cfg.data.path is None),
    *(
        IgnoredUnless(
            f"trainer.{k}",
            "task=sft or task=reward_model (a PPO run has no validation loop)",
            lambda cfg: not _PPO(cfg),
        )
        for k in ("limit_val_batches", "val_check_interval", "check_val_every_n_epoch", "num_sanity_val_steps")
    ),
)
"""Keys that do nothing in some modes; ``validate`` warns when one is set there, and
``docs/config.md`` renders this table. (Combinations that would do something other than their docs
say are refused instead: ``_check_estimator_options``.)"""


def ignored_keys(cfg) -> list[str]:
    """``"<key>=<value> is ignored unless <mode>"`` for each key set away from its schema default
    in a mode that does not read it (the PPO job's keys; the stages read their own)."""
    out = []
    for rule in IGNORED_UNLESS if cfg.task.name == "ppo" else ():
        if rule.active(cfg):
            continue
        section, name = rule.key.rsplit(".", 1)
        schema = next(f for f in dataclasses.fields(SECTIONS[section]) if f.name == name)
        value = OmegaConf.select(cfg, rule.key)
        value = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
        if value != _schema_default(schema):
            out.append(f"{rule.key}={value!r} is ignored unless {rule.mode}")
    return out


def _schema_default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


# ============================================================================= validation
FP16_PRECISIONS = ("16-mixed", "16", "16-true", "transformer-engine-float16")  # refused by validate
SECTIONS = {
    "model": ModelConfig,
    "model.lora": LoRAConfig,
    "model.build_tiny": TinyModelConfig,
    "ref": RefConfig,
    "reward": RewardConfig,
    "optimizer": OptimizerConfig,
    "ppo": PPOConfig,
    "sampling": SamplingConfig,
    "eval": EvalConfig,
    "data": DataConfig,
    "trainer": TrainerConfig,
}


def validate(cfg) -> None:
    """Every field's own check (``param``), then the constraints across fields that no single
    field can express; raises ``ConfigError`` naming the key. Files and imports are checked by
    ``factory.check_inputs``, which calls this first."""
    check_moved_keys(cfg)
    for prefix, cls in SECTIONS.items():
        node = OmegaConf.select(cfg, prefix)
        if node is not None:
            check_fields(node, cls, prefix)
    check_fields(cfg, TrainConfig)  # the run-level keys
    check_reward_terms(cfg.reward)
    pass_term = cfg.eval.pass_term
    if pass_term is not None and pass_term not in (cfg.reward.terms or {}):
        raise ConfigError(
            f"eval.pass_term={pass_term!r}: not a reward.terms name; choose one of "
            f"{sorted(cfg.reward.terms or {})} or null (the whole reward)"
        )
    for line in ignored_keys(cfg):
        log.warning(line)
    p, d = cfg.ppo, cfg.data
    rows = d.batch_size * p.num_generations
    if rows % p.minibatch_size:
        what = (
            f"data.batch_size={d.batch_size} (the rollout batch)"
            if p.num_generations == 1
            else f"the rollout's {rows} rows (data.batch_size={d.batch_size} x ppo.num_generations={p.num_generations})"
        )
        raise ConfigError(
            f"ppo.minibatch_size={p.minibatch_size!r}: must divide {what}; choose a divisor, e.g. "
            f"ppo.minibatch_size={_largest_divisor(rows, p.minibatch_size)}"
        )
    spec = choices.ESTIMATORS.spec(p.advantage)
    if spec.groups and p.num_generations < 2:
        raise ConfigError(
            f"ppo.advantage={p.advantage}: compares the responses to one prompt; set ppo.num_generations >= 2 (e.g. 4)"
        )
    if not spec.critic:
        for key in ("model.value_head_path", "model.value_head_init"):
            value = OmegaConf.select(cfg, key)
            if value not in (None, "zeros"):
                raise ConfigError(
                    f"{key}={value!r} with ppo.advantage={p.advantage}: the critic-free "
                    "estimators run no value head; unset it, or use ppo.advantage=gae"
                )
    _check_estimator_options(p)
    _check_env(cfg)
    world = processes_per_job(cfg.trainer)
    r = cfg.reward
    if r.normalize and world and r.normalize_samples < world:
        raise ConfigError(
            f"reward.normalize_samples={r.normalize_samples} with {world} processes (trainer.devices x "
            f"trainer.num_nodes): each rank scores normalize_samples // {world} = 0 samples; set "
            f"reward.normalize_samples >= {max(2, world)}"
        )
    if str(cfg.trainer.precision) in FP16_PRECISIONS:
        raise ConfigError(
            f"trainer.precision={cfg.trainer.precision}: float16 is not supported (it needs loss "
            "scaling, which PPO's skip-on-overflow would have to share); use bf16-mixed (GPUs "
            "since Ampere, and CPUs) or 32-true"
        )
    if p.micro_batch_size is not None and p.minibatch_size % p.micro_batch_size:
        raise ConfigError(
            f"ppo.micro_batch_size={p.micro_batch_size!r}: must divide ppo.minibatch_size="
            f"{p.minibatch_size}; choose a divisor, e.g. ppo.micro_batch_size="
            f"{_largest_divisor(p.minibatch_size, p.micro_batch_size)}"
        )
    lora = cfg.model.lora
    if lora.r > 0 and (cfg.ref.name_or_path is not None or cfg.ref.dtype is not None):
        key = "ref.name_or_path" if cfg.ref.name_or_path is not None else "ref.dtype"
        raise ConfigError(
            f"{key}={OmegaConf.select(cfg, key)!r} with model.lora.r={lora.r}: with LoRA the "
            "reference is the policy with its adapters off (no second copy of the weights); unset "
            f"{key}, or set model.lora.r=0 to keep a separate reference"
        )
    target = strategy_name(cfg.trainer)
    if target.lower() in ("fsdp", "fsdpstrategy") or target.endswith(".FSDPStrategy"):
        raise ConfigError(
            f"trainer.strategy={target}: Lightning's FSDP1 flattens the weights the sampler reads; "
            "use trainer=fsdp (FSDP2, ppo_lightning.parallel.sharding.FSDP2Strategy) or trainer=fsdp_cpu"
        )
    if cfg.model.value_head_init == "reward_model" and (cfg.reward.kind != "model" or cfg.reward.terms):
        raise ConfigError(f"model.value_head_init={cfg.model.value_head_init!r}: needs reward=model")


def check_reward_terms(reward) -> None:
    """Each ``reward.terms`` entry: a mapping with a name fit for a metric key and only the keys
    of ``RewardTermConfig``, each within its check."""
    known = [f.name for f in dataclasses.fields(RewardTermConfig)]
    for name, term in (reward.get("terms") or {}).items():
        key = f"reward.terms.{name}"
        if not TERM_NAME.match(str(name)):
            raise ConfigError(f"{key}: a term's name may hold letters, digits, _ and - only (it names its metrics)")
        if not OmegaConf.is_dict(term) and not isinstance(term, dict):
            raise ConfigError(f"{key}={term!r}: expected a mapping such as {{fn: my_pkg.my_fn, weight: 0.5}}")
        unknown = [k for k in term if k not in known]
        if unknown:
            raise ConfigError(f"{key}.{unknown[0]}: not a reward term key; choose from {', '.join(known)}")
        check_fields(term, RewardTermConfig, key)
        if term.get("kind", "function") == "function" and not term.get("fn"):
            raise ConfigError(f"{key}.fn is empty: set {key}.fn=my_pkg.my_module.my_fn")


def check_moved_keys(cfg) -> None:
    """A moved key that is set fails with one line: its new home, with the value to write there;
    a removed one says why it went."""
    for old, why in REMOVED_KEYS.items():
        if OmegaConf.select(cfg, old) is not None:
            raise ConfigError(f"{old} was removed: {why}; unset it")
    for old, new in MOVED_KEYS.items():
        value = OmegaConf.select(cfg, old)
        if value is not None:
            shown = OmegaConf.to_container(value) if OmegaConf.is_config(value) else value
            raise ConfigError(f"{old} moved to {new}: write {new}={shown!r} instead")


def _check_estimator_options(p) -> None:
    """Keys that would do nothing, or something other than their docs say, with the chosen
    estimator or KL placement: refused, naming both keys."""
    spec = choices.ESTIMATORS.spec(p.advantage)
    if p.whiten_rewards and not spec.critic:
        raise ConfigError(
            f"ppo.whiten_rewards=true with ppo.advantage={p.advantage}: reward whitening is GAE's; "
            f"{p.advantage} normalises the scores itself, and whitening per-token rewards would add "
            "a term proportional to each response's length; unset ppo.whiten_rewards"
        )
    if p.gamma < 1 and spec.groups:
        raise ConfigError(
            f"ppo.gamma={p.gamma} with ppo.advantage={p.advantage}: {p.advantage} judges each "
            "response by its score as a whole, with no per-token discount; unset ppo.gamma (it "
            "discounts GAE and REINFORCE++)"
        )
    if not p.scale_by_group_std and not spec.group_std:
        dividers = choices.ESTIMATORS.names(group_std=True)
        raise ConfigError(
            f"ppo.scale_by_group_std=false with ppo.advantage={p.advantage}: only {' | '.join(dividers)} "
            f"{'divides' if len(dividers) == 1 else 'divide'} by the group's std; unset it, or use "
            f"ppo.advantage={dividers[0]} (Dr. GRPO)"
        )
    if p.kl_in == "loss" and p.kl_estimator is not None and p.kl_estimator not in choices.LOSS_KL_ESTIMATORS:
        raise ConfigError(
            f"ppo.kl_estimator={p.kl_estimator} with ppo.kl_in=loss: as a loss term k1's gradient "
            "has expectation 0 under the policy's own samples, so it pulls nothing toward the "
            f"reference; choose one of {' | '.join(choices.LOSS_KL_ESTIMATORS)} (null: k3)"
        )


TOOL_ENVIRONMENT = "ppo_lightning.envs.ToolEnvironment"  # env=tools' class (conf/env/tools.yaml)


def _check_env(cfg) -> None:
    """The ``env`` group's keys: a class chosen, the loop's keys (and a tool environment's) in
    range, and turns that can end (stop at EOS)."""
    env = cfg.get("env")
    if not env:
        return
    if not env.get("_target_"):
        raise ConfigError("env._target_ is null: name the environment class, env=function env._target_=my_pkg.MyEnv")
    check_fields(env, EnvConfig, "env")
    if env.get("_target_") in (TOOL_ENVIRONMENT, "ppo_lightning.envs.tools.ToolEnvironment"):
        check_fields(env, ToolsConfig, "env")
    if not cfg.sampling.stop_at_eos:
        raise ConfigError(
            "sampling.stop_at_eos=false with env: a policy turn must end (at EOS or a stop string) for the "
            "environment to answer; unset sampling.stop_at_eos"
        )


def strategy_name(trainer) -> str:
    """``trainer.strategy`` as a name: a string as given (``ddp``), a class by its ``_target_``."""
    strategy = trainer.get("strategy", "auto")
    return str(strategy.get("_target_", "")) if OmegaConf.is_dict(strategy) else str(strategy)


def processes_per_job(trainer) -> int | None:
    """How many processes the ``trainer`` group starts: devices per node times nodes (None for
    ``devices: -1`` / ``auto`` with a multi-process strategy: every visible device, unknown
    until the accelerator is queried)."""
    devices, nodes = trainer.get("devices", 1), int(trainer.get("num_nodes", 1) or 1)
    if isinstance(devices, (list, tuple)) or OmegaConf.is_list(devices):
        return len(devices) * nodes
    if str(devices) in ("-1", "auto"):
        return None if strategy_name(trainer) not in ("auto", "single_device") else nodes
    return int(devices) * nodes


def check_sweep_launch(cfg) -> None:
    """A Hydra multirun (``-m``) runs its jobs one after another in one process. With a trainer
    of several processes, Lightning's launcher starts the others by re-running the command line,
    so each of them runs the whole sweep on its own, in step with rank 0 only by luck (a sweep
    directory named by the clock, a sampler's draws), and under torchrun every process does.
    Refused, with what to do instead."""
    n = processes_per_job(cfg.trainer)
    if n == 1:
        return
    raise ConfigError(
        f"hydra multirun (-m) with a trainer of {n or 'several'} processes (trainer.devices="
        f"{cfg.trainer.get('devices')}, trainer.num_nodes={cfg.trainer.get('num_nodes', 1)}): each "
        "process would run the whole sweep; sweep on one device per job (trainer=cpu or trainer=gpu), "
        "or launch each multi-process job on its own (a shell loop over the values)"
    )


def _largest_divisor(n: int, at_most: int) -> int:
    return max(k for k in range(1, max(1, min(n, at_most)) + 1) if n % k == 0)
