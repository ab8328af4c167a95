"""Config composition: groups stay in their lanes, a recipe's values reach only that recipe, and every
field's declared check is the one ``validate`` runs."""

from __future__ import annotations

import dataclasses
import os
import re
import sys

import pytest
import yaml
from omegaconf import OmegaConf

from ppo_lightning import config as C
from ppo_lightning.config.root import SECTIONS

from ppo_lightning.algo.advantages import AdvantageInputs, estimate


from ppo_lightning.algo.losses import aggregate
from ppo_lightning.config.errors import ConfigError
from ppo_lightning.config import recipe_root
from tests.conftest import CONF, compose_cfg
from tests.helpers import run_train

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
    assert (cfg.ppo.kl_coef, cfg.sampling.max_new_tokens, cfg.optimizer.lr) == (0.2, 20, 5.0e-5)
    root = recipe_root(cache_dir, "reviews", 42)
    assert cfg.model.name_or_path == str(root / "sft") and cfg.data.path == str(root / "prompts_train.txt")
    assert cfg.reward.name_or_path == str(root / "reward_model") and cfg.reward.normalize


def test_own_model_prompts_and_reward_get_the_library_defaults(tmp_path, cache_dir):
    """The user who swaps the demo's model, data and reward inherits no value of the demo recipe."""
    cfg = compose(
        tmp_path,
        cache_dir,
        "model=tiny",
        "data=file",
        "data.path=prompts.txt",
        "reward=function",
        "reward.fn=my_pkg.score",
    )
    assert cfg.recipe is None
    assert OmegaConf.to_container(cfg.ppo) == schema_defaults(C.PPOConfig)
    assert OmegaConf.to_container(cfg.data) == {**schema_defaults(C.DataConfig), "path": "prompts.txt"}
    assert OmegaConf.to_container(cfg.reward) == {**schema_defaults(C.RewardConfig), "fn": "my_pkg.score"}
    # the one documented exception: model=tiny keeps the learning rate it needs
    assert OmegaConf.to_container(cfg.optimizer) == {**schema_defaults(C.OptimizerConfig), "lr": 1.0e-3}


def test_the_headline_command_runs_gpt2_on_the_reviews_task(tmp_path, cache_dir):
    """``python train.py model=gpt2 ppo.clip=0.2``: GPT-2 small as the policy on the documented
    reviews recipe (its preset: recipe, KL coefficient, response length), at the optimizer's default
    learning rate. tests/test_recipes.py runs it offline with a local stand-in for the weights."""
    cfg = compose(tmp_path, cache_dir, "model=gpt2", "ppo.clip=0.2")
    assert (cfg.model.name_or_path, cfg.ppo.clip, cfg.optimizer.lr) == ("gpt2", 0.2, 1.0e-5)
    assert (cfg.recipe, cfg.reward.kind, cfg.ppo.kl_coef, cfg.sampling.max_new_tokens) == ("reviews", "model", 0.2, 20)
    assert cfg.data.path == str(recipe_root(cache_dir, "reviews", 42) / "prompts_train.txt")


def test_a_preset_needs_both_its_reward_and_its_prompts(tmp_path, cache_dir):
    for overrides in (["data=file", "data.path=p.txt"], ["reward=function", "reward.fn=m.f"]):
        cfg = compose(tmp_path, cache_dir, *overrides)
        assert cfg.recipe is None and cfg.ppo.kl_coef == 0.05 and cfg.sampling.max_new_tokens == 32, overrides
    cfg = compose(tmp_path, cache_dir, "experiment=arithmetic")
    assert (cfg.recipe, cfg.sampling.max_new_tokens, cfg.ppo.kl_coef, cfg.optimizer.lr) == (
        "arithmetic",
        4,
        0.02,
        1.0e-4,
    )


@pytest.mark.parametrize(
    "name, advantage, generations, prompts",
    [("grpo", "grpo", 4, 8), ("rloo", "rloo", 4, 8), ("reinforce_pp", "reinforce_pp", 1, 32)],
)
def test_the_estimator_experiments_are_the_arithmetic_job_with_their_estimator(
    tmp_path, cache_dir, name, advantage, generations, prompts
):
    """``experiment=arithmetic_<name>``: the arithmetic recipe and preset, the estimator, and the
    same 32 episodes per iteration (prompts x generations); GRPO takes the KL as a loss term."""
    cfg = compose(tmp_path, cache_dir, f"experiment=arithmetic_{name}")
    C.validate(cfg)
    assert (cfg.recipe, cfg.sampling.max_new_tokens, cfg.ppo.kl_coef) == ("arithmetic", 4, 0.02)
    assert (cfg.ppo.advantage, cfg.ppo.num_generations, cfg.data.batch_size) == (advantage, generations, prompts)
    assert prompts * generations == 32 and cfg.ppo.kl_in == ("loss" if name == "grpo" else "reward")


def _checked_fields():
    for prefix, cls in {**SECTIONS, "": C.TrainConfig}.items():
        for f in dataclasses.fields(cls):
            if f.metadata and not C.is_placeholder(f):
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
    cfg = compose(tmp_path, cache_dir, "model=tiny", "data=file", "data.path=p.txt", "reward=function", "reward.fn=m.f")
    bad = _bad_value(f.metadata)
    if prefix == "model.build_tiny":
        cfg.model.build_tiny = OmegaConf.structured(C.TinyModelConfig)
    OmegaConf.update(cfg, key, bad, force_add=True)
    with pytest.raises(ConfigError, match=rf"^{re.escape(key)}=\S+: (must be|choose) "):
        C.validate(cfg)
    assert C.describe_check(f.metadata)  # and the docs show it (docs/gen_config.py)


def test_sharded_trainers_compose_to_fsdp2_and_fsdp1_is_refused(tmp_path, cache_dir):
    from ppo_lightning.config import validate
    from ppo_lightning.config.errors import ConfigError

    for trainer, accelerator, devices in (("fsdp", "gpu", -1), ("fsdp_cpu", "cpu", 2)):
        cfg = compose_cfg([f"trainer={trainer}"], tmp_path, cache_dir)
        validate(cfg)
        assert cfg.trainer.strategy._target_ == "ppo_lightning.parallel.sharding.FSDP2Strategy"
        assert (cfg.trainer.accelerator, cfg.trainer.devices) == (accelerator, devices)
    with pytest.raises(ConfigError, match=r"^trainer.strategy=fsdp: Lightning's FSDP1 .* use trainer=fsdp"):
        validate(compose_cfg(["trainer.strategy=fsdp"], tmp_path, cache_dir))


TORCHRUN_ENV = {
    "TORCHELASTIC_RUN_ID": "job",
    "WORLD_SIZE": "4",
    "RANK": "1",
    "LOCAL_RANK": "1",
    "LOCAL_WORLD_SIZE": "2",
    "GROUP_RANK": "0",
    "MASTER_ADDR": "head",
    "MASTER_PORT": "29500",
}
SLURM_ENV = {
    "SLURM_NTASKS": "4",
    "SLURM_NTASKS_PER_NODE": "2",
    "SLURM_JOB_NAME": "ppo",
    "SLURM_JOB_ID": "7",
    "SLURM_PROCID": "1",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "0",
    "SLURM_NODELIST": "node[1-2]",
}


@pytest.mark.parametrize(
    "launcher_env,environment",
    [(TORCHRUN_ENV, "TorchElasticEnvironment"), (SLURM_ENV, "SLURMEnvironment")],
    ids=["torchrun", "slurm"],
)
def test_two_nodes_of_two_processes_make_one_sharding_mesh_of_four(
    tmp_path, cache_dir, monkeypatch, launcher_env, environment
):
    """The multi-node lines of docs/scaling.md: ``trainer=fsdp_cpu trainer.num_nodes=2`` under the
    environment torchrun or SLURM sets for rank 1 of 4. Lightning reads the ranks from it (no
    processes of its own), and the FSDP mesh spans all four processes."""
    from ppo_lightning.jobs.trainer import build_trainer

    for k in [k for k in os.environ if k.startswith(("SLURM_", "TORCHELASTIC_"))]:
        monkeypatch.delenv(k)
    for k, v in launcher_env.items():
        monkeypatch.setenv(k, v)
    from lightning.fabric.utilities import rank_zero as fabric_rank_zero
    from lightning.pytorch.utilities import rank_zero as pytorch_rank_zero
    from lightning_utilities.core import rank_zero as utilities_rank_zero

    for module in (fabric_rank_zero, pytorch_rank_zero, utilities_rank_zero):  # the Trainer sets rank 1 in them
        monkeypatch.setattr(module.rank_zero_only, "rank", getattr(module.rank_zero_only, "rank", 0))
    cfg = compose_cfg(["trainer=fsdp_cpu", "trainer.num_nodes=2", "logger=none"], tmp_path, cache_dir)
    trainer = build_trainer(cfg)
    env = trainer.strategy.cluster_environment
    assert type(env).__name__ == environment and env.creates_processes_externally
    assert (trainer.num_nodes, trainer.num_devices, trainer.world_size, trainer.global_rank) == (2, 2, 4, 1)
    assert trainer.strategy.data_parallel_devices == 4


@pytest.mark.slow  # train.py in a subprocess
def test_a_sweep_over_a_multi_process_trainer_is_refused_before_any_job_runs(tmp_path, cache_dir):
    """Lightning starts a trainer's other processes by re-running the command line, so under
    ``-m`` each of them would run the whole sweep (seen: rank 1 printed "Launching 2 jobs")."""
    from ppo_lightning.config.rules import check_sweep_launch, processes_per_job

    for overrides, n in (
        (["trainer=cpu"], 1),
        (["trainer=ddp_cpu"], 2),
        (["trainer=fsdp_cpu"], 2),
        (["trainer=gpu", "trainer.num_nodes=2"], 2),
        (["trainer=fsdp"], None),
    ):
        assert processes_per_job(compose_cfg(overrides, tmp_path, cache_dir).trainer) == n, overrides
    check_sweep_launch(compose_cfg(["trainer=cpu"], tmp_path, cache_dir))
    p = run_train(["-m", "trainer=ddp_cpu", "ppo.clip=0.1,0.2", f"hydra.sweep.dir={tmp_path / 'sweep'}"], cache_dir)
    assert p.returncode == 1
    assert "error: hydra multirun (-m) with a trainer of 2 processes" in p.stderr
    assert "Launching 2 jobs" in p.stdout + p.stderr and not (tmp_path / "sweep" / "0" / "metrics.csv").exists()


def test_loading_the_config_imports_no_torch():
    """``config.py`` reads its choice lists from ``choices.py``: composing or printing a config
    (``--cfg job``, the docs generator) must not pay for torch, Lightning or transformers."""
    import subprocess
    import sys

    code = (
        "import sys, ppo_lightning.config; "
        "print(','.join(m for m in ('torch', 'lightning', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == ""


def test_every_choice_list_is_what_its_code_implements():
    """Each list in ``choices.py`` names exactly what the code behind it accepts."""
    import torch

    from ppo_lightning.config import choices
    from ppo_lightning.train import optim
    from ppo_lightning.models import policy
    from ppo_lightning.models import tiny

    assert set(optim.OPTIMIZER_CLASSES) == set(choices.OPTIMIZERS)
    assert set(policy.TORCH_DTYPES) == set(choices.DTYPES)
    assert set(choices.DEFAULT_KL_ESTIMATOR) == set(choices.KL_PLACEMENTS)
    assert choices.KL_ESTIMATORS.names(in_loss=True) == ("k2", "k3")
    for arch in choices.TINY_ARCHITECTURES:
        tiny.causal_lm_config(arch, 1, 1, 8, 16)  # raises for an architecture it does not know
    mask = torch.ones(2, 3)
    for agg in choices.LOSS_AGGREGATIONS:
        aggregate(torch.zeros(2, 3), mask, agg, mask.sum(), 2, 3)
    for est in choices.ESTIMATORS:  # each registered estimator runs on a rollout of two groups of two
        x = AdvantageInputs(torch.zeros(4), torch.zeros(4, 3), torch.ones(4, 3), torch.zeros(4, 3), group_size=2)
        assert all(t.shape == (4, 3) for t in estimate(est, x))


def test_keys_a_mode_ignores_get_one_warning_naming_the_key_and_the_mode(tmp_path, cache_dir, caplog):
    """``config.IGNORED_UNLESS``: a key set where it does nothing warns; the shipped jobs set none."""
    import logging

    for experiment in (
        None,
        "tiny_char",
        "arithmetic",
        "arithmetic_grpo",
        "arithmetic_rloo",
        "arithmetic_reinforce_pp",
    ):
        assert C.ignored_keys(compose_cfg([], tmp_path, cache_dir, experiment=experiment)) == [], experiment
    cfg = compose_cfg(
        [
            "ppo.advantage=grpo",
            "ppo.num_generations=2",
            "ppo.minibatch_size=4",
            "ppo.vf_coef=0.5",
            "reward.gain=2.0",
            "reward.normalize=true",
            "sampling.stop_at_eos=false",
            "sampling.stop_strings=[x]",
            "trainer.val_check_interval=5",
        ],
        tmp_path,
        cache_dir,
    )
    with caplog.at_level(logging.WARNING, logger="ppo_lightning.config"):
        C.validate(cfg)
    assert [r.getMessage() for r in caplog.records] == [
        "ppo.vf_coef=0.5 is ignored unless ppo.advantage=gae (the only estimator with a critic)",
        "sampling.stop_strings=['x'] is ignored unless sampling.stop_at_eos=true",
        "reward.gain=2.0 is ignored unless reward.normalize=false (normalisation fits gain and bias)",
        "trainer.val_check_interval=5 is ignored unless task=sft or task=reward_model (a PPO run has no "
        "validation loop)",
    ]


def test_the_trainer_groups_describe_hardware_only(tmp_path, cache_dir):
    """Choosing hardware does not change the run's length (and with it the lr schedule)."""
    for name in sorted(p.stem for p in (CONF / "trainer").glob("*.yaml")):
        assert "max_steps" not in yaml.safe_load((CONF / "trainer" / f"{name}.yaml").read_text()), name
        assert compose_cfg([f"trainer={name}"], tmp_path, cache_dir, experiment=None).trainer.max_steps == 100


def test_compose_config_outside_a_hydra_app_finds_the_config_tree():
    """``jobs.factory.compose_config`` outside ``train.py`` (a benchmark, a recipe's build) composes
    ``conf/train.yaml`` from the repository's config tree."""
    from ppo_lightning.jobs.factory import CONF_DIR, compose_config

    assert CONF_DIR == CONF and (CONF_DIR / "train.yaml").is_file()
    cfg = compose_config(["experiment=tiny_char", "ppo.clip=0.15"])
    assert cfg.ppo.clip == 0.15


def test_the_recipes_are_their_folders_and_each_build_is_keyed_by_its_code_and_seed(tmp_path):
    """``choices.RECIPES`` lists the recipe folders; ``recipe_root`` keys a build by the recipe's
    sources and the seed, so an edited copy or another seed never reuses a build. A folder that
    still holds a recipe's module under its old name, ``task.py``, is named with the new one."""
    import shutil

    from ppo_lightning.config import choices, ConfigError, recipe_folder

    assert choices.RECIPES == ("arithmetic", "calculator_tool", "math_chat", "reviews")
    assert recipe_root("/c", "arithmetic", 42) == recipe_root("/c", "arithmetic", 42)
    assert recipe_root("/c", "arithmetic", 42) != recipe_root("/c", "arithmetic", 43)
    assert recipe_root("/c", "arithmetic", 42).name.startswith("arithmetic-")

    shutil.copytree(recipe_folder("arithmetic"), tmp_path / "my_recipes" / "countdown")
    sys.path.insert(0, str(tmp_path))
    try:
        copy = recipe_root("/c", "my_recipes.countdown", 42)
        assert copy.name.startswith("countdown-") and copy.name[-12:] == recipe_root("/c", "arithmetic", 42).name[-12:]
        data = tmp_path / "my_recipes" / "countdown" / "data.py"
        data.write_text(data.read_text() + "\n# edited\n")
        assert recipe_root("/c", "my_recipes.countdown", 42) != copy
        with pytest.raises(ConfigError, match=r"recipe='my_recipes.nothing': no my_recipes/nothing/recipe.py"):
            recipe_folder("my_recipes.nothing")
        shutil.copytree(tmp_path / "my_recipes" / "countdown", tmp_path / "my_recipes" / "old")
        (tmp_path / "my_recipes" / "old" / "recipe.py").rename(tmp_path / "my_recipes" / "old" / "task.py")
        with pytest.raises(
            ConfigError,
            match=r"^recipe='my_recipes.old': .*old/task.py is a recipe's module under its old name; rename it recipe.py$",
        ):
            recipe_folder("my_recipes.old")
    finally:
        sys.path.remove(str(tmp_path))
    with pytest.raises(ConfigError, match=r"recipe='arithmetc': choose one of \['arithmetic'"):
        recipe_folder("arithmetc")


def test_the_old_name_of_the_recipes_package_is_one_line_naming_the_new_one(tmp_path, cache_dir, monkeypatch):
    """``ppo_lightning.tasks`` is now ``ppo_lightning.recipes``: a config value that names it (a
    reward function of a saved command line or experiment) fails validation naming the value to
    write, and a recipe of your own that still imports it fails naming the new package."""
    import shutil

    from ppo_lightning.config import ConfigError, recipe_folder
    from ppo_lightning.jobs.recipe import load_recipe

    old = "ppo_lightning.tasks.arithmetic.data.reward_fn"
    cfg = compose_cfg(["reward=function", f"reward.fn={old}"], tmp_path, cache_dir)
    said = (
        f"reward.fn='{old}': ppo_lightning.tasks is now ppo_lightning.recipes; "
        "write reward.fn='ppo_lightning.recipes.arithmetic.data.reward_fn' instead"
    )
    with pytest.raises(ConfigError, match="^" + re.escape(said) + "$"):
        C.validate(cfg)
    stale = tmp_path / "my_recipes" / "stale"
    shutil.copytree(recipe_folder("arithmetic"), stale)
    code = (stale / "recipe.py").read_text()
    (stale / "recipe.py").write_text(code.replace("ppo_lightning.recipes.common", "ppo_lightning.tasks.common"))

    class Gone:  # no ppo_lightning.tasks, whatever else is installed (an older checkout's editable install)
        def find_spec(self, name, path=None, target=None):
            if name == "ppo_lightning.tasks" or name.startswith("ppo_lightning.tasks."):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    monkeypatch.setattr(sys, "meta_path", [Gone(), *sys.meta_path])
    for name in [m for m in sys.modules if m == "ppo_lightning.tasks" or m.startswith("ppo_lightning.tasks.")]:
        monkeypatch.delitem(sys.modules, name)
    sys.path.insert(0, str(tmp_path))
    try:
        with pytest.raises(
            ConfigError,
            match=r"^recipe=my_recipes.stale: .*recipe.py imports ppo_lightning.tasks(\.common)?; ppo_lightning.tasks is now ppo_lightning.recipes$",
        ):
            load_recipe("my_recipes.stale")
    finally:
        sys.path.remove(str(tmp_path))


README_REWARD_EXAMPLE = [
    "model=gpt2",
    "data=file",
    "data.path=problems.jsonl",
    "reward=function",
    "reward.fn=my_pkg.rewards.correct",
]


def test_the_readmes_reward_example_validates_with_any_batch_size(tmp_path, cache_dir):
    """The README's own command with ``data.batch_size=4`` (or any other size, with or without
    groups): the default ``ppo.minibatch_size`` is the largest divisor of the rollout's rows up to
    8, so it fits every batch, and it is 8 wherever 8 fits (the former default's numbers)."""
    from ppo_lightning.config.ppo import minibatch_size_for

    for batch, extra, minibatch in (
        (4, [], 4),
        (32, [], 8),
        (12, [], 6),
        (3, [], 3),
        (4, ["ppo.advantage=grpo", "ppo.num_generations=8"], 8),
        (3, ["ppo.advantage=grpo", "ppo.num_generations=2"], 6),
    ):
        cfg = compose(tmp_path, cache_dir, *README_REWARD_EXAMPLE, f"data.batch_size={batch}", *extra)
        assert cfg.ppo.minibatch_size is None
        C.validate(cfg)
        assert minibatch_size_for(cfg.ppo, batch * cfg.ppo.num_generations) == minibatch, (batch, extra)
    assert minibatch_size_for(C.PPOConfig(minibatch_size=5), 32) == 5  # a size set is the size used


def test_a_minibatch_size_set_that_does_not_divide_the_rollout_is_refused_in_one_line(tmp_path, cache_dir):
    """The default fits any batch; a size the user sets is never replaced, and one that does not
    divide the rollout is refused, with a divisor that would."""
    cfg = compose(tmp_path, cache_dir, *README_REWARD_EXAMPLE, "data.batch_size=4", "ppo.minibatch_size=8")
    with pytest.raises(
        ConfigError, match=r"^ppo.minibatch_size=8: must divide data.batch_size=4 .*ppo.minibatch_size=4"
    ):
        C.validate(cfg)
    cfg = compose(tmp_path, cache_dir, *README_REWARD_EXAMPLE, "data.batch_size=4", "ppo.micro_batch_size=8")
    with pytest.raises(ConfigError, match=r"^ppo.micro_batch_size=8: must divide ppo.minibatch_size=4 \(null"):
        C.validate(cfg)  # the resolved minibatch, not the null the user left
