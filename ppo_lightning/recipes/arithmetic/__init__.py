"""The arithmetic recipe: RL from a verifiable reward on digit arithmetic. ``data.py`` holds its data and reward, ``recipe.py`` builds its models and prints its before/after table."""
