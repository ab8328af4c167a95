"""Config composition: groups stay in their lanes, a task's values reach only that task, and every
field's declared check is the one ``validate`` runs."""

from __future__ import annotations

import dataclasses
import re

import pytest
import yaml
from omegaconf import OmegaConf

from ppo_lightning import config as C
from ppo_lightning.errors import ConfigError
from ppo_lightning.recipes import recipe_root
from tests.conftest import CONF, compose_cfg

# group -> the keys outside its own package that its files may set, and why (each file says so too)
ALLOWED_OUTSIDE = {"model": {"optimizer.lr"}}  # a model keeps the learning rate it needs
GLOBAL_GROUPS = ("experiment", "experiment/preset", "hparams_search", "task")  # set several groups by design


def compose(tmp_path, cache_dir, *overrides):
    return compose_cfg(list(overrides), tmp_path, cache_dir, experiment=None)


def schema_defaults(cls) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cls))


def test_every_group_file_sets_only_its_own_package():
    for path in sorted(CONF.rglob("*.yaml")):
        group = "/".join(path.relative_to(CONF).parts[:-1])
        if not group or group in GLOBAL_GROUPS:
            continue
        text = path.read_text()
        data = yaml.safe_load(text) or {}
        data.pop("defaults", None)
        if "# @package _global_" not in text:
            continue  # Hydra puts every key under the group's own package
        outside = {f"{k}.{sub}" for k, v in data.items() if k != group for sub in (v or {})}
        assert outside <= ALLOWED_OUTSIDE.get(group, set()), f"{path.relative_to(CONF)} sets {sorted(outside)}"


def test_the_default_job_is_the_reviews_task(tmp_path, cache_dir):
    cfg = compose(tmp_path, cache_dir)
    assert cfg.recipe == "reviews"
    assert (cfg.ppo.kl_coef, cfg.ppo.max_new_tokens, cfg.optimizer.lr) == (0.2, 20, 5.0e-5)
    root = recipe_root(cache_dir, "reviews")
    assert cfg.model.name_or_path == str(root / "sft") and cfg.data.path == str(root / "prompts_train.txt")
    assert cfg.reward.name_or_path == str(root / "reward_model") and cfg.reward.normalize


def test_own_model_prompts_and_reward_get_the_library_defaults(tmp_path, cache_dir):
    """The user who swaps the demo's model, data and reward inherits no value of the demo task."""
    cfg = compose(tmp_path, cache_dir, "model=tiny", "data=file", "data.path=prompts.txt", "reward=function",
                  "reward.fn=my_pkg.score")
    assert cfg.recipe is None
    assert OmegaConf.to_container(cfg.ppo) == schema_defaults(C.PPOConfig)
    assert OmegaConf.to_container(cfg.data) == {**schema_defaults(C.DataConfig), "path": "prompts.txt"}
    assert OmegaConf.to_container(cfg.reward) == {**schema_defaults(C.RewardConfig), "fn": "my_pkg.score"}
    # the one documented exception: model=tiny keeps the learning rate it needs
    assert OmegaConf.to_container(cfg.optimizer) == {**schema_defaults(C.OptimizerConfig), "lr": 1.0e-3}


def test_the_headline_command_runs_gpt2_on_the_reviews_task(tmp_path, cache_dir):
    """``python train.py model=gpt2 ppo.clip=0.2``: GPT-2 small as the policy on the documented
    reviews task (its preset: recipe, KL coefficient, response length), at the optimizer's default
    learning rate. tests/test_recipes.py runs it offline with a local stand-in for the weights."""
    cfg = compose(tmp_path, cache_dir, "model=gpt2", "ppo.clip=0.2")
    assert (cfg.model.name_or_path, cfg.ppo.clip, cfg.optimizer.lr) == ("gpt2", 0.2, 1.0e-5)
    assert (cfg.recipe, cfg.reward.kind, cfg.ppo.kl_coef, cfg.ppo.max_new_tokens) == ("reviews", "model", 0.2, 20)
    assert cfg.data.path == str(recipe_root(cache_dir, "reviews") / "prompts_train.txt")


def test_a_preset_needs_both_its_reward_and_its_prompts(tmp_path, cache_dir):
    for overrides in (["data=file", "data.path=p.txt"], ["reward=function", "reward.fn=m.f"]):
        cfg = compose(tmp_path, cache_dir, *overrides)
        assert cfg.recipe is None and cfg.ppo.kl_coef == 0.05 and cfg.ppo.max_new_tokens == 32, overrides
    cfg = compose(tmp_path, cache_dir, "experiment=arithmetic")
    assert (cfg.recipe, cfg.ppo.max_new_tokens, cfg.ppo.kl_coef, cfg.optimizer.lr) == ("arithmetic", 4, 0.02, 1.0e-4)


def _checked_fields():
    for prefix, cls in {**C.SECTIONS, "": C.TrainConfig}.items():
        for f in dataclasses.fields(cls):
            if f.metadata:
                yield prefix, f


def _bad_value(meta):
    if "choices" in meta:
        return "no-such-choice"
    if "gt" in meta:
        return meta["gt"]
    if "ge" in meta:
        return meta["ge"] - 1
    return meta.get("le", meta.get("lt")) + 1


@pytest.mark.parametrize("prefix, f", list(_checked_fields()), ids=lambda x: getattr(x, "name", x))
def test_every_declared_check_is_enforced_and_names_the_key(tmp_path, cache_dir, prefix, f):
    key = f"{prefix}.{f.name}" if prefix else f.name
    cfg = compose(tmp_path, cache_dir, "model=tiny", "data=file", "data.path=p.txt", "reward=function",
                  "reward.fn=m.f")
    bad = _bad_value(f.metadata)
    if prefix == "model.build_tiny":
        cfg.model.build_tiny = OmegaConf.structured(C.TinyModelConfig)
    OmegaConf.update(cfg, key, bad, force_add=True)
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=\S+: (must be|choose) "):
        C.validate(cfg)
    assert C.describe_check(f.metadata)  # and the docs show it (docs/gen_config.py)


def test_sharded_trainers_compose_to_fsdp2_and_fsdp1_is_refused(tmp_path, cache_dir):
    from ppo_lightning.config import validate
    from ppo_lightning.errors import ConfigError

    for trainer, accelerator, devices in (("fsdp", "gpu", -1), ("fsdp_cpu", "cpu", 2)):
        cfg = compose_cfg([f"trainer={trainer}"], tmp_path, cache_dir)
        validate(cfg)
        assert cfg.trainer.strategy._target_ == "ppo_lightning.sharding.FSDP2Strategy"
        assert (cfg.trainer.accelerator, cfg.trainer.devices) == (accelerator, devices)
    with pytest.raises(ConfigError, match=r"^trainer.strategy=fsdp: Lightning's FSDP1 .* use trainer=fsdp"):
        validate(compose_cfg(["trainer.strategy=fsdp"], tmp_path, cache_dir))
