"""The Lightning side of a PPO run: the ``LightningModule`` that adapts ``algo.algorithm.PPO``
to the Trainer (``module.py``), the optimizer and schedule (``optim.py``), the logged metrics
(``metrics.py``), evaluation with pass@k (``evaluation.py``), callbacks and loggers, and the
rollout dumps (``dumps.py``)."""
