"""Offline demo tasks: data generators, ground-truth rewards and word-level tokenizers.

No machine here reaches a dataset hub, so the two demo tasks generate their data from code:

- :mod:`ppo_lightning.tasks.reviews` -- an offline analogue of "steer GPT-2 towards positive movie
  reviews": a small probabilistic grammar of movie reviews with a known sentiment per adjective,
  so the reward (ground-truth sentiment) and well-formedness are exact.
- :mod:`ppo_lightning.tasks.arithmetic` -- RL from a verifiable reward: ``"12+7="`` -> ``"19"``.
- :mod:`ppo_lightning.tasks.tokenizer` -- word-/character-level tokenizers over each task's fixed
  vocabulary (needs ``tokenizers`` and ``transformers``; the task modules themselves are pure
  Python).

Every task offers ``prompts(rng, n)``, ``sft_corpus(rng, n)`` and
``reward_fn(prompts, responses) -> list[float]`` (usable as ``reward.fn=...``); ``rng`` is a
``random.Random`` (or an int seed), so every corpus is reproducible.
"""
