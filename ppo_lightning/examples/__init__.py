"""The example problems: prompts, ground-truth rewards, corpora and word-level tokenizers.

(Not ``task=``, which picks the job a command runs: ppo, sft, reward_model or export.) No machine
here reaches a dataset hub, so the two examples generate their data from code:

- :mod:`ppo_lightning.examples.reviews` -- an offline analogue of "steer GPT-2 towards positive
  movie reviews": a small probabilistic grammar of movie reviews with a known sentiment per
  adjective, so the reward (ground-truth sentiment) and well-formedness are exact.
- :mod:`ppo_lightning.examples.arithmetic` -- RL from a verifiable reward: ``"12+7="`` -> ``"19"``.
- :mod:`ppo_lightning.examples.tokenizer` -- word-/character-level tokenizers over each
  example's fixed vocabulary (needs ``tokenizers`` and ``transformers``; the example modules
  themselves are pure Python).

Every example offers ``prompts(rng, n)``, ``sft_corpus(rng, n)`` and
``reward_fn(prompts, responses) -> list[float]`` (usable as ``reward.fn=...``); ``rng`` is a
``random.Random`` (or an int seed), so every corpus is reproducible.
"""
