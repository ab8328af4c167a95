"""Recipes: offline demos, one folder each, that build everything they need and then report.

A recipe is a folder, ``recipes/<name>/``, of at most three files: ``recipe.py``
(``jobs.recipe.Recipe``: ``build`` writes its models and prompts into the cache, ``evaluate``
prints the table), ``data.py`` (its prompts, corpora and reward) and ``__init__.py``. Its config is
one file, ``conf/experiment/<name>.yaml``, which sets ``recipe=<name>`` (the default job's reviews
recipe uses its groups and ``conf/experiment/preset/reviews-reviews.yaml`` instead). A run builds
the recipe once (cached under ``${recipe_dir:<name>}``, keyed by the recipe's code and the seed),
and after PPO prints a before/after table on held-out prompts: the run's own first and last
evaluation (``eval.*``; ``common.eval_report``). What the recipes share: ``common.py`` (the stages,
the base models, the table) and ``tokenizers.py``.

``recipes/arithmetic/`` is the template for a recipe of your own: copy the folder and its
experiment file (docs/usage.md, "A recipe of your own").
"""
