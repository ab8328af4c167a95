"""Every choice list of the config, in a module that imports nothing.

``config.py`` reads its choices here, so loading the config (``--cfg job``, ``--help``, the docs
generator) imports no torch, Lightning or transformers. The code that implements each choice
imports its list from here too: one place per list, and a test (``tests/test_config.py``) checks
that each implementation covers exactly its list.
"""

ESTIMATORS = ("gae", "grpo", "rloo", "reinforce_pp")  # ppo.advantage; gae needs the value head
GROUP_ESTIMATORS = ("grpo", "rloo")  # need ppo.num_generations >= 2

KL_ESTIMATORS = ("k1", "k2", "k3")  # ppo.kl_estimator: Schulman's estimators (ppo.KL_ESTIMATOR_FNS)
KL_PLACEMENTS = ("reward", "loss")  # ppo.kl_in
# ppo.kl_estimator=null: k1 in the reward ([Z19], TRL's PPO); k3 in the loss (DeepSeekMath's GRPO).
# k1 is refused in the loss: its gradient, grad log p, has expectation 0 under the policy's own
# samples, so as a loss term it pulls nothing toward the reference.
DEFAULT_KL_ESTIMATOR = {"reward": "k1", "loss": "k3"}
LOSS_KL_ESTIMATORS = ("k2", "k3")  # k2's gradient is that of KL(p||q), k3's that of KL(q||p)
LOSS_AGGREGATIONS = (
    "token_mean",
    "token_mean_global",
    "seq_mean_token_mean",
    "seq_mean_token_sum",
    "seq_mean_token_sum_norm",
)  # ppo.loss_agg (ppo.aggregate)

DTYPES = ("float32", "bfloat16", "float16")  # model.dtype, ref.dtype, reward.dtype (policy.TORCH_DTYPES)
VALUE_HEAD_INITS = ("zeros", "reward_model")  # model.value_head_init
TINY_ARCHITECTURES = ("gpt2", "llama", "qwen2", "gpt_neox")  # model.build_tiny.arch

OPTIMIZERS = ("adamw", "adam", "sgd")  # optimizer.name (optim.OPTIMIZER_CLASSES)
SCHEDULERS = ("constant", "linear", "cosine")  # optimizer.scheduler

REWARD_KINDS = ("function", "model", "environment")  # reward.kind (environment: a TRL environment's get_reward)
REWARD_INPUTS = ("auto", "tokens", "text")  # reward.input: see RewardModel.use_policy_tokens

PROMPT_TRUNCATION = ("left", "error")  # data.truncation: keep a long prompt's last tokens, or refuse it
SFT_TRUNCATION = ("truncate", "drop", "error")  # task.truncation of task=sft (stages/sft.py)

RECIPES = {
    "reviews": "reviews-v3",
    "arithmetic": "arithmetic-v2",
    "math_chat": "math_chat-v1",
    "calculator_tool": "calculator_tool-v1",
}
"""``recipe``: a task's name -> its cache directory under ``paths.cache_dir``, the one place each
is named (configs reach it as ``${recipe_dir:<name>}``; the code of task ``<name>`` is
``ppo_lightning/tasks/<name>/``). Bump the version when a task's data or models change, so no run
reuses an old build."""

ENV_ERROR_MODES = ("count", "raise")  # env.on_error: an environment whose step raises (envs/episodes.py)
