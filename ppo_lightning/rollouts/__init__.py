"""The rollout layer, between the parts that sample and score (``generation``, ``envs``,
``rewards``) and the algorithm (``algo``): records in, scored episodes out.

- ``records.py``: ``Prompts`` (a batch of records, tokenised) and ``Episodes`` (the same records
  played and scored: frozen, self-contained);
- ``worker.py``: ``RolloutWorker``, the one object that plays records into episodes, for
  training, evaluation and the reward normalisation's fit alike;
- ``forward.py``: the forwards over a batch of sequences and their layouts (padding removed,
  each prompt once, token budgets): the old policy's and the reference's logprobs, the update's
  forward;
- ``engine.py``: an engine backend's view of its samples (the trainer's logprobs under the
  sampling's truncation).
"""

from ppo_lightning.rollouts.records import Episodes, Prompts
from ppo_lightning.rollouts.worker import RolloutWorker

__all__ = ["Episodes", "Prompts", "RolloutWorker"]
