"""What both sides of the GRPO comparison (``benchmarks.compare_trl --trainer grpo``) share: the GRPO
shape on top of a workload of ``workloads``, its hyperparameters, and the reward function.

Kept free of heavy imports: ``ours`` (ppo_lightning's venv) and ``trl_grpo`` (the TRL venv,
another trl version) both import it, and ppo_lightning imports the reward by its dotted path
(``reward.fn=benchmarks.lib.grpo_workload.char_fraction_reward``).

One GRPO iteration on either side: ``prompts`` prompts of the workload's prompt set, each sampled
``generations`` times (``prompts x generations`` completions, every one exactly the workload's
``response_tokens`` long: EOS never ends one), a reference forward for the KL, the reward
function on the decoded texts, group-normalised advantages (mean and std of each prompt's group),
then one pass over the batch as one minibatch: one forward + backward with the clipped policy loss
plus ``BETA`` x the k3 KL estimate to the reference, one AdamW step at ``LR``.
"""

from __future__ import annotations

DEFAULT_PROMPTS = 8  # P: prompts per iteration
DEFAULT_GENERATIONS = 4  # G: completions per prompt
BETA = 0.04  # the KL coefficient (TRL's beta, our ppo.kl_coef), k3 estimator in the loss on both sides
LR = 1.0e-5  # constant learning rate, AdamW, on both sides
ADAM_EPS = 1.0e-5  # ppo_lightning's OptimizerConfig default (TRL's Trainer default 1e-8 is overridden)
REWARD_FN = "benchmarks.lib.grpo_workload.char_fraction_reward"  # the reward.fn of our side


def char_fraction_reward(prompts, completions, **kwargs) -> list[float]:
    """TRL's reward-function signature (``prompts=, completions=, completion_ids=, **columns``,
    all by keyword), which ppo_lightning's ``reward=function`` also calls that way (a parameter
    named ``completions`` chooses it): the same function, called the same way, on both sides.

    The fraction of each completion's characters that are lowercase letters or spaces
    (``ppo_lightning.rewards.rules.char_fraction``): deterministic, microseconds per batch, and
    varied within a group, so every group has a non-zero std. Chat completions (assistant
    messages, as both sides pass them for chat prompts) are scored on their text."""
    from ppo_lightning.rewards.rules import char_fraction
    from ppo_lightning.rewards.verifiable import completion_text

    return char_fraction(prompts, [completion_text(c) for c in completions])
