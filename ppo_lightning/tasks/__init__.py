"""Tasks: offline demos, one folder each, that build everything they need and then report.

A task is a folder, ``tasks/<name>/``, of at most three files: ``task.py`` (``jobs.task.Task``:
``build`` writes its models and prompts into the cache, ``evaluate`` prints the table), ``data.py``
(its prompts, corpora and reward) and ``__init__.py``. Its config is one file,
``conf/experiment/<name>.yaml``, which sets ``recipe=<name>`` (the default job's reviews task uses
its groups and ``conf/experiment/preset/reviews-reviews.yaml`` instead). A run builds the task
once (cached under ``${recipe_dir:<name>}``, keyed by the task's code and the seed), and after PPO
prints a before/after table on held-out prompts: the run's own first and last evaluation
(``eval.*``; ``common.eval_report``). What the tasks share: ``common.py`` (the stages, the base
models, the table) and ``tokenizers.py``.

``tasks/arithmetic/`` is the template for a task of your own: copy the folder and its experiment
file (docs/usage.md, "A task of your own").
"""
