"""Tasks: offline demos, one folder each, that build everything they need and then report.

A task (``recipe=<name>``, set by its preset: ``conf/experiment/preset/*.yaml``, or by an
``experiment/`` file) generates its data, trains its own tokenizer-sized SFT policy and reward
model once (cached under ``paths.cache_dir``), and after PPO prints a before/after table on
held-out prompts: the run's own first and last evaluation (``eval.*``, set by the preset;
``common.eval_report``). ``tasks/<name>/task.py`` implements ``jobs.task.Task`` (``root``,
``prepare``, ``evaluate``); ``tasks/<name>/data.py`` holds its prompts, corpora and reward.
What the tasks share: ``common.py`` (cached builds, the stages, the table), ``tokenizers.py``.
"""
