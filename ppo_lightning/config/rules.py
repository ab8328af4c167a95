"""The checks across keys: ``validate`` (every field's own check, then the constraints no single
field can express, in ``RULES``) and ``validate_stage`` (a stage's keys), each raising one
``ConfigError`` that names the key and what to do. The keys a mode ignores, which ``validate``
warns of, are ``ignored.py``'s."""

from __future__ import annotations

import dataclasses
import logging

from omegaconf import OmegaConf

from ppo_lightning.config import choices
from ppo_lightning.config.compat import check_moved_keys, check_moved_modules
from ppo_lightning.config.env import EnvConfig, ToolsConfig
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.config.ignored import ignored_keys, user_set_keys
from ppo_lightning.config.optimizer import OptimizerConfig
from ppo_lightning.config.ppo import largest_divisor, minibatch_size_for
from ppo_lightning.config.recipes import recipe_folder
from ppo_lightning.config.reward import RewardTermConfig, TERM_NAME
from ppo_lightning.config.root import SECTIONS, TrainConfig
from ppo_lightning.config.task import DEFAULT_MAX_LENGTH, SFTConfig
from ppo_lightning.config.schema import check_fields, check_types

log = logging.getLogger(__name__)

FP16_PRECISIONS = ("16-mixed", "16", "16-true", "transformer-engine-float16")  # refused by validate


def validate(cfg) -> None:
    """Every field's own check (``param``), then the constraints across fields that no single
    field can express (``RULES``, in order); raises ``ConfigError`` naming the key. Files and
    imports are checked by ``factory.check_inputs``, which calls this first."""
    for rule in RULES:
        rule(cfg)


def _check_fields(cfg) -> None:
    check_moved_keys(cfg)
    check_moved_modules(cfg)
    for prefix, cls in SECTIONS.items():
        node = OmegaConf.select(cfg, prefix)
        if node is not None:
            check_fields(node, cls, prefix)
    check_fields(cfg, TrainConfig)  # the run-level keys
    check_reward_terms(cfg.reward)


def _check_pass_term(cfg) -> None:
    pass_term = cfg.eval.pass_term
    if pass_term is not None and pass_term not in (cfg.reward.terms or {}):
        raise ConfigError(
            f"eval.pass_term={pass_term!r}: not a reward.terms name; choose one of "
            f"{sorted(cfg.reward.terms or {})} or null (the whole reward)"
        )


def _warn_ignored(cfg) -> None:
    """One warning per ignored key the user set; a job validates its config once."""
    for line in ignored_keys(cfg, user_set_keys()):
        log.warning(line)


def _check_minibatch(cfg) -> None:
    """An explicit ``ppo.minibatch_size`` that does not divide the rollout's rows, and a
    ``micro_batch_size`` that does not divide the minibatch (as resolved: null fits any rollout)."""
    p, d = cfg.ppo, cfg.data
    rows = d.batch_size * p.num_generations
    minibatch = minibatch_size_for(p, rows)
    if rows % minibatch:
        what = (
            f"data.batch_size={d.batch_size} (the rollout batch)"
            if p.num_generations == 1
            else f"the rollout's {rows} rows (data.batch_size={d.batch_size} x ppo.num_generations={p.num_generations})"
        )
        raise ConfigError(
            f"ppo.minibatch_size={minibatch!r}: must divide {what}; choose a divisor, e.g. "
            f"ppo.minibatch_size={largest_divisor(rows, minibatch)}, or null (the largest that fits, up to 8)"
        )
    if p.micro_batch_size is not None and minibatch % p.micro_batch_size:
        auto = " (null: the largest divisor of the rollout's rows up to 8)" if p.minibatch_size is None else ""
        raise ConfigError(
            f"ppo.micro_batch_size={p.micro_batch_size!r}: must divide ppo.minibatch_size="
            f"{minibatch}{auto}; choose a divisor, e.g. ppo.micro_batch_size="
            f"{largest_divisor(minibatch, p.micro_batch_size)}"
        )
    if p.micro_batch_size is not None and p.micro_batch_tokens is not None:
        raise ConfigError(
            f"ppo.micro_batch_size={p.micro_batch_size} and ppo.micro_batch_tokens={p.micro_batch_tokens}: "
            "choose one (rows per micro-batch, or a token budget per micro-batch); set the other to null"
        )


def _check_shared_prompt(cfg) -> None:
    """``ppo.shared_prompt_forward=true`` where it cannot apply (``auto`` turns it off there)."""
    p = cfg.ppo
    if p.shared_prompt_forward is not True:
        return
    key = "ppo.shared_prompt_forward=true"
    if p.num_generations == 1:
        raise ConfigError(f"{key}: ppo.num_generations=1 repeats no prompt; set ppo.num_generations > 1, or auto")
    minibatch = minibatch_size_for(p, cfg.data.batch_size * p.num_generations)
    if minibatch % p.num_generations:
        raise ConfigError(
            f"{key}: ppo.minibatch_size={minibatch} must hold whole groups of ppo.num_generations="
            f"{p.num_generations}; set ppo.minibatch_size to a multiple of it, or auto"
        )
    if cfg.model.get("gradient_checkpointing"):
        raise ConfigError(
            f"{key}: model.gradient_checkpointing=true gives no KV cache to share; set one of them false, or auto"
        )


def _check_estimator(cfg) -> None:
    p = cfg.ppo
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


def _check_reward_normalization(cfg) -> None:
    world, r = processes_per_job(cfg.trainer), cfg.reward
    if r.normalize and world and r.normalize_samples < world:
        raise ConfigError(
            f"reward.normalize_samples={r.normalize_samples} with {world} processes (trainer.devices x "
            f"trainer.num_nodes): each rank scores normalize_samples // {world} = 0 samples; set "
            f"reward.normalize_samples >= {max(2, world)}"
        )
    if cfg.model.value_head_init == "reward_model" and (cfg.reward.kind != "model" or cfg.reward.terms):
        raise ConfigError(f"model.value_head_init={cfg.model.value_head_init!r}: needs reward=model")


def _check_precision(cfg) -> None:
    if str(cfg.trainer.precision) in FP16_PRECISIONS:
        raise ConfigError(
            f"trainer.precision={cfg.trainer.precision}: float16 is not supported (it needs loss "
            "scaling, which PPO's skip-on-overflow would have to share); use bf16-mixed (GPUs "
            "since Ampere, and CPUs) or 32-true"
        )


def _check_lora_reference(cfg) -> None:
    lora = cfg.model.lora
    if lora.r > 0 and (cfg.ref.name_or_path is not None or cfg.ref.dtype is not None):
        key = "ref.name_or_path" if cfg.ref.name_or_path is not None else "ref.dtype"
        raise ConfigError(
            f"{key}={OmegaConf.select(cfg, key)!r} with model.lora.r={lora.r}: with LoRA the "
            "reference is the policy with its adapters off (no second copy of the weights); unset "
            f"{key}, or set model.lora.r=0 to keep a separate reference"
        )


def _check_strategy(cfg) -> None:
    target = strategy_name(cfg.trainer)
    if target.lower() in ("fsdp", "fsdpstrategy") or target.endswith(".FSDPStrategy"):
        raise ConfigError(
            f"trainer.strategy={target}: Lightning's FSDP1 flattens the weights the sampler reads; "
            "use trainer=fsdp (FSDP2, ppo_lightning.parallel.sharding.FSDP2Strategy) or trainer=fsdp_cpu"
        )


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
    if p.kl_in == "loss" and p.kl_estimator is not None and not choices.KL_ESTIMATORS.spec(p.kl_estimator).in_loss:
        raise ConfigError(
            f"ppo.kl_estimator={p.kl_estimator} with ppo.kl_in=loss: as a loss term k1's gradient "
            "has expectation 0 under the policy's own samples, so it pulls nothing toward the "
            f"reference; choose one of {' | '.join(choices.KL_ESTIMATORS.names(in_loss=True))} (null: k3)"
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
    check_types(env, EnvConfig, "env")  # untyped at composition: its other keys are the class's
    check_fields(env, EnvConfig, "env")
    if env.get("_target_") in (TOOL_ENVIRONMENT, "ppo_lightning.envs.tools.ToolEnvironment"):
        check_types(env, ToolsConfig, "env")
        check_fields(env, ToolsConfig, "env")
    if not cfg.sampling.stop_at_eos:
        raise ConfigError(
            "sampling.stop_at_eos=false with env: a policy turn must end (at EOS or a stop string) for the "
            "environment to answer; unset sampling.stop_at_eos"
        )


HF_BACKEND = "ppo_lightning.generation.hf.HFBackend"


def _check_staleness(cfg) -> None:
    """``rollout.staleness >= 1``: corrected (unless allowed otherwise), on the backend and the
    strategy the lagging copy of the policy runs on."""
    K = cfg.rollout.staleness
    if not K:
        return
    key = f"rollout.staleness={K}"
    if cfg.ppo.engine_correction == "none" and not cfg.rollout.allow_uncorrected:
        raise ConfigError(
            f"{key} with ppo.engine_correction=none: the samples come from the policy up to {K} update(s) "
            "back, and uncorrected each token trains as if the current policy had sampled it (the clip "
            "then bounds nothing against the policy that did); set ppo.engine_correction=token_truncate "
            "(the default), or rollout.allow_uncorrected=true to train uncorrected"
        )
    target = (cfg.get("generation") or {}).get("_target_", HF_BACKEND)
    if target != HF_BACKEND:
        raise ConfigError(
            f"{key} with generation._target_={target}: a lagging sampler runs on generation=hf for now "
            "(a copy of the policy's weights, K updates old); set generation=hf or rollout.staleness=0"
        )
    if "FSDP2Strategy" in strategy_name(cfg.trainer):
        raise ConfigError(
            f"{key} with trainer.strategy={strategy_name(cfg.trainer)}: the lagging copy of the policy needs "
            "whole (unsharded) weights; use trainer=cpu, gpu or ddp, or rollout.staleness=0"
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


def _check_recipe(cfg) -> None:
    if cfg.recipe is not None:
        recipe_folder(cfg.recipe)  # a recipe folder of the package, or a package of yours with a recipe.py


RULES = (
    _check_fields,
    _check_recipe,
    _check_pass_term,
    _warn_ignored,
    _check_minibatch,
    _check_shared_prompt,
    _check_estimator,
    _check_env,
    _check_reward_normalization,
    _check_precision,
    _check_lora_reference,
    _check_strategy,
    _check_staleness,
)
"""``validate``'s rules, in the order they run: each field's own check first, so that the rules
after it read values of the right type and range."""


# ----------------------------------------------------------------------------- the stages
def validate_stage(cfg, cls: type, key_prefix: str = "task", optimizer=None) -> None:
    """A stage's keys (``task=sft``, ``task=reward_model``: a ``cls`` instance): each field's own
    check, then ``STAGE_RULES``; with ``optimizer``, its keys against ``OptimizerConfig`` (a
    partial dict is fine). Raises ``ConfigError`` naming ``<key_prefix>.<key>``."""
    check_fields(cfg, cls, key_prefix)
    for rule in STAGE_RULES:
        rule(cfg, key_prefix)
    if optimizer is not None:
        check_fields(optimizer, OptimizerConfig, "optimizer")


def _check_stage_source(cfg, p: str) -> None:
    if cfg.path is not None and cfg.hf_dataset is not None:
        raise ConfigError(f"{p}.path={cfg.path!r} and {p}.hf_dataset={cfg.hf_dataset!r} are both set; choose one")


def _check_sft_prompt_length(cfg, p: str) -> None:
    if not isinstance(cfg, SFTConfig):
        return
    max_length = DEFAULT_MAX_LENGTH if cfg.max_length is None else cfg.max_length
    if not cfg.max_prompt_length < max_length:
        raise ConfigError(
            f"{p}.max_prompt_length={cfg.max_prompt_length!r}: must be >= 1 and < {p}.max_length={max_length} "
            "(a response token must fit)"
        )


STAGE_RULES = (_check_stage_source, _check_sft_prompt_length)
"""``validate_stage``'s rules, after each field's own check."""
