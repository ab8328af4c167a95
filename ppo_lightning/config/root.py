"""The root config (``conf/train.yaml``): run-level keys and one node per group; ``SECTIONS``, the
schema class of each section."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

from ppo_lightning.config.data import DataConfig
from ppo_lightning.config.eval import EvalConfig
from ppo_lightning.config.model import LoRAConfig, ModelConfig, RefConfig, TinyModelConfig
from ppo_lightning.config.optimizer import OptimizerConfig
from ppo_lightning.config.ppo import PPOConfig
from ppo_lightning.config.reward import RewardConfig
from ppo_lightning.config.rollout import RolloutConfig
from ppo_lightning.config.sampling import SamplingConfig
from ppo_lightning.config.trainer import TrainerConfig


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
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Which policy samples each rollout: ``rollout.staleness`` (``RolloutConfig``)."""
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
    for the rotary ones; no hub kernel in place; ``generation/fast_decode.py`` lists the rest) with a lean
    per-token step: the same ops on the same weights, the hidden state bitwise equal to the
    model's forward (the LM head, on a CPU, in another summation order: the logits to float32
    rounding, the head 3-4x faster on few rows), about half the per-token overhead; the prefill
    and every logprob PPO learns from still go through the model's forward, and other models
    always decode through it; ``generation.logprobs`` (default false) has it return its own
    logprobs of the tokens it draws, which ``rollout/engine_*`` compare with the training
    forward's (a check of the sampler's numerics; ~1e-7 in float32). ``vllm``: a colocated vLLM engine with its own copy of the
    policy's weights, synced after every iteration
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
    recipe: Optional[str] = None
    """The recipe this job runs: a folder of ``ppo_lightning/recipes`` (one of
    ``choices.RECIPES``) or a package of your own holding a ``recipe.py`` (``my_pkg.my_recipe``, a
    copy of ``recipes/arithmetic``). Set by its experiment (``conf/experiment/<name>.yaml``). Before
    PPO it builds its models and prompts once (cached under ``${recipe_dir:<name>}``, keyed by the
    recipe's code and the seed, atomically); after PPO rank 0 prints a before/after table of the
    run's first and last evaluation (``eval.*``, which its experiment sets) and writes
    ``eval.json``. Null: none."""
    optimized_metric: str = "objective/scores"
    """Metric whose last logged value ``train.py`` returns to Hydra sweepers (docs/metrics.md); an
    unknown name or a non-finite value returns None."""


SECTIONS = {
    "model": ModelConfig,
    "model.lora": LoRAConfig,
    "model.build_tiny": TinyModelConfig,
    "ref": RefConfig,
    "reward": RewardConfig,
    "optimizer": OptimizerConfig,
    "ppo": PPOConfig,
    "sampling": SamplingConfig,
    "rollout": RolloutConfig,
    "eval": EvalConfig,
    "data": DataConfig,
    "trainer": TrainerConfig,
}
"""The root's sections that have a schema class, by their dotted key (nested ones included):
what ``validate`` checks field by field, and where ``ignored_keys`` finds a key's default."""
