"""What ``train.py`` runs: ``factory.py`` checks the inputs and builds the module, data and
Trainer from a composed config; ``run.py`` holds the jobs (PPO, the stages, export)."""
