"""Typed schemas for every config group, and the checks that need more than a type.

``conf/train.yaml`` starts its defaults list with ``train_schema`` (registered below), so Hydra
merges every YAML and command-line override into these dataclasses while composing: an unknown key
(``ppo.clpi=0.1``) or a wrong type (``ppo.clip=abc``) fails at composition, naming the key, before
anything is loaded. ``validate(cfg)`` then checks ranges and cross-group constraints.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, OmegaConf

from ppo_lightning.errors import ConfigError

ASSETS = Path(__file__).parent / "assets"


@dataclass
class TinyModelConfig:
    """A random GPT-2 over a byte vocabulary, built offline (tests, demos, benchmarks)."""

    n_layer: int = 2
    n_head: int = 2
    n_embd: int = 64
    n_positions: int = 256
    seed: int = 0  # init seed of the random weights


@dataclass
class ModelConfig:
    name_or_path: str = MISSING
    """Hub id (``gpt2``) or a local directory written by ``save_pretrained``."""
    tokenizer_name_or_path: Optional[str] = None
    """Tokenizer source when it differs from ``name_or_path``."""
    dtype: str = "float32"
    """Weights dtype: float32 | bfloat16 | float16 (mixed precision is ``trainer.precision``)."""
    trust_remote_code: bool = False
    """Run model code shipped with the checkpoint. Off unless you trust its source."""
    gradient_checkpointing: bool = False
    """Recompute activations in the backward pass: less memory, ~30% slower updates."""
    value_head_path: Optional[str] = None
    """Directory holding ``value_head.safetensors`` to start the value head from (else zeros)."""
    value_head_init: str = "zeros"
    """zeros: V = 0 at the start; reward_model: copy the reward model's score head (needs the
    same hidden size; meaningful when policy and reward model share a pretrained backbone)."""
    build_tiny: Optional[TinyModelConfig] = None
    """If set and ``name_or_path`` does not exist yet, build a tiny random GPT-2 there first."""


@dataclass
class RewardConfig:
    kind: str = "function"
    """function: a Python callable; model: an AutoModelForSequenceClassification."""
    fn: Optional[str] = None
    """(function) dotted path of ``fn(prompts, responses) -> list[float]``."""
    kwargs: Dict[str, Any] = field(default_factory=dict)
    """(function) extra keyword arguments passed to ``fn``."""
    name_or_path: Optional[str] = None
    """(model) hub id or local directory of the reward model."""
    batch_size: int = 32
    """(model) texts scored per forward."""
    max_length: int = 512
    """(model) tokens kept per text, truncated from the left (the response end is kept)."""
    dtype: str = "float32"
    input: str = "auto"
    """(model) auto | tokens | text. tokens: score the policy's token ids directly (no decode
    and re-encode); needs the policy's vocabulary and a tokenizer that adds no special tokens.
    text: always score the decoded text. auto: tokens when possible."""
    label_index: int = 0
    """(model) which logit is the score."""
    gain: float = 1.0
    """score = gain * raw + bias, for every reward kind; replaced by the fit when ``normalize``."""
    bias: float = 0.0
    normalize: bool = True
    """Before training, set gain/bias so the scores of responses sampled from the reference policy
    have mean 0 and std 1 ([N+] reward normalisation): the KL coefficient then means the same
    thing whatever the reward's scale. Without variance the scores are only centred (a warning)."""
    normalize_samples: int = 256
    """Reference-policy responses scored to fit the normalisation (per run, split over ranks)."""
    trust_remote_code: bool = False


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    """adamw | adam | sgd (torch.optim)."""
    lr: float = 1.0e-5
    betas: List[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1.0e-5
    """1e-5 rather than torch's 1e-8, as OpenAI's RLHF code ([N+] detail)."""
    weight_decay: float = 0.0
    scheduler: str = "constant"
    """constant | linear | cosine, applied per PPO iteration after ``warmup_steps``."""
    warmup_steps: int = 0
    """PPO iterations of linear warmup: iteration i < w uses lr (i + 1) / (w + 1)."""
    min_lr_ratio: float = 0.0
    """Final lr / lr for linear and cosine decay."""
    fused: bool = True
    """torch's fused kernel (one per parameter); false: ``foreach`` (one per op over all tensors)."""


@dataclass
class PPOConfig:
    clip: float = 0.2
    """Policy ratio clip epsilon."""
    vf_clip: float = 0.2
    """Value clip range around the rollout's values."""
    gamma: float = 1.0
    """Discount per token."""
    lam: float = 0.95
    """GAE lambda."""
    kl_coef: float = 0.05
    """beta: per-token KL penalty weight in the reward (initial value when adaptive)."""
    kl_estimator: str = "k1"
    """Estimator in the per-token penalty: k1 | k2 | k3."""
    adaptive_kl: bool = False
    """Ziegler et al. adaptive controller: move beta so the KL tracks ``kl_target``."""
    kl_target: float = 6.0
    """Target per-sequence KL (nats) of the adaptive controller."""
    kl_horizon: int = 10000
    """Horizon (episodes) of the adaptive controller."""
    vf_coef: float = 0.1
    """Weight of the value loss in the total loss."""
    ent_coef: float = 0.0
    """Weight of the entropy bonus (subtracted from the loss)."""
    ppo_epochs: int = 4
    """Passes over each rollout."""
    minibatch_size: int = 8
    """Episodes per gradient step; must divide ``data.batch_size``."""
    max_grad_norm: float = 1.0
    """Gradient norm clip (``self.clip_gradients``); <= 0 disables."""
    whiten_rewards: bool = False
    """Whiten per-token rewards (keeping the mean) before GAE."""
    missing_eos_penalty: Optional[float] = None
    """Subtracted from the score of responses that never emit EOS (only with stop_at_eos)."""
    max_new_tokens: int = 32
    """Response length limit."""
    temperature: float = 1.0
    """Sampling temperature; logprobs use logits / temperature too (top-k/top-p truncation is
    not applied to logprobs, as in TRL and OpenAI's RLHF code)."""
    top_k: int = 0
    """Sample from the k most likely tokens (0 = off)."""
    top_p: float = 1.0
    """Nucleus sampling mass (1.0 = off)."""
    stop_at_eos: bool = True
    """Stop a response at EOS. False runs every response to max_new_tokens (benchmarks)."""
    fast_decode: bool = True
    """Sample GPT-2-architecture models with a lean per-token step (same logits, about half the
    per-token overhead; ``fast_decode.py``). Other models always decode through their forward."""
    max_nonfinite_iterations: int = 3
    """Stop the run after this many PPO iterations in a row with a non-finite reward, loss or
    gradient (each such update is skipped, weights untouched, and counted)."""
    rollout_forward_batch_size: Optional[int] = None
    """Rows per scoring forward during the rollout (bounds memory; null = whole batch)."""
    fuse_rollout_forward: bool = True
    """When one minibatch is the whole batch, take the old logprobs and values from the first
    update's forward (detached) instead of a separate no-grad forward: the same numbers, one
    policy forward fewer per iteration. False always runs the separate forward."""


@dataclass
class DataConfig:
    path: Optional[str] = None
    """Local prompt file: ``.txt`` (one prompt a line) or ``.jsonl`` (a ``prompt_field`` per line)."""
    hf_dataset: Optional[str] = None
    """Hugging Face dataset name (used when ``path`` is null)."""
    hf_split: str = "train"
    prompt_field: str = "prompt"
    batch_size: int = 16
    """Prompts per PPO iteration per device (the rollout batch)."""
    max_prompt_length: int = 128
    """Prompt tokens kept; longer prompts follow ``truncation``."""
    truncation: str = "left"
    """left: keep the last max_prompt_length tokens (one warning); error: refuse long prompts."""
    shuffle: bool = True
    num_workers: int = 0


@dataclass
class TrainerConfig:
    _target_: str = "lightning.Trainer"
    accelerator: str = "auto"
    devices: Any = "auto"
    strategy: Any = "auto"
    num_nodes: int = 1
    precision: Any = "32-true"
    max_steps: int = 100
    """PPO iterations (one rollout + its updates each)."""
    max_epochs: int = -1
    """Passes over the prompt set; -1 = until max_steps."""
    log_every_n_steps: int = 1
    enable_progress_bar: bool = True
    enable_model_summary: bool = True
    enable_checkpointing: bool = True
    deterministic: Any = False
    default_root_dir: Optional[str] = "${paths.output_dir}"
    num_sanity_val_steps: int = 0
    use_distributed_sampler: bool = False
    """Off: the prompt loader shards over ranks itself, in an order a resumed run can replay."""
    limit_val_batches: Any = 0
    """PPO has no validation loop; the sft / reward_model tasks set 1.0."""
    val_check_interval: Any = None
    check_val_every_n_epoch: Optional[int] = 1


@dataclass
class PathsConfig:
    output_dir: str = "${hydra:runtime.output_dir}"
    """The run directory (logs, checkpoints, exported policy)."""
    cache_dir: str = "${oc.env:PPO_LIGHTNING_CACHE,${oc.env:HOME,.}/.cache/ppo_lightning}"
    """Built tiny models and other reusable artefacts."""


@dataclass
class TrainConfig:
    task: Any = field(default_factory=lambda: {"name": "ppo"})
    """The job: ``task.name`` = ppo | sft | reward_model | export, plus that task's own keys
    (conf/task/*.yaml; the stage keys are typed by ``SFTConfig`` / ``RewardModelConfig`` in
    ``ppo_lightning/stages`` and checked, naming ``task.<key>``, before anything loads)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    data: DataConfig = field(default_factory=DataConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    logger: Dict[str, Any] = field(default_factory=dict)
    """Named Lightning loggers, each with a ``_target_``."""
    callbacks: Dict[str, Any] = field(default_factory=dict)
    """Named Lightning callbacks, each with a ``_target_``."""
    task_name: str = "${task.name}"
    """Names the output directory (outputs/<task_name>/<date>)."""
    seed: int = 42
    """Global seed: data order, weight init of new heads; rank r samples with seed + 1000 r."""
    ckpt_path: Optional[str] = None
    """Resume from this Lightning checkpoint."""
    export_dir: Optional[str] = "${paths.output_dir}/policy"
    """Where the trained policy is written as an HF directory at the end (null: skip)."""
    recipe: Optional[str] = None
    """reviews | arithmetic | null: build the recipe's models and prompts offline before PPO
    (cached) and print a before/after table after it (ppo_lightning/recipes)."""
    optimized_metric: str = "objective/scores"
    """Metric returned to Hydra sweepers (its last logged value)."""


def register_configs() -> None:
    ConfigStore.instance().store(name="train_schema", node=TrainConfig)
    if not OmegaConf.has_resolver("ppo_asset"):
        # ${ppo_asset:toy_prompts.txt} -> a data file shipped inside the package
        OmegaConf.register_new_resolver("ppo_asset", lambda name: str(ASSETS / name))
    if not OmegaConf.has_resolver("recipe_dir"):
        # ${recipe_dir:reviews} -> where recipe=reviews builds its models and prompts
        OmegaConf.register_new_resolver("recipe_dir", _recipe_dir)


def _recipe_dir(name: str, *, _root_) -> str:
    from ppo_lightning.recipes import recipe_root

    return str(recipe_root(_root_.paths.cache_dir, name))


register_configs()


def _check(ok: bool, key: str, value: Any, what: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: {what}")


def validate(cfg) -> None:
    """Range and cross-group checks that types alone cannot express; raises ``ConfigError``.
    Files and imports are checked by ``factory.check_inputs``, which calls this first."""
    p, d, o = cfg.ppo, cfg.data, cfg.optimizer
    _check(p.clip > 0, "ppo.clip", p.clip, "must be > 0 (0.2 is the usual value)")
    _check(p.vf_clip > 0, "ppo.vf_clip", p.vf_clip, "must be > 0 (0.2 is the usual value)")
    _check(0 <= p.gamma <= 1, "ppo.gamma", p.gamma, "must be in [0, 1]")
    _check(0 <= p.lam <= 1, "ppo.lam", p.lam, "must be in [0, 1]")
    _check(p.kl_coef >= 0, "ppo.kl_coef", p.kl_coef, "must be >= 0")
    _check(p.kl_estimator in ("k1", "k2", "k3"), "ppo.kl_estimator", p.kl_estimator, "choose k1, k2 or k3")
    _check(p.kl_target > 0, "ppo.kl_target", p.kl_target, "must be > 0")
    _check(p.kl_horizon > 0, "ppo.kl_horizon", p.kl_horizon, "must be > 0")
    _check(p.max_nonfinite_iterations >= 1, "ppo.max_nonfinite_iterations", p.max_nonfinite_iterations, "must be >= 1")
    _check(p.ppo_epochs >= 1, "ppo.ppo_epochs", p.ppo_epochs, "must be >= 1")
    _check(p.minibatch_size >= 1, "ppo.minibatch_size", p.minibatch_size, "must be >= 1")
    _check(d.batch_size >= 1, "data.batch_size", d.batch_size, "must be >= 1")
    _check(d.batch_size % p.minibatch_size == 0, "ppo.minibatch_size", p.minibatch_size,
           f"must divide data.batch_size={d.batch_size} (the rollout batch); choose a divisor, "
           f"e.g. ppo.minibatch_size={_largest_divisor(d.batch_size, p.minibatch_size)}")
    _check(p.max_new_tokens >= 1, "ppo.max_new_tokens", p.max_new_tokens, "must be >= 1")
    _check(p.temperature > 0, "ppo.temperature", p.temperature, "must be > 0 (logprobs divide by it)")
    _check(0 < p.top_p <= 1, "ppo.top_p", p.top_p, "must be in (0, 1]")
    _check(p.top_k >= 0, "ppo.top_k", p.top_k, "must be >= 0 (0 turns it off)")
    _check(o.name in ("adamw", "adam", "sgd"), "optimizer.name", o.name, "choose adamw, adam or sgd")
    _check(o.lr > 0, "optimizer.lr", o.lr, "must be > 0")
    _check(o.scheduler in ("constant", "linear", "cosine"), "optimizer.scheduler", o.scheduler,
           "choose constant, linear or cosine")
    _check(o.warmup_steps >= 0, "optimizer.warmup_steps", o.warmup_steps, "must be >= 0")
    _check(d.truncation in ("left", "error"), "data.truncation", d.truncation, "choose left or error")
    _check(d.max_prompt_length >= 1, "data.max_prompt_length", d.max_prompt_length, "must be >= 1")
    _check(cfg.model.dtype in ("float32", "bfloat16", "float16"), "model.dtype", cfg.model.dtype,
           "choose float32, bfloat16 or float16")
    _check(cfg.reward.kind in ("function", "model"), "reward.kind", cfg.reward.kind,
           "choose function or model")
    _check(cfg.model.value_head_init in ("zeros", "reward_model"), "model.value_head_init",
           cfg.model.value_head_init, "choose zeros or reward_model")
    _check(cfg.model.value_head_init != "reward_model" or cfg.reward.kind == "model",
           "model.value_head_init", cfg.model.value_head_init, "needs reward=model")
    _check(cfg.reward.normalize_samples >= 2, "reward.normalize_samples", cfg.reward.normalize_samples, "must be >= 2")
    _check(cfg.reward.input in ("auto", "tokens", "text"), "reward.input", cfg.reward.input,
           "choose auto, tokens or text")
    _check(cfg.reward.dtype in ("float32", "bfloat16", "float16"), "reward.dtype", cfg.reward.dtype,
           "choose float32, bfloat16 or float16")
    _check(cfg.trainer.max_steps >= 1, "trainer.max_steps", cfg.trainer.max_steps,
           "must be >= 1 (the number of PPO iterations)")


def _largest_divisor(n: int, at_most: int) -> int:
    return max(k for k in range(1, max(1, min(n, at_most)) + 1) if n % k == 0)
