"""Config -> the parts of a PPO run: policy, reference, reward, prompts, ``PPOModule``, Trainer.

The jobs (``ppo_lightning/jobs/run.py``, which the entry point ``train.py`` runs) and the recipes
(whose red-team rounds are short PPO runs) both build runs here; nothing here imports a recipe.
``check_inputs`` holds every check of the user's inputs that needs no model, so each can run
before any recipe build or model load; ``check_built_inputs`` the same checks of what a recipe
builds, once it has built it. A job runs each check once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from pathlib import Path

import hydra
import lightning as L
import torch
from omegaconf import DictConfig, OmegaConf

from ppo_lightning.parallel.checkpoint import is_sharded_checkpoint
from ppo_lightning.parallel.preemption import StopOnPreemption
from ppo_lightning.config import validate
from ppo_lightning.data.prompts import PromptDataModule
from ppo_lightning.data.records import read_prompts, record_formats
from ppo_lightning.envs import SingleTurn, build_runner, check_env, check_env_reward, first_record
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.config.ppo import minibatch_size_for
from ppo_lightning.generation import GenerationBackend, SamplingParams
from ppo_lightning.jobs.trainer import build_trainer, warn_of_emulated_bf16
from ppo_lightning.train.callbacks import IterationProgressBar
from ppo_lightning.train.evaluation import Evaluation
from ppo_lightning.train.module import Generation, PPOModule
from ppo_lightning.train.normalization import NormalizedReward
from ppo_lightning.models.lora import DisabledAdapters, apply_lora
from ppo_lightning.models.policy import (
    PolicyWithValueHead,
    VALUE_HEAD_FILE,
    context_length,
    freeze,
    load_causal_lm,
    load_tokenizer,
    load_value_head,
    make_reference,
    resolve_source,
)
from ppo_lightning.config import recipe_root
from ppo_lightning.config.choices import ESTIMATORS, RECIPES
from ppo_lightning.rewards import build_eval_metrics, build_reward, function_scorers, needs_model
from ppo_lightning.rewards.environment import with_environment_reward
from ppo_lightning.rewards.function import check_reward_columns
from ppo_lightning.models.tiny import ensure_tiny_model

log = logging.getLogger(__name__)

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"  # the repository's config tree (ppo_lightning/jobs/ -> root)


# ----------------------------------------------------------------------------- configs
def compose_config(overrides: list[str]) -> DictConfig:
    """``conf/train.yaml`` composed with ``overrides`` through Hydra's compose API, exactly as
    ``train.py`` composes it (schemas, defaults list, presets). Inside a running Hydra app it
    uses that app's config search path; elsewhere it initialises one on ``CONF_DIR``."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if GlobalHydra.instance().is_initialized():
        return compose("train", overrides=overrides)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("train", overrides=overrides)


def _under(path: str | os.PathLike, root: Path) -> bool:
    return Path(path).expanduser().resolve().is_relative_to(root.resolve())


def check_inputs(cfg: DictConfig, built_by_recipe: Path | None = None) -> None:
    """Every check of the user's inputs that needs no model: ranges and cross-group constraints
    (``config.validate``), the prompt file (exists, holds prompts, parses), the reward function
    (imports), model and checkpoint paths (exist, or are hub ids that can be reached).

    Paths under ``built_by_recipe`` are skipped: the recipe builds them next, and
    ``check_built_inputs`` checks them once it has. A missing path that another recipe builds
    says which ``recipe=`` would build it.
    """
    validate(cfg)

    def pending(path) -> bool:
        return built_by_recipe is not None and bool(path) and _under(path, built_by_recipe)

    if cfg.data.path is None and cfg.data.hf_dataset is None:
        raise ConfigError(
            "data.path and data.hf_dataset are both null: set data.path=prompts.txt "
            "(one prompt a line) or .jsonl, or data.hf_dataset=<name>"
        )
    _check_prompt_files(cfg, pending, recipe_builds=built_by_recipe is not None)
    if cfg.ckpt_path is not None and not (os.path.isfile(cfg.ckpt_path) or is_sharded_checkpoint(cfg.ckpt_path)):
        raise ConfigError(
            f"ckpt_path={cfg.ckpt_path!r}: no such checkpoint (a .ckpt file, or the directory of a sharded one)"
        )
    _check_code(cfg, pending)
    _check_model_sources(cfg, pending)
    if not pending(cfg.model.name_or_path):
        check_context(cfg)
    warn_of_emulated_bf16(cfg)


def check_built_inputs(cfg: DictConfig, built_by_recipe: Path) -> None:
    """Once the job's recipe has built ``built_by_recipe``: the checks ``check_inputs`` left for
    the paths under it (prompt files, model sources, the model's context) and, where the recipe
    wrote the prompts, the environment's ``reset`` on their first record. Nothing
    ``check_inputs`` checked runs again."""

    def checked(path) -> bool:  # check_inputs took it: not the recipe's
        return not (path and _under(path, built_by_recipe))

    _check_prompt_files(cfg, checked, recipe_builds=False)
    _check_model_sources(cfg, checked)
    if not checked(cfg.model.name_or_path):
        check_context(cfg)
    if cfg.get("env") and not checked(cfg.data.path):
        record = first_record(cfg.data.path, cfg.data.prompt_field)
        check_env(cfg.env, record, reward=_env_owns_reward(cfg))


def _check_prompt_files(cfg: DictConfig, pending, recipe_builds: bool) -> None:
    """``data.path`` and ``eval.path``: existing, holding prompts that parse; unless ``pending``
    says another pass takes them (a recipe builds them next)."""
    d = cfg.data
    if d.path is not None and recipe_builds and not pending(d.path):
        log.warning(
            "data.path=%s is not recipe=%s's prompts: this job keeps that recipe's data group and "
            "preset (prompt limit, KL coefficient, response length); for your own prompts with the "
            "library's defaults choose data=file",
            d.path,
            cfg.recipe,
        )
    if d.path is not None and not pending(d.path):
        if not os.path.exists(d.path):
            raise ConfigError(
                f"data.path={d.path!r}: no such file or directory. Give a {record_formats()}, each record "
                f"with a {d.prompt_field!r} field (data.prompt_field)" + _built_by_hint(d.path, cfg)
            )
        read_prompts(d.path, d.prompt_field)  # empty, malformed or unsupported files fail here
    if cfg.eval.path is not None and not pending(cfg.eval.path):
        if not os.path.exists(cfg.eval.path):
            raise ConfigError(
                f"eval.path={cfg.eval.path!r}: no such file or directory. Give a {record_formats()}"
                + _built_by_hint(cfg.eval.path, cfg)
            )
        read_prompts(cfg.eval.path, d.prompt_field, key_prefix="eval")  # as data.path's: fails here


def _check_code(cfg: DictConfig, pending) -> None:
    """The code the config names imports and builds: reward functions, eval metrics, the
    generation backend, the environment (and its ``get_reward`` when it is the reward)."""
    r = cfg.reward
    if not needs_model(r):
        build_reward(r)  # imports reward.fn (or every term's)
    build_eval_metrics(cfg.eval.metrics)  # imports each eval.metrics function
    check_backend(cfg.get("generation"))
    own_reward = _env_owns_reward(cfg)
    if cfg.get("env"):
        # the environment class imports and builds, has reset and step, its tools have schemas, its
        # reset takes the data's first record (where the file is there to read), and it gives a reward
        record = first_record(None if pending(cfg.data.path) else cfg.data.path, cfg.data.prompt_field)
        check_env(cfg.env, record, reward=own_reward)
    elif own_reward:
        check_env_reward(None)


def _env_owns_reward(cfg: DictConfig) -> bool:
    """``reward=environment`` with no other term: the environment scores its episodes alone."""
    return cfg.reward.kind == "environment" and not cfg.reward.terms


def _check_model_sources(cfg: DictConfig, pending) -> None:
    """Model, tokenizer, reference and reward-model paths exist or are reachable hub ids (not the
    tiny model this run builds, nor what ``pending`` says a recipe builds); the value head file."""
    m, r = cfg.model, cfg.reward
    sources = [
        (
            "model.name_or_path",
            m.name_or_path,
            m.build_tiny is not None and _under(m.name_or_path, Path(cfg.paths.cache_dir)),
        ),
        ("model.tokenizer_name_or_path", m.tokenizer_name_or_path, False),
        ("ref.name_or_path", cfg.ref.name_or_path, False),
        ("reward.name_or_path", r.name_or_path if r.kind == "model" and not r.terms else None, False),
        *(
            (f"reward.terms.{name}.name_or_path", term.get("name_or_path"), False)
            for name, term in (r.terms or {}).items()
            if term.get("kind", "function") == "model"
        ),
    ]
    for key, value, built_here in sources:
        if value and not built_here and not pending(value):
            try:
                resolve_source(value, key)
            except ConfigError as e:
                raise ConfigError(f"{e}{_built_by_hint(value, cfg)}") from None
    if (
        m.value_head_path
        and not pending(m.value_head_path)
        and not (Path(m.value_head_path) / VALUE_HEAD_FILE).is_file()
    ):
        raise ConfigError(f"model.value_head_path={m.value_head_path!r}: no {VALUE_HEAD_FILE} there")


def check_context(cfg: DictConfig) -> int | None:
    """The model's context (positions), read from its config alone (``AutoConfig``: no weights),
    and the run's longest sequence checked against it: ``data.max_prompt_length`` plus
    ``sampling.max_new_tokens``, or with an environment ``env.max_total_tokens`` (null: the rest
    of the context, which must leave the episode a token). None where the config cannot be read
    yet (a model the run builds or a recipe builds next, a hub id out of reach: loading says so)."""
    from transformers import AutoConfig

    m = cfg.model
    try:
        config = AutoConfig.from_pretrained(
            os.path.expanduser(m.name_or_path), trust_remote_code=m.trust_remote_code, local_files_only=True
        )
    except Exception:  # noqa: BLE001 - not there yet, or not a local model: the load reports it
        return None
    ctx = context_length(config)
    if ctx is None:
        return None
    env = cfg.get("env")
    response = "env.max_total_tokens" if env else "sampling.max_new_tokens"
    budget = env.get("max_total_tokens") if env else cfg.sampling.max_new_tokens
    if budget is None:  # env.max_total_tokens: null, what fits
        budget = ctx - cfg.data.max_prompt_length
        if budget < 1:
            raise ConfigError(
                f"data.max_prompt_length={cfg.data.max_prompt_length} leaves no room for an episode in the model's "
                f"context of {ctx} tokens; lower data.max_prompt_length"
            )
    need = cfg.data.max_prompt_length + budget
    if need > ctx:
        raise ConfigError(
            f"data.max_prompt_length + {response} = {need} exceeds the model's context of {ctx} tokens "
            f"(model.name_or_path={m.name_or_path!r}); lower data.max_prompt_length or {response}"
        )
    return ctx


def _built_by_hint(path: str, cfg: DictConfig) -> str:
    for name in RECIPES:
        if _under(path, recipe_root(cfg.paths.cache_dir, name, cfg.seed)):
            return (
                f" It is built by recipe={name}, which this job does not run: add recipe={name} "
                "(the experiment that uses it sets it: conf/experiment), or point the key at your "
                "own file or model."
            )
    return ""


# ----------------------------------------------------------------------------- the module
def build(cfg: DictConfig, checked: bool = False) -> tuple[PPOModule, PromptDataModule, L.Trainer]:
    """Module, prompts and Trainer for a composed config; every cheap check runs first, unless
    ``checked`` (the caller ran them). The Trainer stops on SIGTERM at an iteration's end, with a
    checkpoint (``StopOnPreemption``), and its progress bar counts iterations
    (``IterationProgressBar``)."""
    module, datamodule = build_module(cfg, checked=checked)
    trainer = build_trainer(cfg, extra_callbacks=[StopOnPreemption()], progress_bar=IterationProgressBar)
    return module, datamodule, trainer


def build_module(cfg: DictConfig, checked: bool = False) -> tuple[PPOModule, PromptDataModule]:
    """The ``PPOModule`` (policy with value head, frozen reference, reward) and the prompts, after
    ``check_inputs`` (unless ``checked``: the caller ran it). The parts are built in a fixed order
    from one seed (LoRA's adapters and some heads draw from the global RNG): prompts, policy and
    reference, reward, then the module."""
    if not checked:
        check_inputs(cfg)
    # first: building the tiny model seeds the global RNG itself, and what follows must not
    # depend on whether this run built it (LoRA's adapter init draws from that RNG)
    ensure_tiny_model(cfg.model, cfg.paths.cache_dir)
    context = check_context(cfg)  # from the model's config, before any weights load
    L.seed_everything(cfg.seed, workers=True, verbose=False)
    reward_fn = None if needs_model(cfg.reward) else build_reward(cfg.reward)

    tokenizer_path = cfg.model.tokenizer_name_or_path or cfg.model.name_or_path
    tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=cfg.model.trust_remote_code)
    # how each record is played: an environment's episodes (its chat template checked,
    # prefix-preserving and rendering tools, before any model loads), or the null environment's
    runner = SingleTurn(tokenizer)
    if cfg.get("env"):
        runner = build_runner(cfg.env, cfg.data, tokenizer, tokenizer_path, context)
    datamodule, eval_metrics = build_prompts(cfg, tokenizer, runner)
    policy, ref_lm = build_policy(cfg, tokenizer)
    reward = build_normalized_reward(cfg, reward_fn, tokenizer, runner, policy)

    # plain dataclasses: attribute reads on a DictConfig cost ~50 us each, in the hot loop
    ppo_cfg, optim_cfg = OmegaConf.to_object(cfg.ppo), OmegaConf.to_object(cfg.optimizer)
    # the update reads the minibatch size that validate checked (null: what fits the rollout)
    rows = cfg.data.batch_size * ppo_cfg.num_generations
    ppo_cfg = dataclasses.replace(ppo_cfg, minibatch_size=minibatch_size_for(ppo_cfg, rows))
    module = PPOModule(
        policy,
        ref_lm,
        reward,
        tokenizer,
        ppo_cfg,
        optim_cfg,
        seed=cfg.seed,
        evaluation=Evaluation(OmegaConf.to_object(cfg.eval), eval_metrics),
        generation=Generation(
            build_backend(cfg.get("generation")),
            SamplingParams.from_config(OmegaConf.to_object(cfg.sampling), tokenizer),
            runner,
            cfg.rollout.staleness,
        ),
        rollout_dir=str(Path(cfg.paths.output_dir) / "rollouts") if cfg.ppo.rollout_dump else None,
    )
    return module, datamodule


def build_prompts(cfg: DictConfig, tokenizer, runner) -> tuple[PromptDataModule, dict]:
    """The prompts, read, rendered and tokenised, and the ``eval.metrics`` scorers; every record
    has the columns each reward function and eval metric asks for."""
    datamodule = PromptDataModule(
        cfg.data, tokenizer, seed=cfg.seed, eval_cfg=cfg.eval, chat=runner.chat, tools=runner.probe_tools()
    )
    datamodule.load()  # reads, renders (chat templates) and tokenises the prompts
    for fn in function_scorers(cfg.reward):  # every record has the columns each function asks for
        check_reward_columns(fn, [*datamodule.records, *datamodule.eval_records])
    eval_metrics = build_eval_metrics(cfg.eval.metrics)
    for fn in eval_metrics.values():
        check_reward_columns(fn, datamodule.eval_records)
    return datamodule, eval_metrics


def build_policy(cfg: DictConfig, tokenizer) -> tuple[PolicyWithValueHead, torch.nn.Module]:
    """The policy (the LM, with LoRA adapters when ``model.lora.r`` > 0, and a value head when the
    estimator has a critic) and its frozen reference (the LoRA policy with its adapters disabled)."""
    lm = load_causal_lm(cfg.model.name_or_path, tokenizer, cfg.model.dtype, cfg.model.trust_remote_code)
    ref_lm = build_reference(cfg, lm, tokenizer)  # before LoRA: a copy, if any, of the plain LM
    peft_model = None
    if cfg.model.lora.r > 0:
        lora = cfg.model.lora
        peft_model = apply_lora(
            lm, lora.r, lora.alpha, OmegaConf.to_object(lora.target_modules) if lora.target_modules else None
        )
        ref_lm = DisabledAdapters(peft_model)
    critic = ESTIMATORS.spec(cfg.ppo.advantage).critic  # an estimator without a critic has no value head
    policy = PolicyWithValueHead(lm, peft_model, value_head=critic)
    if cfg.model.value_head_path:
        load_value_head(policy, cfg.model.value_head_path)
    if cfg.model.gradient_checkpointing:  # the policy only: the frozen reference never backprops
        policy.enable_gradient_checkpointing()
    return policy, ref_lm


def build_normalized_reward(
    cfg: DictConfig, reward_fn, tokenizer, runner, policy: PolicyWithValueHead
) -> NormalizedReward:
    """The run's reward (``reward_fn``, or the reward model built now, after the policy; with a
    TRL environment's ``get_reward``, one term more) with its normalisation: fitted when the run
    starts, else the configured gain and bias. ``model.value_head_init=reward_model`` copies the
    reward model's head into ``policy``'s value head, on the raw scale when a fit will rescale it."""
    if needs_model(cfg.reward):
        reward_fn = build_reward(cfg.reward)
        reward_fn.use_policy_tokens(tokenizer, cfg.reward.input)
    # a TRL environment's get_reward(): one more term, named after its class
    reward_fn = with_environment_reward(reward_fn, runner.reward_owners())
    reward_norm = None if cfg.reward.normalize else (cfg.reward.gain, cfg.reward.bias)
    from_reward = cfg.model.value_head_init == "reward_model"
    if from_reward:  # on the raw scale when a fit will rescale it
        init_value_head_from(policy, reward_fn, *(reward_norm or (1.0, 0.0)))
    return NormalizedReward(reward_fn, reward_norm, cfg.reward.normalize_samples, from_reward)


def build_backend(node: DictConfig | None):
    """The generation backend's factory (``generation.*``: a partial ``_target_``); the ``hf``
    backend when the group is absent."""
    if not node:
        return None  # PPOModule's default: hf
    if "_target_" not in node:
        raise ConfigError("generation: expected a mapping with a _target_ (a backend class), e.g. generation=hf")
    factory = hydra.utils.instantiate(node, _partial_=True)
    if not callable(factory):
        raise ConfigError(f"generation._target_={node._target_!r}: not a class or function to call")
    return factory


def check_backend(node: DictConfig | None) -> None:
    """The generation backend's class imports, is a ``GenerationBackend``, and its ``preflight``
    (vllm's: the package imports) passes, before any model loads."""
    if not node or "_target_" not in node:
        return  # build_backend says what is missing
    try:
        cls = hydra.utils.get_object(node._target_)
    except (ImportError, ValueError) as e:
        raise ConfigError(f"generation._target_={node._target_!r}: cannot import it ({e})") from None
    if not (isinstance(cls, type) and issubclass(cls, GenerationBackend)):
        raise ConfigError(
            f"generation._target_={node._target_!r} is not a generation backend: subclass "
            "ppo_lightning.generation.GenerationBackend (generate, sync_weights, close)"
        )
    cls.preflight()


def build_reference(cfg: DictConfig, lm, tokenizer):
    """The frozen reference (``ref.*``): a copy of the policy's initial LM in ``ref.dtype``, or the
    model at ``ref.name_or_path``; None with LoRA, whose reference is the policy with its adapters
    off (``lora.DisabledAdapters``)."""
    ref = cfg.ref
    if cfg.model.lora.r > 0:
        return None
    if ref.name_or_path is None:
        return make_reference(lm, ref.dtype)
    ref_lm = load_causal_lm(
        ref.name_or_path, tokenizer, ref.dtype or cfg.model.dtype, cfg.model.trust_remote_code, key="ref.name_or_path"
    )
    n_ref, n_policy = ref_lm.get_input_embeddings().num_embeddings, lm.get_input_embeddings().num_embeddings
    if n_ref != n_policy:
        raise ConfigError(
            f"ref.name_or_path={ref.name_or_path!r}: its vocabulary has {n_ref} entries, the "
            f"policy's {n_policy}; the KL penalty compares the two token by token, so the reference "
            "must share the policy's tokenizer"
        )
    return freeze(ref_lm)


def init_value_head_from(policy: PolicyWithValueHead, reward_model, gain: float = 1.0, bias: float = 0.0) -> None:
    """Copy the reward model's score head into the value head ([N+]: initialise the value
    function from the reward model), mapped by the reward normalisation ``gain * score + bias``,
    so early value estimates are already on the reward's scale."""
    head = reward_model.score_head()
    if head.weight.shape != policy.v_head.weight.shape:
        raise ConfigError(
            f"model.value_head_init=reward_model: reward head {tuple(head.weight.shape)} does "
            f"not fit the value head {tuple(policy.v_head.weight.shape)} (hidden sizes differ)"
        )
    with torch.no_grad():
        policy.v_head.weight.copy_(head.weight.float() * gain)
        head_bias = head.bias.float() if head.bias is not None else torch.zeros(1)
        policy.v_head.bias.copy_(head_bias * gain + bias)
