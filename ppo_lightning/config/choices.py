"""Every choice list of the config, in a module that imports nothing but the standard library.

The config's schemas (``config/``) read their choices here, so loading it (``--cfg job``,
``--help``) imports no torch, Lightning or transformers. The code that implements each choice
imports its list from here too: one place per list, and a test (``tests/test_config.py``) checks
that each implementation covers exactly its list.

The algorithm's choices are registries instead: the advantage estimators (``ppo.advantage``), the
KL estimators (``ppo.kl_estimator``) and the loss aggregations (``ppo.loss_agg``) register here,
each with what the config must know of it, from the module that implements them
(``algo/advantages.py``, ``algo/kl.py``, ``algo/losses.py``; importing any ``ppo_lightning.algo``
module imports all three), so that adding one touches that module alone.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Iterator
import dataclasses


@dataclasses.dataclass(frozen=True)
class EstimatorSpec:
    """What the config and the factory must know of an advantage estimator (``ppo.advantage``)."""

    critic: bool
    """It learns a value head (built, trained, checkpointed; ``ppo.vf_coef``, ``ppo.vf_clip``,
    ``model.value_head_*`` and reward whitening, ``ppo.whiten_rewards``, are its)."""
    groups: bool
    """It compares the ``ppo.num_generations`` samples of one prompt (which must be >= 2), and
    judges each by its score as a whole (no per-token discount, ``ppo.gamma``)."""
    group_std: bool = False
    """It divides by the group's std, which ``ppo.scale_by_group_std=false`` turns off."""
    turn_rewards: str = "token"
    """Multi-turn: ``token``, each turn's reward on its turn's last token; ``total``, added to the
    episode's score before the comparison."""


class Registry:
    """A choice whose implementations register themselves: ``name -> (spec, implementation)``,
    filled when the implementing module is imported (the factory imports it before it validates
    the config; so does ``tests/conftest.py``). Iterates over the names, as a choice tuple does."""

    def __init__(self, key: str, home: str):
        self.key, self.home = key, home  # the config key, the module that registers
        self._entries: dict[str, tuple[Any, Callable]] = {}

    def register(self, name: str, spec: Any) -> Callable[[Callable], Callable]:
        def add(impl: Callable) -> Callable:
            if name in self._entries:
                raise ValueError(f"{self.key}: {name!r} is registered twice")
            self._entries[name] = (spec, impl)
            return impl

        return add

    def _filled(self) -> dict[str, tuple[Any, Callable]]:
        if not self._entries:
            raise RuntimeError(f"{self.key}: nothing registered yet; import {self.home} first (the factory does)")
        return self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._filled())

    def __contains__(self, name: object) -> bool:
        return name in self._filled()

    def __len__(self) -> int:
        return len(self._filled())

    def spec(self, name: str) -> Any:
        return self._filled()[name][0]

    def implementation(self, name: str) -> Callable:
        return self._filled()[name][1]

    def names(self, **flags: Any) -> tuple[str, ...]:
        """The names whose spec has every one of ``flags`` (``names(groups=True)``)."""
        return tuple(n for n, (s, _) in self._filled().items() if all(getattr(s, k) == v for k, v in flags.items()))


ESTIMATORS = Registry("ppo.advantage", "ppo_lightning.algo.advantages")
"""``ppo.advantage``: the advantage estimators, registered by ``algo/advantages.py``."""


@dataclasses.dataclass(frozen=True)
class KLEstimatorSpec:
    """What the config must know of a KL estimator (``ppo.kl_estimator``)."""

    in_loss: bool
    """It may be a loss term (``ppo.kl_in=loss``): its gradient pulls the policy toward the
    reference. k1's gradient, grad log p, has expectation 0 under the policy's own samples, so as a
    loss term it pulls nothing; k2's is that of KL(p||q), k3's that of KL(q||p)."""


KL_ESTIMATORS = Registry("ppo.kl_estimator", "ppo_lightning.algo.kl")
"""``ppo.kl_estimator``: Schulman's estimators, registered by ``algo/kl.py``."""
KL_PLACEMENTS = ("reward", "loss")  # ppo.kl_in
# ppo.kl_estimator=null: k1 in the reward ([Z19], TRL's PPO); k3 in the loss (DeepSeekMath's GRPO).
DEFAULT_KL_ESTIMATOR = {"reward": "k1", "loss": "k3"}


@dataclasses.dataclass(frozen=True)
class AggregationSpec:
    """What the update must know of a loss aggregation (``ppo.loss_agg``) before it reduces."""

    global_tokens: bool = False
    """Its token count is every rank's (``losses.global_token_count``), not this rank's."""


LOSS_AGGREGATIONS = Registry("ppo.loss_agg", "ppo_lightning.algo.losses")
"""``ppo.loss_agg``: how per-token losses become one number, registered by ``algo/losses.py``."""

ENGINE_CORRECTIONS = (
    "none",
    "token_truncate",
    "token_mask",
    "sequence_truncate",
    "sequence_mask",
)  # ppo.engine_correction
SHARED_PROMPT_FORWARD = ("auto", True, False)  # ppo.shared_prompt_forward
DTYPES = ("float32", "bfloat16", "float16")  # model.dtype, ref.dtype, reward.dtype (policy.TORCH_DTYPES)
VALUE_HEAD_INITS = ("zeros", "reward_model")  # model.value_head_init
TINY_ARCHITECTURES = ("gpt2", "llama", "qwen2", "gpt_neox")  # model.build_tiny.arch

OPTIMIZERS = ("adamw", "adam", "sgd")  # optimizer.name (optim.OPTIMIZER_CLASSES)
SCHEDULERS = ("constant", "linear", "cosine")  # optimizer.scheduler

REWARD_KINDS = ("function", "model", "environment")  # reward.kind (environment: a TRL environment's get_reward)
REWARD_INPUTS = ("auto", "tokens", "text")  # reward.input: see RewardModel.use_policy_tokens

PROMPT_TRUNCATION = ("left", "error")  # data.truncation: keep a long prompt's last tokens, or refuse it
SFT_TRUNCATION = ("truncate", "drop", "error")  # task.truncation of task=sft (stages/sft.py)

RECIPES_DIR = Path(__file__).parents[1] / "recipes"
"""The package's recipes, one folder each (``ppo_lightning/recipes/<name>/recipe.py``)."""
RECIPES = tuple(sorted(p.parent.name for p in RECIPES_DIR.glob("*/recipe.py")))
"""``recipe``: the package's recipes, found by their folders (a copied folder is a new choice;
``recipe=my_pkg.my_recipe`` names one outside the package). Where each builds: ``config/recipes.py``."""

ENV_ERROR_MODES = ("count", "raise")  # env.on_error: an environment whose step raises (envs/episodes.py)
